"""Gloo's reduce-scatters have no future: the guard waits for them in the caller's own wait().

Two real gloo processes: the reduce-scatter completes when both take part; with a hung peer, an
abandon (before or during the wait) ends the wait at once, marks the group failed, and the
group no longer reports an operation in flight. A rank that left in a drain issues nothing more.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlaunch.runtime import backend as backends
from rlaunch.runtime.groups import SwitchableGroup
from tests.gloo_pair import TIMEOUT, run_pair, world_group


def _rank(rank: int, port: int, results: Any, mode: str) -> None:
    group = world_group(rank, port)
    out, inp = torch.zeros(2), torch.arange(4.0)
    if rank == 1 and mode != "both":
        time.sleep(8)  # a hung peer: never joins the reduce-scatter
        return
    work = group._reduce_scatter_base(out, inp, dist.ReduceScatterOptions())
    issued_busy = group.busy
    if mode == "during":
        threading.Timer(1.0, group.abandon, args=("a peer is gone",)).start()
    elif mode == "before":
        group.abandon("a peer is gone")
    began = time.monotonic()
    work.wait()
    if rank == 0:
        results.put((mode, issued_busy, time.monotonic() - began, group.failed, group.busy, out.tolist()))


def test_a_waited_reduce_scatter_completes_and_is_no_longer_in_flight() -> None:
    mode, issued_busy, _, failed, busy, out = run_pair(_rank, "both")
    assert (failed, busy) == ("", False)
    assert out == [0.0, 2.0]  # rank 0's chunk ([0, 1]) summed over both ranks


def test_an_abandon_during_or_before_the_wait_ends_it_at_once() -> None:
    for mode in ("during", "before"):
        got_mode, issued_busy, waited, failed, busy, _ = run_pair(_rank, mode)
        assert issued_busy, "issued and not completed: in flight (the heartbeat says the rank waits on peers)"
        assert failed == "a peer is gone" and not busy, got_mode
        assert waited < 5.0, f"{mode}: the wait took {waited:.1f} s; the abandon must end it at once"


def _planned(rank: int, port: int, results: Any) -> None:
    """Rank 0 is in a tensor-parallel allreduce that rank 1 (already in its recovery) never issues;
    a replacement plan of another rank arrives: the collective ends, its group is rebuilt, and
    later collectives of any group return at once until the recovery ends."""
    from rlaunch.plans import ReplacePlan, Role
    from rlaunch.runtime.grouptable import GroupTable
    from rlaunch.runtime.rankstate import RankState
    from rlaunch.runtime.recovery import Recovery
    from rlaunch.runtime.snapshots import HostSnapshots
    from rlaunch.runtime.vote import StepVote

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=TIMEOUT)
    tp = SwitchableGroup("tp", [0, 1], rank, backends.build(store, "g1/tp/", rank, 2, TIMEOUT), 1)
    idle = SwitchableGroup("idle", [0, 1], rank, backends.build(store, "g1/idle/", rank, 2, TIMEOUT), 1)
    if rank == 1:
        time.sleep(8)
        return
    state = RankState(
        rank=0, world_size=3, generation=1, standby=False, link=None, store=None, timeout=TIMEOUT,
        groups=GroupTable(None, TIMEOUT), vote=StepVote(3),
    )  # fmt: skip
    for group in (tp, idle):
        state.groups.add(group)
    recovery = Recovery(
        state, str, lambda p, a: ({}, ""), dict, lambda k: None, str, HostSnapshots(state, 0, 1, bool), str
    )
    plan = ReplacePlan(generation=2, role=Role.SURVIVOR, rank=0, moved_ranks=(2,), world_size=3, sources={})
    t = torch.ones(4)
    work = tp.allreduce([t])
    threading.Timer(1.0, recovery.on_replace, args=(plan,)).start()
    began = time.monotonic()
    work.wait()
    waited = time.monotonic() - began
    later = torch.ones(2)
    idle.allreduce([later]).wait()  # paused: returns at once, un-issued
    # the plan is handed over right after the abandon that ended the wait (the listener's thread)
    handed = time.monotonic() + 5.0
    while not recovery.planned and time.monotonic() < handed:
        time.sleep(0.05)
    results.put((waited, tp.failed, idle.failed, idle.paused, later.tolist(), recovery.planned))


def test_a_plan_ends_a_collective_a_recovering_peer_never_issues_and_pauses_the_rest() -> None:
    waited, tp_failed, idle_failed, idle_paused, later, planned = run_pair(_planned)
    assert waited < 5.0, f"the in-flight collective waited {waited:.1f} s for a peer that never issues it"
    assert "one of its collectives was in flight" in tp_failed, "abandoned: rebuilt by the recovery"
    assert idle_failed == "" and idle_paused, "a group with nothing in flight is kept, paused"
    assert later == [1.0, 1.0] and planned


def _switched_after_plan(rank: int, port: int, results: Any) -> None:
    """A drain's switch and a replacement plan cross: the plan (a peer of the drain was lost) pauses
    rank 0's groups while rank 0 is still short of the drain's agreed switch; the switch then swaps
    the drained group's new communicator in, with the lost peer in it. Until the recovery, its
    collectives must still return at once, un-issued: one issued would wait for the lost peer."""
    from rlaunch.plans import ReplacePlan, Role
    from rlaunch.runtime.grouptable import GroupTable
    from rlaunch.runtime.rankstate import RankState
    from rlaunch.runtime.recovery import Recovery
    from rlaunch.runtime.snapshots import HostSnapshots
    from rlaunch.runtime.vote import StepVote

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=TIMEOUT)
    old = SwitchableGroup("world", [0, 1], rank, backends.build(store, "g1/world/", rank, 2, TIMEOUT), 1)
    drained = backends.build(store, "g2/world/", rank, 2, TIMEOUT)  # what the drain prepared (phase 1)
    if rank == 1:
        time.sleep(8)  # the lost peer: alive to its sockets, never issuing again
        return
    state = RankState(
        rank=0, world_size=2, generation=1, standby=False, link=None, store=None, timeout=TIMEOUT,
        groups=GroupTable(None, TIMEOUT), vote=StepVote(2),
    )  # fmt: skip
    state.groups.add(old)
    recovery = Recovery(
        state, str, lambda p, a: ({}, ""), dict, lambda k: None, str, HostSnapshots(state, 0, 1, bool), str
    )
    recovery.on_replace(
        ReplacePlan(generation=3, role=Role.SURVIVOR, rank=0, moved_ranks=(1,), world_size=2, sources={})
    )
    state.groups.swap({"world": drained}, 2)  # Migration.switch, at the boundary the drain's vote agreed on
    t = torch.ones(2)
    began = time.monotonic()
    old.allreduce([t]).wait()
    results.put((time.monotonic() - began, old.paused, old.version, t.tolist(), recovery.planned))


def test_a_drains_switch_after_a_replacement_plan_keeps_the_groups_paused() -> None:
    waited, paused, version, t, planned = run_pair(_switched_after_plan)
    assert version == 2 and planned, "the drain's communicator is in, the plan waits for the recovery"
    assert paused and waited < 2.0, f"the switch un-paused the group: its allreduce waited {waited:.1f} s"
    assert t == [1.0, 1.0], "un-issued: the caller's inputs back"


def _left(rank: int, port: int, results: Any) -> None:
    """Rank 1 has handed its state over in a drain: its peer swapped the group out and never issues
    on it again, yet a broadcast still comes (Lightning's SIGTERM handler, when the agent stops the
    leaver's worker)."""
    group = world_group(rank, port)
    both = torch.ones(2)
    group.allreduce([both]).wait()
    if rank == 0:
        time.sleep(8)  # alive, its connections open, never issuing again
        return
    group.leave("rank 1 left the job at step 3")
    flag = torch.tensor([5.0])
    began = time.monotonic()
    group.broadcast([flag], dist.BroadcastOptions()).wait()
    group.monitored_barrier(TIMEOUT)
    results.put((time.monotonic() - began, flag.tolist(), group.left, group.failed, group.own_results, both.tolist()))


def test_a_rank_that_left_in_a_drain_issues_no_collective_its_peers_would_never_meet() -> None:
    waited, flag, left, failed, own, both = run_pair(_left)
    assert both == [2.0, 2.0], "the group worked until the leave"
    assert waited < 2.0, f"the broadcast after the leave waited {waited:.1f} s for a peer that never issues it"
    assert flag == [5.0] and left == "rank 1 left the job at step 3"
    # Not a fault: a framework's teardown on the leaver (Lightning's after-vote check) must see none.
    assert failed == "" and own == 0


def _after_the_loop(rank: int, port: int, results: Any) -> None:
    """Rank 0's training loop has ended; then a replacement of rank 1 is planned (it came after the
    last step's vote) and rank 1 dies. No vote is left to redo a collective that cannot run, so one
    must fail in the caller's hands instead of giving it its own inputs, as torch does under torchrun;
    a group made after the loop too. What each call did is reported, not asserted, in this process."""
    from rlaunch.plans import ReplacePlan, Role
    from rlaunch.runtime.grouptable import GroupTable
    from rlaunch.runtime.rankstate import RankState
    from rlaunch.runtime.recovery import Recovery
    from rlaunch.runtime.snapshots import HostSnapshots
    from rlaunch.runtime.vote import StepVote

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=TIMEOUT)
    world = SwitchableGroup("world", [0, 1], rank, backends.build(store, "g1/world/", rank, 2, TIMEOUT), 1)
    both = torch.ones(2)
    world.allreduce([both]).wait()  # the last step's gradients
    if rank == 1:
        return  # dies: its connections close
    state = RankState(
        rank=0, world_size=2, generation=1, standby=False, link=None, store=None, timeout=TIMEOUT,
        groups=GroupTable(None, TIMEOUT), vote=StepVote(2),
    )  # fmt: skip
    state.groups.add(world)
    solo = SwitchableGroup("solo", [0], 0, backends.build(store, "g1/solo/", 0, 1, TIMEOUT), 1)
    state.groups.add(solo)
    recovery = Recovery(
        state, str, lambda p, a: ({}, ""), dict, lambda k: None, str, HostSnapshots(state, 0, 1, bool), str
    )
    state.groups.stop_guarding("rank 0's training loop ended")  # Runtime._done_stepping
    evals = SwitchableGroup("evals", [0, 1], 0, world.comm, 1)  # made after the loop, on the same communicator
    state.groups.add(evals)
    time.sleep(1.0)  # rank 1 is gone

    def outcome(call: Callable[[], Any]) -> str:
        try:
            call()
        except RuntimeError as exc:  # torch's own error, or LostCollectiveError (a RuntimeError too)
            return f"{type(exc).__name__}: {exc}"
        return "returned"

    loss = torch.full((1,), 3.0)
    dead = outcome(lambda: evals.allreduce([loss]).wait())
    recovery.on_replace(
        ReplacePlan(generation=2, role=Role.SURVIVOR, rank=0, moved_ranks=(1,), world_size=2, sources={})
    )
    failed = outcome(lambda: world.allreduce([torch.ones(1)]).wait())
    paused = outcome(lambda: solo.allreduce([torch.ones(1)]).wait())
    barrier = outcome(lambda: solo.monitored_barrier(TIMEOUT))
    solo.paused, solo.held = False, True
    held = outcome(lambda: solo.allreduce([torch.ones(1)]).wait())
    solo.held = False
    healthy = outcome(lambda: solo.allreduce([torch.ones(1)]).wait())
    world.left = "rank 0 left the job at step 3"
    left = outcome(lambda: world.allreduce([torch.ones(1)]).wait())
    results.put((both.tolist(), dead, loss.tolist(), failed, paused, barrier, held, healthy, left, world.own_results))


def test_after_the_loop_a_collective_that_cannot_run_raises_instead_of_handing_back_own_values() -> None:
    both, dead, loss, failed, paused, barrier, held, healthy, left, own = run_pair(_after_the_loop)
    assert both == [2.0, 2.0], "guarded and working until the loop ended"
    assert dead != "returned", f"a sum over a dead peer returned {loss} (this rank's own) instead of failing"
    assert "LostCollectiveError" not in dead, "torch's own error, as under torchrun"
    assert failed.startswith(
        "LostCollectiveError: A collective (allreduce) on group world (rank 0 of it) was issued after rank 0's "
        "training loop ended, but the group failed (ranks [1] are being replaced"
    ), failed
    assert "--max-restarts" in failed
    assert "is paused for the replacement of a lost rank" in paused, paused
    assert "A collective (monitored_barrier) on group solo" in barrier, barrier
    assert "is held for a replacement that never received its state" in held, held
    assert healthy == "returned", "a group with every member there works after the loop"
    assert left == "returned", "a group the rank left in a drain returns at once, as before"
    assert own == 0, "nothing was handed back as a result"
