"""PyTorch Lightning, time-aware: stop before the deadline with a verified checkpoint, resume.

    python examples/lightning_time_aware.py      # CPU, ~10 s, exit 0

Given a deadline -- ``PYRECOVER_END_TIME`` or a real SLURM job -- it stops at an optimizer-step
boundary with a committed checkpoint and exits 75; run it again and it resumes and finishes with 0,
with weights bitwise equal to a run that never stopped:

    PYRECOVER_END_TIME=$(( $(date +%s) + 12 )) python examples/lightning_time_aware.py  # 75
    python examples/lightning_time_aware.py                                             # 0

Two plugins, each usable alone:

- ``slurmclock.lightning.TimeAwareCallback`` -- slurmclock's time-aware loop (measured steps and
  saves, SLURM's end time, stop signals as flags, every rank agreeing through the strategy, the
  final save and extra saves after it), the RNG states, exit code 75. Under SLURM it takes over
  Lightning's auto-requeue signal handling.
- ``ckptstore.lightning.CkptStoreIO`` -- every checkpoint Lightning writes, verified, atomic and in
  the background, on any fsspec URL, never pickled.

The data loader must be resumable for an exact resume: torchdata's ``StatefulDataLoader``.
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from typing import Any

import lightning as L
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from ckptstore.lightning import CkptStoreIO
from slurmclock import end_process, process_start_time
from slurmclock.lightning import TimeAwareCallback

STEPS = 4000
CKPT_DIR = os.environ.get("EXAMPLE_CKPT_URL", "example-runs/lightning")


class YourModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.GELU(),
            nn.Linear(128, 1),
        )  # fmt: skip

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def your_data() -> StatefulDataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 32, generator=g)
    y = torch.sin(x @ torch.randn(32, 1, generator=g))
    # Shuffled from the global RNG (no generator=): the callback saves and restores it.
    return StatefulDataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode() + value.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> int:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    # Fixed small margins for a tiny model on a local disk; on a cluster: measured (omit).
    timer = TimeAwareCallback(CKPT_DIR, margin=3, initial_save_estimate=2)
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        callbacks=[timer],
        plugins=[CkptStoreIO()],
        default_root_dir=CKPT_DIR,
        logger=False,
        enable_checkpointing=False,  # add a ModelCheckpoint for periodic saves; it uses CkptStoreIO
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = YourModel()
    began = time.time()  # the deadline counts from the process's start: start-up uses it
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(model, your_data(), ckpt_path=timer.resume_path())
    if timer.stopped_early:
        given = timer.budget.deadline()
        used = f"start-up used {began - process_start_time():.1f} s"
        if given is not None and given.end is not None:
            used += f" of {given.end - process_start_time():.1f} s"
        print(f"stopped at step {trainer.global_step}/{STEPS}; exit {timer.exit_code}; {used}")
    else:
        print(f"finished step {trainer.global_step}/{STEPS}")
        print(f"weights {weights_digest(model)}")
    return timer.exit_code


if __name__ == "__main__":
    end_process(main())  # sys.exit without the interpreter's teardown (part of the job's exit)
