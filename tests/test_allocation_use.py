"""The e2e suite's allocation-use arithmetic (e2e/allocation_use.py): the share of an allocation
that went into persisted steps, judged against a straight run in the same seconds.

CI failed once on a share that was the reference's fault, not the trainer's: the straight run
finished a third of the way into an allocation, the machine then got ten times busier (the other
scenarios' start-ups), and the old rule priced every step of the allocation at the quiet
reference's rate. These tests pin both halves of the rule: a reference from other seconds does
not shrink the share, and a trainer slower than the reference beside it does not flatter itself.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from allocation_use import (
    GOODPUT_TARGET,
    Allocation,
    AllocationUse,
    Calibration,
    allocation_use,
    allocations,
    covered,
    rate,
)

T0 = 1_800_000_000.0
LIMIT_S = 180.0


def stamp(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def job_log(start: float, end: float, first: int, last: int) -> str:
    return "\n".join(
        [
            f"[{stamp(start)}] submit-training-simple: job 7, restart 0, 1 node(s), 1 task(s)",
            f"pyrecover-train: resumed from step {first}",
            f"pyrecover-train: stopped at step {last} (time limit)",
            f"[{stamp(end)}] submit-training-simple: training step exited with status 75",
        ]
    )


def steps(start: float, step: int, pieces: list[tuple[int, float]]) -> list[dict[str, Any]]:
    """Step events every 10 steps: ``pieces`` of (steps, seconds per step), one after another."""
    out, t = [], start
    for count, per in pieces:
        for _ in range(count // 10):
            t, step = t + 10 * per, step + 10
            out.append({"event": "step", "step": step, "time": t})
    return out


def one_use(
    own: list[dict[str, Any]], reference: list[dict[str, Any]], first: int, last: int
) -> AllocationUse:
    allocs = allocations(job_log(T0, T0 + LIMIT_S - 1, first, last))
    (use,) = allocation_use(allocs, [own], reference, LIMIT_S)
    return use


def test_a_reference_from_quieter_seconds_does_not_shrink_the_share() -> None:
    # 120 s at 31 ms, then the machine ten times busier for 50 s; the reference finished at 100 s.
    own = steps(T0 + 5, 0, [(3870, 0.031), (150, 0.33)])
    reference = steps(T0, 9000, [(3230, 0.031)])
    use = one_use(own, reference, 0, 4020)
    plain = own[-1]["time"] - own[0]["time"]
    assert use.own_beside_s == pytest.approx(0.031, rel=0.02)
    assert use.step_s == pytest.approx(plain / (4020 - 10), rel=0.01)
    assert use.share > 0.9  # 165 s of steps in 180 s
    # the old rule: every step at the reference's 31 ms
    assert 4020 * 0.031 / LIMIT_S < 0.7


def test_a_trainer_slower_than_the_reference_beside_it_does_not_flatter_itself() -> None:
    own = steps(T0 + 5, 0, [(2000, 0.080)])  # twice the reference's time per step throughout
    reference = steps(T0, 9000, [(4000, 0.040)])
    use = one_use(own, reference, 0, 2000)
    assert use.step_s == pytest.approx(0.040, rel=0.02)
    assert use.share == pytest.approx(2000 * 0.040 / LIMIT_S, rel=0.02)


def test_a_reference_beside_the_whole_allocation_is_the_plain_minimum() -> None:
    own = steps(T0 + 5, 100, [(4000, 0.040)])
    reference = steps(T0, 9000, [(4600, 0.038)])
    use = one_use(own, reference, 100, 4100)
    assert use.step_s == pytest.approx(min(use.own_step_s, use.reference_step_s or 1.0), rel=0.02)


def test_without_a_reference_the_own_rate_counts() -> None:
    own = steps(T0 + 5, 0, [(3000, 0.050)])
    use = one_use(own, [], 0, 3000)
    assert use.reference_step_s is None and use.own_beside_s is None
    assert use.step_s == pytest.approx(0.050)


def test_a_reference_covering_under_half_the_allocation_is_not_used() -> None:
    own = steps(T0 + 5, 0, [(3000, 0.050)])
    reference = steps(T0, 9000, [(500, 0.040)])  # 20 s of 180
    assert rate(reference, (T0, T0 + LIMIT_S)) is None
    assert covered(reference, (T0, T0 + LIMIT_S)) is not None
    assert one_use(own, reference, 0, 3000).step_s == pytest.approx(0.050)


def test_the_job_log_gives_each_allocation_its_steps() -> None:
    text = job_log(T0, T0 + 100, 500, 2500) + "\n" + job_log(T0 + 300, T0 + 400, 2500, 4000)
    got = allocations(text.replace("restart 0", "restart {}").format(0, 1))
    assert [(a.step_said("resumed from", None), a.step_said("stopped at", None)) for a in got] == [
        (500, 2500),
        (2500, 4000),
    ]
    assert [a.status for a in got] == [75, 75]
    assert isinstance(got[0], Allocation) and got[0].held_s == pytest.approx(101.0)


def test_a_start_up_kept_off_the_cpu_lowers_the_target_by_the_kernels_count() -> None:
    """A CI run: load x4.9 over the steps, but 37 s of start-up (15x quiet) while the other
    scenarios imported torch. The steps' load allows 9.5 s; the kernel counted the trainer
    runnable with no CPU free for most of the rest."""
    quiet = Calibration(step_s=0.0181, startup_s=2.43)
    own = steps(T0 + 38, 0, [(1520, 0.0888)])
    allocs = allocations(job_log(T0, T0 + LIMIT_S - 1, 0, 1520))
    waited = [{"event": "startup", "seconds": 37.3, "cpu_wait": 30.2}]
    (before,) = allocation_use(allocs, [own], [], LIMIT_S, quiet)
    (use,) = allocation_use(allocs, [waited + own], [], LIMIT_S, quiet)
    assert use.share == before.share == pytest.approx(1520 * 0.0888 / LIMIT_S, rel=0.01)
    assert before.startup_allowance_s == pytest.approx((0.0888 / 0.0181 - 1) * 2.43, rel=0.01)
    assert before.share < before.target  # the steps' load alone: below target
    assert use.startup_allowance_s == 30.2 and use.share >= use.target
    assert "start-up 30.2 s waiting for a CPU" in use.describe()
    # a kernel count below the steps' estimate does not raise the target
    low = [{"event": "startup", "seconds": 12.0, "cpu_wait": 1.0}]
    (lower,) = allocation_use(allocs, [low + own], [], LIMIT_S, quiet)
    assert lower.target == before.target


@pytest.mark.parametrize("garbled", [None, "30", -1.0, True, float("nan"), 1e9, [30]])
def test_a_cpu_wait_that_is_not_seconds_is_no_allowance(garbled: Any) -> None:
    own = steps(T0 + 38, 0, [(1520, 0.0888)])
    allocs = allocations(job_log(T0, T0 + LIMIT_S - 1, 0, 1520))
    run = [{"event": "startup", "seconds": 37.3, "cpu_wait": garbled}, *own]
    (use,) = allocation_use(allocs, [run], [], LIMIT_S)
    assert use.startup_cpu_wait_s is None and use.target == GOODPUT_TARGET
