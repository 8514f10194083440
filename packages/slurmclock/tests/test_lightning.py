"""slurmclock.lightning.TimeAwareCallback against the real Lightning (extra [lightning]).

A run stopped at step k (by a real signal, a stop flag or the deadline) and resumed must end with
weights bitwise equal to a run that never stopped: dropout (global RNG), a shuffled resumable
dataloader crossing epochs, AdamW and a per-step LR schedule all take part.
"""

from __future__ import annotations

import os
import re
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning", reason="needs the [lightning] extra")
pytest.importorskip("torchdata", reason="needs torchdata (StatefulDataLoader)")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.fabric.plugins.environments import SLURMEnvironment  # noqa: E402
from torch import nn  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from slurmclock import Deadline, JobTimeline, TimeBudget  # noqa: E402
from slurmclock.lightning import EXIT_STOPPED, TimeAwareCallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
NO_DEADLINE = Deadline(None, "none")
MAX_STEPS = 13  # 5 batches per epoch: the runs cross two epoch boundaries


class Net(L.LightningModule):
    def __init__(self, clock: list[float] | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 1))
        self.clock = clock

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.clock is not None:
            self.clock[0] += 1.0  # one fake second per step
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, 4, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader() -> StatefulDataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 8, generator=g)
    # No generator=: torchdata's state misses a loader generator's draw at each epoch start; the
    # global RNG, which the callback restores, is exact.
    return StatefulDataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), 8, True)


class At(L.Callback):
    """Does ``action`` once, at the end of optimizer step ``step``."""

    def __init__(self, step: int, action: Any) -> None:
        self.step, self.action = step, action

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.action()


def fit(
    root: Path,
    *callbacks: L.Callback,
    timer: TimeAwareCallback | None = None,
    clock: list[float] | None = None,
    **kw: Any,
) -> tuple[Net, TimeAwareCallback, L.Trainer]:
    L.seed_everything(0, verbose=False)
    timer = timer or TimeAwareCallback(root, deadline=NO_DEADLINE)
    trainer = L.Trainer(
        max_steps=MAX_STEPS,
        callbacks=[*callbacks, timer],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
        **kw,
    )
    model = Net(clock)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader(), ckpt_path=timer.resume_path())
    return model, timer, trainer


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Net:
    model, timer, trainer = fit(tmp_path_factory.mktemp("straight"))
    assert timer.exit_code == 0 and trainer.global_step == MAX_STEPS
    return model


def test_real_signal_stops_saves_and_resumes_bitwise(straight: Net, tmp_path: Path) -> None:
    usr2 = At(7, lambda: os.kill(os.getpid(), signal.SIGUSR2))
    first, timer, trainer = fit(tmp_path, usr2)
    assert timer.exit_code == EXIT_STOPPED and timer.stopped_early
    assert trainer.global_step == 7
    assert "SIGUSR2" in timer.loop.reason
    assert not same_weights(first, straight)
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # handlers put back

    resumed, timer2, trainer2 = fit(tmp_path)
    assert timer2.exit_code == 0 and trainer2.global_step == MAX_STEPS
    assert same_weights(resumed, straight)

    # Finished runs save at the end: a third run is a no-op, not a redo of steps 8..13.
    again, timer3, trainer3 = fit(tmp_path)
    assert timer3.exit_code == 0 and same_weights(again, straight)


def test_deadline_stop_keeps_the_margin(straight: Net, tmp_path: Path) -> None:
    clock = [0.0]
    budget = TimeBudget(
        Deadline(100.0, "override"),
        margin=5.5,
        initial_save_estimate=2.0,
        warmup_steps=0,
        clock=lambda: clock[0],
    )
    # left = 100 - k after step k; needed = step (1 fake s) + 2 + 5.5: first stop at k = 92,
    # so start the fake clock at 87: stop after step 5.
    clock[0] = 87.0
    timer = TimeAwareCallback(tmp_path, budget=budget, probe_saves=False, extra_saves=False)
    _, timer, trainer = fit(tmp_path, timer=timer, clock=clock)
    assert timer.exit_code == EXIT_STOPPED and trainer.global_step == 5
    assert "s left <" in timer.loop.reason
    assert budget.saves_measured == 1  # the final save fed the budget

    resumed, timer2, _ = fit(tmp_path)
    assert timer2.exit_code == 0 and same_weights(resumed, straight)
    # The measured figures travel in the checkpoint (its own save time cannot: it is measured
    # after the state was taken, so here, without periodic saves, no save time travels).
    ckpt = torch.load(tmp_path / "timeaware.ckpt", weights_only=True)
    carried = ckpt["callbacks"][timer2.state_key]["budget"]
    assert carried["steps"] and carried["saves"] == []


def stop_for_time(root: Path, clock: list[float]) -> TimeAwareCallback:
    """A stop for time on the fake clock (one fake second per step): the final save after step
    9 (at 95.5; it takes a fraction of its 2 s guess), then two more steps fit before the exit
    must begin (100 - margin 2): an extra save of step 11."""
    clock[0] = 86.5
    budget = TimeBudget(
        Deadline(100.0, "override"),
        margin=2.0,
        initial_save_estimate=2.0,
        warmup_steps=0,
        clock=lambda: clock[0],
    )
    return TimeAwareCallback(root, budget=budget, probe_saves=False)


def test_the_time_the_final_save_left_is_trained_and_saved_again(
    straight: Net, tmp_path: Path
) -> None:
    """The extra save is written at the same path, and the run resumes from it bitwise."""
    saves: list[int] = []

    class Count(L.Callback):
        def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
            saves.append(trainer.global_step)

    clock = [0.0]
    _, timer, trainer = fit(tmp_path, Count(), timer=stop_for_time(tmp_path, clock), clock=clock)
    assert saves == [9, 11] and trainer.global_step == 11  # final, then extra
    assert timer.exit_code == EXIT_STOPPED and timer.loop.abandoned is None
    assert timer.budget.saves_measured == 1  # the extra save is not a save-time sample
    resumed, timer2, trainer2 = fit(tmp_path)
    assert timer2.exit_code == 0 and same_weights(resumed, straight)


def test_an_extra_save_not_durable_in_time_is_abandoned_and_the_final_one_stands(
    straight: Net, tmp_path: Path
) -> None:
    """In a process of its own (the abandon ends it): a CheckpointIO that stalls in the extra
    save; the watchdog ends the process with 75 when the exit must begin, and the next run
    resumes from the final save, bitwise."""
    import subprocess
    import sys

    worker = Path(__file__).with_name("lightning_worker.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYRECOVER_"))}
    r = subprocess.run(
        [sys.executable, str(worker), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == EXIT_STOPPED, out[-3000:]
    said = re.search(r"extra save of step (\d+) abandoned \(the exit must begin\): step (\d+)", out)
    assert said is not None and int(said[2]) < int(said[1]), out[-3000:]
    assert torch.load(tmp_path / "timeaware.ckpt", weights_only=True)["global_step"] == int(said[2])
    resumed, timer2, _ = fit(tmp_path)
    assert timer2.exit_code == 0 and same_weights(resumed, straight)


def test_takes_over_lightning_slurm_auto_requeue(
    straight: Net, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """Under SLURM Lightning would save inside its SIGUSR1 handler and run scontrol requeue; the
    callback turns SIGUSR1 into a stop at the next step boundary and leaves the requeue to 75.
    It says so when the signal comes, and says nothing in a job without one."""
    for key, value in {
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NAME": "train",
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PATH", str(tmp_path / "no-scontrol"))  # a requeue attempt would fail
    with caplog.at_level("INFO"):
        _, quiet, _ = fit(tmp_path / "no-signal")
    assert quiet.exit_code == 0 and "taken over" not in caplog.text
    usr1 = At(5, lambda: os.kill(os.getpid(), signal.SIGUSR1))
    with caplog.at_level("INFO"):
        _, timer, trainer = fit(tmp_path, usr1)
    assert "SIGUSR1 is Lightning's requeue signal, taken over" in caplog.text
    env = trainer._accelerator_connector.cluster_environment
    assert isinstance(env, SLURMEnvironment) and env.auto_requeue is False
    assert timer.exit_code == EXIT_STOPPED and trainer.global_step == 5
    assert not list(tmp_path.glob("hpc_ckpt_*"))  # Lightning's own handler did not run
    # The stop's checkpoint, durable, is marked in the job's timeline: the exit that follows
    # until the requeue is measured for the next allocation (as pyrecover-train does).
    marks = [(e.name, e.info.get("step")) for e in JobTimeline().events()]
    assert marks[-2:] == [("checkpoint", 5), ("saved", None)]
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("SLURM_NTASKS")
    resumed, _, _ = fit(tmp_path)
    assert same_weights(resumed, straight)


def test_periodic_saves_and_bad_arguments(tmp_path: Path) -> None:
    saves: list[int] = []

    class Count(L.Callback):
        def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
            saves.append(trainer.global_step)

    _, timer, _ = fit(tmp_path, Count(), timer=TimeAwareCallback(tmp_path, every_n_steps=5))
    assert saves == [5, 10, 13]  # periodic, then the save at the end
    assert timer.budget.saves_measured == 3
    with pytest.raises(ValueError, match="every_n_steps must be an integer >= 1"):
        TimeAwareCallback(every_n_steps=0)
    with pytest.raises(ValueError, match="plain file name"):
        TimeAwareCallback(filename="a/b.ckpt")


def torchrun(root: Path, *args: str) -> list[dict[str, str]]:
    """Two gloo ranks of lightning_ddp_worker.py; each rank's RESULT line, parsed."""
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PYRECOVER_"))}
    env["TMPDIR"] = str(root.parent / "tmp")  # torchrun's torchelastic_* folders stay in tmp_path
    os.makedirs(env["TMPDIR"], exist_ok=True)
    worker = Path(__file__).with_name("lightning_ddp_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    out = subprocess.run(
        [*cmd, str(worker), str(root), *args], env=env, capture_output=True, text=True, timeout=300
    )
    # The two ranks share one pipe: lines may run into each other, so match exact widths.
    pattern = (
        r"RESULT rank=(?P<rank>\d) step=(?P<step>\d+) exit=(?P<exit>\d+) digest=(?P<d>[0-9a-f]{16})"
    )
    found = [m.groupdict() for m in re.finditer(pattern, out.stdout)]
    assert len(found) == 2, out.stdout[-3000:] + out.stderr[-3000:]
    return sorted(found, key=lambda r: r["rank"])


def test_async_periodic_saves_are_timed_as_background_saves(tmp_path: Path) -> None:
    """With a CheckpointIO that persists in the background (ckptstore's CkptStoreIO: it reports
    ``saves_completed()``), periodic saves are recorded as background saves and the save the
    callback waits for as a blocking one, so the final save's bound is not inflated by them."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.io import TorchCheckpointIO

    class BackgroundIO(TorchCheckpointIO):
        def __init__(self) -> None:
            self.done: list[SimpleNamespace] = []

        def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options)
            step = checkpoint["global_step"]
            self.done.append(SimpleNamespace(step=step, total_s=1.0 if step == MAX_STEPS else 3.0))

        def saves_completed(self) -> list[SimpleNamespace]:
            done, self.done = self.done, []
            return done

        def wait(self) -> None:
            pass

    timer = TimeAwareCallback(tmp_path, every_n_steps=5, deadline=NO_DEADLINE)
    fit(tmp_path, timer=timer, plugins=[BackgroundIO()])
    state = timer.budget.state_dict()
    assert state["background_saves"] == [3.0, 3.0]  # steps 5 and 10, written while training
    assert state["saves"] == [1.0]  # the save at the end, waited for
    assert (timer.budget.save_estimate or 0) < (timer.budget.background_save_estimate or 0)


def test_ddp_one_rank_stopping_stops_all_and_resumes_bitwise(tmp_path: Path) -> None:
    straight = torchrun(tmp_path / "straight")
    stopped = torchrun(tmp_path / "run", "5")  # only rank 1 raises its flag after step 5
    assert [(r["step"], r["exit"]) for r in stopped] == [("5", "75"), ("5", "75")]
    resumed = torchrun(tmp_path / "run")
    assert [(r["step"], r["exit"]) for r in resumed] == [("12", "0"), ("12", "0")]
    assert {r["d"] for r in resumed} == {straight[0]["d"]}


def test_saves_do_not_make_lightning_log_weights_only(tmp_path: Path) -> None:
    """Each save of the callback asks for a full checkpoint: Lightning logged "`weights_only`
    was not set, defaulting to `False`." at every one (26 lines in a run with every_n_steps)."""
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    lightning_log = logging.getLogger("lightning.pytorch")
    lightning_log.addHandler(handler)
    try:
        timer = TimeAwareCallback(tmp_path, every_n_steps=2, deadline=NO_DEADLINE)
        fit(tmp_path, timer=timer)
    finally:
        lightning_log.removeHandler(handler)
    assert (tmp_path / "timeaware.ckpt").exists()
    assert not [m for m in said if "weights_only" in m], said
