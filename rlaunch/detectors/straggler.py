"""Straggler detection (pure logic; the controller feeds it node records and acts).

Each active node reports its workers' median *compute* time per step: from the step's start to
the worker's last collective before the vote, i.e. its own forward, backward and data work
without the time spent waiting for slower peers (under DDP every rank's wall-clock step is the
same, so wall time cannot tell the slow node apart). A node is a straggler when its compute time
stays above ``FACTOR`` times the median of the other active nodes' for ``window_s`` seconds on
end. A straggler is not a failure: the controller moves its ranks to a ready standby live, as a
drain would, and the node leaves with a drained mark for an operator to look at.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from rlaunch.store.records import Generation, GenerationStatus, NodeRecord, NodeState

#: How many times the others' median compute time makes a node slow.
FACTOR = 2.0


def compute_times(gen: Generation | None, record_of: Callable[[str], NodeRecord | None]) -> dict[str, float]:
    """What the watch is fed: the compute time of each node of the running generation ``gen`` that runs
    it and reported one. A replacement's survivor that still recovers its workers runs the last
    generation (its record says so, with the time it had before the fault): not counted until it runs
    this one."""
    if gen is None or gen.status is not GenerationStatus.RUNNING:
        return {}
    times = {}
    for node in gen.assignment:
        record = record_of(node)
        if record is None or record.state is not NodeState.RUNNING or record.generation != gen.number:
            continue
        if record.compute_s > 0:
            times[node] = record.compute_s
    return times


class StragglerWatch:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._slow_since: dict[str, float] = {}

    def update(self, now: float, compute_s: dict[str, float]) -> list[str]:
        """Feed the active nodes' compute times; return the nodes slow for the whole window."""
        if self.window_s <= 0 or len(compute_s) < 2:
            self._slow_since.clear()
            return []
        slow = set()
        for node, mine in compute_s.items():
            others = statistics.median(t for n, t in compute_s.items() if n != node)
            if others > 0 and mine > FACTOR * others:
                slow.add(node)
        self._slow_since = {n: self._slow_since.get(n, now) for n in slow}
        return sorted(n for n, since in self._slow_since.items() if now - since >= self.window_s)

    @property
    def watched(self) -> int:
        """How many nodes are slow and being watched (their window may or may not have run out)."""
        return len(self._slow_since)

    @property
    def pending(self) -> bool:
        """Some node is slow but its window has not run out: check again soon."""
        return bool(self._slow_since)
