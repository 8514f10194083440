"""One rank of a run that resumes with another --parallelism than the checkpoint's, stopped
right after the load, for tests/test_fsdp.py: the trainer's own set-up and resume (torchrun,
gloo), then every rank's live state, gathered whole and keyed by parameter name, compared with
the checkpoint as ckptstore reads it.

    python -m torch.distributed.run ... switch_worker.py OUT.json -- PYRECOVER-TRAIN FLAGS

Rank 0 writes OUT.json: {"step", "position", "checkpoint_position", "differ": [paths]}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import ckptstore
import slurmclock
from pyrecover_train import build
from pyrecover_train.config import config_from_args
from pyrecover_train.state import tensors_equal
from pyrecover_train.trainer import Trainer


def by_name(saved: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A checkpoint's optimizer state keyed by parameter name: a DDP run's is torch's own (by
    position: the decayed matrices, then the norms, in the model's order)."""
    if all(isinstance(k, str) for k in saved["state"]):
        return dict(saved["state"])
    return {names[int(i)]: v for i, v in saved["state"].items()}


def main(out: str, argv: list[str]) -> None:
    cfg = config_from_args(argv)
    build.check_launcher(cfg)
    signals = slurmclock.StopSignals(slurmclock.STOP_SIGNALS).install()
    with build.join(cfg) as dist:
        trainer = Trainer(cfg, dist, signals)
        try:
            state = trainer.state
            whole = StateDictOptions(full_state_dict=True)  # gathered on every rank
            model = get_model_state_dict(state.model, options=whole)
            optim = get_optimizer_state_dict(state.model, state.optimizer, options=whole)
            params = list(state.model.named_parameters())
            names = [n for n, p in params if p.ndim >= 2] + [n for n, p in params if p.ndim < 2]
            if dist.rank == 0:
                url, exp = cfg.store_url, cfg.experiment_name
                with ckptstore.CheckpointStore(url, experiment=exp, distributed=False) as store:
                    _, saved = store.read(state.step)
                differ = tensors_equal(saved["model"], model)
                differ += tensors_equal(by_name(saved["optim"], names), optim["state"])
                result = {
                    "step": state.step,
                    "position": state.loader.position,
                    "checkpoint_position": saved["data"]["position"],
                    "differ": differ,
                    "dtypes": sorted({str(t.dtype) for t in model.values()}),
                    "sharded": state.sharded,
                }
                Path(out).write_text(json.dumps(result))
        finally:
            trainer.close()
    signals.restore()


if __name__ == "__main__":
    cut = sys.argv.index("--")
    main(sys.argv[1], sys.argv[cut + 1 :])
