"""Gloo process groups made in the test process, kept until the session ends.

A gloo group's destructor joins its worker threads while the thread that drops the group holds
the GIL. A worker may still be freeing the last work it ran, whose captured thread-local state
holds Python objects: that needs the GIL, and the process hangs for good (torch 2.13; it hung a
CI run in tests/unit/test_verify.py). A test's locals are dropped right after its last
collective, so the groups tests make are kept here (those built through the runtime's
``Communicators.build`` too: tests/conftest.py) and dropped as the session ends, when every
worker has long been idle. The runtime drops the groups it replaced late, on a thread of its own
(``rlaunch.runtime.groups.retire``).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from torch.distributed import HashStore, ProcessGroup
from torch.distributed.distributed_c10d import ProcessGroupGloo

G = TypeVar("G")

_kept: list[Any] = []


def kept(group: G) -> G:
    """``group``, kept until the session ends."""
    _kept.append(group)
    return group


def one_rank() -> ProcessGroup:
    """A one-rank gloo group over a store of its own, kept until the session ends."""
    store = HashStore()
    group = ProcessGroup(store, 0, 1)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, ProcessGroupGloo(store, 0, 1))
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    return kept(group)


def drop_kept() -> None:
    """Drop the kept groups (the session ended: their workers are idle)."""
    _kept.clear()
