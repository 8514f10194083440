"""The README's usage examples run as written (all ```python blocks, in order, one namespace)
and print what its ``<!-- output -->`` blocks show (compared by tools/mdexamples.py)."""

from __future__ import annotations

import runpy
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
TOOL = Path(__file__).resolve().parents[3] / "tools" / "mdexamples.py"


def test_readme_examples_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mdexamples = SimpleNamespace(**runpy.run_path(str(TOOL)))  # loaded by path: no package
    examples = mdexamples.examples(README.read_text())
    assert len(examples) >= 4 and sum(ex.output is not None for ex in examples) >= 3
    monkeypatch.delenv("PARQUETLM_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    # The example's mkdtemp() lands in tmp_path. (Not all of tempfile: worker processes put
    # sockets there, and a socket's path must stay short.)
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: mkdtemp(*a, **{**k, "dir": tmp_path}))
    namespace: dict[str, object] = {"__name__": "readme"}
    for ex in examples:
        exec(compile(ex.code, f"README.md line {ex.line}", "exec"), namespace)
        mdexamples.check(ex, capsys.readouterr().out)
    assert (Path(str(namespace["data"])) / ".parquetlm-cache").is_dir()
    assert namespace["batches"].step == 5  # type: ignore[attr-defined]
