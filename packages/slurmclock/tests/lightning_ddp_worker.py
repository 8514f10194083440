"""Run by test_lightning.py under ``torchrun --nproc-per-node=2``: Lightning DDP on gloo (CPU).

    lightning_ddp_worker.py ROOT [STOP_STEP]

With STOP_STEP, only rank 1 raises its stop flag after that step: the strategy's agreement must
stop both ranks at the same step, with one checkpoint holding both ranks' RNG states. Prints
``RESULT rank=R step=N exit=E digest=D`` on every rank.
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from typing import Any

import lightning as L
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from slurmclock import Deadline
from slurmclock.lightning import TimeAwareCallback


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class RankOneStops(L.Callback):
    def __init__(self, timer: TimeAwareCallback, step: int) -> None:
        self.timer, self.step = timer, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 1:
            self.timer.loop.request_stop("rank 1 only")


def main() -> int:
    root, stop = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    timer = TimeAwareCallback(root, deadline=Deadline(None, "none"))
    callbacks: list[L.Callback] = [timer] if stop is None else [RankOneStops(timer, stop), timer]
    trainer = L.Trainer(
        max_steps=12,
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
    )
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    model = Net()
    trainer.fit(model, StatefulDataLoader(data, batch_size=4), ckpt_path=timer.resume_path())
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode() + value.detach().numpy().tobytes())
    rank, step, code = trainer.global_rank, trainer.global_step, timer.exit_code
    print(f"RESULT rank={rank} step={step} exit={code} digest={h.hexdigest()[:16]}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
