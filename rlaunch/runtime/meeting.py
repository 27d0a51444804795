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

import contextlib
import datetime
import functools
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


def meet(store: Any, key: str, side: int, wait_s: float = MEET_S) -> bool:
    """(holding the build lock) Say ``side`` of the pair is here under ``key`` and wait up to ``wait_s``
    for the other side (one watched read, not a poll); True when both are: both sides read the same
    verdict. A failure after this side said it is here still writes "no" where it can, so that the
    other side does not build alone."""
    store.set(f"{key}here/{side}", b"1")
    try:
        try:
            store.wait([f"{key}here/{1 - side}"], datetime.timedelta(seconds=wait_s))
            met = True
        except Exception:  # noqa: BLE001 - a store's wait raises when it times out (the kind depends on the store)
            met = store.check([f"{key}here/{1 - side}"])
        return bytes(store.compare_set(f"{key}verdict", "", "go" if met else "no")) == b"go"
    except BaseException:
        with contextlib.suppress(Exception):
            store.compare_set(f"{key}verdict", "", "no")
        raise


def build_pair(
    store: Any,
    prefix: str,
    side: int,
    timeout: datetime.timedelta,
    cut: Callable[[], bool],
    build: Callable[..., Any] | None = None,
) -> Any:
    """Side ``side`` of the 2-rank gloo communicator on ``prefix``, built once both sides met (each
    attempt under ``prefix`` and its number; ``build``: the process's layer's, by default). Raises
    ``TimeoutError`` if they have not met within ``timeout``, and ``RuntimeError`` once ``cut()``
    says the pair is no longer wanted.

    A side that comes late passes the attempts the other already gave up on (their verdict is
    written) without waiting, so it catches up at once. Each side needs a layer of its own (ranks
    in one process would share its lock, and never meet).
    """
    build = build or backends.build
    deadline = time.monotonic() + timeout.total_seconds()
    for attempt in itertools.count():
        if cut():
            raise RuntimeError(f"the snapshot pair {prefix} was cut before its two sides met")
        key = f"{prefix}{attempt}/"
        if store.check([f"{key}meet/verdict"]):
            continue  # given up by the other side ("go" needs this side's word): the next one
        try:
            return build(store, key, side, 2, timeout, backends.Backend.GLOO, None,
                         meet=functools.partial(meet, store, f"{key}meet/", side))  # fmt: skip
        except backends.NotMet:
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"the two sides of the snapshot pair {prefix} did not meet within {timeout.total_seconds():.0f} s"
            )
        time.sleep(BACKOFF_S)
    raise AssertionError("unreachable")
