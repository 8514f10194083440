"""Model and optimizer state that stays sharded: FSDP2 checkpoints with no full-state gather.

``CheckpointStore`` calls ``state_dict()`` on every object of the state it saves and
``load_state_dict()`` on load. The two wrappers here answer through
``torch.distributed.checkpoint.state_dict``, so that

- an FSDP2 model's state is its DTensor shards: with ``format="dcp"`` each rank writes only its
  own shard, and a load reads only what each rank of the *current* job holds, on any world size;
- the optimizer's state is keyed by parameter *name* (not by the position of the parameter in
  ``optimizer.param_groups``), so it follows its parameter through a reshard, and an optimizer
  that has not stepped yet is loadable (its moments are made first, with a zero learning rate);
- the keys carry no ``module.`` (DDP) or ``_orig_mod.`` (``torch.compile``) prefix: a checkpoint
  written by a DDP run loads into an FSDP run, or into a bare model in one process, and back.

::

    from ckptstore import CheckpointStore
    from ckptstore.sharded import ModelState, OptimizerState

    state = {"model": ModelState(model), "optim": OptimizerState(model, optimizer), "step": step}
    store = CheckpointStore("s3://bucket/run", format="dcp")
    store.save(step, state)
    store.load(state)  # in place, on this job's world size

Saving is a collective under torch.distributed (every rank calls it), as DCP itself is. The
``torch`` format still works for unsharded models (rank 0 writes everything); for DTensors it
refuses with a pointer to ``dcp``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["ModelState", "OptimizerState"]


def _options(*, strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Sharded (full_state_dict=False): no gather to rank 0; tensors stay where they live.
    return StateDictOptions(full_state_dict=False, cpu_offload=False, strict=strict)


class ModelState:
    """``model``'s parameters and buffers, sharded when the model is (FSDP2), for a
    :class:`ckptstore.CheckpointStore` state."""

    __slots__ = ("model",)

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"ModelState needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=_options())

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load in place (into the shards this rank holds); returns torch's missing/unexpected
        keys, which ``CheckpointStore.load(strict=False)`` reports."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        return set_model_state_dict(self.model, dict(state_dict), options=_options(strict=strict))

    def __repr__(self) -> str:
        return f"ModelState({type(self.model).__name__})"


class OptimizerState:
    """``optimizer``'s state (moments, step counts, param groups) keyed by the names of
    ``model``'s parameters, sharded like them, for a :class:`ckptstore.CheckpointStore` state."""

    __slots__ = ("model", "optimizer")

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"OptimizerState needs the model first, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"OptimizerState needs a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        owned = {id(p) for p in model.parameters()}
        strays = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in owned)
        if strays:
            raise ValueError(
                f"{strays} parameter(s) of the optimizer are not parameters of the model: build "
                "the optimizer from this model's parameters (after sharding it)"
            )
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        # An optimizer that never stepped has no moments yet: torch makes them with one step at
        # lr=0 (parameters unchanged) so that a load has tensors to read into.
        return get_optimizer_state_dict(self.model, self.optimizer, options=_options())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, dict(state_dict), options=_options())

    def __repr__(self) -> str:
        return f"OptimizerState({type(self.optimizer).__name__})"
