"""Where the step trains: the nodes of the allocation, spares, and the nodes that were lost.

An allocation of A nodes trains on ``A - spare`` of them (never fewer than ``min_nodes`` while
it has them): the others are hot spares, idle until a node is lost, when one takes its place
and the world size stays the same. Without a spare left, the step goes on with the nodes it
still has, down to ``min_nodes`` (the trainer reshards: the data position stays exact, the
tokens per step follow the world size). Below that the allocation is of no use to the job: it
is requeued, asking for no more nodes than the partition can still give (:func:`requeue_size`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

__all__ = ["Placement", "place", "requeue_size", "training_nodes"]


def training_nodes(allocated: int, *, spare: int, min_nodes: int) -> int:
    """How many of an allocation's ``allocated`` nodes train: all but ``spare`` of them, but not
    fewer than ``min_nodes`` while the allocation has them (spares only above the minimum)."""
    return max(min(allocated, min_nodes), allocated - spare)


@dataclass(frozen=True, slots=True)
class Placement:
    """The step's nodes (host names, in the allocation's order) out of ``healthy`` ones; ``why``
    says it in words when it is not the plain first launch."""

    nodes: tuple[str, ...]
    healthy: int
    why: str = ""


def place(
    hosts: Sequence[str], *, lost: Collection[str], spare: int, min_nodes: int
) -> Placement | str:
    """The nodes of the allocation ``hosts`` to train on, leaving out ``lost`` ones; a string
    saying why not when fewer than ``min_nodes`` are left."""
    gone_names = {_short(h) for h in lost}
    healthy = [h for h in hosts if _short(h) not in gone_names]
    want = training_nodes(len(hosts), spare=spare, min_nodes=min_nodes)
    if len(healthy) < min_nodes:
        return (
            f"{len(healthy)} node(s) of this allocation left, fewer than the minimum of "
            f"{min_nodes} (MIN_NODES)"
        )
    nodes = tuple(healthy[:want])
    gone = [h for h in hosts if h not in healthy]
    if not gone:
        return Placement(nodes, len(healthy))
    spares = [h for h in nodes if hosts.index(h) >= want]
    if len(nodes) == want:
        took = f"; spare {', '.join(spares)} takes over" if spares else ""
        why = f"on {', '.join(nodes)} without {', '.join(gone)}{took}"
    else:
        why = (
            f"on {len(nodes)} node(s) ({', '.join(nodes)}) of {want} without {', '.join(gone)}: "
            f"world size x{len(nodes)}/{want}, the data goes on from its exact position"
        )
    return Placement(nodes, len(healthy), why)


def requeue_size(usable: int, asked: int, *, min_nodes: int) -> int | None:
    """The node count a requeued job asks for: ``asked`` when the partition's ``usable`` nodes
    give it, else as many as there are down to ``min_nodes`` (a job that asks for more nodes
    than a partition has pends for ever); None when not even ``min_nodes`` are usable."""
    if usable >= asked:
        return asked
    return usable if usable >= min_nodes else None


def _short(host: str) -> str:
    return host.split(".")[0]
