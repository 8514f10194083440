"""What a checkpoint holds -- one definition, used by save, resume and the dry run -- and helpers
to size and compare nested state dicts.

Checkpoint layout (every rank passes identical content, so a sharded format deduplicates it)::

    {"model": the bare module (keys without "module."/"_orig_mod." prefixes),
     "optim": the optimizer, "sched": the LR scheduler, "scaler": the GradScaler (fp16) or {},
     "data": the PackedLoader (its global position), "step": int,
     "rng": {"rank0": {...}, "rank1": {...}, ...}}   # every rank's RNG states, as tensors

With FSDP (a sharded model) "model" and "optim" are ckptstore's ``ModelState`` and
``OptimizerState``: each rank's DTensor shards (nothing gathered), the optimizer state keyed by
parameter name so that it follows its parameter onto another world size.

ckptstore calls ``state_dict()`` of the objects when saving and ``load_state_dict()`` when
loading; "rng" and "step" come back as values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import ddpkit
from ckptstore.sharded import ModelState, OptimizerState
from parquetlm import PackedLoader


@dataclass(slots=True)
class TrainState:
    """The training state of one process: what is saved, resumed and compared."""

    model: nn.Module  # the bare module (no DDP / torch.compile wrapper)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    loader: PackedLoader
    step: int = 0

    def checkpoint(self, rng_by_rank: dict[str, Any]) -> dict[str, Any]:
        """What a save writes. Objects go in as themselves: the store calls their
        ``state_dict()``, so an optimizer needs no state before its first step."""
        return {**self._objects(), "rng": rng_by_rank, "step": self.step}

    def template(self, *, with_scaler: bool = True, saved_as: str | None = None) -> dict[str, Any]:
        """What a load fills: the objects in place; "rng" and "step" come back as values.
        ``with_scaler=False`` for a checkpoint written without fp16 (it holds no scaler
        state): the scaler then starts fresh. ``saved_as``: the --parallelism that wrote the
        checkpoint, when it is not this run's: a DDP checkpoint (whole tensors, the optimizer
        by parameter position) loads into FSDP shards, an FSDP one (by parameter name,
        sharded) into whole tensors; either way the values are the saved ones, bitwise."""
        objects = self._objects()
        if not with_scaler:
            objects["scaler"] = {}
        if saved_as == "ddp" and self.sharded:
            objects["model"] = FromWhole(objects["model"])
            objects["optim"] = FromWhole(objects["optim"], rename=self._named_optim_state)
        elif saved_as == "fsdp" and not self.sharded:
            objects["optim"] = OptimizerState(self.model, self.optimizer)
        return {**objects, "rng": {}, "step": -1}

    def _named_optim_state(self, saved: dict[str, Any]) -> dict[str, Any]:
        """torch's optimizer state dict (parameters by position in the param groups) keyed by
        parameter name instead. The positions are this optimizer's: the run that saved built
        its optimizer in the same order (build.py)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        order = [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        try:
            return {
                "state": {order[int(i)]: v for i, v in saved["state"].items()},
                "param_groups": [
                    {**g, "params": [order[int(i)] for i in g["params"]]}
                    for g in saved["param_groups"]
                ],
            }
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ValueError(f"not an optimizer state of this model ({e!r})") from None

    @property
    def sharded(self) -> bool:
        return ddpkit.is_sharded(self.model)

    def weights_finite(self, dist: ddpkit.Dist) -> bool:
        """Are all weights finite? One reduction per tensor and one sync: cheap next to the save
        it guards. Sharded: each rank checks its shards and the ranks agree."""
        sums = torch.stack([local(p.detach()).sum() for p in self.model.parameters()])
        finite = bool(torch.isfinite(sums).all())
        return dist.all_ranks(finite) if self.sharded else finite

    def live(self) -> dict[str, Any]:
        """The comparable values now, as a save writes them (the dry run checks a read-back
        against them); DTensors when sharded."""
        objects = self._objects()
        return {k: objects[k].state_dict() for k in ("model", "optim", "data")}

    def _objects(self) -> dict[str, Any]:
        model: Any = self.model
        optim: Any = self.optimizer
        if self.sharded:
            model, optim = ModelState(self.model), OptimizerState(self.model, self.optimizer)
        return {
            "model": model,
            "optim": optim,
            "sched": self.scheduler,
            "scaler": self.scaler if self.scaler is not None else {},
            "data": self.loader,
        }


class FromWhole:
    """A checkpoint's "model" or "optim" of whole tensors (written without FSDP) loaded into
    the sharded ``target`` (ckptstore's ``ModelState``/``OptimizerState``). The checkpoint's
    tensors are read as they are (a local file: mapped, so each rank touches only its part),
    ``rename`` brings them into the target's layout, then every rank copies its own shard
    (``ddpkit.fill_shards``): no whole model on any device, no communication."""

    __slots__ = ("rename", "target")

    def __init__(
        self, target: ModelState | OptimizerState, rename: Callable[[Any], Any] | None = None
    ) -> None:
        self.target, self.rename = target, rename

    def state_dict(self) -> dict[str, Any]:
        return {}  # nothing to read into in place: the whole tensors come as they are

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        whole = self.rename(state_dict) if self.rename is not None else state_dict
        self.target.load_state_dict(ddpkit.fill_shards(self.target.state_dict(), whole))


def count_bytes(obj: Any) -> int:
    """Bytes of all tensors in a nested state dict (for the first save-time estimate)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(count_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(count_bytes(v) for v in obj)
    return 0


def clone_tree(obj: Any) -> Any:
    """A deep copy of a nested state dict whose tensors share no storage with the original."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_tree(v) for v in obj)
    return obj


def tensors_equal(a: Any, b: Any) -> list[str]:
    """Paths where two nested state dicts differ (empty when bitwise equal)."""
    out: list[str] = []
    _diff(a, b, "", out)
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard, else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = local(a), local(b)  # shards compare shard by shard, on each rank
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.cpu(), b.cpu()):
            out.append(path or "<root>")
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}.{k}")
            else:
                _diff(a[k], b[k], f"{path}.{k}", out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append(path)
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _diff(x, y, f"{path}[{i}]", out)
    elif a != b:
        out.append(path)
