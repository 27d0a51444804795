"""Which controller ticks read the node records whole from etcd rather than from the leader's feed:
the first of a run (which may follow a failed run: rlaunch.agent.background starts it again), those
no change woke (a deadline's: the watch may be open and silent) and the one after a failed tick; the
others use the feed (rlaunch.controller.feed)."""

from __future__ import annotations

import asyncio
import time

from rlaunch.controller.controller import Controller
from rlaunch.controller.planner import PlannerConfig
from rlaunch.errors import StoreUnavailableError
from rlaunch.events import EventLog
from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import JobSpec


class ScriptedTicks(Controller):
    """The real controller loop; each tick records how it was asked to read and does the next step of
    ``script`` in place of planning (etcd is never asked: the loop's choices are what is tested)."""

    def __init__(self, script: list[str], stop: asyncio.Event, wake: asyncio.Event) -> None:
        store = Store(parse_endpoints("127.0.0.1:1"))  # (never reached: campaign and tick are the script's)
        keys = JobKeys("reads")
        spec = JobSpec(keys.job_id, 1, 1, 0, "train.py", [], "f", "test")
        super().__init__(store, keys, spec, PlannerConfig("a", 60.0), 1, EventLog(store, keys, "a", None, time.time))
        self.script, self.stop, self.wake = script, stop, wake
        self.reads: list[bool] = []

    async def campaign(self) -> bool:
        self._term = 1
        return True

    async def tick(self, whole: bool = False) -> None:
        self.reads.append(whole)
        step = self.script.pop(0)
        self._deadline_pending = step == "deadline"  # a generation waits for a spare until a deadline
        if step == "end":
            self.stop.set()
        if step in ("change", "fail after a change"):
            self.wake.set()  # a change came while this tick planned
        if step == "fail after a change":
            raise StoreUnavailableError("etcd did not answer")


def test_ticks_no_change_woke_and_ticks_after_a_failure_read_the_records_whole() -> None:
    async def go() -> list[bool]:
        stop, wake = asyncio.Event(), asyncio.Event()
        ctl = ScriptedTicks(["deadline", "change", "fail after a change", "end"], stop, wake)
        await asyncio.wait_for(ctl.run(stop, wake), 30)
        return ctl.reads

    reads = asyncio.run(go())
    # 1st: the first of the run (after a failed run, the feed's records may be stale); 2nd: the deadline's,
    # no change woke it; 3rd: woken by a change; 4th: woken by a change, but after a failed tick
    assert reads == [True, True, False, True]
