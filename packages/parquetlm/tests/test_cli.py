"""The ``parquetlm`` command line: tokenize, train-tokenizer, stats, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from parquetlm.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_tokenize_then_stats(corpus: tuple[Path, list[str]], tmp_path: Path, capsys: Any) -> None:
    root, texts = corpus
    cache_dir = str(tmp_path / "c")
    code, out, _ = run(capsys, "tokenize", str(root), "--cache-dir", cache_dir, "--json")
    assert code == 0
    info = json.loads(out)
    n_tokens = sum(len(t.encode()) + 1 for t in texts)
    assert info["tokens"] == n_tokens and info["docs"] == 400 and info["dtype"] == "uint16"
    code, out, _ = run(
        capsys, "stats", str(root), "--cache-dir", cache_dir, "--seq-len", "64", "--json"
    )
    stats = json.loads(out)
    assert code == 0 and stats["cache"] == info["cache"]
    assert stats["rows"] == 400 and stats["tokens"] == n_tokens
    assert stats["text_bytes"] == sum(len(t.encode()) for t in texts)
    assert stats["windows_per_epoch"] == (n_tokens - 1) // 64
    code, out, _ = run(
        capsys, "stats", str(root), "--cache-dir", cache_dir, "--val-fraction", "0.1"
    )
    assert code == 0 and "val_windows" in out and "windows_per_epoch" in out


def test_train_tokenizer_then_tokenize_with_it(
    corpus: tuple[Path, list[str]], tmp_path: Path, capsys: Any
) -> None:
    root, _ = corpus
    out_path = tmp_path / "tok" / "tokenizer.json"
    code, out, _ = run(
        capsys, "train-tokenizer", str(root), "--vocab-size", "300", "--out", str(out_path)
    )
    assert code == 0 and out_path.is_file() and "vocab_size 300" in out
    code, out, _ = run(
        capsys,
        "tokenize",
        str(root),
        "--tokenizer",
        str(out_path),
        "--json",
        "--cache-dir",
        str(tmp_path / "c"),
        "--workers",
        "2",
    )
    assert code == 0 and json.loads(out)["vocab_size"] == 300


def test_python_dash_m_and_null_report(tmp_path: Path, tools: Any) -> None:
    path = tools.write_parquet(tmp_path / "n.parquet", ["ab", None, "c"])
    proc = subprocess.run(
        [sys.executable, "-m", "parquetlm", "tokenize", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "null_rows_skipped  1" in proc.stdout and "skipped 1 null rows" in proc.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["stats", "{tmp}/nope.parquet"], "no such file"),
        (["stats", "{tmp}/bad.parquet"], "is not a parquet file"),
        (["stats", "{tmp}/ok.parquet", "--column", "body"], "its columns are: text, id"),
        (["stats", "{tmp}/ok.parquet", "--column", "id"], "not string"),
        (["stats", "{tmp}/empty.parquet"], "empty dataset"),
        (["stats", "{tmp}/nulls.parquet"], "are null"),
        (["stats", "{tmp}/ok.parquet", "--seq-len", "100000"], "lower seq_len or add data"),
        (["stats", "{tmp}/ok.parquet", "--tokenizer", "{tmp}/bad.json"], "corrupt tokenizer file"),
        (["stats", "{tmp}/ok.parquet", "--tokenizer", "wordpiece"], "unknown tokenizer"),
        (
            ["train-tokenizer", "{tmp}/ok.parquet", "--vocab-size", "10", "--out", "{tmp}/t.json"],
            "vocab_size=10 is impossible",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, tools: Any, capsys: Any, argv: list[str], message: str
) -> None:
    tools.write_parquet(tmp_path / "ok.parquet", ["hello world", "more text"])
    tools.write_parquet(tmp_path / "empty.parquet", [])
    tools.write_parquet(tmp_path / "nulls.parquet", [None, None])
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 nope")
    (tmp_path / "bad.json").write_text('{"model": ')
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, out, err = run(capsys, *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("parquetlm: error: ") and message in err
    # Nothing half-written: only complete caches (reusable) may have appeared.
    new = {p for p in tmp_path.rglob("*") if p.name not in before and p.suffix != ".lock"}
    caches = {p for p in new if p.name.startswith("tokens-")}
    assert all((c / "meta.json").is_file() for c in caches)
    assert {p.name for p in new - caches if p.parent not in caches} <= {".parquetlm-cache"}


def test_usage_errors_exit_2(capsys: Any) -> None:
    with pytest.raises(SystemExit) as e:
        main(["tokenize"])
    assert e.value.code == 2
    capsys.readouterr()
    for argv, said in [
        (["stats", "x.parquet", "--seq-len", "0"], "argument --seq-len: 0 must be >= 1"),
        (["tokenize", "x.parquet", "--workers", "abc"], "argument --workers: 'abc' is not an"),
        (["stats", "x.parquet", "--storage-options", "{bad"], "--storage-options: not JSON"),
        ([], "the following arguments are required: COMMAND"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err, err
        assert len(err.splitlines()) == 1 and err.rstrip().endswith("--help)"), err  # no usage


def test_what_is_no_cache_or_no_file_to_write_is_one_line(
    corpus: tuple[Path, list[str]], tmp_path: Path, capsys: Any
) -> None:
    """`parquetlm verify FILE` and `train-tokenizer --out FOLDER` printed tracebacks."""
    pytest.importorskip("tokenizers")
    src = str(corpus[0] / "part-0.parquet")
    for argv, said in [
        (["verify", src], f"parquetlm: error: {src} is a file: give a token cache folder"),
        (["train-tokenizer", src, "--out", str(tmp_path)], f"parquetlm: error: {tmp_path} is a fo"),
    ]:
        code, _, err = run(capsys, *argv)
        assert code == 2 and err.startswith(said) and len(err.splitlines()) == 1, err


def test_stats_to_a_reader_that_left_ends_with_141_and_no_message(
    corpus: tuple[Path, list[str]], tmp_path: Path
) -> None:
    tool = Path(__file__).resolve().parents[3] / "tools" / "closedpipe.py"
    stats = ["-m", "parquetlm", "stats", str(corpus[0]), "--cache-dir", str(tmp_path / "c")]
    done = subprocess.run(
        [sys.executable, str(tool), sys.executable, *stats], capture_output=True, text=True
    )
    assert done.returncode == 141 and done.stderr == "", done.stderr  # as `| head -1` gives
