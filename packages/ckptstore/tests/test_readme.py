"""The README's usage examples run as written and print what its ``<!-- output -->`` blocks show
(compared by tools/mdexamples.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from ckpt_helpers import load_tool

README = Path(__file__).resolve().parents[1] / "README.md"
mdexamples = load_tool("mdexamples")
EXAMPLES = mdexamples.examples(README.read_text())


def test_readme_has_an_example_with_its_output() -> None:
    assert EXAMPLES and EXAMPLES[0].output, "README.md must show a ```python usage example"


@pytest.mark.parametrize("i", range(len(EXAMPLES)))
def test_readme_example_runs(
    i: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    # The example's mkdtemp() lands in tmp_path. (Not all of tempfile: worker processes put
    # sockets there, and a socket's path must stay short.)
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: mkdtemp(*a, **{**k, "dir": tmp_path}))
    example = EXAMPLES[i]
    exec(
        compile(example.code, f"README.md line {example.line}", "exec"), {"__name__": "__readme__"}
    )
    mdexamples.check(example, capsys.readouterr().out)
