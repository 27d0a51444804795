"""Gloo process groups of the unit tests, kept until the session ends.

A gloo group's destructor joins its worker threads. Dropped from Python it runs without the GIL
(torch's holder releases it), but dropped by C++ code that holds the GIL, such as DDP's Reducer as
its module goes, it joins them with the GIL held. A worker may still be freeing the last work it
ran, whose captured thread-local state holds Python objects: that needs the GIL, and the process
hangs for good (torch 2.13; it hung a CI run in test_verify.py). A test's models are dropped right
after their last collective, so the groups the unit tests make are kept here (those built through
the runtime's ``Communicators.build`` too: conftest.py) and dropped as the session ends. The
runtime drops the groups it replaced late, on a thread of its own (``rlaunch.runtime.groups.retire``).
"""

from __future__ import annotations

import datetime
from typing import Any, TypeVar

from torch.distributed import HashStore, ProcessGroup

from rlaunch.runtime import backend as backends

G = TypeVar("G")

_kept: list[Any] = []


def kept(group: G) -> G:
    """``group``, kept until the session ends."""
    _kept.append(group)
    return group


def one_rank() -> ProcessGroup:
    """A one-rank gloo group over a store of its own, built as the runtime builds its groups, kept
    until the session ends."""
    return kept(backends.build(HashStore(), "one/", 0, 1, datetime.timedelta(seconds=30)))


def drop_kept() -> None:
    """Drop the kept groups (the session ended: their workers are idle)."""
    _kept.clear()
