"""Two real gloo processes for the unit tests of a runtime group (``SwitchableGroup``).

:func:`run_pair` spawns ``target(rank, port, results, *args)`` for ranks 0 and 1 and gives back the
first tuple either rank put on ``results``, once both ended without a signal; :func:`world_group` builds,
inside such a process, the group named ``world`` over both ranks the way the runtime builds it (a
TCPStore at ``port``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from rlaunch.runtime import backend as backends
from rlaunch.runtime.groups import SwitchableGroup
from rlaunch.store.embedded import free_port

TIMEOUT = datetime.timedelta(seconds=30)


def world_group(rank: int, port: int) -> SwitchableGroup:
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=TIMEOUT)
    return SwitchableGroup("world", [0, 1], rank, backends.build(store, "g1/world/", rank, 2, TIMEOUT), 1)


def run_pair(target: Callable[..., None], *args: Any) -> tuple[Any, ...]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, results, *args)) for r in (0, 1)]
    for p in procs:
        p.start()
    hung = []
    try:
        got = tuple(results.get(timeout=60))
    finally:
        for rank, p in enumerate(procs):
            p.join(20)
            if p.is_alive():
                hung.append(rank)
                p.kill()
                p.join()
    # A rank that does not end, or is ended by a signal, hung or died in torch's C++ (a communicator
    # freed on its own thread ends in std::terminate, SIGABRT): a runtime bug, not a test's noise. (A
    # rank that raised, as the peer of one that cut the group while it was still being built may, exits 1.)
    assert not hung, f"rank {hung[0]} was still running 20 s after the result"
    aborted = [p.exitcode for p in procs if p.exitcode is not None and p.exitcode < 0]
    assert not aborted, f"a rank was ended by signal {-aborted[0]}"
    return got
