"""Two kinds of time spans, two readers -- and the checkpoint interval they lead to.

A **SLURM time string** (``sbatch --time``, ``squeue %l``, ``scontrol``'s ``TimeLimit=``) is read
by :func:`parse_slurm_time` exactly as SLURM 22.05 reads it (``time_str2mins`` in SLURM's
``src/common/parse_time.c``, checked against a live ``sbatch`` by the table test): minutes,
minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds;
a bare number is minutes; no field has an upper bound (``59:60`` is an hour, ``1:75`` 2 min 15 s);
seconds are rounded *up* to whole minutes; ``0`` (any form adding up to 0), ``-1``, ``UNLIMITED``
and ``INFINITE`` (any case) mean no limit.

A **human duration** (``--stop-margin 90s``, ``PYRECOVER_SIGNAL_LEAD=5m``) is read by
:func:`parse_human_duration`: seconds (``5400``, ``1.5``) or units (``90s``, ``15m``, ``2h``,
``1.5h``, ``1d``, ``1h30m``). It refuses SLURM's colon forms, so the two never get mixed up.

:func:`parse_time_limit` reads a time limit given by a user (``--time-limit``): a SLURM time string
with SLURM's meaning, or a human duration *with a unit* (``30s``: what SLURM's minutes cannot say).

:func:`parse_time` reads a point in time: epoch seconds, or ISO-8601 (local time without an offset,
as ``squeue`` and ``scontrol`` print it).

:func:`checkpoint_interval` is Young/Daly's rule for how often to save under random failures.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from datetime import datetime

__all__ = [
    "check_seconds",
    "checkpoint_interval",
    "parse_duration",
    "parse_human_duration",
    "parse_slurm_time",
    "parse_time",
    "parse_time_limit",
    "young_daly_interval",
]

_UNITS = {
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "m": 60.0,
    "min": 60.0,
    "mins": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hrs": 3600.0,
    "d": 86400.0,
}
_NUMBER = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
_PART = re.compile(rf"({_NUMBER})\s*([a-z]+)\s*")
_HUMAN_HINT = "give seconds (5400, 1.5) or a unit (90s, 15m, 2h, 1.5h, 1d, 1h30m)"
_SLURM_HINT = (
    "SLURM reads minutes, minutes:seconds, hours:minutes:seconds, days-hours, "
    "days-hours:minutes or days-hours:minutes:seconds (0, UNLIMITED or INFINITE: no limit)"
)
# SLURM's 32-bit sentinels (slurm.h): INFINITE = 0xffffffff, NO_VAL = 0xfffffffe, as int.
_C_INFINITE, _C_NO_VAL = -1, -2
_LIMIT_HINT = (
    "give it as sbatch --time does (90 = 90 min, 1:30:00, 2-12:00; 0 or UNLIMITED: no limit) "
    "or with a unit (30s, 1h30m)"
)
_INT32_MAX = 2**31 - 1
_LARGEST = _INT32_MAX - 59  # seconds whose rounding up to minutes does not wrap around either


def check_seconds(name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a float of seconds, or a one-line ValueError naming ``name`` and the fix.

    Refuses booleans, non-numbers, NaN, infinity and negatives (zero too when ``positive``).
    """
    low = "> 0" if positive else ">= 0"
    problem = ValueError(f"{name} must be a finite number of seconds {low}, got {_brief(value)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise problem
    try:
        seconds = float(value)
    except OverflowError:  # an int of 400 digits (a damaged file): no float holds it
        raise problem from None
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        raise problem
    return seconds


def _brief(value: object) -> str:
    """``repr(value)``, short: a value from a damaged file may be a 4000-digit number."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return "a number of more than 30 digits"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


# -- human durations -------------------------------------------------------------------------


def parse_human_duration(value: str | float) -> float:
    """Seconds from a number of seconds or a unit form (``90s``, ``1.5h``, ``1h30m``).

    Units ``s``/``sec``, ``m``/``min``, ``h``/``hr``, ``d``, any case, each at most once and
    largest first. A SLURM time string (``1:30``, ``1-00:00:00``) is refused with a pointer to
    :func:`parse_slurm_time`: in SLURM ``1:30`` is 2 minutes, not 90 s. One ValueError for
    anything else, NaN, infinity and negatives included.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{value!r} is not a duration: {_HUMAN_HINT}")
    seconds = _human_text(value) if isinstance(value, str) else float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"duration {value!r} must be a finite number of seconds >= 0")
    return seconds


def _human_text(value: str) -> float:
    text = value.strip().lower()
    if re.fullmatch(_NUMBER, text):
        return float(text)
    if re.fullmatch(rf"-\s*{_NUMBER}\s*[a-z]*", text):
        raise ValueError(f"duration {value!r} must be a finite number of seconds >= 0")
    if text and re.fullmatch(r"[0-9:-]+", text):
        raise ValueError(
            f"{value!r} is a SLURM time string{_as_slurm_reads_it(text)}; a duration here is "
            f"seconds or has a unit: 5400, 90s, 1h30m"
        )
    total, pos = 0.0, 0
    seen: list[int] = []
    order = "smhd"
    while pos < len(text):
        m = _PART.match(text, pos)
        unit = _UNITS.get(m.group(2)) if m else None
        if m is None or unit is None:
            raise ValueError(f"{value!r} is not a duration: {_HUMAN_HINT}")
        rank = order.index(m.group(2)[0])
        if seen and rank >= seen[-1]:
            raise ValueError(
                f"{value!r} is not a duration: give each unit once, largest first (1h30m)"
            )
        seen.append(rank)
        total += float(m.group(1)) * unit
        pos = m.end()
    if not seen:
        raise ValueError(f"{value!r} is not a duration: {_HUMAN_HINT}")
    return total


def _as_slurm_reads_it(text: str) -> str:
    try:
        seconds = parse_slurm_time(text)
    except ValueError:
        return ""
    if math.isinf(seconds):
        return " (no limit to sbatch --time)"
    return f" ({seconds / 60:.0f} min to sbatch --time)"


# Compatible name from slurmclock 0.1 (its colon forms are SLURM time strings now).
parse_duration = parse_human_duration


# -- SLURM time strings ----------------------------------------------------------------------


def parse_slurm_time(text: str) -> float:
    """Seconds of the time limit SLURM gives ``sbatch --time=TEXT``; ``math.inf`` for no limit.

    Exactly SLURM 22.05's ``time_str2mins`` (and sbatch's "0 means no limit"), its 32-bit C
    arithmetic included: values past 2**31 s wrap around as they do in SLURM (``-2`` is
    4294964417 minutes there); :func:`parse_time_limit` refuses those instead. A one-line
    ValueError where sbatch says "Invalid --time specification".
    """
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a SLURM time string: {_SLURM_HINT}")
    minutes = _time_str2mins(text)
    if minutes is None:
        raise ValueError(f"{text!r} is not a SLURM time: {_SLURM_HINT}")
    if minutes in (0, _C_INFINITE):
        return math.inf
    return float((minutes & 0xFFFFFFFF) * 60)  # the controller keeps a uint32 of minutes


def _time_str2mins(text: str) -> int | None:
    """SLURM's ``time_str2mins`` as a C int; None for NO_VAL (rejected)."""
    if text.lower() in _NO_LIMIT_WORDS:
        return _C_INFINITE
    fields = _slurm_fields(text)
    if fields is None:
        return None
    # sscanf's %d is strtol (saturating at the long range) cast to int; then int arithmetic.
    longs = [max(-(2**63), min(2**63 - 1, f)) for f in fields]
    secs = _c_int(sum(f * k for f, k in zip(longs, _FIELD_SECONDS, strict=True)))
    if secs in (_C_NO_VAL, _C_INFINITE):
        return None if secs == _C_NO_VAL else _C_INFINITE
    return _c_div(_c_int(secs + 59), 60)  # ROUNDUP(secs, 60), C's truncating division


_NO_LIMIT_WORDS = ("-1", "infinite", "unlimited")
_FIELD_SECONDS = (86400, 3600, 60, 1)


def _slurm_fields(text: str) -> tuple[int, int, int, int] | None:
    """(days, hours, minutes, seconds) as SLURM lays them out; None where SLURM refuses."""
    if not _valid_timespec(text):
        return None
    if "-" in text:  # sscanf(text, "%d-%d:%d:%d"): days-[hours[:minutes[:seconds]]]
        d, h, m, s = (*_scan_ints(text, "-::"), 0, 0, 0)[:4]
        return d, h, m, s
    fields = _scan_ints(text, "::")
    if len(fields) == 3:  # hours:minutes:seconds
        return 0, fields[0], fields[1], fields[2]
    return 0, 0, fields[0], fields[1] if len(fields) > 1 else 0  # minutes[:seconds]


def _valid_timespec(text: str) -> bool:
    """SLURM's ``_is_valid_timespec``: digits, at most one '-' (before any ':'), two ':'."""
    if not text or any(c not in "0123456789-:" for c in text):
        return False
    groups = len(re.findall(r"[0-9]+", text))
    dash, colon = text.count("-"), text.count(":")
    if groups == 0 or dash > 1 or colon > 2 or (dash and text.index("-") > text.find(":") >= 0):
        return False
    need = {1: 3, 2: 4} if dash else {1: 2, 2: 3}
    return groups >= need.get(colon, 0)


def _scan_ints(text: str, separators: str) -> list[int]:
    """``sscanf``'s ``%d`` fields between the literal ``separators``; stops at a mismatch."""
    fields: list[int] = []
    pos = 0
    for i in range(len(separators) + 1):
        if i:
            if not text.startswith(separators[i - 1], pos):
                break
            pos += 1
        m = _INT.match(text, pos)
        if m is None:
            break
        fields.append(int(m.group()))
        pos = m.end()
    return fields


_INT = re.compile(r"[+-]?[0-9]+")


def _c_int(value: int) -> int:
    """``value`` as a 32-bit two's-complement C int (wraps around like SLURM's arithmetic)."""
    value &= 0xFFFFFFFF
    return value - 2**32 if value > _INT32_MAX else value


def _c_div(a: int, b: int) -> int:
    """C's integer division, which truncates toward zero (Python's ``//`` floors)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


# -- a time limit given by a user ------------------------------------------------------------


def parse_time_limit(value: str | float) -> float:
    """Seconds of a user's time limit (``--time-limit``); ``math.inf`` for no limit.

    A number is seconds (the Python API). Text is a SLURM time string with SLURM's meaning
    (:func:`parse_slurm_time`: ``90`` is 90 minutes, ``0:30`` one minute, ``0`` no limit) or a
    human duration with a unit (``30s``, ``1h30m``). Values SLURM's 32-bit arithmetic wraps
    around (negative, or over 2**31 s: about 68 years) are refused instead of read as SLURM
    would read them.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{value!r} is not a time limit: {_LIMIT_HINT}")
    if not isinstance(value, str):
        if math.isinf(value) and value > 0:
            return math.inf
        return check_seconds("time limit", value)
    text = value.strip()
    if re.search(r"[a-zA-Z]", text) and text.lower() not in ("infinite", "unlimited"):
        try:
            return parse_human_duration(text)
        except ValueError as e:
            if "must be" in str(e):  # negative: that message is the clearer one
                raise
            raise ValueError(f"{value!r} is not a time limit: {_LIMIT_HINT}") from None
    try:
        seconds = parse_slurm_time(text)
    except ValueError:
        raise ValueError(f"{value!r} is not a time limit: {_LIMIT_HINT}") from None
    fields = None if text.lower() in _NO_LIMIT_WORDS else _slurm_fields(text)
    exact = (
        None if fields is None else sum(f * k for f, k in zip(fields, _FIELD_SECONDS, strict=True))
    )
    if exact is not None and not 0 <= exact <= _LARGEST:
        shown = "no limit" if math.isinf(seconds) else f"{seconds / 60:.0f} minutes"
        what = "negative" if exact < 0 else f"over {_LARGEST // 86400} days"
        raise ValueError(
            f"{value!r} is {what} (sbatch's 32-bit arithmetic would wrap it around to {shown}); "
            "give a limit in that range, or 0 / UNLIMITED for none"
        )
    return seconds


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


# 9999-12-31: beyond it datetime (and so ISO-8601) has no way to write a time.
_LAST_TIME = 253402214400.0


def parse_time(value: str | float) -> float:
    """Epoch seconds from epoch seconds (number or numeric string) or ISO-8601.

    ISO-8601 without a UTC offset is local time -- what ``squeue``/``scontrol`` print.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a time")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        if re.fullmatch(r"[+-]?[0-9]+(\.[0-9]*)?", text):  # ASCII: float() takes any digits
            seconds = float(text)
        else:
            if text[-1:] in {"Z", "z"}:  # fromisoformat takes "Z" only from Python 3.11
                text = text[:-1] + "+00:00"
            try:
                seconds = datetime.fromisoformat(text).timestamp()
            except (ValueError, OverflowError, OSError):
                raise ValueError(
                    f"{_shown(value)} is neither epoch seconds nor ISO-8601 "
                    "(e.g. 1767225600 or 2026-01-01T00:00:00+01:00)"
                ) from None
    if not math.isfinite(seconds) or not 0 < seconds < _LAST_TIME:
        raise ValueError(
            f"{_shown(value)} is not a valid time: epoch seconds must be > 0 and before the year "
            "10000"
        )
    return seconds


def _shown(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut short: a command's garbage must not become a screenful."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...' ({len(str(value))} chars)"
