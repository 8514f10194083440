"""Checksums of the token cache: damage on disk is found before a batch carrying it is used."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import parquetlm.cache
from parquetlm import (
    ByteTokenizer,
    CacheError,
    CacheRebuiltWarning,
    PackedLoader,
    ParquetSource,
    TokenCache,
)
from parquetlm.cli import main as cli
from parquetlm.integrity import ChunkCrc

PIECE = 4096  # small pieces: a small corpus spans many of them


@pytest.fixture
def cache(corpus: tuple[Path, list[str]], tmp_path: Path, monkeypatch: Any) -> TokenCache:
    monkeypatch.setattr(parquetlm.cache, "CHUNK_BYTES", PIECE)
    built = TokenCache.build(ParquetSource(corpus[0]), ByteTokenizer(), tmp_path / "c", workers=1)
    assert built.meta["checksums"]["chunk_bytes"] == PIECE
    assert os.path.getsize(built.path / "tokens.bin") > 8 * PIECE
    return built


def damage(path: Path, offset: int, data: bytes = b"\x41\x00\x42\x00") -> None:
    """Overwrite bytes in place (the size stays, so only a checksum can tell)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_chunk_crc_matches_crc32_of_each_piece() -> None:
    data = np.random.default_rng(0).integers(0, 256, 10 * 1000 + 7, dtype=np.uint8).tobytes()
    acc = ChunkCrc(1000)
    for lo in range(0, len(data), 333):  # blocks that straddle piece edges
        acc.update(data[lo : lo + 333])
    want = [zlib.crc32(data[lo : lo + 1000]) for lo in range(0, len(data), 1000)]
    assert acc.sums().tolist() == want


def test_a_clean_cache_reads_and_verifies(cache: TokenCache) -> None:
    loader = PackedLoader(cache, seq_len=64, batch_size=4, seed=0, shuffle=False)
    for _ in loader.eval_batches():
        pass
    assert cache._check.complete  # every piece checked once, the checks now cost nothing
    cache.verify()
    assert cli(["verify", str(cache.path)]) == 0


def test_damaged_tokens_fail_the_batch_that_reads_them(cache: TokenCache) -> None:
    seq_len, target = 64, 5 * PIECE + 100  # a byte in the sixth piece
    damage(cache.path / "tokens.bin", target)
    reopened = TokenCache(cache.path)  # sizes and meta are fine: it opens
    loader = PackedLoader(reopened, seq_len=seq_len, batch_size=1, seed=0, shuffle=False)
    assert loader.batch_at(0).shape == (1, seq_len + 1)  # the first piece is intact
    window = (target // 2) // seq_len  # uint16 tokens: byte target is token target // 2
    with pytest.raises(CacheError) as err:
        loader.batch_at(window)
    msg = str(err.value)
    assert "\n" not in msg
    assert f"{cache.path / 'tokens.bin'} is damaged" in msg
    assert f"delete {cache.path} and run again" in msg
    with pytest.raises(CacheError, match="is damaged"):
        reopened.verify()


def test_damage_is_found_in_every_reader(cache: TokenCache, capsys: Any) -> None:
    damage(cache.path / "tokens.bin", 3 * PIECE + 2)
    reopened = TokenCache(cache.path)
    with pytest.raises(CacheError, match="tokens.bin is damaged"):
        reopened.read(0, reopened.num_tokens)
    for batch_size in (8, 100):  # small batches check window by window, big ones vectorized
        loader = PackedLoader(TokenCache(cache.path), seq_len=32, batch_size=batch_size)
        with pytest.raises(CacheError, match="tokens.bin is damaged"):
            list(loader.take(10_000))
    assert cli(["verify", str(cache.path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("parquetlm: error: ") and "tokens.bin is damaged" in err
    assert len(err.splitlines()) == 1


def test_a_wide_window_checks_every_piece_it_spans(cache: TokenCache) -> None:
    damage(cache.path / "tokens.bin", 2 * PIECE + 10)
    reopened = TokenCache(cache.path)
    seq_len = 3 * PIECE  # a window of 6 pieces (uint16): the damage is in its middle
    loader = PackedLoader(reopened, seq_len=seq_len, batch_size=1, seed=0, shuffle=False)
    with pytest.raises(CacheError, match="bytes 8,192..12,288 do not match"):
        loader.batch_at(0)


def test_damaged_document_index(cache: TokenCache) -> None:
    damage(cache.path / "docs.bin", 8 * 3, np.int64(7).tobytes())
    reopened = TokenCache(cache.path)
    with pytest.raises(CacheError, match="docs.bin is damaged"):
        reopened.document(3)
    with pytest.raises(CacheError, match="docs.bin is damaged"):
        reopened.verify()


@pytest.mark.parametrize("how", ["missing", "truncated", "changed"])
def test_damaged_checksum_file_refuses_to_open(cache: TokenCache, how: str) -> None:
    sums = cache.path / "tokens.crc32"
    if how == "missing":
        sums.unlink()
    elif how == "truncated":
        sums.write_bytes(sums.read_bytes()[:-4])
    else:
        damage(sums, 4, b"\xff\xff\xff\xff")
    with pytest.raises(CacheError, match=f"tokens.crc32 .*delete {cache.path}"):
        TokenCache(cache.path)


def test_build_with_verify_rebuilds_a_damaged_cache(
    cache: TokenCache, corpus: tuple[Path, list[str]], tmp_path: Path
) -> None:
    good = np.array(cache.tokens)
    damage(cache.path / "tokens.bin", 7 * PIECE)
    source = ParquetSource(corpus[0])
    lazy = TokenCache.build(source, ByteTokenizer(), tmp_path / "c", workers=1)
    assert lazy.path == cache.path  # reused without reading it all: damage shows on use
    with pytest.warns(CacheRebuiltWarning) as caught:
        rebuilt = TokenCache.build(source, ByteTokenizer(), tmp_path / "c", workers=1, verify=True)
    (said,) = [str(w.message) for w in caught]  # what was damaged; not "delete it": done here
    assert said.startswith("rebuilding a damaged token cache: ") and "tokens.bin is dam" in said
    assert said.endswith("do not match the checksum written when the cache was built"), said
    rebuilt.verify()
    assert np.array_equal(np.asarray(rebuilt.tokens), good)


@pytest.mark.parametrize("command", ["tokenize --verify", "stats"])
def test_the_command_line_says_a_rebuild_in_one_line(
    command: str, cache: TokenCache, corpus: tuple[Path, list[str]], tmp_path: Path
) -> None:
    """`parquetlm tokenize --verify` on a damaged cache, `parquetlm stats` with docs.bin cut
    short: rebuilt, and the warning is one line, not Python's with a source line under it."""
    if command == "stats":
        (cache.path / "docs.bin").write_bytes((cache.path / "docs.bin").read_bytes()[:100])
    else:
        damage(cache.path / "tokens.bin", 3 * PIECE)
    argv = [*command.split(), str(corpus[0]), "--cache-dir", str(tmp_path / "c")]
    done = subprocess.run(
        [sys.executable, "-m", "parquetlm", *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"parquetlm: warning: rebuilding a damaged token cache: {cache.path}/")
    TokenCache(cache.path).verify()


def test_old_cache_format_is_refused_with_the_fix(cache: TokenCache) -> None:
    meta = (cache.path / "meta.json").read_text().replace('"format": 2', '"format": 1')
    (cache.path / "meta.json").write_text(meta)
    with pytest.raises(CacheError, match="format 1, expected 2: delete it"):
        TokenCache(cache.path)
