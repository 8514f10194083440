"""The human-duration, SLURM-time and time-limit readers, and the Young/Daly interval."""

from __future__ import annotations

import math
from typing import Any

import pytest

from slurmclock import (
    check_seconds,
    checkpoint_interval,
    parse_duration,
    parse_human_duration,
    parse_slurm_time,
    parse_time_limit,
    young_daly_interval,
)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (90, 90.0),
        (1.5, 1.5),
        ("90", 90.0),  # a bare number is seconds: a duration, not a SLURM time
        ("1.5", 1.5),
        (".5", 0.5),
        ("90s", 90.0),
        ("15m", 900.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1.5h", 5400.0),
        ("0.5D", 43200.0),
        ("1h30m", 5400.0),
        ("1h 30m", 5400.0),
        ("1d2h3m4s", 93784.0),
        ("2 hr", 7200.0),
        ("10 min", 600.0),
        ("5sec", 5.0),
        (" 15m ", 900.0),
    ],
)
def test_human_durations(text: Any, seconds: float) -> None:
    assert parse_human_duration(text) == seconds
    assert parse_duration(text) == seconds  # the 0.1 name stays, for the human reader


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("", "give seconds (5400, 1.5) or a unit"),
        ("soon", "give seconds (5400, 1.5) or a unit"),
        ("5x", "give seconds (5400, 1.5) or a unit"),
        ("nan", "give seconds"),
        ("inf", "give seconds"),
        ("1e3", "give seconds"),
        ("\uff11", "give seconds"),  # a fullwidth digit is not a digit here
        ("30m1h", "each unit once, largest first"),
        ("1h1h", "each unit once, largest first"),
        ("-5", "must be a finite number of seconds >= 0"),
        ("-5m", "must be a finite number of seconds >= 0"),
        ("1:30", "'1:30' is a SLURM time string (2 min to sbatch --time)"),
        ("1:00:00", "(60 min to sbatch --time)"),
        ("1-00:00:00", "(1440 min to sbatch --time)"),
        ("0:00", "(no limit to sbatch --time)"),
        ("1:2:3:4", "is a SLURM time string; a duration here is"),
    ],
)
def test_anything_else_is_one_clear_error(bad: str, says: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_human_duration(bad)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1, True, None, [60]])
def test_non_finite_negative_and_non_numbers_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_human_duration(bad)


@pytest.mark.parametrize(
    ("text", "minutes"),
    [  # sbatch's manual, every form; SLURM's normalisations; seconds rounded up
        ("90", 90),
        ("90:30", 91),
        ("1:30:00", 90),
        ("2-3", 2 * 1440 + 180),
        ("2-3:04", 2 * 1440 + 184),  # days-hours:minutes, not days-minutes:seconds
        ("2-3:04:05", 2 * 1440 + 185),
        ("59:60", 60),
        ("1:75", 3),
        ("1:60:00", 120),
        ("0:01", 1),
        ("1-", 1440),
        ("-2", 2**32 - 2 * 1440 + 1),  # 32-bit wrap-around, as SLURM itself computes it
        ("71582789", 1),  # 71582789 * 60 s wraps to 44 s
    ],
)
def test_slurm_time_strings(text: str, minutes: int) -> None:
    assert parse_slurm_time(text) == minutes * 60


@pytest.mark.parametrize("text", ["0", "00:00", "0-0:0:0", "-0", "-1", "UNLIMITED", "iNfInItE"])
def test_slurm_no_limit(text: str) -> None:
    assert parse_slurm_time(text) == math.inf


@pytest.mark.parametrize("bad", ["", " 10", "1h", "1.5", "1:2:3:4", "1-2:3-4", "0:4294967294", 5])
def test_slurm_refuses_what_sbatch_refuses(bad: Any) -> None:
    with pytest.raises(ValueError, match="is not a SLURM time") as e:
        parse_slurm_time(bad)
    assert "minutes:seconds, hours:minutes:seconds, days-hours" in str(e.value)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (90, 90.0),  # a number is seconds (the Python API)
        (2.5, 2.5),
        (math.inf, math.inf),
        ("90", 5400.0),  # text: as sbatch --time reads it
        (" 90 ", 5400.0),
        ("0:30", 60.0),
        ("1:00:00", 3600.0),
        ("0", math.inf),
        ("unlimited", math.inf),
        ("30s", 30.0),  # or a duration with a unit
        ("1h30m", 5400.0),
    ],
)
def test_time_limit(value: Any, seconds: float) -> None:
    assert parse_time_limit(value) == seconds


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (
            "-2",
            "'-2' is negative (sbatch's 32-bit arithmetic would wrap it around to 4294964417 "
            "minutes); give a limit in that range, or 0 / UNLIMITED for none",
        ),
        ("99999999999", "'99999999999' is over 24855 days"),
        ("2147483647", "is over 24855 days (sbatch's 32-bit arithmetic would wrap it around to no"),
        ("soon", "is not a time limit: give it as sbatch --time does (90 = 90 min"),
        ("1:2:3:4", "is not a time limit: give it as sbatch --time does"),
        ("1x", "is not a time limit"),
        ("-5s", "must be a finite number of seconds >= 0"),
        (-1, "time limit must be a finite number of seconds >= 0"),
        (math.nan, "time limit must be"),
        (True, "is not a time limit"),
    ],
)
def test_time_limit_refuses_with_one_line(bad: Any, says: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_time_limit(bad)
    assert says in str(e.value) and "\n" not in str(e.value)


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
