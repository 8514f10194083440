"""The little torch.distributed the store needs: who am I, and a private gloo group.

The store runs its collectives (DCP planning, "did every rank read this checkpoint fine?") on a
gloo group of its own, created once in the constructor, never on the default group: an async save
runs them from a background thread while training runs its own collectives on the default group,
and two threads must never interleave calls on one communicator.
"""

from __future__ import annotations

from typing import Any


def dist_info(distributed: bool | None) -> tuple[int, int, Any]:
    """(rank, world size, private gloo group or None) from torch.distributed if initialized."""
    if distributed is False:
        return 0, 1, None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if distributed:
            raise RuntimeError(
                "CheckpointStore(distributed=True) needs torch.distributed initialized first "
                "(dist.init_process_group(...)); or leave distributed=None"
            )
        return 0, 1, None
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return rank, world, None
    # Every rank must construct the store, in the same order as its other new_group() calls.
    return rank, world, dist.new_group(backend="gloo")


def broadcast(group: Any, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (pickled over gloo; only our own plain data)."""
    if group is None:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def all_gather(group: Any, obj: Any) -> list[Any]:
    if group is None:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
