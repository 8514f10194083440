"""The README's usage examples run as written."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_an_example() -> None:
    assert python_blocks(), "README.md must contain a ```python usage example"


@pytest.mark.parametrize("i", range(len(python_blocks())))
def test_readme_example_runs(
    i: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    # The example's mkdtemp() lands in tmp_path. (Not all of tempfile: worker processes put
    # sockets there, and a socket's path must stay short.)
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: mkdtemp(*a, **{**k, "dir": tmp_path}))
    exec(compile(python_blocks()[i], f"README.md block {i}", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    if i == 0:  # the usage example prints what its comments say
        assert out.splitlines() == ["[3, 4]", "4", "True True"]
