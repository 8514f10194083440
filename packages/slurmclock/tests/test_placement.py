"""slurmclock.supervisor.placement: which of an allocation's nodes train, who takes a lost
node's place, and what a requeued job asks for -- pure functions, from tables."""

from __future__ import annotations

import pytest

from slurmclock.supervisor.placement import Placement, place, requeue_size, training_nodes

HOSTS = ("n1", "n2", "n3", "n4")


@pytest.mark.parametrize(
    ("allocated", "spare", "min_nodes", "train"),
    [
        (4, 0, 1, 4),  # no spare: every node trains
        (4, 1, 1, 3),  # one hot spare
        (4, 1, 4, 4),  # spares only above the minimum
        (2, 3, 1, 1),  # more spares than nodes: still one trains
        (3, 1, 3, 3),
    ],
)
def test_training_nodes(allocated: int, spare: int, min_nodes: int, train: int) -> None:
    assert training_nodes(allocated, spare=spare, min_nodes=min_nodes) == train


def test_the_first_launch_trains_on_the_first_nodes() -> None:
    assert place(HOSTS, lost=(), spare=1, min_nodes=1) == Placement(("n1", "n2", "n3"), 4)


def test_a_spare_takes_a_lost_nodes_place() -> None:
    placed = place(HOSTS, lost={"n2.cluster"}, spare=1, min_nodes=1)  # a long name, too
    assert isinstance(placed, Placement)
    assert placed.nodes == ("n1", "n3", "n4") and placed.healthy == 3
    assert placed.why == "on n1, n3, n4 without n2; spare n4 takes over"


def test_without_a_spare_the_step_goes_on_with_fewer_nodes() -> None:
    placed = place(HOSTS, lost={"n4"}, spare=0, min_nodes=2)
    assert isinstance(placed, Placement) and placed.nodes == ("n1", "n2", "n3")
    assert "world size x3/4" in placed.why


def test_below_the_minimum_it_says_why_in_one_line() -> None:
    why = place(HOSTS, lost={"n1", "n2", "n3"}, spare=0, min_nodes=2)
    assert why == "1 node(s) of this allocation left, fewer than the minimum of 2 (MIN_NODES)"


@pytest.mark.parametrize(
    ("usable", "asked", "min_nodes", "size"),
    [(4, 4, 1, 4), (8, 4, 2, 4), (3, 4, 2, 3), (1, 4, 2, None), (0, 1, 1, None)],
)
def test_a_requeued_job_asks_for_no_more_than_the_partition_has(
    usable: int, asked: int, min_nodes: int, size: int | None
) -> None:
    assert requeue_size(usable, asked, min_nodes=min_nodes) == size
