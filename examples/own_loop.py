"""Your own training loop, time-aware: the smallest honest composition of the four packages.

    python examples/own_loop.py          # trains a tiny byte-level LM on CPU, ~10 s, exit 0

Given a deadline -- ``PYRECOVER_END_TIME`` (epoch seconds or ISO-8601) or a real SLURM job (the end
time comes from squeue) -- it stops in time with a committed checkpoint and exits 75; run it again
and it resumes exactly where it stopped (weights, optimizer, data position) and finishes with 0:

    PYRECOVER_END_TIME=$(( $(date +%s) + 12 )) python examples/own_loop.py; echo $?   # 75
    python examples/own_loop.py; echo $?                                              # 0

Under ``torchrun``/``srun`` every rank joins (ddpkit) and they stop at the same step. Who does what:
ddpkit (process group, seeding, the per-step agreement), parquetlm (packed, shuffled, exactly
resumable batches from any 1-D token array), ckptstore (verified, atomic, async saves on any fsspec
URL), slurmclock's ``TimeLoop`` (deadline, measured step and save times, stop signals, when to
stop and to save, extra saves after the final one -- the protocol pyrecover-train follows). The
model and the data are yours: replace ``your_model`` and ``your_tokens``.
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import numpy as np
import torch
from torch import nn

import ddpkit
from ckptstore import CheckpointStore
from parquetlm import PackedLoader
from slurmclock import DeadlineWatcher, TimeLoop, end_process, process_start_time

STEPS = int(os.environ.get("EXAMPLE_STEPS", 600))  # more: a longer run, e.g. under SLURM
SAVE_EVERY = 100  # periodic async saves: a crash without warning loses at most this many steps
CKPT_URL = os.environ.get("EXAMPLE_CKPT_URL", "example-runs/own_loop")  # or s3://bucket/run


def your_tokens() -> np.ndarray:
    """Any 1-D integer array; here the bytes of a small generated text (vocabulary 256)."""
    rng = np.random.default_rng(0)
    words = [b"time", b"budget", b"step", b"save", b"slurm", b"queue", b"node", b"rank", b"loss"]
    text = b" ".join(words[i] for i in rng.integers(0, len(words), 20_000))
    return np.frombuffer(text, dtype=np.uint8)


class your_model(nn.Module):  # noqa: N801 - reads as "your model" where it is used
    """A one-block causal transformer over bytes."""

    def __init__(self, dim: int = 64, seq_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.block = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.block(x, src_mask=self.mask, is_causal=True))


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, value in sorted(ddpkit.clean_state_dict(model.state_dict()).items()):
        h.update(name.encode() + value.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def train(dist: ddpkit.Dist, state: dict[str, Any], store: CheckpointStore) -> TimeLoop:
    """Train from ``state["step"]`` until the steps are done or the loop says stop."""
    model, opt, data = state["model"], state["optim"], state["data"]
    # SIGUSR2/SIGTERM only raise a flag; rank 0 watches the clock, every rank follows its answer.
    # A fixed small margin for a tiny model on a local disk; on a cluster: measured (omit it).
    loop = TimeLoop(
        deadline=DeadlineWatcher(), margin=3, initial_save_estimate=2, background_saves=True,
        leader=dist.rank == 0, agree=dist.agree, share=dist.broadcast_object,
    )  # fmt: skip
    loop.begin()
    while loop.training:
        batch = torch.from_numpy(data.next_batch()).to(dist.device)
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["step"] += 1
        durable(store, loop)  # async saves that finished meanwhile: their time until durable
        step = state["step"]
        act = loop.after_step(step, save_due=step % SAVE_EVERY == 0, last=step == STEPS)
        if act.save:  # periodic (async), or final/extra: durable before training goes on
            with loop.saving(act):  # an extra save: abandoned (exit 75) if not durable in time
                store.save(step, state, metadata={"loss": loss.item()}, blocking=act.durable)
                durable(store, loop)
    loop.end()
    return loop


def durable(store: CheckpointStore, loop: TimeLoop) -> None:
    for done in store.saves_completed():
        loop.saved(done.step, done.total_s, background=done.background)


def main() -> int:
    torch.set_num_threads(1)
    with ddpkit.init() as dist:
        ddpkit.seed_everything(0, dist.rank)
        model = ddpkit.wrap_ddp(your_model(), dist)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = PackedLoader(
            your_tokens(), seq_len=64, batch_size=16, seed=0, rank=dist.rank,
            world_size=dist.world_size,
        )  # fmt: skip
        state: dict[str, Any] = {"model": model, "optim": opt, "data": data, "step": 0}
        store = CheckpointStore(CKPT_URL, keep_last=2)
        if store.latest_step() is not None:
            store.load(state)  # model, optimizer, data position in place; "step" replaced
            dist.print(f"resumed from step {state['step']}")
        began = time.time()  # the deadline counts from the process's start: start-up uses it
        loop = train(dist, state, store) if state["step"] < STEPS else None
        store.close()  # waits for anything in flight; re-raises a background failure
        if loop is not None and loop.stopped_early:
            given = loop.budget.deadline()
            used = f"start-up used {began - process_start_time():.1f} s"
            if given is not None and given.end is not None:
                used += f" of {given.end - process_start_time():.1f} s"
            dist.print(f"stopped at step {state['step']}/{STEPS} ({loop.reason}); {used}")
            return loop.exit_code  # 75: steps left, resume from the checkpoint
        dist.print(f"finished step {state['step']}/{STEPS}")
        dist.print(f"weights {weights_digest(model)}")
        return 0


if __name__ == "__main__":
    end_process(main())  # sys.exit without the interpreter's teardown (part of the job's exit)
