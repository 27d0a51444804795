"""Each group counts the collectives that handed their caller its own inputs instead of a result.

Two real gloo processes. A collective that completes counts nothing. When the peer is gone, the
collective that finds it out hands back the caller's inputs and counts, and so does every later
one of the failed group (un-issued), except a barrier (no result) and those issued inside
``alike()`` (inputs the same on every rank: Lightning's SIGTERM flag). With a hung peer, the
operations an abandon ends in flight count the same way. Work after a step's vote, which no
redone step runs again, reads this count (see ``rlaunch.lightning.aftervote``).

NCCL completes a collective's future when it is queued on the GPU: one lost afterwards (its
communicator aborted, or an error recorded on it) counts when that is found, unless the runtime had
waited for the GPU since it was queued (over a fake NCCL: see below).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import HashStore

from rlaunch.runtime import backend as backends
from rlaunch.runtime import devicework
from rlaunch.runtime.backend import Backend, Communicators
from rlaunch.runtime.groups import SwitchableGroup, alike
from tests.gloo_pair import run_pair, world_group
from tests.unit.test_backend import TIMEOUT, FakeNccl


def _gone(rank: int, port: int, results: Any) -> None:
    """Rank 1 takes part in one allreduce and exits; rank 0 goes on issuing."""
    group = world_group(rank, port)
    both = torch.full((2,), float(rank + 1))
    group.allreduce([both]).wait()
    if rank == 1:
        os._exit(0)  # the peer is gone: its connections close
    counts = [group.own_results]
    found = torch.full((2,), 7.0)
    group.allreduce([found]).wait()  # fails on the closed connection: the caller's inputs come back
    counts.append(group.own_results)
    later = torch.full((2,), 8.0)
    group.allreduce([later]).wait()  # the group failed: returns at once, un-issued
    counts.append(group.own_results)
    group.barrier().wait()
    counts.append(group.own_results)
    with alike():
        flag = torch.zeros(1)
        group.broadcast([flag], dist.BroadcastOptions()).wait()
    counts.append(group.own_results)
    results.put((both.tolist(), found.tolist(), later.tolist(), bool(group.failed), counts))


def _hung(rank: int, port: int, results: Any) -> None:
    """Rank 1 never issues; rank 0's operations in flight are abandoned (a plan, or the agent's word)."""
    group = world_group(rank, port)
    if rank == 1:
        time.sleep(3)  # past the abandon, never issuing
        return
    with alike():
        flag = torch.zeros(1)
        alike_work = group.broadcast([flag], dist.BroadcastOptions())
    value = torch.full((2,), 3.0)
    work = group.allreduce([value])
    threading.Timer(1.0, group.abandon, args=("a peer is hung",)).start()
    work.wait()
    alike_work.wait()
    results.put((value.tolist(), group.own_results))


def _held(rank: int, port: int, results: Any) -> None:
    """Rank 0's step was recovered (its group held until the step's boundary): its collective returns at
    once, un-issued, and counts; released, its next one meets rank 1's, which never issued the first."""
    group = world_group(rank, port)
    mine, quick, counted = [5.0, 5.0], True, 0
    if rank == 0:
        group.held = True
        held = torch.full((2,), 5.0)
        began = time.perf_counter()
        group.allreduce([held]).wait()
        mine, quick, counted = held.tolist(), time.perf_counter() - began < 1.0, group.own_results
        group.held = False
    both = torch.full((2,), float(rank + 1))
    group.allreduce([both]).wait()
    if rank == 0:
        results.put((mine, quick, counted, both.tolist(), group.own_results))


def test_a_held_group_issues_nothing_until_the_steps_boundary_and_counts_what_it_handed_back() -> None:
    mine, quick, counted, both, after = run_pair(_held)
    assert mine == [5.0, 5.0] and quick and counted == 1, "held: the caller's inputs, at once, counted"
    assert both == [3.0, 3.0] and after == 1, "released: the next collective meets the peer's, counted nothing"


def test_a_gone_peer_counts_each_result_that_was_the_callers_own_inputs() -> None:
    both, found, later, failed, counts = run_pair(_gone)
    assert both == [3.0, 3.0], "completed: every rank's sum, and nothing counted"
    assert failed and found == [7.0, 7.0] and later == [8.0, 8.0], "the caller's own inputs came back"
    assert counts == [0, 1, 2, 2, 2], "the failed allreduce and the un-issued one count; a barrier and alike() do not"


def test_operations_abandoned_in_flight_count_unless_issued_alike() -> None:
    value, count = run_pair(_hung)
    assert value == [3.0, 3.0]
    assert count == 1, "the abandoned allreduce counts; the broadcast issued inside alike() does not"


# --- NCCL: futures complete when the work is queued on the GPU ----------------------------------------
#
# A machine without a GPU has no CUDA tensors, so the fake NCCL of test_backend is put on the CPU: the
# group's communicator is built by the runtime's own communicator layer, with its NCCL side taking the
# CPU tensors. Its operations complete at once for the host and never run anywhere, as NCCL's complete
# when queued: the guard sees each succeed, and only what happens to the communicator says they were lost.


@pytest.fixture
def cpu_nccl() -> Iterator[FakeNccl]:
    nccl = FakeNccl()
    previous = backends.use(Communicators(nccl, device=lambda: torch.device("cpu", 0)))
    yield nccl
    backends.use(previous)


def _group(backend: Backend) -> SwitchableGroup:
    comm = backends.build(HashStore(), "g1/world/", 0, 1, TIMEOUT, backend)
    return SwitchableGroup("world", [0], 0, comm, 1, guarded=True, backend=backend)


def _issue(group: SwitchableGroup, first: float) -> list[torch.Tensor]:
    """Two counted collectives, and those that never count: a barrier, a send (over NCCL; a gloo group of
    one has no peer to send to) and a broadcast issued alike."""
    summed, sent = torch.full((2,), first), torch.full((2,), first + 1)
    group.allreduce([summed]).wait()
    group.broadcast([sent], dist.BroadcastOptions()).wait()
    barrier = dist.BarrierOptions()
    barrier.device = torch.device("cpu")  # torch's barrier makes its tensor on the default backend's device
    group.barrier(barrier).wait()
    if group.backend is Backend.NCCL:
        group.send([torch.zeros(1)], 0, 0).wait()
    with alike():
        group.broadcast([torch.zeros(1)], dist.BroadcastOptions()).wait()
    return [summed, sent]


def test_nccl_collectives_queued_since_the_gpu_was_last_known_done_count_when_the_group_is_abandoned(
    cpu_nccl: FakeNccl,
) -> None:
    group = _group(Backend.NCCL)
    _issue(group, 1.0)
    assert group.own_results == 0 and not group.busy, "completed at enqueue: the guard saw them succeed"
    assert devicework.finish([group], sync=lambda: None) == devicework.Found()  # the step's vote: known done
    _issue(group, 3.0)
    assert group.own_results == 0
    group.abandon("rank 1 is being replaced")
    assert ("abort", "g1.world") in cpu_nccl.sequence()
    assert group.own_results == 2, "the allreduce and broadcast queued after the wait were lost with the abort"
    group.abandon("again")
    assert group.own_results == 2, "counted once"


def test_nccl_collectives_queued_on_a_communicator_that_recorded_an_error_count_once(cpu_nccl: FakeNccl) -> None:
    group = _group(Backend.NCCL)
    _issue(group, 1.0)
    devicework.finish([group], sync=lambda: None)
    _issue(group, 3.0)
    cpu_nccl.errors["g1.world"] = "COMM_ERROR"  # torch's watchdog saw a peer die
    found = devicework.finish([group], sync=lambda: None)
    assert found.errors == ((group, "COMM_ERROR"),)
    assert group.own_results == 2
    group.abandon("torch's NCCL watchdog found an error")  # what the runtime does next
    assert group.own_results == 2, "not counted again when the group is abandoned"


def test_nccl_collectives_count_when_the_wait_for_the_gpu_fails(cpu_nccl: FakeNccl) -> None:
    def sync() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    group = _group(Backend.NCCL)
    _issue(group, 1.0)
    assert devicework.finish([group], sync=sync).wait.startswith("CUDA error")
    assert group.own_results == 2


def test_a_swap_starts_the_count_afresh_on_the_new_communicator(cpu_nccl: FakeNccl) -> None:
    group = _group(Backend.NCCL)
    _issue(group, 1.0)  # queued on generation 1's communicator, which is retired, not cut
    group.swap(backends.build(HashStore(), "g2/world/", 0, 1, TIMEOUT, Backend.NCCL), 2)
    _issue(group, 3.0)
    group.abandon("rank 1 is being replaced")
    assert group.own_results == 2


def test_gloo_collectives_that_completed_never_count_when_the_group_is_abandoned_later(cpu_nccl: FakeNccl) -> None:
    """Gloo's futures complete when the operation ended: what completed was every rank's result."""
    group = _group(Backend.GLOO)
    summed, sent = _issue(group, 1.0)
    assert summed.tolist() == [1.0, 1.0] and sent.tolist() == [2.0, 2.0]
    group.abandon("rank 1 is being replaced")
    assert group.own_results == 0 and cpu_nccl.calls == []
