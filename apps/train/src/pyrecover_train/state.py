"""What a checkpoint holds, and helpers to size and compare nested state dicts.

Checkpoint layout (every rank passes identical content, so a sharded format deduplicates it)::

    {"model": the bare module (keys without "module."/"_orig_mod." prefixes),
     "optim": the optimizer, "sched": the LR scheduler, "scaler": the GradScaler (fp16) or {},
     "data": the PackedLoader (its global position), "step": int,
     "rng": {"rank0": {...}, "rank1": {...}, ...}}   # every rank's RNG states, as tensors

ckptstore calls ``state_dict()`` of the objects when saving and ``load_state_dict()`` when
loading; "rng" and "step" come back as values.
"""

from __future__ import annotations

from typing import Any

import torch


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


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
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
