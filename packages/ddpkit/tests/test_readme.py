"""The README's ```python blocks run as written (in one namespace, in order) and print what its
``<!-- output -->`` blocks show (compared by tools/mdexamples.py); the usage example, run as a
newcomer runs it (a fresh process, numpy not installed), prints no warning."""

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
NO_NUMPY = "import sys; sys.modules['numpy'] = None  # `import numpy` fails, as if not installed\n"


def test_readme_has_examples() -> None:
    assert len(EXAMPLES) >= 2 and sum(ex.output is not None for ex in EXAMPLES) >= 4


def test_readme_examples_run(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    launch: object,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    for key in list(os.environ):
        if key.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_")) or key in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "WANDB_MODE",
        ):
            monkeypatch.delenv(key)
    namespace: dict[str, object] = {"__name__": "__readme__"}
    for ex in EXAMPLES:
        exec(compile(ex.code, f"{README}:{ex.line}", "exec"), namespace)
        mdexamples.check(ex, capsys.readouterr().out)


def test_the_usage_example_prints_no_warning_without_numpy(tmp_path: Path) -> None:
    """Issue 24: `pip install ./packages/ddpkit` brings no numpy, and the example printed
    torch's "UserWarning: Failed to initialize NumPy" (it imported torch first)."""
    usage = EXAMPLES[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", NO_NUMPY + usage.code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    mdexamples.check(usage, done.stdout)
