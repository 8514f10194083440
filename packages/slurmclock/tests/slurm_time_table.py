"""Records how a real SLURM reads ``--time`` strings, for slurmclock's table test.

    python packages/slurmclock/tests/slurm_time_table.py [--out PATH]

starts a private single-node SLURM (``tools/localslurm.py``), submits one held job per string
with ``sbatch --hold --time=STRING``, reads the ``TimeLimit=`` SLURM gave it from ``scontrol show
job`` (or the error sbatch printed), cancels the jobs, stops the cluster and writes
``data/slurm_time_strings.json`` next to this file. ``test_slurm_time_table.py`` compares
:func:`slurmclock.parse_slurm_time` with every row, and re-asks the live SLURM for a sample.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
TABLE = HERE / "data" / "slurm_time_strings.json"
LOCALSLURM = HERE.parents[2] / "tools" / "localslurm.py"


def _grid(pattern: str, *axes: Iterable[int]) -> list[str]:
    return [pattern.format(*values) for values in itertools.product(*axes)]


def strings() -> list[str]:
    """Every form of the sbatch manual over a grid of values, the no-limit words, SLURM's
    normalisations and wrap-arounds, and what sbatch refuses."""
    forms = [
        *_grid("{}", [0, 1, 2, 5, 9, 10, 30, 59, 60, 61, 75, 90, 99, 100, 119, 120, 1439, 1440]),
        *_grid("{}:{}", [0, 1, 5, 59, 60, 90, 1000], [0, 1, 30, 59, 60, 61, 75, 99, 100, 3600]),
        *_grid("{}:{}:{}", [0, 1, 2, 23, 24, 25, 100], [0, 1, 59, 60, 75], [0, 1, 30, 59, 60, 61]),
        *_grid("{}-{}", [0, 1, 2, 7, 365], [0, 1, 23, 24, 25, 48]),
        *_grid("{}-{}:{}", [0, 1, 3], [0, 1, 23, 24], [0, 1, 59, 60, 75]),
        *_grid("{}-{}:{}:{}", [0, 1, 2], [0, 2, 24], [0, 59, 60], [0, 1, 59, 60, 61]),
    ]
    common = ["30", "1:30", "1:30:00", "00:30:00", "04:00:00", "24:00:00", "7-00:00:00"]
    issue = ["59:60", "1:75", "1:60:00", "0:00", "2-12", "2-12:30", "2-12:30:15"]
    padded = ["00", "007", "01:02", "001:002:003", "00-00:00:00", "0-0", "0-0:0", "1-00"]
    no_limit = ["0:0", "0:00", "00:00:00", "-0", "-1", "-01", "1-", "5-"]
    words = ["UNLIMITED", "unlimited", "Unlimited", "uNlImItEd", "INFINITE", "infinite"]
    wrap = [
        "-2",
        "-5",
        "-365",
        "2147483647",
        "35791393",
        "35791394",
        "71582788",
        "71582789",
        "99999999",
        "99999999999",
        "4294967295",
        "4294967296",
        "99999999999999999999",
        "-9999999999999999999",
        "24855-",
        "24856-",
        "1491308-",
        "0:4294967295",
        "0:4294967294",
        "596523:14:07",
        "596523:14:08",
        "24855-3:14:07",
        "24855-3:14:08",
    ]
    refused = [
        "",
        " ",
        " 10",
        "10 ",
        "1:2:3:4",
        "1::",
        ":1",
        "1:",
        ":",
        "::",
        "-",
        "--",
        "1--2",
        "1-2-3",
        "1-2:",
        "1-:2",
        "-1-",
        "1:2-3",
        "-5:0",
        "-1:00",
        "1-2:3:4:5",
        "1.5",
        "1,5",
        "+5",
        "10m",
        "1h",
        "90s",
        "1h30m",
        "0x10",
        "1e3",
        "\uff11",  # fullwidth digit one
        "\u00b9",  # superscript one
        "\u0663",  # Arabic-Indic three
        "1\n",
        "\t1",
        "inf",
        "nan",
        "NONE",
        "Partition_Limit",
        "UNLIMITED ",
        "unlimit",
        "INFINITY",
    ]
    seen: dict[str, None] = {}
    for s in (*forms, *common, *issue, *padded, *no_limit, *words, *wrap, *refused):
        seen.setdefault(s, None)
    return list(seen)


def minutes_of(time_limit: str) -> int | None:
    """Minutes of scontrol's ``TimeLimit=`` (``[D-]HH:MM:SS``); None for ``UNLIMITED``."""
    if time_limit == "UNLIMITED":
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d+):(\d+)", time_limit)
    if m is None:
        raise ValueError(f"unexpected TimeLimit={time_limit!r}")
    days, hours, minutes, seconds = (int(x or 0) for x in m.groups())
    assert seconds == 0, time_limit  # SLURM keeps whole minutes
    return days * 1440 + hours * 60 + minutes


def ask_slurm(cluster: Any, texts: Sequence[str]) -> list[dict[str, Any]]:
    """One held job per string; what sbatch and scontrol said. Cancels every job it made."""
    script = cluster.workdir / "held.sh"
    script.write_text("#!/bin/sh\ntrue\n")
    rows: list[dict[str, Any]] = []
    jobs: list[str] = []
    try:
        for text in texts:
            out = cluster.run(
                ["sbatch", "--parsable", "--hold", f"--time={text}", "-o", "/dev/null", script],
                check=False,
            )
            if out.returncode != 0:
                said = out.stderr.strip().splitlines()[-1:] or ["(nothing)"]
                rows.append({"time": text, "accepted": False, "sbatch": said[0]})
                continue
            job = out.stdout.strip().split(";")[0]
            jobs.append(job)
            limit = cluster.job(job)["TimeLimit"]
            rows.append(
                {"time": text, "accepted": True, "time_limit": limit, "minutes": minutes_of(limit)}
            )
    finally:
        if jobs:
            cluster.run(["scancel", *jobs], check=False)
    return rows


def load_localslurm() -> ModuleType:
    """tools/localslurm.py (not a package: imported from its folder)."""
    if str(LOCALSLURM.parent) not in sys.path:
        sys.path.insert(0, str(LOCALSLURM.parent))
    return importlib.import_module("localslurm")


def slurm_version(cluster: Any) -> str:
    return str(cluster.run(["sbatch", "--version"]).stdout.strip())


def _dump(table: dict[str, Any]) -> str:
    """JSON with one row per line: a regenerated table diffs row by row."""
    head = {k: v for k, v in table.items() if k != "rows"}
    lines = [json.dumps(head)[:-1] + ', "rows": [']
    lines += [f"  {json.dumps(row)}," for row in table["rows"]]
    lines[-1] = lines[-1].rstrip(",")
    return "\n".join([*lines, "]}"]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TABLE, help=f"default: {TABLE}")
    args = parser.parse_args(argv)
    localslurm = load_localslurm()
    reason = localslurm.unavailable_reason()
    if reason is not None:
        print(f"slurm_time_table: no SLURM here: {reason}", file=sys.stderr)
        return 1
    with localslurm.LocalCluster(cpus=1) as cluster:
        version = slurm_version(cluster)
        rows = ask_slurm(cluster, strings())
    table = {
        "slurm": version,
        "how": "sbatch --hold --time=TIME; TimeLimit= of scontrol show job (minutes: null = "
        "UNLIMITED); accepted=false: sbatch refused it",
        "generated_by": "packages/slurmclock/tests/slurm_time_table.py",
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(_dump(table))
    accepted = sum(r["accepted"] for r in rows)
    print(f"{len(rows)} strings ({accepted} accepted) from {version} -> {args.out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.SubprocessError as e:
        print(f"slurm_time_table: {e}", file=sys.stderr)
        sys.exit(1)
