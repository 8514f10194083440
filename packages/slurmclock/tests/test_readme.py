"""The README's Python examples run as written, each in a process of its own (as a user runs
them: a TimeLoop's abandon would end the process), and print what the README shows (its
``<!-- output -->`` blocks, compared by tools/mdexamples.py); its bash pattern is run for real in
test_slurm.py."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
TOOL = Path(__file__).resolve().parents[3] / "tools" / "mdexamples.py"
mdexamples = SimpleNamespace(**runpy.run_path(str(TOOL)))  # loaded by path: no package
EXAMPLES = mdexamples.examples(README.read_text())


def test_readme_has_examples_and_shows_what_one_prints() -> None:
    assert len(EXAMPLES) >= 2 and any(ex.output for ex in EXAMPLES)


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_python_block_runs(index: int, tmp_path: Path) -> None:
    # The examples show the outside-SLURM case.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYRECOVER_"))}
    example = EXAMPLES[index]
    script = tmp_path / "block.py"
    script.write_text("\n" * (example.line - 1) + example.code)  # tracebacks name README lines
    r = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    mdexamples.check(example, r.stdout)
