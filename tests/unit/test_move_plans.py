"""The listener and the recovery as they take plans: a failed preparation does not end the listener,
and a survivor recovers to the newest replacement plan it holds."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed import HashStore

from rlaunch.plans import MigratePlan, ReplacePlan, Role, plan_to_json
from rlaunch.runtime import snapshots
from rlaunch.runtime.agent_link import AgentLinkError
from rlaunch.runtime.groups import SandboxComm, SwitchableGroup
from rlaunch.runtime.grouptable import GroupTable
from rlaunch.runtime.hostcopy import HostCopy
from rlaunch.runtime.migration import Migration, Prepared
from rlaunch.runtime.phases import MovePhases
from rlaunch.runtime.rankstate import RankState
from rlaunch.runtime.recovery import Recovery
from rlaunch.runtime.snapshots import HostSnapshots
from rlaunch.runtime.vote import StepVote

TIMEOUT = datetime.timedelta(seconds=5)


class _Link:
    """The agent as the listener sees it: plans handed out in turn, then the agent is gone."""

    def __init__(self, plans: list[Any]) -> None:
        self._plans: Iterator[Any] = iter(plans)
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.calls.append((op, fields))
        if op == "wait_plan":
            try:
                return plan_to_json(next(self._plans))
            except StopIteration:
                raise AgentLinkError("The rlaunch agent closed the connection during 'wait_plan'.") from None
        return {}


def _state(link: _Link, build: Any) -> RankState:
    groups = GroupTable(HashStore(), TIMEOUT, build=build)
    groups.add(SwitchableGroup("world", [0, 1], 0, SandboxComm(0, 2), 1))
    state = RankState(
        rank=0, world_size=2, generation=1, standby=False, link=link, store=HashStore(), timeout=TIMEOUT,
        groups=groups, vote=StepVote(2),
    )  # type: ignore[arg-type]  # fmt: skip
    state.tracked["model"] = object()
    return state


def test_a_failed_preparation_leaves_the_listener_taking_later_plans() -> None:
    """An etcd outage in the middle of a drain's phase 1 failed the build: that rank never took a plan again."""
    built: list[str] = []

    def build(store: Any, prefix: str, rank: int, size: int, timeout: Any, backend: Any, ranks: Any) -> Any:
        if prefix.startswith("g2/"):
            raise RuntimeError("etcd at 127.0.0.1:2379 did not answer within 5.0 s")
        built.append(prefix)
        return SandboxComm(rank, size)

    plans = [
        MigratePlan(generation=2, role=Role.SURVIVOR, rank=0, moved_ranks=(1,), world_size=2),
        MigratePlan(generation=3, role=Role.SURVIVOR, rank=0, moved_ranks=(1,), world_size=2),
    ]
    link = _Link(plans)
    state = _state(link, build)
    migration = Migration(state, lambda plan: None, lambda: "", dict, HostSnapshots(state, 0, 1, lambda: False))
    migration.listen()  # returns once the agent is gone
    assert ("prepared", {"generation": 3}) in link.calls and built == ["g3/world/"]
    assert migration.ready == 3


def test_a_drain_this_rank_cannot_make_is_never_prepared() -> None:
    link = _Link([MigratePlan(generation=2, role=Role.SURVIVOR, rank=0, moved_ranks=(1,), world_size=2)])
    state = _state(link, lambda *a: SandboxComm(0, 2))
    host = HostSnapshots(state, 0, 1, lambda: False)
    migration = Migration(state, lambda plan: None, lambda: "no state", dict, host)
    migration.listen()
    assert not any(op == "prepared" for op, _ in link.calls) and migration.ready == 0


def _replace(gen: int, moved: tuple[int, ...]) -> ReplacePlan:
    return ReplacePlan(generation=gen, role=Role.SURVIVOR, rank=0, moved_ranks=moved, world_size=3, sources={})


def test_a_survivor_recovers_to_the_newest_plan_it_holds() -> None:
    """Two faults seconds apart: the older plan's exchange waits on a rank the newer plan replaces."""
    state = _state(_Link([]), lambda *a: SandboxComm(0, 2))
    recovery = Recovery(
        state,
        lambda: "",
        lambda plan, alive: ({}, ""),
        dict,
        lambda known: None,
        str,
        HostSnapshots(state, 0, 1, bool),
        str,
    )
    recovery.on_replace(_replace(5, (1,)))
    recovery.on_replace(_replace(6, (1, 2)))
    assert recovery._take_plan().generation == 6
    recovery.on_replace(_replace(7, (1, 2)))
    newer = recovery._newer_than(_replace(6, (1, 2)))
    assert newer is not None and newer.generation == 7 and recovery._newer_than(newer) is None


def test_a_survivors_switch_keeps_the_host_snapshot_only_after_a_vote_that_found_it_whole() -> None:
    """The survivor's side of a drain that keeps the committed snapshot (rlaunch.runtime.handover):
    the agree vote's sums decide, the switch keeps it (no snapshot at the first step), and a later
    drain whose vote did not find it whole ends the wait, so its first step takes a new one."""
    state = _state(_Link([]), lambda *a: SandboxComm(0, 2))
    host = HostSnapshots(state, 20, 1, lambda: True)
    migration = Migration(state, lambda plan: None, lambda: "", dict, host)
    blob = torch.empty(0, dtype=torch.uint8)
    host.pending = 40
    host.own, host.held = HostCopy({"step": 40}, blob, []), HostCopy({"step": 40}, blob, [])

    def switch_after_vote(generation: int, step: int, mine: list[float], theirs: list[float]) -> None:
        state.step = step
        host.commit([a + b for a, b in zip(mine, theirs, strict=True)])  # the agree vote, both ranks' terms
        plan = MigratePlan(generation=generation, role=Role.SURVIVOR, rank=0, moved_ranks=(1,), world_size=2)
        migration._agreed = Prepared(plan, {"world": SandboxComm(0, 2)}, MovePhases(generation, "survivor"))
        migration.switch(step + 1)

    switch_after_vote(2, 45, host.terms(), host.terms())
    assert state.generation == 2 and host.committed == 40 and host.kept == 40
    assert not host.due(46) and host.due(60), "no snapshot at the first step; the schedule stays"
    joiner = [0.0, 0.0, *host.terms()[2:]]  # the first drain's joiner: its copies still arriving
    switch_after_vote(3, 47, host.terms(), joiner)
    assert state.generation == 3 and host.kept == -1 and host.due(48), "the second drain keeps nothing"


def test_a_rank_votes_ready_for_a_drain_only_once_its_snapshot_exchange_ended_or_ran_too_long() -> None:
    """A drain agreed while the snapshot of step 40 is exchanged could not keep one (the copies of 20
    are overwritten): the rank votes ready only once the exchange ended (a later vote then finds 40
    whole and the drain keeps it), and past EXCHANGE_WAIT_STEPS steps anyway (the drain retakes)."""
    state = _state(_Link([]), lambda *a: SandboxComm(0, 2))
    host = HostSnapshots(state, 20, 1, lambda: True)
    migration = Migration(state, lambda plan: None, lambda: "", dict, host)
    plan = MigratePlan(generation=2, role=Role.SURVIVOR, rank=0, moved_ranks=(1,), world_size=2)
    migration._prepared = Prepared(plan, {"world": SandboxComm(0, 2)}, MovePhases(2, "survivor"))
    ended = threading.Event()
    host._thread = threading.Thread(target=ended.wait, daemon=True)  # the exchange of step 40, in flight
    host._thread.start()
    blob = torch.empty(0, dtype=torch.uint8)
    host.own = HostCopy({"step": 40}, blob, [])  # taken at step 40
    host.pending, host.committed, state.step = 40, 20, 41
    try:
        assert migration.ready == 0
        host.own = HostCopy({"step": 20}, blob, [])
        assert migration.ready == 2, "step 40 took none (an exchange still ran): nothing to keep, no wait"
        host.own = HostCopy({"step": 40}, blob, [])
        state.step = 40 + snapshots.EXCHANGE_WAIT_STEPS
        assert migration.ready == 2, "an exchange that runs this long does not hold the drain any longer"
        state.step = 41
        host.committed = 40
        assert migration.ready == 2, "committed: nothing in flight"
        host.committed = 20
        assert migration.ready == 0
    finally:
        ended.set()
        host._thread.join(5)
    assert migration.ready == 2, "the exchange ended"
    host.held = HostCopy({"step": 40}, blob, [])
    host.commit([2 * term for term in host.terms()])  # the vote that agrees: both ranks hold step 40 whole
    assert host.committed == 40 and host.keeps(state.step + 1), "the drain agreed now keeps snapshot 40"
