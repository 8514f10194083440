from __future__ import annotations

import logging

import pytest

from ddpkit import RankZeroFilter, current_rank, rank_zero_only


def records(rank: int | None, caplog: pytest.LogCaptureFixture) -> list[str]:
    log = logging.getLogger(f"ddpkit-test-{rank}")
    log.propagate = True
    flt = RankZeroFilter(rank)
    log.addFilter(flt)
    try:
        with caplog.at_level(logging.INFO, logger=log.name):
            log.info("only rank zero")
            log.info("everyone", extra={"all_ranks": True})
    finally:
        log.removeFilter(flt)
    return [f"{r.rank}:{r.getMessage()}" for r in caplog.records]  # type: ignore[attr-defined]


def test_filter_on_rank_zero(caplog: pytest.LogCaptureFixture) -> None:
    assert records(0, caplog) == ["0:only rank zero", "0:everyone"]


def test_filter_on_other_ranks(caplog: pytest.LogCaptureFixture) -> None:
    assert records(2, caplog) == ["2:everyone"]


def test_filter_reads_the_rank_from_the_environment(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in ("SLURM_PROCID", "SLURM_STEP_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "h")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert current_rank() == 3
    assert records(None, caplog) == ["3:everyone"]


def test_current_rank_with_broken_variables_is_zero() -> None:
    assert current_rank({"RANK": "x", "WORLD_SIZE": "2"}) == 0
    assert (
        current_rank(
            {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "5"}
        )
        == 1
    )


def test_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    @rank_zero_only
    def save(x: int) -> int:
        calls.append(x)
        return x * 2

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    assert save(2) == 4
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    assert save(3) is None
    assert calls == [2]
    assert save.__name__ == "save"
