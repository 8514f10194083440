"""Reading from a real S3 endpoint (moto_server on 127.0.0.1) through fsspec/s3fs."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from parquetlm import ByteTokenizer, PackedLoader, ParquetSource, SourceError, TokenCache

pytestmark = pytest.mark.s3
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A moto_server on 127.0.0.1 from the repository's tools/s3server.py (loaded by path: it is
    test infrastructure, not a package)."""
    try:
        import s3fs  # noqa: F401
    except ImportError:
        # Not the S3 endpoint missing: this environment lacks the [s3] extra.
        pytest.skip("s3fs not installed: pip install 'parquetlm[s3]' to run the S3 test")
    spec = importlib.util.spec_from_file_location("s3server", ROOT / "tools" / "s3server.py")
    assert spec is not None and spec.loader is not None
    s3server = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(s3server)
    why = s3server.unavailable_reason()
    if why is not None:
        if os.environ.get("PYRECOVER_REQUIRE_S3") == "1":
            pytest.fail(f"PYRECOVER_REQUIRE_S3=1 but {why}")
        pytest.skip(why)
    with s3server.MotoServer() as server:
        yield server.endpoint_url


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
