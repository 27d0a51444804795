"""Two "processes" (a communicator layer each, with its own build lock) build a snapshot pair and a
drain's group at the same moment, in the order that held a drain for the pairs' whole timeout in
a benchmark: A's snapshot thread holds A's lock for the pair while B's listener holds B's for the
group. The pair is built only once both sides met, so both builds end within seconds. Real gloo,
over one store."""

from __future__ import annotations

import datetime
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed import HashStore

from rlaunch.runtime import meeting
from rlaunch.runtime.backend import Communicators
from tests.unit import gloo_groups as gloo

TIMEOUT = datetime.timedelta(seconds=20)


def _start(out: dict[Any, Any], name: Any, work: Callable[[], Any]) -> threading.Thread:
    """Run ``work`` on a thread of its own: ``out[name]`` is what it built, or what it raised."""

    def body() -> None:
        try:
            out[name] = gloo.kept(work())
        except BaseException as exc:  # noqa: BLE001 - asserted by the caller
            out[name] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def _built(out: dict[Any, Any]) -> list[Any]:
    failed = [v for v in out.values() if isinstance(v, BaseException)]
    assert not failed, failed
    return sorted(out)


def test_a_pair_and_a_group_built_across_two_processes_in_crossed_order_both_end() -> None:
    store = HashStore()
    a, b = Communicators(), Communicators()
    built: dict[str, Any] = {}
    began = time.monotonic()
    threads = [
        _start(built, "a-pair", lambda: meeting.build_pair(store, "g4/snapshot/0/", 0, TIMEOUT, lambda: False, a.build))
    ]
    deadline = time.monotonic() + 10
    while not store.check(["g4/snapshot/0/0/meet/here/0"]) and time.monotonic() < deadline:
        time.sleep(0.01)  # A's snapshot thread now holds A's lock, waiting for B
    threads.append(_start(built, "b-group", lambda: b.build(store, "g5/world/", 1, 2, TIMEOUT)))
    while not b._lock.locked() and time.monotonic() < deadline:
        time.sleep(0.01)  # B's listener holds B's lock, waiting for A's
    threads.append(_start(built, "a-group", lambda: a.build(store, "g5/world/", 0, 2, TIMEOUT)))
    threads.append(
        _start(built, "b-pair", lambda: meeting.build_pair(store, "g4/snapshot/0/", 1, TIMEOUT, lambda: False, b.build))
    )
    for thread in threads:
        thread.join(30)
    assert _built(built) == ["a-group", "a-pair", "b-group", "b-pair"]
    assert time.monotonic() - began < 10, "no build waited for its timeout"
    assert store.compare_set("g4/snapshot/0/0/meet/verdict", "", "?") == b"no", "the first try was given up"


def test_sides_that_come_together_meet_at_once_and_a_side_alone_gives_up_by_its_timeout() -> None:
    store = HashStore()
    a, b = Communicators(), Communicators()
    out: dict[int, Any] = {}
    began = time.monotonic()
    threads = [
        _start(out, s, functools.partial(meeting.build_pair, store, "g2/snapshot/1/", s, TIMEOUT, lambda: False,
                                         layer.build))
        for s, layer in ((0, a), (1, b))
    ]  # fmt: skip
    for thread in threads:
        thread.join(30)
    assert _built(out) == [0, 1] and time.monotonic() - began < meeting.MEET_S + 2
    assert store.compare_set("g2/snapshot/1/0/meet/verdict", "", "?") == b"go", "they met at the first try"
    alone = time.monotonic()
    try:
        meeting.build_pair(store, "g3/snapshot/1/", 0, datetime.timedelta(seconds=2), lambda: False, a.build)
    except TimeoutError as exc:
        assert "did not meet within 2 s" in str(exc)
    else:
        raise AssertionError("a pair whose other side never came was built")
    assert 2 <= time.monotonic() - alone < 2 + meeting.MEET_S + 1
    cut = {"now": False}
    later = threading.Timer(0.5, lambda: cut.__setitem__("now", True))
    later.start()
    try:
        meeting.build_pair(store, "g4/snapshot/1/", 0, TIMEOUT, lambda: cut["now"], a.build)
    except RuntimeError as exc:
        assert "was cut before its two sides met" in str(exc)
    else:
        raise AssertionError("a cut pair was built")


def test_a_side_that_comes_late_passes_the_tries_given_up_and_meets_at_once() -> None:
    store = HashStore()
    a, b = Communicators(), Communicators()
    out: dict[int, Any] = {}
    early = _start(out, 0, lambda: meeting.build_pair(store, "g2/snapshot/0/", 0, TIMEOUT, lambda: False, a.build))
    time.sleep(6 * (meeting.MEET_S + meeting.BACKOFF_S))  # side 0 gave up its first 6 tries
    came = time.monotonic()
    out[1] = gloo.kept(meeting.build_pair(store, "g2/snapshot/0/", 1, TIMEOUT, lambda: False, b.build))
    early.join(10)
    assert _built(out) == [0, 1]
    assert time.monotonic() - came < meeting.MEET_S, "it caught up without a backoff per try (6 x 0.2 s)"
    assert store.compare_set("g2/snapshot/0/0/meet/verdict", "", "?") == b"no"
