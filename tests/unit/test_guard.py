"""Gloo's reduce-scatters have no future: the guard waits for them in the caller's own wait().

Two real gloo processes: the reduce-scatter completes when both take part; with a hung peer, an
abandon (before or during the wait) ends the wait at once, marks the group failed, and the
group no longer reports an operation in flight.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlaunch.runtime import backend as backends
from rlaunch.runtime.groups import SwitchableGroup
from rlaunch.store.embedded import free_port

TIMEOUT = datetime.timedelta(seconds=30)


def _rank(rank: int, port: int, mode: str, results: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=TIMEOUT)
    group = SwitchableGroup("world", [0, 1], rank, backends.build(store, "g1/world/", rank, 2, TIMEOUT), 1)
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


def _run(mode: str) -> tuple[Any, ...]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, mode, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return tuple(results.get(timeout=60))
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()


def test_a_waited_reduce_scatter_completes_and_is_no_longer_in_flight() -> None:
    mode, issued_busy, _, failed, busy, out = _run("both")
    assert (failed, busy) == ("", False)
    assert out == [0.0, 2.0]  # rank 0's chunk ([0, 1]) summed over both ranks


def test_an_abandon_during_or_before_the_wait_ends_it_at_once() -> None:
    for mode in ("during", "before"):
        got_mode, issued_busy, waited, failed, busy, _ = _run(mode)
        assert issued_busy, "issued and not completed: in flight (the heartbeat says the rank waits on peers)"
        assert failed == "a peer is gone" and not busy, got_mode
        assert waited < 5.0, f"{mode}: the wait took {waited:.1f} s; the abandon must end it at once"
