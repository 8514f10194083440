"""Shared helpers for the benchmark scripts in bench/.

Rules every suite follows: alternatives are measured side by side in the same run, interleaved
(A B A B ...), several repeats, medians reported, and every figure is given as a ratio against a
named baseline. Results go to ``bench/results/<suite>.json`` (+ ``.png``) with the machine
description, so a table in the README can always say where it came from.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# BENCH_RESULTS moves every suite's output (bench/run.py --out, and --quick runs, which must not
# overwrite the committed results).
RESULTS = Path(os.environ.get("BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


def quick() -> bool:
    """True for a fast smoke run (``BENCH_QUICK=1``, set by ``bench/run.py --quick``)."""
    return os.environ.get("BENCH_QUICK", "") not in ("", "0")


def machine() -> dict[str, Any]:
    """A short description of where the numbers came from."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["processor"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        # Other users' load on a shared machine is the main source of noise: say how much.
        info["load_avg_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        out = subprocess.run(
            ["df", "-h", "--output=source,fstype,size", str(RESULTS.parent)],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.splitlines()
        info["disk"] = " ".join(out[-1].split()) if out else "?"
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes (wall clock)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(
    candidates: dict[str, Callable[[], float | None]],
    *,
    repeats: int = 5,
    warmup: int = 1,
    between: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Run each candidate ``repeats`` times, interleaved A B C A B C ...

    A candidate returns the seconds it wants recorded (to exclude its own set-up) or None, in which
    case its whole call is timed. ``between`` runs after every call (e.g. drop page cache, delete
    files) and is not timed.
    """
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for i in range(warmup + repeats):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            got = fn()
            elapsed = time.perf_counter() - t0 if got is None else float(got)
            if i >= warmup:
                samples[name].append(elapsed)
            if between is not None:
                between()
    return samples


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    sys.stdout.flush()


def _fmt(c: object) -> str:
    if isinstance(c, float):
        return f"{c:.3g}" if abs(c) < 1000 else f"{c:,.0f}"
    return str(c)


def write_results(suite: str, data: dict[str, Any], out_dir: Path | None = None) -> Path:
    out = out_dir or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{suite}.json"
    payload = {"suite": suite, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine()}
    payload.update(data)
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {path}")
    return path


def bar_chart(
    path: Path, labels: Sequence[str], values: Sequence[float], *, title: str, ylabel: str
) -> Path | None:
    """A horizontal bar chart; None (and a note) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart (pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(labels) + 1.2))
    ax.barh(list(labels)[::-1], list(values)[::-1], color="#4C72B0")
    ax.set_xlabel(ylabel)
    ax.set_title(title)
    for i, v in enumerate(list(values)[::-1]):
        ax.text(v, i, f" {v:.3g}", va="center", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path
