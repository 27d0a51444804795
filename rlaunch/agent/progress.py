"""The agent's periodic ``progress`` event: a few numbers a minute per node, for ``rlaunch report``.

Every :data:`PROGRESS_EVERY_S` seconds (``RLAUNCH_PROGRESS_S`` overrides it) while this node's
workers complete steps, the agent emits one ``progress`` event with the node's steps completed
since the previous one, its ranks' last applied step, their median step time and their goodput.
The values are read from the agent's own metrics registry (fed by the workers' heartbeats), so
no new channel or per-step write exists: at the default cadence this is two small etcd writes a
minute per node. Nothing is emitted while no step is completed (a standby, a restart).
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from rlaunch.errors import UsageError
from rlaunch.waiting import wait_event

#: Seconds between two progress events of one node (steady-state etcd traffic stays a few records a minute).
PROGRESS_EVERY_S = 30.0
#: Environment variable that sets another cadence, in seconds (tests use a short one).
PROGRESS_ENV = "RLAUNCH_PROGRESS_S"


def progress_every_s(env: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """The cadence: :data:`PROGRESS_EVERY_S`, or ``RLAUNCH_PROGRESS_S`` when it is set."""
    raw = env.get(PROGRESS_ENV, "")
    if not raw:
        return PROGRESS_EVERY_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value >= 1.0:
        raise UsageError(f"{PROGRESS_ENV}={raw!r} is not valid: give a number of seconds, at least 1.")
    return value


def read_sample(registry: CollectorRegistry, node_id: str) -> dict[str, float]:
    """The node's totals as its metrics show them now: steps, step_s, goodput, applied (max over ranks)."""
    labels = {"node": node_id}
    applied = [
        s.value
        for metric in registry.collect()
        if metric.name == "rlaunch_rank_applied_step"
        for s in metric.samples
        if s.labels.get("node") == node_id
    ]
    return {
        "steps": registry.get_sample_value("rlaunch_node_steps_completed_total", labels) or 0.0,
        "step_s": registry.get_sample_value("rlaunch_node_step_seconds", labels) or 0.0,
        "goodput": registry.get_sample_value("rlaunch_node_goodput_ratio", labels) or math.nan,
        "applied": max(applied) if applied else -1.0,
        "ranks": float(len(applied)),
    }


def progress_data(previous_steps: float, sample: dict[str, float]) -> dict[str, Any] | None:
    """The ``progress`` event's data for ``sample``, or None when no step was completed since the last one."""
    steps = int(sample["steps"] - previous_steps)
    if steps <= 0 or sample["step_s"] <= 0:
        return None
    goodput = sample["goodput"]
    return {
        "steps": steps,
        "applied": int(sample["applied"]),
        "step_s": round(sample["step_s"], 6),
        "goodput": None if math.isnan(goodput) else round(goodput, 4),
        "ranks": int(sample["ranks"]),
    }


class ProgressReporter:
    """Emits this node's ``progress`` events (one task per agent; see the module's docstring)."""

    def __init__(self, registry: CollectorRegistry, node_id: str, emit: Callable[..., None], every_s: float) -> None:
        self._registry = registry
        self._node_id = node_id
        self._emit = emit
        self.every_s = every_s

    async def run(self, generation: Callable[[], int], stop: asyncio.Event) -> None:
        """Every ``every_s`` seconds in which this node's ranks stepped, emit one event; until ``stop``."""
        previous = read_sample(self._registry, self._node_id)["steps"]
        while not await wait_event(stop, self.every_s):
            sample = read_sample(self._registry, self._node_id)
            data = progress_data(previous, sample)
            previous = sample["steps"]
            if data is not None:
                self._emit("progress", generation(), **data)
