"""Hang detection from the workers' own heartbeats (pure logic; the agent feeds it and acts).

A worker that uses the runtime sends a heartbeat about once a second from a background thread:
how many steps it has completed, its median step time, and whether it is *waiting on peers*
(a collective in flight, or a recovery under way). A worker is hung when

- its heartbeats stop for longer than the timeout (the process is frozen), or
- it completes no step for longer than the timeout while not waiting on peers.

A worker blocked in a collective is a victim of someone else's hang, not hung itself: the peer's
own agent (or the peer's lease expiry) detects that one, so only the hung rank is replaced. The
timeout is derived from the job's own step time: ``max(floor, STEP_FACTOR x median step)``,
where the floor is ``--hang-timeout``. A worker is watched from its first completed step on
(start-up, model building and the first step have no step time to measure against).
"""

from __future__ import annotations

import dataclasses
import statistics

#: How many median step times without progress count as a hang (above the floor).
STEP_FACTOR = 20.0
#: A worker waiting on peers without completing a step for the larger of these (seconds, and median
#: steps) is stalled: its agent probes the other nodes for a network cut (see rlaunch.agent.reach).
STALL_FLOOR_S = 5.0
STALL_STEPS = 3.0


@dataclasses.dataclass
class _Beat:
    steps: int
    step_s: float
    waiting: bool
    heard_at: float  # when the last heartbeat came
    moved_at: float  # when the step count last changed, or the worker stopped waiting


@dataclasses.dataclass(frozen=True)
class Hang:
    local_rank: int
    silent_s: float
    timeout_s: float
    frozen: bool  # no heartbeat at all (as opposed to heartbeats without progress)

    def sentence(self) -> str:
        what = "sent no heartbeat" if self.frozen else "completed no step"
        return (
            f"local rank {self.local_rank} {what} for {self.silent_s:.1f} s "
            f"(hang timeout {self.timeout_s:.1f} s: the larger of --hang-timeout and {STEP_FACTOR:.0f} median steps)"
        )


class HangDetector:
    def __init__(self, floor_s: float) -> None:
        self.floor_s = floor_s
        self._beats: dict[int, _Beat] = {}

    def reset(self) -> None:
        """New workers: forget the old ones."""
        self._beats.clear()

    def heartbeat(self, local_rank: int, now: float, steps: int, step_s: float, waiting: bool) -> None:
        if steps == 0:
            return  # not started yet
        beat = self._beats.get(local_rank)
        if beat is None or beat.steps != steps or (beat.waiting and not waiting):
            self._beats[local_rank] = _Beat(steps, step_s, waiting, now, now)
        else:
            beat.step_s, beat.waiting, beat.heard_at = step_s, waiting, now

    def forget(self, local_rank: int) -> None:
        self._beats.pop(local_rank, None)

    def timeout(self) -> float:
        steps = [b.step_s for b in self._beats.values() if b.step_s > 0]
        return max(self.floor_s, STEP_FACTOR * statistics.median(steps)) if steps else self.floor_s

    def stall_limit(self) -> float:
        """How long a worker may wait on peers without a step before its agent looks for a cut."""
        steps = [b.step_s for b in self._beats.values() if b.step_s > 0]
        return max(STALL_FLOOR_S, STALL_STEPS * statistics.median(steps)) if steps else STALL_FLOOR_S

    def stalled_s(self, now: float) -> float:
        """The longest any watched worker now waiting on peers has gone without completing a step (0: none waits)."""
        return max((now - b.moved_at for b in self._beats.values() if b.waiting), default=0.0)

    def hung(self, now: float) -> list[Hang]:
        limit = self.timeout()
        out = []
        for local_rank, beat in sorted(self._beats.items()):
            if now - beat.heard_at > limit:
                out.append(Hang(local_rank, now - beat.heard_at, limit, frozen=True))
            elif not beat.waiting and now - beat.moved_at > limit:
                out.append(Hang(local_rank, now - beat.moved_at, limit, frozen=False))
        return out
