"""Reading from a real S3 endpoint (moto_server on 127.0.0.1) through fsspec/s3fs."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from parquetlm import ByteTokenizer, PackedLoader, ParquetSource, SourceError, TokenCache

pytestmark = pytest.mark.s3


def _missing(reason: str) -> None:
    if os.environ.get("PYRECOVER_REQUIRE_S3") == "1":
        pytest.fail(f"PYRECOVER_REQUIRE_S3=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    try:
        import s3fs  # noqa: F401
    except ImportError:
        # Not the S3 endpoint missing: this environment lacks the [s3] extra (see the report).
        pytest.skip("s3fs not installed: pip install 'parquetlm[s3]' to run the S3 test")
    exe = shutil.which("moto_server")
    if exe is None:
        _missing("moto_server not found: pip install 'moto[server]'")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):  # up to ~30 s for the server to listen
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None:
                    _missing(f"moto_server exited with {proc.returncode}")
                time.sleep(0.1)
        else:
            _missing("moto_server did not start listening")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_s3_source_cache_and_loader(
    s3_endpoint: str, corpus: tuple[Path, list[str]], tmp_path: Path
) -> None:
    import s3fs

    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_endpoint}}
    fs = s3fs.S3FileSystem(**opts)
    fs.mkdir("plm-bucket")
    root, texts = corpus
    for p in sorted(root.glob("*.parquet")):
        fs.put(str(p), f"plm-bucket/data/{p.name}")
    fs.pipe("plm-bucket/data/_SUCCESS", b"")
    source = ParquetSource("s3://plm-bucket/data/", storage_options=opts)
    assert source.files == [
        "s3://plm-bucket/data/part-0.parquet",
        "s3://plm-bucket/data/part-1.parquet",
    ]
    assert list(source.iter_texts()) == texts
    assert source.fingerprint() == ParquetSource(root).fingerprint()  # content, not location
    cache = TokenCache.build(source, ByteTokenizer(), tmp_path / "cache", workers=2)
    local = TokenCache.build(ParquetSource(root), ByteTokenizer(), tmp_path / "cache")
    assert cache.path == local.path  # same content + tokenizer: one cache
    assert PackedLoader(cache, seq_len=64, batch_size=2).next_batch().shape == (2, 65)
    with pytest.raises(SourceError, match="no such file"):
        ParquetSource("s3://plm-bucket/data/nope.parquet", storage_options=opts)
