"""Durations as people and SLURM write them, and the checkpoint interval they lead to.

:func:`parse_duration` is the one reader of durations in PyRecover: a number of seconds, a unit
form (``90s``, ``15m``, ``2h``, ``1d``, ``1.5h``) or SLURM's own forms with SLURM's meaning
(``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``: ``2-3:04`` is 2 days 3 hours
4 minutes). A bare number is seconds (unlike ``sbatch --time``, where it is minutes).

:func:`checkpoint_interval` is Young/Daly's rule for how often to save under random failures.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence

__all__ = ["check_seconds", "checkpoint_interval", "parse_duration", "young_daly_interval"]

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_HINT = (
    "give seconds (5400), a unit (90s, 15m, 2h, 1.5h, 1d) or SLURM's [D-]HH:MM:SS "
    "(2-3:04 = 2 days 3 h 4 min)"
)


def check_seconds(name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a float of seconds, or a one-line ValueError naming ``name`` and the fix.

    Refuses booleans, non-numbers, NaN, infinity and negatives (zero too when ``positive``).
    """
    low = "> 0" if positive else ">= 0"
    problem = ValueError(f"{name} must be a finite number of seconds {low}, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise problem
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        raise problem
    return seconds


def parse_duration(value: str | float) -> float:
    """Seconds from a number of seconds, a unit form or SLURM's ``[D-]HH:MM:SS`` forms.

    Minutes and seconds after a colon must be below 60 (``1:75`` is a typo, not 2:15); the
    leading field is free (``90:00`` = 90 minutes, as SLURM reads it). One ValueError with the
    accepted forms for anything else, NaN, infinity and negatives included.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration: {_HINT}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_text(value.strip(), value)
    else:
        raise ValueError(f"{value!r} is not a duration: {_HINT}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"duration {value!r} must be a finite number of seconds >= 0")
    return seconds


def _parse_text(text: str, original: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([smhdSMHD]?)", text)
    if m:
        return float(m.group(1)) * _UNITS.get(m.group(2).lower(), 1.0)
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+(?:\.\d+)?))?", text)
    if not m or (m.group(1) is None and m.group(3) is None):
        raise ValueError(f"{original!r} is not a duration: {_HINT}")
    days, first, second, third = m.groups()
    later = [float(x) for x in (second, third) if x is not None]
    if any(x >= 60 for x in later):
        raise ValueError(
            f"{original!r} is not a duration: minutes and seconds after ':' must be below 60"
        )
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        hms = [float(first), *later, 0.0, 0.0][:3]
        return int(days) * 86400 + hms[0] * 3600 + hms[1] * 60 + hms[2]
    if third is not None:  # HH:MM:SS
        return float(first) * 3600 + float(second) * 60 + float(third)
    return float(first) * 60 + float(second)  # MM:SS


def young_daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Seconds between checkpoints that lose the least under random failures.

    ``sqrt(2 * C * MTBF)`` (Young 1974; Daly 2006 to first order) for a save that blocks training
    for ``C`` seconds and a mean time between failures ``MTBF``; never shorter than the save.
    """
    cost = check_seconds("save_cost_s", save_cost_s)
    mtbf = check_seconds("mtbf_s", mtbf_s, positive=True)
    return max(cost, math.sqrt(2.0 * cost * mtbf))


def checkpoint_interval(
    setting: float | str | None,
    measured_costs: Sequence[float],
    assumed_cost: float,
    mtbf_s: float,
) -> float | None:
    """Seconds between time-based saves for a setting of None (off), a number, or ``"auto"``.

    ``"auto"`` is :func:`young_daly_interval` of the median measured blocking cost of a save
    (``assumed_cost`` until one was measured) and ``mtbf_s``.
    """
    if setting is None:
        return None
    if setting == "auto":
        cost = statistics.median(measured_costs) if measured_costs else assumed_cost
        return young_daly_interval(cost, mtbf_s)
    if isinstance(setting, str):
        raise ValueError(f"checkpoint interval {setting!r}: give seconds, 'auto' or None (off)")
    return check_seconds("checkpoint interval", setting, positive=True)
