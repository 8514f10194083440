"""The README's ```python blocks run as written (in one namespace, in order)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples() -> None:
    assert len(python_blocks()) >= 2


def test_readme_examples_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, launch: object
) -> None:
    monkeypatch.chdir(tmp_path)
    for key in list(__import__("os").environ):
        if key.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_")) or key in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "WANDB_MODE",
        ):
            monkeypatch.delenv(key)
    namespace: dict[str, object] = {"__name__": "__readme__"}
    for block in python_blocks():
        exec(compile(block, str(README), "exec"), namespace)
