"""A drain's downtime read from outside the runtime, set against the runtime's own figure.

The runtime times a move from its boundary to the last rank's first step end, less a median step
(``rlaunch.runtime.phases.breakdown``). Work outside that span can still cost the job time: phase
1 builds communicators while training goes on, agents and the controller run beside the workers,
the leaver's process ends after it, and a layout with no replica exchanges the host snapshot its
ranks copied at their first step (``snapshot_taken``) beside the steps that follow. So the benchmark reads
the downtime from rank 0's timeline (rank 0 survives every drain of the benchmark), period by
period (a period: from one step's end to the next one's, whatever the runtime did between them):

- the steady period: the median of the job's periods outside every drain's window, after the
  first :data:`WARMUP`; its standard deviation is the noise of one period;
- the drain's window: from the first period that ended after any rank saw the plan, through the
  switch's period (the first that ended after rank 0's own boundary) and :data:`AFTER` more;
- each period's excess over the steady one, summed in three parts: ``before_s`` (phase 1 and the
  wait for the vote), ``switch_s`` (the runtime's span, read on rank 0's clock) and ``after_s``.

A window of ``n`` periods reads ``sd * sqrt(n)`` either way on a job without any drain (the
noise, if periods are independent), which is what its parts are judged against.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from rlaunch.runtime.phases import breakdown

#: periods after the switch's that a window holds (the leaver's exit, a post-move snapshot's exchange)
AFTER = 2
#: the job's first periods, left out of the steady one (start-up)
WARMUP = 3

Row = tuple[int, float, float, str]  # a timeline row: step, start, end, role


def periods(rows: Sequence[Row]) -> list[tuple[int, float, float]]:
    """(step, end, period) of each real step after the first, in the order they ended."""
    real = sorted((r for r in rows if r[3] in ("real", "active")), key=lambda r: r[2])
    return [(b[0], b[2], b[2] - a[2]) for a, b in zip(real, real[1:], strict=False)]


def _first_after(ends: Sequence[float], t: float) -> int | None:
    return next((i for i, e in enumerate(ends) if e > t), None)


def read(rows: Sequence[Row], moves: Mapping[int, Sequence[Mapping[str, Any]]], rank: int = 0) -> dict[str, Any]:
    """Every drain of ``moves`` (generation -> its ranks' ``move_phases`` reports) read on ``rank``'s
    timeline ``rows``: the runtime's breakdown against the steady period, and the bench's parts."""
    found = periods(rows)
    ends = [e for _, e, _ in found]
    spans: dict[int, tuple[int, int, int]] = {}
    for gen, reports in moves.items():
        own = [r["marks"]["boundary"] for r in reports if r.get("rank") == rank and "boundary" in r["marks"]]
        seen = [r["marks"]["plan_seen"] for r in reports if "plan_seen" in r["marks"]]
        k = _first_after(ends, own[0]) if own else None
        j = _first_after(ends, min(seen)) if seen else None
        if k is not None and j is not None and k + AFTER < len(found):
            spans[gen] = (min(j, k), k, k + AFTER)
    busy = {i for j, _, h in spans.values() for i in range(j - 1, h + 2)}
    steady = [p for i, (_, _, p) in enumerate(found) if i >= WARMUP and i not in busy]
    if len(steady) < 3:
        return {"why_not": f"{len(steady)} steady periods on rank {rank}'s timeline: too few to read a drain against"}
    period, sd = statistics.median(steady), statistics.stdev(steady)
    drains = []
    for gen in sorted(moves):
        move = breakdown(moves[gen], period)
        if gen in spans:
            j, k, h = spans[gen]
            excess = [found[i][2] - period for i in range(j, h + 1)]
            move["bench_before_s"] = round(sum(excess[: k - j]), 4)
            move["bench_switch_s"] = round(excess[k - j], 4)
            move["bench_after_s"] = round(sum(excess[k - j + 1 :]), 4)
            move["bench_s"] = round(sum(excess), 4)
            move["bench_periods"] = len(excess)
            move["bench_noise_s"] = round(sd * math.sqrt(len(excess)), 4)
        drains.append(move)
    return {"steady_period_s": round(period, 4), "steady_period_sd_s": round(sd, 4), "steady_periods": len(steady),
            "drains": drains}  # fmt: skip


def summary(read_out: dict[str, Any]) -> dict[str, Any]:
    """The medians over the drains, and whether the bench's and the runtime's downtimes agree.

    ``agree_within_10pct``: the median of the bench's whole window and the median of the runtime's
    figure within 10 % of the runtime's; ``switch_agrees_within_10pct``: the same for the switch's
    period alone (the same span on two clocks). Where the whole window does not agree, ``why_not``
    says which parts lie outside the runtime's span and what the noise of such a window is.
    """
    drains = read_out.get("drains") or []
    out: dict[str, Any] = {k: v for k, v in read_out.items() if k != "drains"}
    out["drains"] = drains
    for key in drains[0] if drains else {}:
        values = [m[key] for m in drains if m.get(key) is not None]
        if values and not key.endswith("_at"):
            out[key] = round(statistics.median(values), 4)
    if "bench_s" not in out or "downtime_s" not in out:
        out["agree_within_10pct"] = False
        out.setdefault("why_not", "no drain reported its phases within a readable window")
        return out
    runtime = out["downtime_s"]

    def agrees(bench: float) -> bool:
        return abs(bench - runtime) <= 0.1 * max(runtime, 1e-9)

    out["runtime_vs_bench_pct"] = round(100 * (runtime - out["bench_s"]) / max(out["bench_s"], 1e-9), 1)
    out["agree_within_10pct"] = agrees(out["bench_s"])
    out["switch_agrees_within_10pct"] = agrees(out["bench_switch_s"])
    if not out["agree_within_10pct"]:
        n = len(drains)
        out["why_not"] = (
            f"the runtime times the switch; the bench's window also holds {out['bench_periods']} periods in all, of "
            f"which those before the boundary (phase 1 and the vote's wait) read {out['bench_before_s']:+.3f} s and "
            f"the {AFTER} after the switch's {out['bench_after_s']:+.3f} s (medians over {n} drains), against a "
            f"noise of {out['bench_noise_s']:.3f} s for one such window (one standard deviation of a steady period, "
            f"{out['steady_period_sd_s']:.3f} s, times the square root of its periods) and "
            f"{out['bench_noise_s'] / math.sqrt(max(n, 1)):.3f} s for a median of {n}"
        )
    return out
