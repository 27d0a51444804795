"""The agent's progress samples for ``rlaunch report``, kept in memory and written in batches.

Every :data:`PROGRESS_EVERY_S` seconds (``RLAUNCH_PROGRESS_S`` overrides it) while this node's
workers complete steps, the agent takes one sample: the node's steps completed since the previous
sample, its ranks' last applied step, their median step time and their goodput. The values are
read from the agent's own metrics registry (fed by the workers' heartbeats), so no new channel
exists. Samples are **not** written one by one: they wait in memory and leave as one ``progress``
event (``data.samples``, a list) only when

- this agent emits any other event (a generation change, a drain, a fault, its workers' end:
  every state change already writes to etcd, so the batch rides along), or
- the buffer holds :data:`PROGRESS_BATCH` samples (``RLAUNCH_PROGRESS_BATCH``; an hour at the
  default cadence), or
- the agent stops.

So a job that trains quietly sends etcd nothing but lease keepalives. Nothing is sampled while no
step is completed (a standby, a restart). A sample lost with a SIGKILLed agent is at most a
batch of report data, never state.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from rlaunch.errors import UsageError
from rlaunch.store.records import Event
from rlaunch.waiting import wait_event

#: Seconds between two samples of one node.
PROGRESS_EVERY_S = 30.0
#: Environment variable that sets another cadence, in seconds (tests use a short one).
PROGRESS_ENV = "RLAUNCH_PROGRESS_S"
#: Samples held before a batch is written although nothing else happened (120 × 30 s = 1 hour).
PROGRESS_BATCH = 120
#: Environment variable that sets another batch size (at least 1).
BATCH_ENV = "RLAUNCH_PROGRESS_BATCH"
#: The event kind of a batch (what ``rlaunch report`` reads).
PROGRESS_KIND = "progress"


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


def progress_batch(env: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """The batch size: :data:`PROGRESS_BATCH`, or ``RLAUNCH_PROGRESS_BATCH`` when it is set."""
    raw = env.get(BATCH_ENV, "")
    if not raw:
        return PROGRESS_BATCH
    if not raw.isdigit() or int(raw) < 1:
        raise UsageError(f"{BATCH_ENV}={raw!r} is not valid: give a whole number of samples, at least 1.")
    return int(raw)


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
    """One sample's data for ``sample``, or None when no step was completed since the last one."""
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
    """Samples this node's progress and writes the samples in batches (see the module's docstring).

    Register :meth:`observe` as an observer of the agent's event log: any other event flushes the
    buffer. :meth:`run` samples until ``stop`` and flushes what is left when it ends.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        node_id: str,
        emit: Callable[..., None],
        every_s: float,
        batch: int = PROGRESS_BATCH,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._registry = registry
        self._node_id = node_id
        self._emit = emit
        self._clock = clock
        self.every_s = every_s
        self.batch = batch
        self._samples: list[dict[str, Any]] = []
        self._steps: float | None = None  # the step count at the last sample (None: not read yet)
        self._held = Gauge(
            "rlaunch_progress_samples_held", "Progress samples waiting in the agent for the next batched event.",
            ["node"], registry=registry,
        ).labels(node_id)  # fmt: skip

    @property
    def held(self) -> int:
        """Samples waiting for the next batch."""
        return len(self._samples)

    def sample(self, previous_steps: float, generation: int) -> float:
        """Take one sample (kept only if a step was completed since ``previous_steps``); return the steps total."""
        now = read_sample(self._registry, self._node_id)
        data = progress_data(previous_steps, now)
        if data is not None:
            self._samples.append({"time": round(self._clock(), 6), "generation": generation, **data})
            self._held.set(len(self._samples))
            if len(self._samples) >= self.batch:
                self.flush("full")
        return now["steps"]

    def observe(self, event: Event) -> None:
        """An event-log observer: another event of this agent carries the held samples along."""
        if event.kind != PROGRESS_KIND:
            self.flush(event.kind)

    def flush(self, why: str) -> None:
        """Emit the held samples as one ``progress`` event (``why``: what made it; nothing if none held)."""
        if not self._samples:
            return
        samples, self._samples = self._samples, []
        self._held.set(0)
        self._emit(PROGRESS_KIND, samples[-1]["generation"], samples=samples, flushed=why)

    async def run(self, generation: Callable[[], int], stop: asyncio.Event) -> None:
        """Sample every ``every_s`` seconds until ``stop``; then flush what is held. Started again after an
        error (rlaunch.agent.background), it goes on from its last sample's step count."""
        if self._steps is None:
            self._steps = read_sample(self._registry, self._node_id)["steps"]
        steps = self._steps
        try:
            while not await wait_event(stop, self.every_s):
                self._steps = steps = self.sample(steps, generation())
        finally:
            if stop.is_set():  # (not when it failed: the samples wait for the next flush)
                self.flush("exit")
