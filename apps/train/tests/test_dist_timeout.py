"""How long a collective may take (ddpkit's process-group timeout) comes from the time left at
the start (issue 34): a quarter of it, between 60 s and ddpkit's 180 s; PYRECOVER_DIST_TIMEOUT
overrides it, and without a deadline ddpkit keeps its own default."""

from __future__ import annotations

import time

import pytest

import slurmclock
from pyrecover_train import build
from pyrecover_train.config import TrainConfig
from pyrecover_train.store_waits import dist_timeout


def deadline(left: float | None) -> slurmclock.Deadline:
    return slurmclock.Deadline(None if left is None else time.time() + left, "test")


@pytest.mark.parametrize(
    "left, env, expect",
    [
        (None, {}, None),  # no deadline: ddpkit's own (180 s)
        (4 * 3600.0, {}, 180.0),  # a long job keeps ddpkit's 180 s
        (400.0, {}, 100.0),  # a quarter of the time left
        (120.0, {}, 60.0),  # never under 60 s: a slow first collective is no hang
        (-30.0, {}, 60.0),  # past the deadline (KillWait runs) too
        (400.0, {"PYRECOVER_DIST_TIMEOUT": "42"}, None),  # the variable wins: ddpkit reads it
        (400.0, {"PYRECOVER_DIST_TIMEOUT": " "}, 100.0),  # empty: not set
    ],
)
def test_dist_timeout_from_the_time_left(
    left: float | None, env: dict[str, str], expect: float | None
) -> None:
    got = dist_timeout(deadline(left), env)
    assert got == (None if expect is None else pytest.approx(expect, abs=0.5))


def test_the_process_group_gets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYRECOVER_DIST_TIMEOUT", raising=False)
    with build.join(TrainConfig(device="cpu"), timeout=dist_timeout(deadline(400.0))) as dist:
        assert dist.timeout_s == pytest.approx(100.0, abs=0.5)
    monkeypatch.setenv("PYRECOVER_DIST_TIMEOUT", "42")
    with build.join(TrainConfig(device="cpu"), timeout=dist_timeout(deadline(400.0))) as dist:
        assert dist.timeout_s == 42.0  # the override, read and checked by ddpkit
