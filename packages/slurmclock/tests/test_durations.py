"""parse_duration (every duration format in PyRecover) and the Young/Daly checkpoint interval."""

from __future__ import annotations

import math
from typing import Any

import pytest

from slurmclock import check_seconds, checkpoint_interval, parse_duration, young_daly_interval


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (90, 90.0),
        (1.5, 1.5),
        ("90", 90.0),
        ("1.5", 1.5),
        ("90s", 90.0),
        ("15m", 900.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1.5h", 5400.0),
        ("0.5D", 43200.0),
        ("2:30", 150.0),  # MM:SS
        ("90:00", 5400.0),  # the leading field is free, as SLURM reads it
        ("1:00:00", 3600.0),  # HH:MM:SS
        ("1:30:00.5", 5400.5),
        ("1-00:00:00", 86400.0),  # D-HH:MM:SS
        ("2-3:04", 2 * 86400 + 3 * 3600 + 4 * 60.0),  # D-HH:MM: 2 days 3 h 4 min
        ("1-2", 93600.0),  # D-HH
        (" 15m ", 900.0),
    ],
)
def test_every_form_with_slurms_meaning(text: Any, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "bad",
    ["", "soon", "1:2:3:4", "-5", "5x", "1h30m", "1:75", "1:00:60", "2-3:04:99", "nan", "inf"],
)
def test_anything_else_is_one_clear_error(bad: str) -> None:
    with pytest.raises(ValueError, match="is not a duration") as e:
        parse_duration(bad)
    assert "\n" not in str(e.value)
    if ":" not in bad:
        assert "90s, 15m, 2h, 1.5h, 1d" in str(e.value) and "2-3:04" in str(e.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1, True, None, [60]])
def test_non_finite_negative_and_non_numbers_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


def test_check_seconds_names_the_parameter() -> None:
    assert check_seconds("x", 3) == 3.0 and check_seconds("x", 0) == 0.0
    for bad in (float("nan"), float("inf"), -0.1, True, "3"):
        with pytest.raises(ValueError, match=r"^x must be a finite number of seconds >= 0, got"):
            check_seconds("x", bad)
    with pytest.raises(ValueError, match="> 0"):
        check_seconds("x", 0, positive=True)


def test_young_daly() -> None:
    assert young_daly_interval(10.0, 6 * 3600.0) == pytest.approx(math.sqrt(2 * 10 * 21600))
    assert young_daly_interval(100.0, 1.0) == 100.0  # never shorter than the save itself
    assert young_daly_interval(0.0, 3600.0) == 0.0
    for save, mtbf in ((float("nan"), 3600.0), (10.0, 0.0), (10.0, float("inf")), (-1.0, 60.0)):
        with pytest.raises(ValueError, match="must be a finite number"):
            young_daly_interval(save, mtbf)


def test_checkpoint_interval_settings() -> None:
    assert checkpoint_interval(None, [5.0], 10.0, 3600.0) is None
    assert checkpoint_interval(600, [5.0], 10.0, 3600.0) == 600.0
    # auto: the median of the measured costs, the assumed cost before any
    assert checkpoint_interval("auto", [], 10.0, 3600.0) == young_daly_interval(10.0, 3600.0)
    assert checkpoint_interval("auto", [1.0, 8.0, 100.0], 10.0, 3600.0) == young_daly_interval(
        8.0, 3600.0
    )
    with pytest.raises(ValueError, match="'often'"):
        checkpoint_interval("often", [], 10.0, 3600.0)
    with pytest.raises(ValueError, match="checkpoint interval must be a finite number"):
        checkpoint_interval(float("nan"), [], 10.0, 3600.0)
