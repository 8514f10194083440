"""The README's Python examples run as written; its bash pattern is run for real in
test_slurm.py."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples() -> None:
    assert len(python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs(
    index: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("SLURM_JOB_ID", "PYRECOVER_END_TIME", "SLURM_JOB_END_TIME"):
        monkeypatch.delenv(name, raising=False)  # the examples show the outside-SLURM case
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    code = python_blocks()[index]
    exec(compile(code, f"{README}:block{index}", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    if "should_stop" in code:
        assert re.search(r"stopped after step \d+: stop: [\d.]+ s left < [\d.]+ s needed", out)
        assert "not requeued: not in a SLURM job" in out
    assert {s: signal.getsignal(s) for s in before} == before  # the example restores handlers
