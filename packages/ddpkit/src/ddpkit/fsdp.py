"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state
sharded over the ranks, as a parallelism choice beside :func:`ddpkit.wrap_ddp`.

``shard_model`` applies ``fully_shard`` to each block the caller names (a transformer layer,
say) and then to the root, with a mixed-precision policy and optional activation checkpointing
per block. It runs on CUDA with NCCL and on CPU with gloo (torch 2.13's gloo has the two
collectives FSDP2 needs, ``all_gather_single`` and ``reduce_scatter_single`` with SUM/AVG, for
fp32, bf16 and fp16), so the same code is tested multi-process on a laptop.

Three dtypes, three jobs:

- ``dtype``: what the parameters are *stored* in, and with them their gradients and the
  optimizer's moments. ``torch.bfloat16`` halves the memory of all three (the original
  PyRecover's ``--model-dtype bf16``): what lets an 8B model train on one 80 GB GPU.
- ``param_dtype``: what the gathered parameters are computed in (mixed precision over fp32
  storage: fp32 master weights, bf16 matmuls).
- ``reduce_dtype``: what gradients are reduce-scattered in (fp32 keeps sums of bf16 gradients
  exact enough).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ddpkit.errors import DistConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class MeshLike(Protocol):
    """What :func:`shard_model` needs from :class:`ddpkit.Dist`."""

    @property
    def mesh(self) -> DeviceMesh: ...

    @property
    def device(self) -> torch.device: ...


@dataclass(kw_only=True, slots=True)
class ShardOptions:
    """The options of :func:`shard_model`, checked before anything is sharded."""

    dtype: torch.dtype | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("dtype", "param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise DistConfigError(
                    f"{name}={value!r} must be a floating torch dtype (torch.bfloat16, "
                    "torch.float32, ...) or None"
                )
        for name in ("reshard_after_forward", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise DistConfigError(f"{name}={getattr(self, name)!r} must be True or False")


Blocks = Iterable[nn.Module] | str | Callable[[nn.Module], Iterable[nn.Module]]


def shard_model(
    model: nn.Module,
    dist: MeshLike,
    *,
    blocks: Blocks,
    dtype: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """Shard ``model`` over ``dist.mesh`` with FSDP2; returns the same module, now sharded.

    ``blocks``: the submodules that each become one FSDP unit (one all-gather in forward, one
    reduce-scatter in backward): the modules themselves, a callable returning them, the
    ModuleList/Sequential holding them, or its dotted name (``"layers"``, ``"transformer.h"``).
    The root gets the rest (embeddings, final norm, head). ``reshard_after_forward`` frees each
    block's gathered parameters after its forward (less memory, one more all-gather in
    backward). ``activation_checkpointing`` recomputes each block's activations in backward
    (dropout draws the same numbers: the RNG state is replayed).

    Build the optimizer *after* this call (it must see the sharded parameters). State dicts
    now hold DTensors: save them with ckptstore's ``dcp`` format and ``ckptstore.sharded``.
    For gradient accumulation use :func:`no_sync`.
    """
    opts = ShardOptions(
        dtype=dtype,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward,
        activation_checkpointing=activation_checkpointing,
    )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    units = _resolve_blocks(model, blocks)
    if opts.dtype is not None:
        model.to(dtype=opts.dtype)  # before sharding: the GPU only ever holds the small copy
    if opts.activation_checkpointing:
        checkpoint_activations(model, blocks=units)
    policy = MixedPrecisionPolicy(param_dtype=opts.param_dtype, reduce_dtype=opts.reduce_dtype)
    mesh = dist.mesh
    for block in units:
        fully_shard(
            block, mesh=mesh, mp_policy=policy, reshard_after_forward=opts.reshard_after_forward
        )
    # The root keeps torch's default: it stays unsharded after forward, since backward needs
    # its parameters (embeddings, head) at once.
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def checkpoint_activations(model: nn.Module, *, blocks: Blocks) -> list[nn.Module]:
    """Recompute each block's activations in backward instead of keeping them (less memory,
    about one more forward of compute), for a model that is not sharded (one process, DDP);
    :func:`shard_model` does the same with ``activation_checkpointing=True``.

    ``blocks`` as for :func:`shard_model`; returns the blocks. Apply it before wrapping the
    model in DDP or ``torch.compile``. Torch's composable ``checkpoint`` is used, so parameter
    names do not change (checkpoints load with or without it) and dropout replays the same RNG
    draws in the recomputation: gradients are the very same bits.
    """
    from torch.distributed._composable import checkpoint

    units = _resolve_blocks(model, blocks)
    for block in units:
        checkpoint(block)
    return units


def _resolve_blocks(model: nn.Module, blocks: Blocks) -> list[nn.Module]:
    if isinstance(blocks, str):
        holder = _attribute(model, blocks)
        units = list(holder.children())
    elif isinstance(blocks, nn.Module):  # the ModuleList itself
        units = list(blocks.children())
    elif callable(blocks):
        units = list(blocks(model))
    else:
        units = list(blocks)
    inside = {id(m) for m in model.modules() if m is not model}
    bad = [u for u in units if not isinstance(u, nn.Module) or id(u) not in inside]
    if not units or bad:
        what = f"{type(bad[0]).__name__} that is not a submodule" if bad else "nothing"
        raise DistConfigError(
            f"blocks gave {what}: pass the model's own repeated submodules (its transformer "
            "layers), not the model itself"
        )
    if len({id(u) for u in units}) != len(units):
        raise DistConfigError("blocks names the same module twice")
    return units


def _attribute(model: nn.Module, dotted: str) -> nn.Module:
    found: Any = model
    for part in dotted.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise DistConfigError(
                f"blocks={dotted!r}: {type(model).__name__} has no attribute {part!r}; name the "
                "ModuleList holding the blocks (e.g. 'layers') or pass the modules"
            )
    if not isinstance(found, nn.Module):
        raise DistConfigError(f"blocks={dotted!r} is a {type(found).__name__}, not a module")
    return found


def is_sharded(model: nn.Module) -> bool:
    """True when ``fully_shard`` was applied to ``model`` (its class became an FSDPModule)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Skip the gradient reduction for the backward passes inside (gradient accumulation).

    DDP: its ``no_sync()``; FSDP2: ``set_requires_gradient_sync(False)`` (gradients then stay
    unsharded until the last micro-batch: more memory, less communication); anything else
    (one process): nothing to skip. Run the last micro-batch outside the block.
    """
    if is_sharded(model):
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]
        return
    skip = getattr(model, "no_sync", None)
    with skip() if callable(skip) else contextlib.nullcontext():
        yield


def local_part(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``whole`` when it is laid out as ``like``: for a DTensor (a
    sharded parameter, or its optimizer moment) the slice of ``whole`` that is this rank's
    shard -- a view: nothing is copied, gathered or sent -- else ``whole`` itself.

    So every rank fills its shard from the same whole tensor on its own (a seeded initial
    value, a checkpoint written without FSDP), and a whole tensor in a memory-mapped file is
    read only where this rank's part lies."""
    if tuple(whole.shape) != tuple(like.shape):
        raise ValueError(f"a whole tensor of shape {tuple(whole.shape)} for {tuple(like.shape)}")
    if not _is_dtensor(like):
        return whole
    # torch's own state-dict code distributes whole tensors with this (torch 2.4+)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = like.device_mesh, like.placements  # type: ignore[attr-defined]
    shape, offset = compute_local_shape_and_global_offset(like.shape, mesh, placements)
    return whole[tuple(slice(o, o + n) for n, o in zip(shape, offset, strict=True))]


def copy_whole_(target: torch.Tensor, whole: torch.Tensor) -> None:
    """``target.copy_(whole)`` for a sharded ``target`` too: each rank copies its own part
    (see :func:`local_part`; a cast to ``target``'s dtype and device comes with the copy)."""
    local = target.to_local() if _is_dtensor(target) else target  # type: ignore[attr-defined]
    with torch.no_grad():
        local.copy_(local_part(whole, target))


def fill_shards(like: Any, whole: Any, where: str = "state") -> Any:
    """A state dict of whole tensors (what a model or optimizer without FSDP saves, keyed by
    parameter name) copied into ``like``, the same state dict of the sharded model (its
    DTensors, e.g. from ``torch.distributed.checkpoint.state_dict``): each rank copies only its
    own part, in place. Returns ``like`` with ``whole``'s other values (step counts, learning
    rates); load it with ``set_model_state_dict``/``set_optimizer_state_dict`` (sharded
    options). A key or shape that does not match raises ValueError naming it."""
    if isinstance(like, torch.Tensor):
        if not isinstance(whole, torch.Tensor):
            raise ValueError(f"{where}: a tensor here, {type(whole).__name__} in the whole state")
        if like.ndim == 0:
            return whole.detach().clone()  # a step count: every rank holds all of it
        try:
            copy_whole_(like, whole)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"{where}: {e}") from None
        return like
    if isinstance(like, dict) and isinstance(whole, dict):
        if set(like) != set(whole):
            odd = sorted(map(str, set(like) ^ set(whole)))[:3]
            raise ValueError(f"{where}: keys differ ({', '.join(odd)} ...)")
        return {k: fill_shards(like[k], whole[k], f"{where}.{k}") for k in like}
    if isinstance(like, list) and isinstance(whole, list) and len(like) == len(whole):
        pairs = enumerate(zip(like, whole, strict=True))
        return [fill_shards(a, b, f"{where}[{i}]") for i, (a, b) in pairs]
    return whole


def _is_dtensor(t: object) -> bool:
    return type(t).__name__ == "DTensor" and callable(getattr(t, "to_local", None))


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a possibly sharded one (e.g. ``clip_grad_norm_``'s total norm under
    FSDP is a DTensor): collective for DTensors, so call it on every rank."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t
