"""Writes checkpoints the way other tools do, for tests/test_import.py. Imports no ckptstore.

python ckpt_foreign_worker.py dcp OUT           # plain dcp.save (1 process, or each rank
                                                # of torchrun: gloo); OUT.expected.pt too
"""

from __future__ import annotations

import os
import sys
from typing import Any


def training_state() -> dict[str, Any]:
    """What a training loop checkpoints with DCP: the same on every rank (DDP)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 21, "epoch": 2}


def dcp_save(out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    try:
        state = training_state()
        dcp.save(state, checkpoint_id=out)
        if int(os.environ.get("RANK", "0")) == 0:
            torch.save(state, f"{out}.expected.pt")
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    mode, out = sys.argv[1:]
    {"dcp": dcp_save}[mode](out)
