"""Faults and bad input, one clear line each (issue 14, weak): prune on a missing path, a
bucket that does not exist (never created behind the user's back), an S3 endpoint that dies in
the middle of an upload (no asyncio noise, no traceback)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_helpers import TESTS

from ckptstore import CheckpointError, CheckpointStore, open_storage
from ckptstore.cli import main as cli


def test_prune_on_a_missing_path_is_one_line_and_exit_1(tmp_path: Path, capsys: Any) -> None:
    missing = tmp_path / "no" / "such"
    assert cli(["prune", str(missing), "--keep-last", "2"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "does not exist" in err
    assert not missing.exists()  # and nothing was created
    assert cli(["list", str(missing)]) == 1 and "does not exist" in capsys.readouterr().err


@pytest.mark.s3
def test_a_missing_bucket_is_refused_never_created(moto: Any, capsys: Any) -> None:
    import s3fs

    opts = moto.storage_options()
    with CheckpointStore("s3://nosuchbucket/run", storage_options=opts) as store:
        with pytest.raises(CheckpointError, match="does not exist: create it first") as info:
            store.save(1, {"w": torch.ones(2)})
        assert "\n" not in str(info.value) and "nosuchbucket" in str(info.value)
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    assert "nosuchbucket" not in [b.rstrip("/") for b in fs.ls("")]
    argv = ["list", "s3://nosuchbucket/run", "--storage-options", json.dumps(opts)]
    assert cli(argv) == 2 and "does not exist" in capsys.readouterr().err  # a setting: exit 2


@pytest.mark.s3
@pytest.mark.slow
def test_a_dying_endpoint_gives_one_line(moto: Any) -> None:
    r = subprocess.run(
        [sys.executable, str(TESTS / "ckpt_s3_outage_child.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    want = (
        "error: StoreUnreachableError: the store did not answer at s3://outage/run/step-00000002/"
    )
    assert r.stdout.startswith(want), r.stdout
    assert len(r.stdout.splitlines()) == 1, r.stdout
    assert "Traceback" not in r.stderr and "never retrieved" not in r.stderr, r.stderr


@pytest.mark.s3
def test_unretrieved_connection_errors_on_the_s3_loop_stay_quiet(
    moto: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp's own tasks fail with connection errors nobody retrieves when an endpoint dies;
    asyncio would print each one with a traceback. Other unretrieved errors still show."""
    from aiohttp import ClientConnectionResetError
    from fsspec.asyn import sync

    storage: Any = open_storage("s3://ckpt/quiet", moto.storage_options())

    async def fail(exc: BaseException) -> None:
        raise exc

    async def orphan(exc: BaseException) -> None:
        task = asyncio.ensure_future(fail(exc))
        while not task.done():
            await asyncio.sleep(0)
        del task  # dropped with its exception unretrieved: asyncio reports it now

    caplog.set_level(logging.DEBUG, logger="asyncio")
    sync(storage.fs.loop, orphan, ClientConnectionResetError("Cannot write to closing transport"))
    sync(storage.fs.loop, orphan, ValueError("a real bug"))
    gc.collect()
    shown = [r.getMessage() + repr(r.exc_info) for r in caplog.records if r.name == "asyncio"]
    assert any("a real bug" in s for s in shown), shown
    assert not any("closing transport" in s for s in shown), shown


def test_a_refused_save_leaves_no_folder_behind(tmp_path: Path) -> None:
    """The writer lock creates the experiment's folders; a store that committed nothing
    removes them at close (an empty folder reads as a checkpoint to resume from: issue 30)."""
    exp = tmp_path / "a" / "b"
    with CheckpointStore(str(exp)) as store, pytest.raises(CheckpointError, match="builtins.set"):
        store.save(1, {"hp": {1, 2}})
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()
    with CheckpointStore(str(tmp_path / "kept")) as store, pytest.raises(CheckpointError):
        store.save(1, {"hp": {1, 2}})
    assert (tmp_path / "kept").is_dir()  # not made by the store: not removed
    with CheckpointStore(str(exp)) as store:
        store.save(1, {"w": torch.ones(2)})
    assert (exp / "step-00000001" / "manifest.json").is_file()
