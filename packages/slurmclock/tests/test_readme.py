"""The README's Python examples run as written, each in a process of its own (as a user runs
them: a TimeLoop's abandon would end the process), and print what the README shows (numbers
aside); its bash pattern is run for real in test_slurm.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def shown_output() -> list[str]:
    """The lines of the block marked ``<!-- output -->``: what the first example prints."""
    m = re.search(r"<!-- output -->\n```\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert m, "the README shows no output block"
    return m.group(1).splitlines()


# Numbers after these words are the budget's settings and its fit of four 0.05 s saves: they must
# be as shown. The others (steps, seconds left) depend on the machine's speed.
FIXED = ("spread x", "median ", "final save ", "exit ", "slack ", "bound of ")


def same_but_timing(shown: str) -> re.Pattern[str]:
    """``shown`` with the numbers that depend on the machine's speed free."""
    pattern, at = "", 0
    for m in re.finditer(r"\d+(?:\.\d+)?", shown):
        fixed = shown[: m.start()].endswith(FIXED)
        pattern += re.escape(shown[at : m.start()])
        pattern += re.escape(m.group()) if fixed else r"\d+(?:\.\d+)?"
        at = m.end()
    return re.compile(pattern + re.escape(shown[at:]))


def test_readme_has_examples() -> None:
    assert len(python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs(index: int, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYRECOVER_"))}
    script = tmp_path / "block.py"
    script.write_text(python_blocks()[index])
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    if index == 0:  # the loop: it prints what the README shows
        lines = r.stdout.splitlines()
        shown = shown_output()
        assert len(lines) == len(shown), r.stdout
        for line, want in zip(lines, shown, strict=True):
            assert same_but_timing(want).fullmatch(line), (line, want)
