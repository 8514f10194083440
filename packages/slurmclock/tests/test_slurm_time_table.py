"""slurmclock reads every ``--time`` string as SLURM does: the table a real SLURM 22.05 made
(``slurm_time_table.py``), and a sample of it asked again of the live local SLURM."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from slurmclock import parse_human_duration, parse_slurm_time, parse_time_limit

HERE = Path(__file__).resolve().parent
TABLE = json.loads((HERE / "data" / "slurm_time_strings.json").read_text())
ROWS: list[dict[str, Any]] = TABLE["rows"]
BY_TIME = {r["time"]: r for r in ROWS}


def slurmclock_says(text: str) -> dict[str, Any]:
    """slurmclock's answer in the table's terms."""
    try:
        seconds = parse_slurm_time(text)
    except ValueError:
        return {"accepted": False}
    return {"accepted": True, "minutes": None if math.isinf(seconds) else seconds / 60}


def slurm_said(row: dict[str, Any]) -> dict[str, Any]:
    if not row["accepted"]:
        return {"accepted": False}
    return {"accepted": True, "minutes": row["minutes"]}


def test_the_table_covers_every_form_of_the_manual() -> None:
    """The table is SLURM's word on the forms that matter; an emptied table must fail here."""
    assert TABLE["slurm"].startswith("slurm-wlm 22.05"), TABLE["slurm"]
    accepted = [r["time"] for r in ROWS if r["accepted"]]
    forms = {
        "minutes": r"\d+",
        "minutes:seconds": r"\d+:\d+",
        "hours:minutes:seconds": r"\d+:\d+:\d+",
        "days-hours": r"\d+-\d+",
        "days-hours:minutes": r"\d+-\d+:\d+",
        "days-hours:minutes:seconds": r"\d+-\d+:\d+:\d+",
    }
    for name, pattern in forms.items():
        assert sum(bool(re.fullmatch(pattern, t)) for t in accepted) >= 15, name
    refused = [r["time"] for r in ROWS if not r["accepted"]]
    assert len(refused) >= 30 and {"", "1h", "1.5", "1:2:3:4"} <= set(refused)
    # The rules the issue names, as SLURM itself answered them.
    assert BY_TIME["0"]["time_limit"] == BY_TIME["0:00"]["time_limit"] == "UNLIMITED"
    assert BY_TIME["-1"]["time_limit"] == BY_TIME["INFINITE"]["time_limit"] == "UNLIMITED"
    assert BY_TIME["59:60"]["time_limit"] == "01:00:00"
    assert BY_TIME["1:75"]["time_limit"] == "00:03:00"  # 135 s, rounded up to whole minutes
    assert BY_TIME["1:60:00"]["time_limit"] == "02:00:00"
    assert BY_TIME["90"]["time_limit"] == "01:30:00"  # a bare number is minutes


def test_slurmclock_agrees_with_slurm_on_every_row() -> None:
    wrong = [
        f"{row['time']!r}: SLURM {slurm_said(row)}, slurmclock {slurmclock_says(row['time'])}"
        for row in ROWS
        if slurmclock_says(row["time"]) != slurm_said(row)
    ]
    assert not wrong, f"{len(wrong)} of {len(ROWS)} rows differ:\n" + "\n".join(wrong)


def test_time_limit_flags_agree_with_slurm_or_refuse_its_wrap_arounds() -> None:
    """``--time-limit`` reads every in-range row exactly as SLURM; what SLURM's 32-bit
    arithmetic wraps around (negative, over 68 years) is refused with one line instead. Of
    what sbatch refuses it takes a duration with a unit (``1h30m``) and ignores outer spaces."""
    refused_wraps = 0
    for row in ROWS:
        text = row["time"]
        if not row["accepted"]:
            if re.search("[a-zA-Z]", text) and _human(text) is not None:
                assert parse_time_limit(text) == _human(text), text
            elif text.strip() != text and BY_TIME.get(text.strip(), {}).get("accepted"):
                assert parse_time_limit(text) == parse_time_limit(text.strip()), text
            else:
                with pytest.raises(ValueError, match="is not a time limit|must be a finite"):
                    parse_time_limit(text)
            continue
        try:
            got = parse_time_limit(text)
        except ValueError as e:
            assert "32-bit arithmetic would wrap it around" in str(e), text
            refused_wraps += 1
            continue
        expected = math.inf if row["minutes"] is None else row["minutes"] * 60.0
        assert got == expected, text
    assert refused_wraps >= 15


def _human(text: str) -> float | None:
    try:
        return parse_human_duration(text)
    except ValueError:
        return None


@pytest.mark.slurm
def test_a_sample_still_matches_the_live_slurm(cluster: Any, time_table_tool: ModuleType) -> None:
    """The committed table against the SLURM on this machine: every 10th row, the refused and
    the wrapped ones. Skipped only where slurm-wlm is absent (unless PYRECOVER_REQUIRE_SLURM=1)."""
    generator = time_table_tool
    assert generator.slurm_version(cluster).startswith(TABLE["slurm"].rsplit(".", 1)[0])
    sample = [
        r for i, r in enumerate(ROWS) if i % 10 == 0 or not r["accepted"] or r["time"][:1] == "-"
    ]
    live = generator.ask_slurm(cluster, [r["time"] for r in sample])
    for row, now in zip(sample, live, strict=True):
        assert slurm_said(now) == slurm_said(row), f"{row['time']!r}: table {row}, live {now}"
        assert slurmclock_says(row["time"]) == slurm_said(now), row["time"]
    assert len(sample) >= 80
