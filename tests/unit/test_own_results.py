"""Each group counts the collectives that handed their caller its own inputs instead of a result.

Two real gloo processes. A collective that completes counts nothing. When the peer is gone, the
collective that finds it out hands back the caller's inputs and counts, and so does every later
one of the failed group (un-issued), except a barrier (no result) and those issued inside
``alike()`` (inputs the same on every rank: Lightning's SIGTERM flag). With a hung peer, the
operations an abandon ends in flight count the same way. Work after a step's vote, which no
redone step runs again, reads this count (see ``rlaunch.lightning.aftervote``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from rlaunch.runtime.groups import alike
from tests.gloo_pair import run_pair, world_group


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


def test_a_gone_peer_counts_each_result_that_was_the_callers_own_inputs() -> None:
    both, found, later, failed, counts = run_pair(_gone)
    assert both == [3.0, 3.0], "completed: every rank's sum, and nothing counted"
    assert failed and found == [7.0, 7.0] and later == [8.0, 8.0], "the caller's own inputs came back"
    assert counts == [0, 1, 2, 2, 2], "the failed allreduce and the un-issued one count; a barrier and alike() do not"


def test_operations_abandoned_in_flight_count_unless_issued_alike() -> None:
    value, count = run_pair(_hung)
    assert value == [3.0, 3.0]
    assert count == 1, "the abandoned allreduce counts; the broadcast issued inside alike() does not"
