"""The competing workload of ``queue_replay.py``: the Lublin-Feitelson model of batch jobs on a
parallel machine, time-scaled and sized to a small cluster (stdlib only, seeded).

Source: U. Lublin and D. G. Feitelson, "The workload on parallel supercomputers: modeling the
characteristics of rigid jobs", J. Parallel Distrib. Comput. 63(11):1105-1122, 2003; the
parameters are those of the authors' published generator ``lublin99.c`` (Parallel Workloads
Archive, www.cs.huji.ac.il/labs/parallel/workload/models.html), for *batch* jobs:

- size: serial with p 0.2927; else log2(size) from a two-stage uniform (ULow 1.2, UMed, UHi,
  UProb 0.875), rounded to a power of two with p 0.6686; UHi = log2(cluster size) and UMed =
  UHi - 2 (the paper: UMed in [UHi-3.5, UHi-1.5]; 5 for its 128 nodes);
- runtime: ln(runtime in s) from a hyper-gamma: Gamma(6.57, 0.823) with p = -0.003 * size +
  0.6986, else Gamma(639.1, 0.0156);
- inter-arrival: ln(seconds) ~ Gamma(6.0415 * 1.0519, 0.8531), the rush-hour process without the
  daily cycle. The paper changes the load by changing this parameter; we scale the inter-arrival
  times instead, to one offered load (sum of size * runtime over cluster size * span).

What the model does not give is the limit a user asks for: we take the smallest of the round
values users pick (Tsafrir, Etsion and Feitelson, "Modeling user runtime estimates", JSSPP 2005:
estimates cluster at round values, mostly far above the runtime) that is at least the runtime
times a factor drawn uniformly from [1, 4]. Runtimes above the partition's MaxTime are cut to it
(the job would have been killed there).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

__all__ = ["Job", "lublin_jobs"]

SERIAL_PROB = 0.2927
POW2_PROB = 0.6686
ULOW, UPROB = 1.2, 0.875
A1, B1, A2, B2, PA, PB = 6.57, 0.823, 639.1, 0.0156, -0.003, 0.6986
AARR, BARR = 6.0415 * 1.0519, 0.8531
# Round limits (minutes) users ask for (Tsafrir et al.: 15 min, 30 min, 1, 2, 4, 8, 12, 24 h...).
ROUND_LIMITS_MIN = (15, 30, 60, 120, 240, 480, 720, 1440, 2880)


@dataclass(frozen=True, slots=True)
class Job:
    """One job of the replay, in the model's (unscaled) seconds."""

    arrival: float  # seconds from the replay's start
    size: int  # nodes (here: CPUs of the one-node cluster)
    runtime: float  # seconds it runs
    limit_min: int  # the limit asked for, minutes


def _two_stage_uniform(rng: random.Random, low: float, med: float, hi: float) -> float:
    return rng.uniform(low, med) if rng.random() <= UPROB else rng.uniform(med, hi)


def _size(rng: random.Random, cluster: int) -> int:
    u = rng.random()
    if u <= SERIAL_PROB:
        return 1
    uhi = math.log2(cluster)
    par = _two_stage_uniform(rng, min(ULOW, uhi), max(uhi - 2.0, ULOW), uhi)
    if u <= SERIAL_PROB + POW2_PROB:
        par = float(int(par + 0.5))
    return max(1, min(cluster, int(2**par + 0.5)))


def _runtime(rng: random.Random, size: int, max_s: float) -> float:
    p = min(1.0, max(0.0, PA * size + PB))
    # random.gammavariate(alpha, beta): beta is the scale, as in lublin99.c's gamrnd.
    log_rt = rng.gammavariate(A1, B1) if rng.random() <= p else rng.gammavariate(A2, B2)
    return min(max_s, max(1.0, math.exp(log_rt)))


def _limit(rng: random.Random, runtime: float, max_s: float) -> int:
    want = runtime * rng.uniform(1.0, 4.0) / 60.0
    for minutes in ROUND_LIMITS_MIN:
        if minutes >= want and minutes * 60 <= max_s:
            return minutes
    return int(max_s // 60)


def lublin_jobs(
    *, seed: int, cluster: int, span_s: float, load: float, max_runtime_s: float
) -> list[Job]:
    """Jobs arriving over ``span_s`` model seconds on ``cluster`` nodes at an offered ``load``
    (0.9: the jobs ask for 90 % of the node-seconds of the span)."""
    rng = random.Random(seed)
    raw: list[tuple[float, int, float]] = []
    t = 0.0
    for _ in range(100_000):
        t += math.exp(rng.gammavariate(AARR, BARR))
        size = _size(rng, cluster)
        raw.append((t, size, _runtime(rng, size, max_runtime_s)))
        work = sum(s * r for _, s, r in raw)
        # Stop once the jobs, squeezed into span_s, offer the load asked for.
        if work >= load * cluster * span_s:
            break
    squeeze = span_s / raw[-1][0]
    return [
        Job(arrival=a * squeeze, size=s, runtime=r, limit_min=_limit(rng, r, max_runtime_s))
        for a, s, r in raw
    ]
