"""A Lightning contestant of bench/race.py: pyrecover-train's GPT (tiny, byte tokens) on its corpus.

    python bench/race_worker.py --mode builtin|ours --root DIR --steps N [--cache-dir DIR]

The model, data and optimisation are pyrecover-train's ``--model-size tiny --tokenizer byte``:
the same GPT (``pyrecover_train.model``), the same Shakespeare parquet packed by parquetlm into
128+1-token windows, batch 8, AdamW 3e-3 with warm-up and cosine, gradient clipping 1.0.

- ``builtin``: Lightning as its docs set it up for SLURM -- ``SLURMEnvironment`` (auto-detected,
  ``auto_requeue=True``), launched by ``srun`` under ``#SBATCH --signal=SIGUSR1@90``: on SIGUSR1
  Lightning saves ``hpc_ckpt_N.ckpt`` from inside the signal handler and runs ``scontrol requeue``;
  the requeued job resumes from it automatically (``ckpt_path=None``).
- ``ours``: the same Trainer with slurmclock's ``TimeAwareCallback`` (its defaults) and
  ckptstore's ``CkptStoreIO``; exit 75 makes the batch script requeue
  (examples/slurm/requeue-on-75.sh).

Every optimizer step prints ``RACE step N EPOCH`` so the harness can tell, from the job log, how far
each allocation trained; the end prints ``RACE weights DIGEST``.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pyarrow.parquet as pq
import torch
from torch import nn

from parquetlm import PackedLoader
from parquetlm.torch import SizedLoader, TorchLoader
from pyrecover_train.corpus import prepare_shakespeare
from pyrecover_train.model import build_model, preset_config

SEQ_LEN, BATCH, LR, WARMUP, SEED = 128, 8, 3e-3, 40, 42


class GPTModule(L.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        shape = preset_config("tiny", vocab_size=256, max_seq_len=SEQ_LEN)
        self.gpt = build_model(shape, seed=SEED)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.gpt(batch[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.1)

        def schedule(step: int) -> float:
            if step < WARMUP:
                return (step + 1) / WARMUP
            progress = min(1.0, (step - WARMUP) / max(1, self.steps - WARMUP))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class RaceLog(L.Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        print(f"RACE start {trainer.global_step} {time.time():.3f}", flush=True)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        print(f"RACE step {trainer.global_step} {time.time():.3f}", flush=True)


def corpus_tokens(cache_dir: Path | None) -> np.ndarray:
    texts = pq.read_table(prepare_shakespeare(cache_dir), columns=["text"]).column("text")
    return np.frombuffer("\n".join(texts.to_pylist()).encode("utf-8"), dtype=np.uint8)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode() + value.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("builtin", "ours"), required=True)
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--margin", type=float, default=None, help="default: slurmclock's measured")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    L.seed_everything(SEED, verbose=False)
    tokens = corpus_tokens(args.cache_dir)
    packed = PackedLoader(tokens, seq_len=SEQ_LEN, batch_size=BATCH, seed=SEED)
    data = SizedLoader(TorchLoader(packed), args.steps)  # sized: no look-ahead
    callbacks: list[L.Callback] = [RaceLog()]
    plugins: list[Any] = []
    timer = None
    if args.mode == "ours":
        from ckptstore.lightning import CkptStoreIO
        from slurmclock.lightning import TimeAwareCallback

        # Shipped defaults: the first save is measured right after the warm-up (probe_saves),
        # the first allocation's exit guessed from its measured launch, extra saves on.
        timer = TimeAwareCallback(args.root, margin=args.margin)
        callbacks.append(timer)
        plugins.append(CkptStoreIO())
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        callbacks=callbacks,
        plugins=plugins,
        default_root_dir=args.root,
        gradient_clip_val=1.0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=args.mode == "builtin",  # Lightning's default there
        limit_val_batches=0,
    )
    model = GPTModule(args.steps)
    ckpt_path = timer.resume_path() if timer is not None else None  # builtin: finds hpc_ckpt_N
    trainer.fit(model, data, ckpt_path=ckpt_path)
    if trainer.global_step >= args.steps:
        print(f"RACE weights {digest(model.gpt)}", flush=True)
    if timer is not None:
        timer.exit()  # 75 or 0, without the interpreter's teardown (part of the job's exit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
