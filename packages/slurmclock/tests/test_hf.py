"""slurmclock.hf.TimeAwareCallback against the real transformers Trainer (extra [hf]).

A run stopped at step k (real signal or deadline) and resumed from its checkpoint ends with weights
bitwise equal to a run that never stopped (CPU: dropout, shuffled data across epochs, AdamW, a
warm-up + linear LR schedule).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs the [hf] extra")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from slurmclock import Deadline, TimeBudget  # noqa: E402
from slurmclock.hf import (  # noqa: E402
    BUDGET_FILE,
    EXIT_STOPPED,
    TimeAwareCallback,
    last_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
MAX_STEPS = 13  # 5 batches per epoch


class Net(nn.Module):
    def __init__(self, clock: list[float] | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 1))
        self.clock = clock

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.clock is not None:
            self.clock[0] += 1.0
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def dataset() -> list[dict[str, torch.Tensor]]:
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(1))
    y = x.sum(1, keepdim=True)
    return [{"x": x[i], "labels": y[i]} for i in range(len(x))]


class At(TrainerCallback):
    def __init__(self, step: int, action: Any) -> None:
        self.step, self.action = step, action

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.step:
            self.action()


def train(
    out: Path,
    *callbacks: TrainerCallback,
    timer: TimeAwareCallback | None = None,
    clock: Any = None,
    save_only_model: bool = False,
) -> tuple[Net, TimeAwareCallback, Trainer]:
    torch.manual_seed(0)
    timer = timer or TimeAwareCallback(deadline=Deadline(None, "none"))
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=MAX_STEPS,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        save_strategy="steps",
        save_steps=1000,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        remove_unused_columns=False,
        save_only_model=save_only_model,
    )
    model = Net(clock)
    trainer = Trainer(
        model=model, args=args, train_dataset=dataset(), callbacks=[*callbacks, timer]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=last_checkpoint(out))
    return model, timer, trainer


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Net:
    model, timer, trainer = train(tmp_path_factory.mktemp("straight"))
    assert timer.exit_code == 0 and trainer.state.global_step == MAX_STEPS
    return model


def test_real_signal_stops_saves_and_resumes_bitwise(straight: Net, tmp_path: Path) -> None:
    usr2 = At(7, lambda: os.kill(os.getpid(), signal.SIGUSR2))
    first, timer, trainer = train(tmp_path, usr2)
    assert timer.exit_code == EXIT_STOPPED and trainer.state.global_step == 7
    assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-7")
    assert timer.budget.saves_measured == 1
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL

    resumed, timer2, trainer2 = train(tmp_path)
    assert timer2.exit_code == 0 and trainer2.state.global_step == MAX_STEPS
    assert same_weights(resumed, straight)
    assert last_checkpoint(tmp_path) == str(tmp_path / f"checkpoint-{MAX_STEPS}")  # saved at end


def test_the_budget_carries_its_measurements_to_the_resumed_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The save time measured in one allocation is the next one's estimate (not the 60 s guess);
    a damaged file costs only the estimates."""
    import json

    usr2 = At(7, lambda: os.kill(os.getpid(), signal.SIGUSR2))
    _, timer, _ = train(tmp_path, usr2)
    assert timer.exit_code == EXIT_STOPPED
    stored = json.loads((tmp_path / "checkpoint-7" / BUDGET_FILE).read_text())
    assert stored == json.loads(json.dumps(timer.budget.state_dict()))
    assert len(stored["saves"]) == 1 and len(stored["steps"]) >= 5

    seen: list[float | None] = []
    probe = At(8, lambda: seen.append(timer2.budget.save_estimate))
    timer2 = TimeAwareCallback(deadline=Deadline(None, "none"))
    train(tmp_path, probe, timer=timer2)
    assert seen[0] is not None and seen[0] < 60.0  # from the measured save, before any new one
    assert len(timer2.budget.state_dict()["saves"]) == 2  # the loaded one + the final save

    (tmp_path / f"checkpoint-{MAX_STEPS}" / BUDGET_FILE).write_text("{not json")
    (tmp_path / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").unlink()  # resume from 7
    (tmp_path / "checkpoint-7" / BUDGET_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        _, timer3, trainer3 = train(tmp_path)
    assert timer3.exit_code == 0 and trainer3.state.global_step == MAX_STEPS
    assert any("starting from the initial estimates" in r.getMessage() for r in caplog.records)


def test_deadline_stop(straight: Net, tmp_path: Path) -> None:
    clock = [90.0]  # left = 100 - t; needed = step (1 fake s) + 2 + 5.5: stops at t = 92, step 2
    budget = TimeBudget(
        Deadline(100.0, "override"),
        margin=5.5,
        initial_save_estimate=2.0,
        warmup_steps=0,
        clock=lambda: clock[0],
    )
    timer = TimeAwareCallback(budget=budget, probe_saves=False, extra_saves=False)
    _, timer, trainer = train(tmp_path, timer=timer, clock=clock)
    assert timer.exit_code == EXIT_STOPPED and trainer.state.global_step == 2
    resumed, timer2, _ = train(tmp_path)
    assert timer2.exit_code == 0 and same_weights(resumed, straight)


def stop_for_time(clock: list[float]) -> TimeAwareCallback:
    """A stop for time on the fake clock (one fake second per step): the final save after step
    9 (at 95.5), then two more steps fit before the exit must begin (100 - margin 2): an extra
    save of step 11."""
    clock[0] = 86.5
    budget = TimeBudget(
        Deadline(100.0, "override"),
        margin=2.0,
        initial_save_estimate=2.0,
        warmup_steps=0,
        clock=lambda: clock[0],
    )
    return TimeAwareCallback(budget=budget, probe_saves=False)


def test_the_time_the_final_save_left_is_trained_and_saved_again(
    straight: Net, tmp_path: Path
) -> None:
    """The Trainer writes checkpoint-11 too, and the run resumes from it bitwise."""
    clock = [0.0]
    _, timer, trainer = train(tmp_path, timer=stop_for_time(clock), clock=clock)
    assert timer.exit_code == EXIT_STOPPED and trainer.state.global_step == 11
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [
        "checkpoint-11",
        "checkpoint-9",
    ]
    assert timer.budget.saves_measured == 1  # the extra save is not a save-time sample
    resumed, timer2, _ = train(tmp_path)
    assert timer2.exit_code == 0 and same_weights(resumed, straight)


def test_an_extra_save_not_durable_in_time_is_abandoned_and_the_final_one_stands(
    straight: Net, tmp_path: Path
) -> None:
    """In a process of its own (the abandon ends it): the Trainer's save stalls in the extra
    save; the watchdog ends the process with 75, last_checkpoint skips the cut-short folder, and
    the next run resumes from the final save, bitwise."""
    import re
    import subprocess
    import sys

    worker = Path(__file__).with_name("hf_worker.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYRECOVER_"))}
    r = subprocess.run(
        [sys.executable, str(worker), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == EXIT_STOPPED, out[-3000:]
    said = re.search(r"extra save of step (\d+) abandoned \(the exit must begin\): step (\d+)", out)
    assert said is not None and (said[1], said[2]) == ("11", "9"), out[-3000:]
    assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-9")
    resumed, timer2, _ = train(tmp_path)
    assert timer2.exit_code == 0 and same_weights(resumed, straight)


def test_last_checkpoint_skips_a_save_cut_short(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A save killed before trainer_state.json, or while writing it (empty or cut off: issue 30
    found those taken), is skipped: the newest complete one is taken, and one line names it and
    each folder skipped."""
    assert last_checkpoint(tmp_path / "missing") is None
    for step, state in ((5, '{"global_step": 5}'), (10, None), (15, ""), (20, '{"global_st')):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if state is not None:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    (tmp_path / "checkpoint-x").mkdir()
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-5")
    (line,) = caplog.messages
    assert line.startswith("slurmclock: resuming from checkpoint-5, the newest complete"), line
    assert "checkpoint-20 (trainer_state.json is not whole JSON: the save was cut short)" in line
    assert "checkpoint-15 (trainer_state.json is empty" in line
    assert "checkpoint-10 (no trainer_state.json" in line
    caplog.clear()
    (tmp_path / "checkpoint-5" / "trainer_state.json").write_text("[]")
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        assert last_checkpoint(tmp_path) is None
    assert "no complete checkpoint in" in caplog.text and "has no global_step" in caplog.text


def test_a_truncated_trainer_state_of_a_real_save_is_skipped_and_the_resume_is_exact(
    straight: Net, tmp_path: Path
) -> None:
    """The real Trainer's checkpoint-7, then a checkpoint-9 whose trainer_state.json was cut
    off mid-write: the resume starts from checkpoint-7 and ends bitwise equal."""
    usr2 = At(7, lambda: os.kill(os.getpid(), signal.SIGUSR2))
    _, timer, _ = train(tmp_path, usr2)
    assert timer.exit_code == EXIT_STOPPED
    cut = tmp_path / "checkpoint-9"
    shutil.copytree(tmp_path / "checkpoint-7", cut)
    state = (cut / "trainer_state.json").read_bytes()
    (cut / "trainer_state.json").write_bytes(state[: len(state) // 2])
    assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-7")
    resumed, timer2, _ = train(tmp_path)
    assert timer2.exit_code == 0 and same_weights(resumed, straight)


def test_save_only_model_is_said_not_to_resume_exactly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """save_only_model=True: the Trainer's checkpoints hold no optimizer or RNG state and its
    resume restarts them without a word (issue 30). The callback says so at the start, and
    again when a run resumes from such a checkpoint."""
    usr2 = At(7, lambda: os.kill(os.getpid(), signal.SIGUSR2))
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        _, timer, _ = train(tmp_path, usr2, save_only_model=True)
    assert timer.exit_code == EXIT_STOPPED
    said = [m for m in caplog.messages if "save_only_model" in m]
    assert said == [
        "slurmclock: save_only_model=True: the checkpoints a stop saves hold the weights only, "
        "so the resume will not be exact (optimizer, LR schedule and RNG start over); set "
        "save_only_model=False for exact resumes"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slurmclock"):
        _, timer, _ = train(tmp_path)  # resumed with save_only_model=False: still not exact
    assert timer.exit_code == 0
    said = [m for m in caplog.messages if "save_only_model" in m]
    assert len(said) == 1 and "checkpoint-7 holds no optimizer/RNG state" in said[0], said
    assert "this resume is not exact" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slurmclock"):  # a whole checkpoint: silent
        train(tmp_path / "whole", At(3, lambda: os.kill(os.getpid(), signal.SIGUSR2)))
        train(tmp_path / "whole")
    assert not [m for m in caplog.messages if "save_only_model" in m], caplog.messages


def test_the_stop_save_is_marked_in_the_jobs_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a SLURM job the stop's checkpoint marks `saved` in the job's timeline (the exit that
    follows, until `slurmclock requeue`, is measured for the next allocation)."""
    from slurmclock import JobTimeline

    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    usr2 = At(7, lambda: os.kill(os.getpid(), signal.SIGUSR2))
    _, timer, _ = train(tmp_path / "out", usr2)
    assert timer.exit_code == EXIT_STOPPED
    marks = [(e.name, e.info.get("step")) for e in JobTimeline().events()]
    # first_step: the start-up a restart in the allocation is planned with
    assert marks == [("first_step", 1), ("checkpoint", 7), ("saved", None)]
