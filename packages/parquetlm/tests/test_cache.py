"""TokenCache: content, reuse, parallel build, kill-and-resume, concurrent builders, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from parquetlm import (
    ByteTokenizer,
    CacheError,
    EmptyDatasetError,
    NullRowsWarning,
    ParquetSource,
    TokenCache,
    default_cache_dir,
)


def expected_stream(texts: Sequence[str]) -> list[int]:
    return [i for t in texts for i in [*t.encode(), 256]]


def leftovers(root: Path) -> list[str]:
    """Anything in a cache dir besides complete caches and lock files."""
    return sorted(
        p.name
        for p in root.iterdir()
        if not (p.name.endswith(".lock") or (p / "meta.json").is_file())
    )


def test_build_content_index_and_reuse(corpus: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, texts = corpus
    source = ParquetSource(root)
    cache = TokenCache.build(source, ByteTokenizer(), tmp_path / "c", workers=1)
    assert cache.tokens.tolist() == expected_stream(texts)
    assert cache.num_docs == len(texts) and cache.dtype == np.uint16
    assert cache.num_tokens == sum(len(t.encode()) + 1 for t in texts)
    dec = ByteTokenizer().decode
    assert dec(cache.document(3).tolist()) == texts[3] == dec(cache.document(-397).tolist())
    assert cache.meta["text_bytes"] == sum(len(t.encode()) for t in texts)
    calls: list[tuple[int, int]] = []
    again = TokenCache.build(
        source, ByteTokenizer(), tmp_path / "c", progress=lambda *a: calls.append(a)
    )
    assert again.path == cache.path and calls == []  # reused: nothing tokenized
    assert leftovers(tmp_path / "c") == []
    with pytest.raises(IndexError):
        cache.document(len(texts))


def test_default_location_next_to_the_data(
    corpus: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = corpus
    monkeypatch.delenv("PARQUETLM_CACHE", raising=False)
    source = ParquetSource(root)
    assert default_cache_dir(source) == root / ".parquetlm-cache"
    assert (
        TokenCache.build(source, ByteTokenizer(), workers=1).path.parent
        == root / ".parquetlm-cache"
    )
    monkeypatch.setenv("PARQUETLM_CACHE", str(tmp_path / "env"))
    assert default_cache_dir(source) == tmp_path / "env"
    monkeypatch.delenv("PARQUETLM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    # A dataset directory we may not write to (root ignores chmod, so pretend): the user cache.
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    assert default_cache_dir(source) == tmp_path / "xdg" / "parquetlm"


def test_parallel_build_equals_serial(corpus: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, texts = corpus
    serial = TokenCache.build(ParquetSource(root), ByteTokenizer(), tmp_path / "a", workers=1)
    progress: list[int] = []
    parallel = TokenCache.build(
        ParquetSource(root),
        ByteTokenizer(),
        tmp_path / "b",
        workers=2,
        progress=lambda d, n: progress.append(d),
    )
    assert progress == list(range(1, 10))
    assert parallel.tokens.tolist() == serial.tokens.tolist() == expected_stream(texts)
    assert parallel.doc_offsets.tolist() == serial.doc_offsets.tolist()
    assert parallel.key == serial.key and leftovers(tmp_path / "b") == []


class WideTokenizer:
    """Byte ids shifted past 65535: needs uint32 storage."""

    vocab_size = 70_001
    eot_id = 70_000

    def encode(self, text: str) -> list[int]:
        return [b + 65_600 for b in text.encode()]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - 65_600 for i in ids if i != self.eot_id).decode()

    def fingerprint(self) -> str:
        return "wide-v1"


def test_large_vocabularies_use_uint32(corpus: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, texts = corpus
    cache = TokenCache.build(ParquetSource(root), WideTokenizer(), tmp_path, workers=2)
    assert cache.dtype == np.uint32 and cache.vocab_size == 70_001
    assert WideTokenizer().decode(cache.document(5).tolist()) == texts[5]
    assert int(cache.tokens[cache.doc_offsets[1] - 1]) == 70_000


def test_a_lying_tokenizer_is_caught(corpus: tuple[Path, list[str]], tmp_path: Path) -> None:
    class Liar(WideTokenizer):
        vocab_size = 300  # but emits ids above 65535

        def fingerprint(self) -> str:
            return "liar"

    with pytest.raises(ValueError, match="outside its vocabulary"):
        TokenCache.build(ParquetSource(corpus[0]), Liar(), tmp_path, workers=1)


def test_null_rows_are_skipped_counted_and_warned(tmp_path: Path, tools: Any) -> None:
    path = tools.write_parquet(tmp_path / "n.parquet", ["a", None, "bc", None], row_group_size=3)
    with pytest.warns(NullRowsWarning, match="skipped 2 null rows"):
        cache = TokenCache.build(ParquetSource(path), ByteTokenizer(), tmp_path / "c")
    assert cache.null_rows == 2 and cache.tokens.tolist() == [97, 256, 98, 99, 256]


def test_all_null_dataset_is_an_error_and_leaves_nothing(tmp_path: Path, tools: Any) -> None:
    path = tools.write_parquet(tmp_path / "n.parquet", [None, None, None], row_group_size=1)
    with pytest.raises(EmptyDatasetError, match="all 3 rows of column 'text'.*are null"):
        TokenCache.build(ParquetSource(path), ByteTokenizer(), tmp_path / "c", workers=2)
    assert leftovers(tmp_path / "c") == []


def test_damaged_cache_is_rebuilt_and_open_checks_sizes(
    corpus: tuple[Path, list[str]], tmp_path: Path
) -> None:
    source = ParquetSource(corpus[0])
    cache = TokenCache.build(source, ByteTokenizer(), tmp_path, workers=1)
    good = cache.tokens.tolist()
    with open(cache.path / "tokens.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CacheError, match="the cache is damaged"):
        TokenCache.open(cache.path)
    with pytest.warns(UserWarning, match="rebuilding a damaged token cache"):
        rebuilt = TokenCache.build(source, ByteTokenizer(), tmp_path, workers=1)
    assert rebuilt.tokens.tolist() == good
    (rebuilt.path / "meta.json").write_text("{")
    with pytest.raises(CacheError, match="meta.json is corrupt"):
        TokenCache.open(rebuilt.path)
    with pytest.raises(CacheError, match="not a complete token cache"):
        TokenCache.open(tmp_path)


def test_pickles_by_path(corpus: tuple[Path, list[str]], tmp_path: Path) -> None:
    import pickle

    cache = TokenCache.build(ParquetSource(corpus[0]), ByteTokenizer(), tmp_path, workers=1)
    data = pickle.dumps(cache)
    assert len(data) < 500
    assert pickle.loads(data).tokens.tolist() == cache.tokens.tolist()


# -- kills and concurrency, in real subprocesses --------------------------------------------------

BUILD = """
import os, signal, sys, json
from parquetlm import ParquetSource, TokenCache, ByteTokenizer
src, out, kill_at, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def progress(done, total):
    print(f"done {done}/{total}", flush=True)
    if done == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)  # a node failure, mid-build
cache = TokenCache.build(
    ParquetSource(src), ByteTokenizer(), out, workers=workers, progress=progress
)
print(json.dumps({"path": str(cache.path), "tokens": cache.num_tokens}), flush=True)
"""


def run_build(
    tmp_path: Path, src: Path, out: Path, kill_at: int, workers: int
) -> subprocess.Popen[str]:
    # Written once: rewriting it while an earlier child is still reading it (it truncates first)
    # would hand that child an empty script, which exits 0 and prints nothing.
    script = tmp_path / "build.py"
    if not script.exists():
        tmp = tmp_path / "build.py.tmp"
        tmp.write_text(textwrap.dedent(BUILD))
        tmp.replace(script)
    return subprocess.Popen(
        [sys.executable, str(script), str(src), str(out), str(kill_at), str(workers)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize(("kill_at", "workers"), [(3, 1), (9, 1), (4, 2)])
def test_killed_build_never_looks_complete_and_resumes(
    corpus: tuple[Path, list[str]], tmp_path: Path, kill_at: int, workers: int
) -> None:
    root, texts = corpus
    out = tmp_path / "cache"
    proc = run_build(tmp_path, root, out, kill_at, workers)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == -9, stderr
    assert f"done {kill_at}/9" in stdout
    assert not [p for p in out.iterdir() if (p / "meta.json").exists()]  # nothing looks complete
    with pytest.raises(CacheError):
        TokenCache.open(next(out.glob("tokens-*.partial")))
    seen: list[int] = []
    cache = TokenCache.build(
        ParquetSource(root), ByteTokenizer(), out, progress=lambda d, n: seen.append(d)
    )
    assert seen[0] > kill_at if kill_at < 9 else seen == [9]  # finished units were reused
    assert seen[-1] == 9
    assert cache.tokens.tolist() == expected_stream(texts)
    assert cache.doc_offsets.tolist()[-1] == cache.num_tokens
    assert leftovers(out) == []


def test_concurrent_builders_share_one_cache(
    corpus: tuple[Path, list[str]], tmp_path: Path
) -> None:
    root, texts = corpus
    out = tmp_path / "cache"
    procs = [run_build(tmp_path, root, out, -1, w) for w in (1, 2, 1)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    assert len({r["path"] for r in results}) == 1
    cache = TokenCache.open(results[0]["path"])
    assert cache.tokens.tolist() == expected_stream(texts)
    assert leftovers(out) == []


def test_one_big_row_group_is_split_across_workers(tmp_path: Path, tools: Any) -> None:
    from parquetlm.cache import split_units

    texts = tools.make_texts(1300, seed=8, max_words=8)
    texts[700] = None
    path = tools.write_parquet(tmp_path / "one.parquet", texts, row_group_size=10_000)
    source = ParquetSource(path)
    parts = split_units(source.units)
    assert len(source.units) == 1 and len(parts) == 5
    assert [(p.row_start, p.row_stop) for p in parts][:2] == [(0, 260), (260, 520)]
    assert parts[-1].row_stop == 1300 and [p.index for p in parts] == list(range(5))
    rows = [t for p in parts for arr, _ in source.read_unit(p) for t in arr.to_pylist()]
    assert rows == [t for t in texts if t is not None]
    progress: list[int] = []
    with pytest.warns(NullRowsWarning):
        cache = TokenCache.build(
            source,
            WideTokenizer(),
            tmp_path / "c",
            workers=2,
            progress=lambda d, n: progress.append(n),
        )
    assert progress == [5] * 5 and cache.null_rows == 1
    want = [i for t in texts if t is not None for i in [*WideTokenizer().encode(t), 70_000]]
    assert cache.tokens.tolist() == want


@pytest.mark.parametrize("where", ["processes", "in-process"])
def test_a_failing_worker_fails_the_build_cleanly(
    tmp_path: Path, tools: Any, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    pytest.importorskip("tokenizers", reason="needs the [hf] extra")
    from parquetlm import ParquetLMError, gpt2_tokenizer

    path = tools.write_parquet(tmp_path / "d.parquet", tools.make_texts(600), row_group_size=300)
    source = ParquetSource(path)
    path.write_bytes(b"PAR1" + b"\0" * 5000 + b"PAR1")  # replaced after validation, mid-job
    if where == "processes":  # a tokenizer that does not parallelize itself gets processes
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    error = CacheError if where == "processes" else ParquetLMError
    with pytest.raises(error, match=r"cannot read .*d\.parquet .*changed or damaged"):
        TokenCache.build(source, gpt2_tokenizer(), tmp_path / "c", workers=2)
    assert not [p for p in (tmp_path / "c").iterdir() if (p / "meta.json").exists()]


def test_hf_builds_in_process_equal_worker_processes_and_resume_each_other(
    tmp_path: Path, tools: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tokenizer that uses every core itself (HF) tokenizes in this process, several units per
    encode_batch call; the result is the same as with worker processes, unit files included, so
    a build interrupted on one path resumes on the other."""
    pytest.importorskip("tokenizers", reason="needs the [hf] extra")
    import parquetlm.cache as cache_mod
    from parquetlm import gpt2_tokenizer

    texts: list[str | None] = list(tools.make_texts(1500, seed=3))
    texts[10] = texts[700] = None
    texts[11] = ""
    path = tools.write_parquet(tmp_path / "d.parquet", texts, row_group_size=600)
    source = ParquetSource(path)
    assert len(cache_mod.split_units(source.units)) == 5  # 2 + 2 + 1
    tok = gpt2_tokenizer()
    want = [i for t in texts if t is not None for i in [*tok.encode(t), tok.eot_id]]
    assert tok.parallel_batch
    monkeypatch.setattr(cache_mod, "BATCH_TEXT_BYTES", 100_000)  # ~2 units per batch
    calls: list[int] = []
    real = cache_mod._encode_texts

    def spy(tokenizer: Any, batch: list[Any]) -> Any:
        calls.append(len(batch))
        return real(tokenizer, batch)

    monkeypatch.setattr(cache_mod, "_encode_texts", spy)
    progress: list[int] = []
    with pytest.warns(NullRowsWarning):
        inproc = TokenCache.build(
            source, tok, tmp_path / "a", workers=1, progress=lambda d, n: progress.append(d)
        )
    assert progress == list(range(1, 6)) and sum(calls) == 5 and max(calls) > 1
    assert inproc.tokens.tolist() == want and inproc.null_rows == 2

    # Interrupted in-process after 2 units, finished by worker processes: the same cache.
    def stop_after_two(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(cache_mod, "BATCH_TEXT_BYTES", 1)  # one unit per batch
    with pytest.raises(KeyboardInterrupt):
        TokenCache.build(source, tok, tmp_path / "b", workers=1, progress=stop_after_two)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert not tok.parallel_batch
    calls.clear()
    progress.clear()
    with pytest.warns(NullRowsWarning):
        resumed = TokenCache.build(
            source, tok, tmp_path / "b", workers=2, progress=lambda d, n: progress.append(d)
        )
    assert calls == [] and progress == [3, 4, 5]  # workers did the 3 units left
    assert resumed.key == inproc.key and leftovers(tmp_path / "b") == []
    assert resumed.tokens.tolist() == want
    assert resumed.doc_offsets.tolist() == inproc.doc_offsets.tolist()


def test_a_build_stopped_while_clearing_its_units_finishes_on_the_next_run(
    corpus: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while a finished build removed its per-unit files left some units with their
    JSON but without their lengths; the next run took them as done and failed on the missing
    file (`No such file or directory: .../units/0000000.len`) instead of finishing."""
    import shutil

    import parquetlm.cache

    root, texts = corpus
    real = shutil.rmtree

    def stopped(path: Any, *a: Any, **k: Any) -> None:
        if Path(path).name == "units":  # the clean-up after meta.json: one file, then Ctrl-C
            next(Path(path).glob("*.len")).unlink()
            raise KeyboardInterrupt
        real(path, *a, **k)

    monkeypatch.setattr(parquetlm.cache.shutil, "rmtree", stopped)
    with pytest.raises(KeyboardInterrupt):
        TokenCache.build(ParquetSource(root), ByteTokenizer(), tmp_path / "c", workers=1)
    monkeypatch.setattr(parquetlm.cache.shutil, "rmtree", real)
    cache = TokenCache.build(ParquetSource(root), ByteTokenizer(), tmp_path / "c", workers=1)
    assert cache.tokens.tolist() == expected_stream(texts) and leftovers(tmp_path / "c") == []
    partial = tmp_path / "c" / f"{cache.path.name}.partial"
    (partial / "units").mkdir(parents=True)  # units without all their files: redone
    (partial / "units" / "0000000.json").write_text("{}")
    shutil.rmtree(cache.path)
    again = TokenCache.build(ParquetSource(root), ByteTokenizer(), tmp_path / "c", workers=1)
    assert again.tokens.tolist() == expected_stream(texts) and leftovers(tmp_path / "c") == []


def test_an_unusable_cache_folder_names_the_setting_that_chose_it(
    corpus: tuple[Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = corpus
    (tmp_path / "file").write_text("x")
    with pytest.raises(CacheError, match=r"file for token caches \(a file is in the way\); it "):
        TokenCache.build(ParquetSource(root), ByteTokenizer(), tmp_path / "file")
    monkeypatch.setenv("PARQUETLM_CACHE", str(tmp_path / "file" / "sub"))
    with pytest.raises(CacheError, match=r"it comes from \$PARQUETLM_CACHE: point it at a folder"):
        TokenCache.build(ParquetSource(root), ByteTokenizer())
    for path, said in [(tmp_path / "file", "is a file"), (tmp_path / "no", "does not exist")]:
        with pytest.raises(CacheError, match=f"{said}: give a token cache folder"):
            TokenCache.open(path)


def test_a_full_disk_is_one_line_naming_the_folder(
    corpus: tuple[Path, list[str]], tmp_path: Path
) -> None:
    """ENOSPC while building: a CacheError that says where and what to do, not "[Errno 28] No
    space left on device" (tools/tmpfs.py: a 64 KiB file system)."""
    import runpy

    tmpfs = runpy.run_path(str(Path(__file__).resolve().parents[3] / "tools" / "tmpfs.py"))
    root, _ = corpus
    try:
        with (
            tmpfs["mounted"](tmp_path / "tiny", "64k") as tiny,
            pytest.raises(CacheError, match=f"no space left for the token cache in {tiny}"),
        ):
            TokenCache.build(ParquetSource(root), ByteTokenizer(), tiny, workers=1)
    except tmpfs["Unavailable"] as e:
        pytest.skip(str(e))
