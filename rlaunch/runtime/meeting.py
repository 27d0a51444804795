"""Two processes meet before they build a pair of host snapshots' communicator together.

Each process builds its communicators one at a time (the layer's lock: see
:class:`rlaunch.runtime.backend.Communicators`), and a build waits, holding that lock, until its
peers build it too. Builds that every rank makes in the same order (a generation's groups, by its
plan) cannot wait on each other across processes. A generation's snapshot pairs are built at its
first scheduled snapshot, on the snapshot thread, while a drain planned at that moment builds its
groups on the listener thread: one rank may hold its lock for a pair, waiting for its buddy, while
the buddy holds its own for the drain's group, waiting for this rank. So a pair is built only once
both sides hold their locks for it: each says it is here, waits a short while for the other, and
both read one verdict (a compare-and-set): "go", and they build at once; "no", and each lets go of
its lock (its other builds go on), waits a moment and tries again under a new key.
"""

from __future__ import annotations

import datetime
import itertools
import time
from collections.abc import Callable
from typing import Any

from rlaunch.runtime import backend as backends

#: how long a side holds its build lock waiting for the other to say it is here
MEET_S = 1.0
#: how long a side waits, its lock let go of, before it tries again (less than MEET_S, so that a side
#: that comes back finds the other still waiting, or waits for it in turn)
BACKOFF_S = 0.2
#: how often a waiting side looks for the other
POLL_S = 0.02


def meet(store: Any, key: str, side: int, wait_s: float = MEET_S) -> bool:
    """(holding the build lock) Say ``side`` of the pair is here under ``key`` and wait up to ``wait_s``
    for the other side; True when both are (both sides read the same verdict)."""
    store.set(f"{key}here/{side}", b"1")
    other = f"{key}here/{1 - side}"
    end = time.monotonic() + wait_s
    met = store.check([other])
    while not met and time.monotonic() < end:
        time.sleep(POLL_S)
        met = store.check([other])
    return bytes(store.compare_set(f"{key}verdict", "", "go" if met else "no")) == b"go"


def build_pair(
    store: Any,
    prefix: str,
    side: int,
    timeout: datetime.timedelta,
    cut: Callable[[], bool],
    build: Callable[..., Any] = backends.build,
) -> Any:
    """Side ``side`` of the 2-rank gloo communicator on ``prefix``, built once both sides met (each
    attempt under ``prefix`` and its number). Raises ``TimeoutError`` if they have not met within
    ``timeout``, and ``RuntimeError`` once ``cut()`` says the pair is no longer wanted."""
    deadline = time.monotonic() + timeout.total_seconds()
    for attempt in itertools.count():
        key = f"{prefix}{attempt}/"
        try:
            return build(store, key, side, 2, timeout, backends.Backend.GLOO, None,
                         meet=lambda key=key: meet(store, f"{key}meet/", side))  # fmt: skip
        except backends.NotMet:
            pass
        if cut():
            raise RuntimeError(f"the snapshot pair {prefix} was cut before its two sides met")
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"the two sides of the snapshot pair {prefix} did not meet within {timeout.total_seconds():.0f} s"
            )
        time.sleep(BACKOFF_S)
    raise AssertionError("unreachable")
