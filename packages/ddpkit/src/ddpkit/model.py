"""DDP wrapping, unwrapping, and state-dict keys that never carry wrapper prefixes."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

# Prefixes the wrappers add: DistributedDataParallel / DataParallel ("module."), and
# torch.compile's OptimizedModule ("_orig_mod.").
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class DistLike(Protocol):
    """What :func:`wrap_ddp` needs from :class:`ddpkit.Dist`."""

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def distributed(self) -> bool: ...


def wrap_ddp(model: nn.Module, dist: DistLike, **ddp_kwargs: Any) -> nn.Module:
    """Move ``model`` to ``dist.device`` and wrap it in DDP when there is more than one rank.

    With one rank the moved model itself comes back (no DDP overhead, same code path).
    ``ddp_kwargs`` go to ``DistributedDataParallel`` (e.g. ``find_unused_parameters=True``);
    ``device_ids`` is filled in for CUDA. Compile after wrapping (``torch.compile(wrap_ddp(m,
    d))``) or before; :func:`unwrap` and :func:`clean_state_dict` undo either order.
    """
    model = model.to(dist.device)
    if dist.world_size <= 1 or not dist.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    if dist.device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [dist.device.index])
        ddp_kwargs.setdefault("output_device", dist.device.index)
    return DistributedDataParallel(model, **ddp_kwargs)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under DDP / DataParallel / ``torch.compile`` wrappers, in any nesting."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif _is_compiled(model):
            inner = model._orig_mod
            assert isinstance(inner, nn.Module)  # checked by _is_compiled
            model = inner
        else:
            return model


def _is_compiled(model: nn.Module) -> bool:
    # Checked by name: importing torch._dynamo to isinstance-check costs a second at import time.
    return type(model).__name__ == "OptimizedModule" and isinstance(
        getattr(model, "_orig_mod", None), nn.Module
    )


def clean_state_dict(state_dict: Mapping[str, Any]) -> OrderedDict[str, Any]:
    """The state dict with wrapper prefixes removed: ``module.`` / ``_orig_mod.`` in front (when
    every key has it, so a submodule that happens to be called ``module`` survives) and
    ``_orig_mod.`` segments inside keys (a compiled submodule). Values are not copied.

    Raises ValueError if two keys would collide after cleaning.
    """
    keys = list(state_dict)
    stripped: list[str] = []  # the prefixes removed, in order, to treat _metadata the same way
    names = dict(zip(keys, keys, strict=True))
    while keys:
        prefix = next(
            (p for p in WRAPPER_PREFIXES if all(names[k].startswith(p) for k in keys)), None
        )
        if prefix is None:
            break
        stripped.append(prefix)
        names = {k: names[k][len(prefix) :] for k in keys}
    seen: dict[str, str] = {}
    out: OrderedDict[str, Any] = OrderedDict()
    for k in keys:
        new = _drop_compiled(names[k])
        if new in seen:
            raise ValueError(f"keys {seen[new]!r} and {k!r} both clean to {new!r}")
        seen[new] = k
        out[new] = state_dict[k]
    # load_state_dict reads per-module versions from _metadata; rename its keys the same way.
    meta = getattr(state_dict, "_metadata", None)
    if isinstance(meta, Mapping):
        clean_meta: OrderedDict[str, Any] = OrderedDict()
        for key, value in meta.items():
            dotted = f"{key}." if key else ""
            for prefix in stripped:
                dotted = dotted[len(prefix) :] if dotted.startswith(prefix) else dotted
            clean_meta[_drop_compiled(dotted.rstrip("."))] = value
        out._metadata = clean_meta  # type: ignore[attr-defined]
    return out


def _drop_compiled(name: str) -> str:
    return ".".join(p for p in name.split(".") if p != "_orig_mod")
