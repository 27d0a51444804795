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


def test_a_copy_that_differs_from_its_digests_is_not_held() -> None:
    copy = hostcopy.capture(_objects(1), 40, rng.capture())
    hostcopy.seal(copy)
    copy.tensors[0].view(-1).view(torch.int32)[0] ^= 1 << 3  # a bit flips in host memory after sealing
    ch0, ch1 = _pair()
    t = threading.Thread(target=lambda: hostcopy.send(ch0, copy))
    t.start()
    with pytest.raises(TransferError, match="snapshot of step 40 landed with 'model'"):
        hostcopy.receive(ch1)
    t.join(30)
    objs = _objects(0)
    with pytest.raises(TransferError, match="after rolling back to the snapshot of step 40, 'model'"):
        hostcopy.restore(copy, objs, rank=3)


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
    assert snapshots.interval("auto") == snapshots.AUTO_EVERY and snapshots.interval("7") == 7
    assert snapshots.interval("0") == 0
    with pytest.raises(UsageError, match="RLAUNCH_SNAPSHOT_EVERY='-3' is not valid"):
        snapshots.interval("-3")
    assert snapshots.rate("0") == 0 and snapshots.rate("250") == 250e6
    for bad in ("fast", "-1", "nan", "inf"):
        with pytest.raises(UsageError, match=f"RLAUNCH_SNAPSHOT_MBPS='{bad}' is not valid"):
            snapshots.rate(bad)


def _keeper(rank: int, held_step: int | None, pending: int, needs: bool = True) -> snapshots.HostSnapshots:
    state = types.SimpleNamespace(rank=rank, world_size=2, link=None, snapshots_wanted=False, generation=1)
    keeper = snapshots.HostSnapshots(state, 20, 1, lambda: needs)  # type: ignore[arg-type]
    blob = torch.empty(0, dtype=torch.uint8)
    keeper.pending = pending
    keeper.own = hostcopy.HostCopy({"step": pending}, blob, [])
    keeper.held = hostcopy.HostCopy({"step": held_step}, blob, []) if held_step is not None else None
    return keeper


def _vote(*keepers: snapshots.HostSnapshots) -> None:
    summed = [sum(k.terms()[i] for k in keepers) for i in range(3)]
    for k in keepers:
        k.commit(summed)


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


def test_the_job_takes_snapshots_once_any_rank_said_no_replica_serves_it() -> None:
    a, b = _keeper(0, None, -1, needs=False), _keeper(1, None, -1, needs=True)
    _vote(a, b)
    assert a._s.snapshots_wanted and b._s.snapshots_wanted, "both ranks take them: the same schedule everywhere"
    a, b = _keeper(0, None, -1, needs=False), _keeper(1, None, -1, needs=False)
    _vote(a, b)
    assert not a._s.snapshots_wanted and not b._s.snapshots_wanted
