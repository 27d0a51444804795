"""A drain's handover of host snapshots: every rank decides alike from the agree vote to keep the
committed snapshot, the leaver sends its two copies after the state on the move's channel (a real
gloo pair), the joiner holds them bit-identically and can roll back to them, and a handover that
breaks or never ends leaves the job taking a new snapshot, or restarting, never a wrong rollback."""

from __future__ import annotations

import copy as copy_module
import datetime
import os
import threading
import time
import types
from typing import Any

import pytest
import torch
from torch.distributed import HashStore

from rlaunch.runtime import backend as backends
from rlaunch.runtime import handover, hostcopy, rng, snapshots
from rlaunch.runtime.backend import Communicators
from rlaunch.runtime.snapshots import HostSnapshots, Rollback, rollback
from rlaunch.runtime.transfer import receive_state, send_state
from tests.unit.test_snapshots import _keeper, _same, _train, _vote
from tests.unit.test_transfer import _objects, _state

TIMEOUT = datetime.timedelta(seconds=20)


def _pair(cuttable: int, timeout: datetime.timedelta = TIMEOUT) -> tuple[Any, Any]:
    """A move's channel, both sides in this process; side ``cuttable`` is built by the process's layer
    (what ``backends.cut`` reaches), the other by a layer of its own (gloo builds are serialized)."""
    layers = {cuttable: backends.current(), 1 - cuttable: Communicators()}
    store, out = HashStore(), {}

    def build(side: int) -> None:
        out[side] = layers[side].build(store, "g2/transfer/1/", side, 2, timeout)

    threads = [threading.Thread(target=build, args=(side,)) for side in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out[0], out[1]


def _joiner(generation: int = 2, step: int = 46) -> HostSnapshots:
    state = types.SimpleNamespace(
        rank=1, world_size=2, link=None, snapshots_wanted=True, generation=generation, step=step, standby=False
    )
    return HostSnapshots(state, 20, 1, lambda: True)  # type: ignore[arg-type]


def _sealed(objs: dict[str, Any], step: int) -> hostcopy.HostCopy:
    copy = hostcopy.capture(objs, step, rng.capture())
    hostcopy.seal(copy)
    return copy


def test_every_rank_keeps_the_committed_snapshot_only_when_the_agree_vote_found_it_whole() -> None:
    a, b = _keeper(0, 40, 40, auto=True), _keeper(1, 40, 40, auto=True)
    a._s.step = b._s.step = 45
    _vote(a, b)
    assert a.committed == b.committed == 40 and a.whole_at == b.whole_at == 45
    assert a.keeps(46) and b.keeps(46), "every rank holds 40 whole: the drain at 46 keeps it"
    assert not a.keeps(60), "a scheduled snapshot's step takes it as usual"
    assert a.keeps(59), "a scheduled snapshot while the copies arrive ends the wait (see below), not the keep"
    a._s.step = b._s.step = 46  # a later vote: the drain agreed at 45 switches at 46 only
    assert not a.keeps(47)
    # one rank's exchange still runs (it holds nothing whole): no rank keeps
    a, b = _keeper(0, 40, 40), _keeper(1, None, 40)
    a.committed = b.committed = 40
    _vote(a, b)
    assert a.whole_at == b.whole_at == -1 and not a.keeps(a._s.step + 1) and not b.keeps(b._s.step + 1)


def test_a_kept_snapshot_is_not_retaken_and_the_joiner_votes_nothing_until_its_copies_land() -> None:
    survivor = _keeper(0, 40, 40, auto=True)
    survivor.committed, survivor._s.snapshots_wanted = 40, True
    survivor._s.generation, survivor._gen = 2, 1
    survivor.switched(3, 46, keep=True)  # the switch to generation 3, before the rank's generation is set
    survivor._s.generation = 3
    joiner = _joiner(generation=3)
    joiner.auto = True
    joiner.expect(3, 40, 46)
    for k in (survivor, joiner):
        assert k.pending == k.committed == 40 and k.kept == 40
        assert not k.due(46) and not k.due(59) and k.due(60), "no snapshot at the first step, the schedule stays"
    every = survivor.every
    survivor._s.step = joiner._s.step = 46
    _vote(survivor, joiner)
    assert joiner.terms()[0] == 0 and survivor.whole_at == joiner.whole_at == -1
    assert survivor.committed == joiner.committed == 40 and survivor.every == joiner.every == every
    assert survivor.kept == joiner.kept == 40, "the contract still carries the kept snapshot"
    blob = torch.empty(0, dtype=torch.uint8)
    joiner.own, joiner.held = hostcopy.HostCopy({"step": 40}, blob, []), hostcopy.HostCopy({"step": 40}, blob, [])
    survivor._s.step = joiner._s.step = 47
    _vote(survivor, joiner)
    assert survivor.kept == joiner.kept == -1 and survivor.whole_at == joiner.whole_at == 47
    assert survivor.committed == joiner.committed == 40 and not survivor.due(48) and not joiner.due(48)


def test_a_drain_that_does_not_keep_ends_the_wait_of_an_earlier_one() -> None:
    """A second drain agreed before the first one's joiner held its copies keeps nothing: every rank
    of it (the first joiner too) stops waiting, so the contract's kept is -1 on all, as on its joiner."""
    survivor, first = _keeper(0, 40, 40), _joiner(generation=3)
    survivor.committed, survivor._s.snapshots_wanted = 40, True
    survivor._s.generation = 2
    survivor.switched(3, 46, keep=True)
    first.expect(3, 40, 46)
    for k in (survivor, first):
        k._s.generation = 3
        k.switched(4, 48, keep=False)
        k._s.generation = 4
        assert k.kept == -1 and k.due(48), "the second drain's first step takes a new snapshot"


def test_a_scheduled_snapshot_while_the_copies_arrive_ends_the_wait_on_every_rank() -> None:
    """Every rank takes it (due() is alike: no exchange runs in the window), so the wait ends at that
    step on every rank alike, and the joiner cuts its receive instead of skipping the snapshot."""
    _, ch1 = _pair(cuttable=1)
    survivor = _keeper(0, 40, 40)
    survivor.committed, survivor._s.snapshots_wanted = 40, True
    survivor._s.generation = 2
    survivor.switched(3, 57, keep=True)
    survivor._s.generation = 3
    joiner = _joiner(generation=3)
    joiner.expect(3, 40, 57)
    joiner.receive(ch1)  # the leaver is slow: nothing arrives before step 60
    for keeper, objs in ((survivor, _objects(0)), (joiner, _objects(1))):
        keeper._s.tracked, keeper._s.store = objs, None  # no store: its exchange fails, after the start tested here
        assert keeper.due(60) and keeper.kept == 40
        assert keeper.take(60), "every rank takes it, the joiner too"
        assert keeper.kept == -1 and keeper.pending == 60 and keeper.own is not None and keeper.own.step == 60
        assert keeper._thread is not None
        keeper._thread.join(10)
    assert joiner._handover is not None and joiner._handover.failed, "the receive was cut"


def test_a_handover_that_does_not_end_within_its_steps_makes_every_rank_take_a_new_snapshot() -> None:
    survivor = _keeper(0, 40, 40)
    survivor.committed = 40
    survivor._s.generation = 2
    survivor.switched(3, 46, keep=True)
    survivor._s.generation = 3
    joiner = _joiner(generation=3)
    joiner.expect(3, 40, 46)
    for step in range(46, 46 + snapshots.HANDOVER_STEPS):
        survivor._s.step = joiner._s.step = step
        _vote(survivor, joiner)
        assert not survivor.due(step + 1) and not joiner.due(step + 1), step
    survivor._s.step = joiner._s.step = 46 + snapshots.HANDOVER_STEPS
    _vote(survivor, joiner)
    assert survivor.due(52) and joiner.due(52) and survivor.kept == joiner.kept == -1


def test_the_leaver_hands_its_copies_to_the_joiner_after_the_state_and_the_joiner_can_roll_back_to_them() -> None:
    leaver, joining = _objects(1), _objects(0)
    own = _sealed(leaver, 40)  # the leaver's own copy of rank 1 at the kept snapshot
    at_40 = copy_module.deepcopy(_state(leaver))
    held = _sealed(_objects(2), 40)  # its copy of rank 0's
    _train(leaver, 3)  # the job ran on to the drain
    ch0, ch1 = _pair(cuttable=1)

    def leave() -> None:  # as Migration.switch: the state, then the copies
        send_state(ch0, leaver, 43, rng.capture(), {handover.KEY: 40})
        handover.send(ch0, own, held, rank=1)

    sender = threading.Thread(target=leave)
    sender.start()
    known: dict[str, Any] = {}
    landing = receive_state(ch1, joining, rank=1, learn=known.update)
    landing.finish()
    assert known[handover.KEY] == 40
    keeper = _joiner()
    keeper.expect(2, 40, 43)
    keeper.receive(ch1)
    assert keeper._thread is not None
    time.sleep(0.3)
    assert keeper._thread.is_alive() and not keeper.holds(), "nothing is received beside the first step"
    gloo_threads = backends.current().transport_threads(ch1)
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert gloo_threads and {os.getpriority(os.PRIO_PROCESS, t) for t in gloo_threads} == {caller} != {19}
    keeper.first_step_ended()
    keeper._thread.join(30)
    sender.join(30)
    assert {os.getpriority(os.PRIO_PROCESS, t) for t in gloo_threads} == {19}, "the channel's reads yield to training"
    assert keeper.holds(), "both copies landed: the joiner's vote holds snapshot 40"
    assert keeper.own is not None and keeper.held is not None
    assert keeper.own.digests == own.digests and keeper.held.digests == held.digests
    assert all(torch.equal(a, b) for a, b in zip(keeper.own.tensors, own.tensors, strict=True))
    keeper.own.tensors[0].view(-1).view(torch.int32)[0] ^= 1 << 5  # a bit flips in the joiner's memory
    report = keeper.report(lost=[0])
    assert report["own"] == -1 and "holds 'model' with digest" in report["handover"], report
    keeper.own.tensors[0].view(-1).view(torch.int32)[0] ^= 1 << 5
    report = keeper.report(lost=[0])
    assert report["own"] == report["held"] == 40 and report["handover"] == "" and keeper.own.checked
    keeper._s.tracked = joining
    keeper.restore(40)  # a fault after the drain: the joiner rolls back to what the leaver held
    assert _same(_state(joining), at_40), "the joiner's state is the leaver's at step 40, bit for bit"


def test_a_first_step_longer_than_half_the_leavers_wait_has_the_copies_arrive_beside_it() -> None:
    """An evaluation or a checkpoint in the first step: the receive does not wait for its end past
    half the leaver's wait, so the copies still arrive before the leaver gives up."""
    own, held = _sealed(_objects(1), 40), _sealed(_objects(2), 40)
    ch0, ch1 = _pair(cuttable=1)
    keeper = _joiner()
    keeper.expect(2, 40, 43)
    previous, handover.WAIT_S = handover.WAIT_S, 0.6
    try:
        sender = threading.Thread(target=handover.send, args=(ch0, own, held, 1))
        sender.start()
        began = time.monotonic()
        keeper.receive(ch1)  # and the first step never ends here
        assert keeper._thread is not None
        keeper._thread.join(10)
        sender.join(10)
    finally:
        handover.WAIT_S = previous
    assert time.monotonic() - began >= 0.3, "it waited for the first step first"
    assert keeper.holds() and keeper.own is not None and keeper.own.digests == own.digests


def test_a_handed_over_copy_that_differs_from_its_digests_is_refused_before_any_rollback() -> None:
    keeper = _joiner()
    keeper.expect(2, 40, 43)
    keeper.own, keeper.held = _sealed(_objects(1), 40), _sealed(_objects(2), 40)
    keeper.own.checked = False  # as received
    keeper.own.tensors[0].view(-1).view(torch.int32)[0] ^= 1 << 5
    report = keeper.report()
    assert report["own"] == -1 and "holds 'model' with digest" in report["handover"]
    survivor = {"committed": 40, "own": 40, "held": 40, "held_refused": "", "source": 1, "handover": ""}
    found = rollback([{"rank": 0, "snapshot": survivor}, {"rank": 1, "snapshot": report}], [2], lambda r: 0)
    assert isinstance(found, str) and found.startswith("rank 1 did not hold its copies of snapshot 40 from the drained")


def test_a_fault_during_the_handover_restarts_the_job_unless_the_joiner_itself_is_lost() -> None:
    _, ch1 = _pair(cuttable=1)
    keeper = _joiner()
    keeper.expect(2, 40, 43)
    keeper.receive(ch1)  # nothing comes: the leaver is slow
    keeper.stop()  # a fault: recovery ends the handover before the rank reports
    assert keeper._thread is None or not keeper._thread.is_alive()
    joiner = keeper.report()
    assert joiner["own"] == joiner["held"] == -1 and joiner["handover"] and joiner["committed"] == 40
    # 3 ranks, one per machine: 0 holds 2's copy, 1 (the joiner) 0's, 2 1's. Rank 2 is lost: the
    # joiner has no copy of its own to roll back to, so no rank rolls back (the job restarts)
    survivor = {"committed": 40, "own": 40, "held": 40, "held_refused": "", "source": 2, "handover": ""}
    reports = [{"rank": 0, "snapshot": survivor}, {"rank": 1, "snapshot": joiner}]
    found = rollback(reports, [2], lambda r: (r + 1) % 3)
    assert found == "rank 1 did not hold its copies of snapshot 40 from the drained rank it replaced (" + (
        joiner["handover"] + ")"
    )
    # the joiner itself lost mid-handover: rank 2 holds the copy of rank 1 the leaver had, the rollback is right
    survivor2 = {**survivor, "source": 1}
    found = rollback([{"rank": 0, "snapshot": survivor}, {"rank": 2, "snapshot": survivor2}], [1], lambda r: r + 1)
    assert found == Rollback(40, {1: 2})


def test_the_leaver_leaves_when_its_joiner_never_takes_the_copies(caplog: pytest.LogCaptureFixture) -> None:
    ch0, _ = _pair(cuttable=0, timeout=datetime.timedelta(seconds=300))  # gloo's own timeout ends nothing here
    big = hostcopy.HostCopy({"step": 40}, torch.empty(0, dtype=torch.uint8), [torch.zeros(16 << 20)])
    previous, handover.WAIT_S = handover.WAIT_S, 0.5  # and 1.3 s for the 134 MB at the slowest rate waited for
    try:
        done = threading.Event()

        def leave() -> None:
            handover.send(ch0, big, big, rank=1)
            done.set()

        began = time.monotonic()
        threading.Thread(target=leave, daemon=True).start()
        assert done.wait(10), "the timer cut the channel: the leaver goes on to leave"
        assert time.monotonic() - began >= 1.8, "it waited for the joiner first"
        assert "the host snapshot of step 40 was not handed to the joiner" in caplog.text
    finally:
        handover.WAIT_S = previous


def test_a_handover_cut_before_its_state_landed_never_starts_and_says_so() -> None:
    """A fault before the joiner's state landed: recovery cuts the handover first, and the landing
    that comes after it does not start the receive."""
    _, ch1 = _pair(cuttable=1)
    keeper = _joiner()
    keeper.expect(2, 40, 43)
    assert keeper.report()["handover"] == "they were still arriving"
    keeper.stop()
    keeper.receive(ch1)
    assert keeper._thread is None and keeper.report()["handover"] == "it was cut before it began"
