"""Host snapshots: a rank's copy taken, exchanged over a real gloo pair, verified and put back,
and the survivors' rule for the snapshot they roll back to."""

from __future__ import annotations

import copy as copy_module
import threading
import time
import types
from typing import Any

import pytest
import torch

from rlaunch.errors import UsageError
from rlaunch.runtime import hostcopy, rng, snapshots
from rlaunch.runtime.moves import Moves
from rlaunch.runtime.snapshots import Rollback, rollback
from rlaunch.runtime.transfer import TransferError, recv_state
from tests.unit.test_transfer import _objects, _pair, _state


def _train(objs: dict[str, Any], steps: int) -> None:
    model, opt, sched, scaler = objs["model"], objs["opt"], objs["sched"], objs["scaler"]
    for _ in range(steps):
        scaler.scale(model(torch.randn(16, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        torch.rand(3, generator=objs["noise"].generator)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_a_rank_rolls_back_to_its_copy_bit_identically_and_the_rng_with_it() -> None:
    objs = _objects(1)
    before = copy_module.deepcopy(_state(objs))  # an optimizer's state_dict() holds its live tensors
    state = rng.capture()
    copy = hostcopy.capture(objs, 40, state)
    hostcopy.seal(copy)
    expected = torch.rand(5)
    _train(objs, 3)  # the job goes on: every object changes
    assert not _same(_state(objs), before)
    hostcopy.restore(copy, objs, rank=0)
    assert _same(_state(objs), before), "parameters, moments, buffers, scheduler, scaler and generator"
    assert torch.equal(torch.rand(5), expected), "the global generator is back at the snapshot's start"
    # a second copy reuses the first's host buffers: the snapshots' host memory is allocated once
    again = hostcopy.capture(objs, 60, rng.capture(), copy)
    assert all(a is b for a, b in zip(again.tensors, copy.tensors, strict=True))


def test_a_copy_held_for_another_rank_lands_on_its_joiner_as_a_move() -> None:
    sender, joiner = _objects(1), _objects(0)
    copy = hostcopy.capture(sender, 40, rng.capture())
    ch0, ch1 = _pair()
    held: dict[str, Any] = {}

    def hold() -> None:
        held["copy"] = hostcopy.receive(ch1)

    t = threading.Thread(target=hold)
    t.start()
    hostcopy.seal(copy)
    hostcopy.send(ch0, copy)
    t.join(30)
    got = held["copy"]
    assert got.step == 40 and got.digests == copy.digests
    assert all(a is not b and torch.equal(a, b) for a, b in zip(got.tensors, copy.tensors, strict=True))
    # the holder sends it on to the lost rank's joiner, which reads it with recv_state
    expected = copy_module.deepcopy(_state(sender))
    _train(sender, 2)  # the sender's live state has moved on: only the held copy serves
    ch2, ch3 = _pair()
    t = threading.Thread(target=lambda: hostcopy.send(ch2, got, {}))
    t.start()
    landed = recv_state(ch3, joiner)
    t.join(30)
    assert landed.step == 40 and _same(_state(joiner), expected)


def test_a_paced_copy_crosses_in_pieces_no_faster_than_its_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostcopy, "PIECE_BYTES", 4096)  # the model's weights cross in several pieces
    objs = _objects(1, width=512)
    copy = hostcopy.capture(objs, 40, rng.capture())
    hostcopy.seal(copy)
    ch0, ch1 = _pair()
    held: dict[str, Any] = {}
    t = threading.Thread(target=lambda: held.update(copy=hostcopy.receive(ch1)))
    t.start()
    began = time.monotonic()
    hostcopy.send(ch0, copy, rate=sum(t.nbytes for t in copy.tensors) / 0.5)  # half a second at this rate
    t.join(30)
    assert time.monotonic() - began >= 0.45, "the sender waits between pieces"
    assert held["copy"].digests == copy.digests
    assert all(torch.equal(a, b) for a, b in zip(held["copy"].tensors, copy.tensors, strict=True))


def test_a_held_copy_that_differs_from_its_owners_digests_is_refused_where_it_is_used() -> None:
    """A received copy is not digested as it lands (most are never used): it keeps its owner's
    digests and is checked against them when it is used, and its joiner checks it again, end to end."""
    owner = _objects(1)
    copy = hostcopy.capture(owner, 40, rng.capture())
    got = _sealed_and_sent(copy)
    assert not got.checked and got.digests == copy.digests, "the owner's digests, taken with the copy"
    got.tensors[0].view(-1).view(torch.int32)[0] ^= 1 << 3  # a bit flips in the holder's memory
    with pytest.raises(TransferError, match="rank 1's copy of rank 0's snapshot of step 40 holds 'model'"):
        hostcopy.verify(got, "rank 1's copy of rank 0's snapshot")
    # the survivors hear it in the holder's report and refuse the rollback, naming the copy
    keeper = _keeper(1, None, 40)
    keeper.held = got
    keeper.committed = 40
    keeper.own.digests, keeper.own.checked = dict(copy.digests), True  # type: ignore[union-attr]  # sealed
    report = keeper.report(lost=[0])
    assert "holds 'model' with digest" in report["held_refused"]
    assert keeper.report(lost=[])["held_refused"] == "", "only a copy about to be used is checked"
    found = rollback([{"rank": 1, "snapshot": report}], [0], lambda r: snapshots.buddy(r, 2, 1))
    assert isinstance(found, str) and found.startswith("rank 1's copy of rank 0's snapshot failed its check:")
    with pytest.raises(TransferError, match="holds 'model' with digest"):
        keeper.send_to(None, 0, 40, {})
    # were it sent anyway, its joiner would refuse it against the owner's digests
    ch2, ch3 = _pair()
    t = threading.Thread(target=lambda: hostcopy.send(ch2, got, {}))
    t.start()
    with pytest.raises(TransferError, match="'model' that landed on this joiner has digest"):
        recv_state(ch3, _objects(0))
    t.join(30)
    # an own copy that changed after it was sealed is refused where it is put back
    copy.tensors[0].view(-1).view(torch.int32)[0] ^= 1 << 3
    with pytest.raises(TransferError, match="after rolling back to the snapshot of step 40, 'model'"):
        hostcopy.restore(copy, _objects(0), rank=3)


def test_an_intact_held_copy_passes_its_check_once_and_lands_on_its_joiner() -> None:
    owner = _objects(1)
    copy = hostcopy.capture(owner, 60, rng.capture())
    keeper = _keeper(1, None, 60)
    keeper.held = _sealed_and_sent(copy)
    assert keeper.report(lost=[0])["held_refused"] == "" and keeper.held.checked
    expected = copy_module.deepcopy(_state(owner))
    joiner = _objects(0)
    ch2, ch3 = _pair()
    t = threading.Thread(target=lambda: keeper.send_to(ch2, 0, 60, {}))
    t.start()
    assert recv_state(ch3, joiner).step == 60 and _same(_state(joiner), expected)
    t.join(30)


def _report(rank: int, committed: int, own: int, held: int, source: int) -> dict[str, Any]:
    return {"rank": rank, "snapshot": {"committed": committed, "own": own, "held": held, "source": source}}


def _holder(rank: int) -> int:
    return snapshots.buddy(rank, 4, 2)


def test_the_survivors_roll_back_to_the_newest_committed_snapshot_that_every_survivor_holds() -> None:
    assert [snapshots.buddy(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
    assert [snapshots.source(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
    assert [snapshots.buddy(r, 3, 1) for r in range(3)] == [1, 2, 0]
    # node b (ranks 2, 3) is lost; ranks 0 and 1 hold their copies; one of them saw step 40 committed
    reports = [_report(0, 40, 40, 40, 2), _report(1, 20, 40, 40, 3)]
    assert rollback(reports, [2, 3], _holder) == Rollback(40, {2: 0, 3: 1})
    # rank 1 had begun the next snapshot: its own copy of step 40 is overwritten
    reports = [_report(0, 40, 40, 40, 2), _report(1, 40, 60, -1, 3)]
    assert "rank 1 had begun the snapshot of step 60" in str(rollback(reports, [2, 3], _holder))
    # the holder's copy of the lost rank did not land whole
    reports = [_report(0, 40, 40, -1, 2), _report(1, 40, 40, 40, 3)]
    assert "rank 0 does not hold rank 2's snapshot of step 40" in str(rollback(reports, [2, 3], _holder))
    assert "no host snapshot had been committed" in str(rollback([_report(0, -1, 20, 20, 2)], [2, 3], _holder))


def test_a_rank_lost_with_the_rank_that_holds_its_snapshot_cannot_roll_back() -> None:
    def holder(rank: int) -> int:
        return snapshots.buddy(rank, 3, 1)

    found = rollback([_report(2, 40, 40, 40, 1)], [0, 1], holder)
    assert found == "rank 0 and rank 1, which held its snapshot, were lost together"


def test_the_interval_reads_steps_auto_or_off_and_refuses_anything_else() -> None:
    assert snapshots.interval("auto") == (snapshots.AUTO_EVERY, True) and snapshots.interval("7") == (7, False)
    assert snapshots.interval("0") == (0, False)
    with pytest.raises(UsageError, match="RLAUNCH_SNAPSHOT_EVERY='-3' is not valid"):
        snapshots.interval("-3")
    assert snapshots.rate("0") == 0 and snapshots.rate("250") == 250e6
    for bad in ("fast", "-1", "nan", "inf"):
        with pytest.raises(UsageError, match=f"RLAUNCH_SNAPSHOT_MBPS='{bad}' is not valid"):
            snapshots.rate(bad)


def _sealed_and_sent(copy: hostcopy.HostCopy) -> hostcopy.HostCopy:
    """``copy`` sealed by its owner and sent over a gloo pair: what its buddy holds."""
    hostcopy.seal(copy)
    ch0, ch1 = _pair()
    held: dict[str, Any] = {}
    t = threading.Thread(target=lambda: held.update(copy=hostcopy.receive(ch1)))
    t.start()
    hostcopy.send(ch0, copy)
    t.join(30)
    return held["copy"]


def _keeper(
    rank: int, held_step: int | None, pending: int, needs: bool = True, every: int = 20, auto: bool = False,
    median_step: float = 1.0,
) -> snapshots.HostSnapshots:  # fmt: skip
    state = types.SimpleNamespace(
        rank=rank, world_size=2, link=None, snapshots_wanted=False, generation=1, step=max(pending, 0), standby=False
    )
    keeper = snapshots.HostSnapshots(state, every, 1, lambda: needs, 0.0, auto)  # type: ignore[arg-type]
    keeper._quiet.extend([median_step] * 3)  # steps no snapshot overlapped
    blob = torch.empty(0, dtype=torch.uint8)
    keeper.pending = pending
    keeper.own = hostcopy.HostCopy({"step": pending}, blob, [])
    keeper.held = hostcopy.HostCopy({"step": held_step}, blob, []) if held_step is not None else None
    return keeper


def _vote(*keepers: snapshots.HostSnapshots) -> list[float]:
    terms = [k.terms() for k in keepers]
    summed = [sum(t[i] for t in terms) for i in range(len(terms[0]))]
    for k in keepers:
        k.commit(summed)
    return summed


def test_a_step_whose_previous_exchange_still_runs_takes_no_snapshot_and_says_so() -> None:
    """take() returns False (so a move's first step marks no snapshot) and its vote holds nothing of this step."""
    keeper = _keeper(0, 40, 40)
    keeper._gen = 1  # this generation took one already: no wait for the exchange
    release = threading.Event()
    keeper._thread = threading.Thread(target=release.wait, daemon=True)
    keeper._thread.start()
    try:
        assert keeper.take(60) is False
        assert keeper.pending == 60 and keeper.own is not None and keeper.own.step == 40 and not keeper.holds()
    finally:
        release.set()
        keeper._thread.join()


def test_a_snapshot_commits_only_when_every_rank_holds_the_same_one() -> None:
    a, b = _keeper(0, 40, 40), _keeper(1, None, 40)  # rank 1's copy of rank 0 has not landed
    _vote(a, b)
    assert a.committed == b.committed == -1
    # rank 1 skipped snapshot 60 (its exchange of 40 still ran): its 40 must not pass for 60
    a, b = _keeper(0, 60, 60), _keeper(1, 40, 40)
    b.pending = 60
    _vote(a, b)
    assert a.committed == b.committed == -1
    a, b = _keeper(0, 60, 60), _keeper(1, 60, 60)
    _vote(a, b)
    assert a.committed == b.committed == 60


def test_ranks_that_follow_different_intervals_commit_nothing_even_when_the_intervals_sum_alike() -> None:
    # 20 + 60 + 40 = 3 x 40: rank 2 alone would read its own interval in the sum and go on alone
    keepers = [_keeper(r, 40, 40, every=every) for r, every in enumerate((20, 60, 40))]
    for k in keepers:
        k._s.world_size = 3
    _vote(*keepers)
    assert [k.committed for k in keepers] == [-1, -1, -1]
    assert [k._broken for k in keepers] == [1, 1, 1], "every rank stops taking them in this generation"
    keepers = [_keeper(r, 40, 40, every=40) for r in range(3)]
    for k in keepers:
        k._s.world_size = 3
    _vote(*keepers)
    assert [k.committed for k in keepers] == [40, 40, 40]


def test_the_job_takes_snapshots_once_any_rank_said_no_replica_serves_it() -> None:
    a, b = _keeper(0, None, -1, needs=False), _keeper(1, None, -1, needs=True)
    _vote(a, b)
    assert a._s.snapshots_wanted and b._s.snapshots_wanted, "both ranks take them: the same schedule everywhere"
    a, b = _keeper(0, None, -1, needs=False), _keeper(1, None, -1, needs=False)
    _vote(a, b)
    assert not a._s.snapshots_wanted and not b._s.snapshots_wanted


def test_auto_takes_the_smallest_multiple_of_20_steps_whose_snapshots_cost_at_most_1_percent() -> None:
    choose = snapshots.choose
    assert choose(20, 0, 0, 1) == 20, "before any cost was measured: 20 steps"
    assert choose(20, 2 * 100, 2 * 1000, 1) == 20, "0.1 s on a 1 s step: 10 steps would do; 20 is the least"
    assert choose(20, 2 * 300, 2 * 1000, 1) == 40, "0.3 s on a 1 s step: 30 steps, on the grid 40"
    assert choose(20, 2 * 300, 2 * 1250, 2) == 40, "0.3 s on a 1.25 s step: 24 steps, on the grid 40"
    assert choose(20, 60, 100, 1) == 60, "60 % of a step: 60 steps"
    assert choose(20, 2 * 5000, 2 * 1000, 1) == snapshots.AUTO_MAX, "never more than AUTO_MAX: the redo is bounded"
    assert choose(20, 2, 2000, 3) == 40, "3 steps from start to commit: a fault restarts 1 step in 10 at most"
    # the noise of the measurement does not move it at every commit: it grows at once, shrinks to half or less
    assert choose(60, 2 * 300, 2 * 1000, 1) == 60, "40 would do, 60 is kept"
    assert choose(80, 2 * 300, 2 * 1000, 1) == 40
    assert choose(40, 2 * 450, 2 * 1000, 1) == 60
    # whole milliseconds: the same sums give the same interval on every rank, whatever their order
    assert choose(20, 3 * 333, 3 * 1000, 1) == choose(20, 333 + 333 + 333, 1000 + 1000 + 1000, 1) == 40


def test_a_snapshot_costs_the_excess_of_the_steps_from_its_start_to_its_commit() -> None:
    keeper = _keeper(0, None, -1, median_step=1.0)
    keeper._s.snapshots_wanted = True
    keeper.stepped(1.0)  # no snapshot under way: nothing measured
    # the generation's first snapshot also builds its pairs: it is not measured
    keeper._window, keeper._measured, keeper._closing = [], False, False
    keeper.stepped(3.0)
    keeper._closing = True
    keeper.stepped(2.0)
    assert keeper.cost() == 0.0 and keeper._window is None
    assert len(keeper._quiet) == 4 and keeper.step_s() == 1.0, "a snapshot's steps are not in the baseline"
    # a later one: its copy and its exchange slowed two steps by 0.2 s and 0.1 s
    keeper.last = {"copy_s": 0.02}
    keeper._window, keeper._measured, keeper._closing = [], True, False
    keeper.stepped(1.2)
    keeper._closing = True  # its commit came in the next step's vote
    keeper.stepped(1.1)
    assert keeper.cost() == pytest.approx(0.3) and keeper.last["cost_s"] == pytest.approx(0.3)
    # steps that ran faster than the median never make it cost less than its copy on the training thread
    keeper._window, keeper._measured, keeper._closing = [], True, True
    keeper.stepped(0.9)
    assert sorted(keeper._costs) == [pytest.approx(0.02), pytest.approx(0.3)]
    terms = keeper.terms()
    assert terms[3:] == [20.0, 300.0, 1000.0, 400.0], "the interval it follows, its median cost and step in ms, 20²"


def test_auto_moves_every_rank_to_the_same_interval_at_the_same_commit() -> None:
    a = _keeper(0, 40, 40, auto=True, median_step=1.0)
    b = _keeper(1, 40, 40, auto=True, median_step=1.25)
    a._s.step = b._s.step = 41  # committed in the vote of step 41: a window of 2 steps
    a._gen = b._gen = 1  # this generation took snapshots already
    a._measured = b._measured = True  # not the generation's first
    a._costs.extend([0.3, 0.5, 0.4])
    b._costs.append(0.2)
    summed = _vote(a, b)
    assert summed[3:] == [40.0, 600.0, 2250.0, 800.0]
    assert a.committed == b.committed == 40
    # 0.6 s over 2.25 s of steps: 27 steps keep it within 1 %, 40 on the grid; both ranks read the same sums
    assert a.every == b.every == 40 and a._s.snapshot_every == b._s.snapshot_every == 40
    assert [a.due(s) for s in (60, 80)] == [b.due(s) for s in (60, 80)] == [False, True]
    # a generation's first snapshot (after a move) also builds its pairs: its long window moves nothing
    a, b = _keeper(0, 100, 100, auto=True), _keeper(1, 100, 100, auto=True)
    a._s.step = b._s.step = 104  # five steps from its start to its commit
    _vote(a, b)
    assert a.committed == 100 and a.every == b.every == 20
    for k in (a, b):  # the next snapshot, of step 120, held whole
        k.pending = 120
        k.own.header["step"] = k.held.header["step"] = 120  # type: ignore[union-attr]
        k._measured = True
    a._s.step = b._s.step = 122  # a later one, three steps: one fault in ten would restart at 30 steps
    _vote(a, b)
    assert a.committed == 120 and a.every == b.every == 40


def test_ranks_that_follow_other_intervals_commit_nothing_and_take_no_more_snapshots() -> None:
    a, b = _keeper(0, 40, 40, every=20), _keeper(1, 40, 40, every=40)  # another RLAUNCH_SNAPSHOT_EVERY on b's node
    for k in (a, b):
        k._s.snapshots_wanted = True
    _vote(a, b)
    assert a.committed == b.committed == -1
    assert not a.due(60) and not b.due(80), "the generation takes no more: they would not meet"


def test_a_joiner_learns_the_interval_the_job_follows_with_its_state() -> None:
    def moves(every: int) -> Moves:
        state = types.SimpleNamespace(
            snapshots_wanted=True, snapshot_every=every, declared=None,
            vote=types.SimpleNamespace(knowledge=lambda: {}, learn=lambda known: None),
        )  # fmt: skip
        verifier = types.SimpleNamespace(knowledge=lambda: {}, learn=lambda known: None)
        return Moves(state, types.SimpleNamespace(verifier=verifier, partitions={}), lambda: every)  # type: ignore[arg-type]

    survivor, joiner = moves(60), moves(20)
    joiner._s.snapshots_wanted = False
    joiner.learn(survivor.knowledge())
    assert joiner._s.snapshot_every == 60 and joiner._s.snapshots_wanted
    off = moves(0)  # snapshots off on this rank: it stays off
    off.learn(survivor.knowledge())
    assert off._s.snapshot_every == 0


def test_a_generations_first_snapshot_moves_no_rank_to_another_interval() -> None:
    """After a rollback, the survivors retake the snapshot they rolled back to, which they had
    committed already; the joiner (and a survivor that had not yet read that commit) commits it
    alone. Were that lone commit to choose auto's interval, from a window of 0 steps, that rank
    alone would move to another interval, and the next vote would stop every rank's snapshots."""
    survivor, joiner = _keeper(0, 40, 40, auto=True, every=40), _keeper(1, 40, 40, auto=True, every=40)
    survivor.committed = 40  # it committed 40 before the fault; the joiner knows of no commit
    for k in (survivor, joiner):
        k._s.snapshots_wanted = True
        k._s.step = 40
        k._s.snapshot_every = 40  # what the job follows: set by a window of 4 steps at 40's commit
        k._costs.append(0.01)  # cheap snapshots: a window of 0 steps would want 20 steps
        k._gen, k._measured = 1, False  # this generation's first snapshot (it built the pairs)
    _vote(survivor, joiner)
    assert survivor.committed == joiner.committed == 40
    assert survivor.every == joiner.every == 40, "no rank chose alone"
    survivor._s.step = joiner._s.step = 41
    _vote(survivor, joiner)  # the next vote: every rank still follows the same interval
    assert survivor.due(80) and joiner.due(80) and not survivor.due(60) and not joiner.due(60)


def test_every_ranks_snapshot_pairs_are_built_within_three_rounds_at_any_world_size() -> None:
    """Each rank builds its two pairs one at a time, in pair_order: simulated round by round (a pair is
    built once it is next on both its ranks), every world and ranks-per-machine up to 40 ends within 3
    rounds, and 4,096 ranks too; in sender order they were a chain as long as the world."""

    def rounds(world: int, per_node: int, order: Any) -> int:
        orders = {r: order(r, world, per_node) for r in range(world)}
        assert all(sorted(o) == sorted({r, snapshots.source(r, world, per_node)}) for r, o in orders.items())
        at, built, depth = dict.fromkeys(range(world), 0), 0, 0
        while built < world:  # one pair per sender
            ready = [
                j for j in range(world)
                if at[j] < len(orders[j]) and orders[j][at[j]] == j
                and orders[snapshots.buddy(j, world, per_node)][at[snapshots.buddy(j, world, per_node)]] == j
            ]  # fmt: skip
            assert ready, f"world {world}, {per_node} per machine: no pair can be built"
            for j in ready:
                at[j] += 1
                at[snapshots.buddy(j, world, per_node)] += 1
            built += len(ready)
            depth += 1
        return depth

    assert max(rounds(w, p, snapshots.pair_order) for w in range(2, 41) for p in range(1, w)) == 3
    assert rounds(4096, 8, snapshots.pair_order) == 2 and rounds(4095, 1, snapshots.pair_order) == 3
    assert rounds(64, 1, lambda r, w, p: sorted({r, snapshots.source(r, w, p)})) == 64, "the chain it replaced"
