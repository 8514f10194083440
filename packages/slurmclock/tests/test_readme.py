"""The README's Python examples run as written and print what the README shows (its
``<!-- output -->`` blocks, compared by tools/mdexamples.py); its bash pattern is run for real in
test_slurm.py."""

from __future__ import annotations

import runpy
import signal
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
def test_readme_python_block_runs(
    index: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("SLURM_JOB_ID", "PYRECOVER_END_TIME", "SLURM_JOB_END_TIME"):
        monkeypatch.delenv(name, raising=False)  # the examples show the outside-SLURM case
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    example = EXAMPLES[index]
    exec(compile(example.code, f"{README}:{example.line}", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    mdexamples.check(example, out)
    assert {s: signal.getsignal(s) for s in before} == before  # the example restores handlers
