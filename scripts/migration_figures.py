"""Figures bench_migration.py derives from its runs, apart from the runs themselves (pure functions).

- :func:`paired_overhead`: rlaunch's steady step against torchrun's, from pairs of runs made back to
  back, with the 95 % interval of the mean, and how many pairs +-1 % would take on this machine.
- :func:`warm_vs_cold`: what a standby's sandbox warm-up saves a drain, phase by phase, beside what
  a fresh process's first step pays here (scripts/bench_warmup.py).
- :func:`memory_report`: resident memory of rlaunch's workers against plain DDP's, stage by stage.
- :func:`spread`: a repeated event's median and spread (bench_floor.py uses it too).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Any


def spread(values: Sequence[float], digits: int = 3) -> dict[str, Any]:
    """The median of ``values`` and their spread, rounded: {"median", "runs", "min", "max"}."""
    return {
        "median": round(statistics.median(values), digits), "runs": [round(v, digits) for v in values],
        "min": round(min(values), digits), "max": round(max(values), digits),
    }  # fmt: skip


#: Student's t at 97.5 % for n - 1 degrees of freedom (n pairs): the 95 % interval of a mean
T975 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26, 11: 2.23, 12: 2.20}


def paired_overhead(pairs: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """rlaunch's figure over torchrun's, in percent, pair by pair ((rlaunch, torchrun) of runs made back
    to back); with two pairs or more, the mean's 95 % interval (each pair's ratio taken as independent
    of the others'); where it is wider than +-1 %, ``why`` says how many pairs that would need."""
    runs = [100 * (a / b - 1) for a, b in pairs]
    out: dict[str, Any] = {"median_pct": round(statistics.median(runs), 2), "runs_pct": [round(r, 2) for r in runs]}
    if len(runs) < 2:
        return out
    mean, sd = statistics.mean(runs), statistics.stdev(runs)
    half = T975.get(len(runs), 2.0) * sd / math.sqrt(len(runs))
    out.update(mean_pct=round(mean, 2), sd_pct=round(sd, 2), resolves_1pct=half <= 1.0)
    out["ci95_pct"] = [round(mean - half, 2), round(mean + half, 2)]
    if half > 1.0:
        out["why"] = (
            f"pairs here differ by {sd:.1f} % (one standard deviation): the 95 % interval of {len(runs)} pairs is "
            f"+-{half:.1f} %, and +-1 % would take about {math.ceil((2.0 * sd) ** 2)} pairs"
        )
    return out


def warm_vs_cold(warm: dict[str, Any], cold: dict[str, Any], fresh: dict[str, Any], layout: str) -> dict[str, Any]:
    """What the sandbox's warm-up saves a drain: each phase's median over the cold drains less the warm
    ones' (``saved_s``), beside what a fresh process's first step pays here beyond a steady one."""
    keys = ("params_s", "transfer_s", "to_first_step_s", "first_step_s", "downtime_s", "bench_s")
    both = [k for k in keys if cold.get(k) is not None and warm.get(k) is not None]
    parts = ("first_step_excess_s", "first_step_over_steady", "second_step_over_steady", "first_step_faults",
             "steady_faults")  # fmt: skip
    out: dict[str, Any] = {
        "saved_s": {k: round(cold[k] - warm[k], 4) for k in both},
        "fresh_process": {k: fresh[k] for k in parts if k in fresh},
    }
    if layout == "ddp":
        out["note"] = (
            "a DDP standby runs at least 2 sandbox steps even with --sandbox-steps 0 (DDP rebuilds its buckets at "
            "its second step, and a joiner must hold the survivors' buckets): 'cold' here is that minimum, not none"
        )
    return out


def memory_report(rl: list[dict[str, Any]], tr: list[dict[str, Any]], snapshots_kb: float = 0.0) -> dict[str, Any]:
    """Peak and steady RSS of rlaunch's workers against plain DDP's, from the FINAL records of
    runs that pair up (run i of each mode ran back to back), and the overhead stage by stage.

    ``snapshots_kb``: the host snapshots a worker holds by design in a layout with no replica (its
    own copy and the one it keeps for its buddy's rank, rlaunch.runtime.snapshots; 0 where the
    layout has a replica). The ``*_less_snapshots_pct`` figures are the overhead without them,
    which is what the RSS targets judge; ``snapshots_pct`` says what they add.
    """

    def workers(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [f for r in results for f in r["finals"].values()]

    def med(results: list[dict[str, Any]], get: Any) -> float:
        return float(statistics.median(get(f) for f in workers(results)))

    peak = lambda f: f["memory_kb"]["end"]["peak"]  # noqa: E731 - VmHWM: the same as ru_maxrss, read with the rest
    steady = lambda f: f["memory_kb"]["end"]["rss"]  # noqa: E731
    out: dict[str, Any] = {
        "peak_rlaunch_kb": med(rl, peak),
        "peak_torchrun_kb": med(tr, peak),
        "steady_rlaunch_kb": med(rl, steady),
        "steady_torchrun_kb": med(tr, steady),
    }
    out["peak_overhead_pct"] = round((out["peak_rlaunch_kb"] / out["peak_torchrun_kb"] - 1) * 100, 2)
    out["steady_overhead_pct"] = round((out["steady_rlaunch_kb"] / out["steady_torchrun_kb"] - 1) * 100, 2)
    out["peak_overhead_pct_runs"] = [
        round((med([a], peak) / med([b], peak) - 1) * 100, 2) for a, b in zip(rl, tr, strict=True)
    ]
    # every rlaunch worker against every plain one, the worst pair: what "in every run" must hold for
    out["peak_overhead_worst_pct"] = round(
        (max(peak(f) for f in workers(rl)) / min(peak(f) for f in workers(tr)) - 1) * 100, 2
    )
    out["snapshots_held_kb"] = round(snapshots_kb)
    out["snapshots_pct"] = round(snapshots_kb / out["peak_torchrun_kb"] * 100, 2)
    out["peak_overhead_less_snapshots_pct"] = round(
        ((out["peak_rlaunch_kb"] - snapshots_kb) / out["peak_torchrun_kb"] - 1) * 100, 2
    )
    out["steady_overhead_less_snapshots_pct"] = round(
        ((out["steady_rlaunch_kb"] - snapshots_kb) / out["steady_torchrun_kb"] - 1) * 100, 2
    )
    out["peak_overhead_worst_less_snapshots_pct"] = round(
        ((max(peak(f) for f in workers(rl)) - snapshots_kb) / min(peak(f) for f in workers(tr)) - 1) * 100, 2
    )
    out["peak_spread_within_mode_pct"] = round(max(
        (max(peak(f) for f in workers(x)) / min(peak(f) for f in workers(x)) - 1) * 100 for x in (rl, tr)
    ), 2)  # fmt: skip
    stages = ("imported", "runtime_imported", "initialized", "model", "end")
    names = ("imports", "init_communicators_threads", "model_and_ddp", "training_steps")
    breakdown = {}
    for name, (a, b) in zip(names, itertools.pairwise(stages), strict=True):
        delta = lambda f, a=a, b=b: f["memory_kb"][b]["rss"] - f["memory_kb"][a]["rss"]  # noqa: E731
        breakdown[name] = med(rl, delta) - med(tr, delta)
    breakdown["total_steady"] = out["steady_rlaunch_kb"] - out["steady_torchrun_kb"]
    breakdown["extra_os_threads"] = med(rl, lambda f: f["memory_kb"]["end"]["threads"]) - med(
        tr, lambda f: f["memory_kb"]["end"]["threads"]
    )
    out["breakdown_kb"] = breakdown
    out["rlaunch_python_threads"] = sorted({t for f in workers(rl) for t in f["threads"]})
    out["worker_heavy_modules"] = sorted({m for f in workers(rl) for m in f["heavy_modules"]})
    return out
