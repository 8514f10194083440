"""The state another tool would checkpoint for this trainer's GPT, and a writer of it with plain
``dcp.save`` under torchrun (gloo), for tests/test_import.py. Imports no ckptstore.

python train_foreign_worker.py dcp OUT VOCAB STEP   # each rank of torchrun (or 1 process)
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch


def source_state(vocab: int, step: int) -> dict[str, Any]:
    """Weights of the tiny GPT after one AdamW step (so there are moments), its optimizer laid
    out as the trainer's (decayed matrices, then norms), and the step."""
    from pyrecover_train.build import decay_params
    from pyrecover_train.model import build_model, preset_config

    model = build_model(preset_config("tiny", vocab_size=vocab, max_seq_len=32), seed=11)
    groups = [
        {"params": decay_params(model, True), "weight_decay": 0.1},
        {"params": decay_params(model, False), "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    model(tokens).float().square().mean().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def dcp_save(out: str, vocab: int, step: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    try:
        dcp.save(source_state(vocab, step), checkpoint_id=out)
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    mode, out, vocab, step = sys.argv[1:]
    {"dcp": dcp_save}[mode](out, int(vocab), int(step))
