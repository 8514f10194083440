"""tools/s3server.py: a real moto_server on 127.0.0.1, outages that keep its data."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
from ckpt_helpers import s3server


def test_unavailable_reason_is_one_line_or_none() -> None:
    why = s3server.unavailable_reason()
    assert why is None or ("\n" not in why and "moto" in why)


@pytest.mark.s3
def test_session_server_serves_s3(moto: Any) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(**moto.storage_options())
    fs.pipe_file("ckpt/s3server/hello", b"world")
    assert fs.cat_file("ckpt/s3server/hello") == b"world"
    env = moto.env()
    assert env["AWS_ENDPOINT_URL"] == moto.endpoint_url and env["AWS_ACCESS_KEY_ID"]
    with pytest.raises(ValueError, match="not valid for S3"):
        moto.make_bucket("A")


@pytest.mark.s3
def test_outages_keep_data_and_stop_kills_by_pid(moto: Any) -> None:
    import s3fs
    from botocore.exceptions import BotoCoreError

    with s3server.MotoServer(proxy=True) as server:
        server.make_bucket("outage")
        opts = server.storage_options()
        fs = s3fs.S3FileSystem(
            **opts,
            skip_instance_cache=True,
            config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2, "read_timeout": 5},
        )
        fs.pipe_file("outage/a", b"1" * 1000)
        server.pause()
        server.resume()
        assert fs.cat_file("outage/a") == b"1" * 1000
        server.disconnect()
        with pytest.raises((OSError, BotoCoreError)):  # connection refused
            s3fs.S3FileSystem(
                **opts,
                skip_instance_cache=True,
                config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 2},
            ).cat_file("outage/a")
        server.reconnect()
        fresh = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
        assert fresh.cat_file("outage/a") == b"1" * 1000  # data survived the outage
        pid = server.pid
        assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)  # stopped and reaped


@pytest.mark.s3
def test_server_dies_with_a_crashed_parent(moto: Any, tmp_path: Any) -> None:
    import subprocess
    import sys
    import time

    from ckpt_helpers import ROOT

    tool = str(ROOT / "tools/s3server.py")
    script = (
        "import importlib.util, os, signal, sys\n"
        f"spec = importlib.util.spec_from_file_location('s3server', {tool!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "srv = m.MotoServer().start()\n"
        "print(srv.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)  # no cleanup at all\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    pid = int(r.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError("moto_server outlived the process that started it")
