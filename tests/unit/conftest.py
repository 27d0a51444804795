"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rlaunch.runtime import backend as backends
from rlaunch.runtime.backend import Communicators
from tests.unit.test_backend import GPU, FakeNccl


@pytest.fixture
def fake() -> Iterator[FakeNccl]:
    """The process's communicator layer, over a fake NCCL that records its calls."""
    nccl = FakeNccl()
    previous = backends.use(Communicators(nccl, device=lambda: GPU))
    yield nccl
    backends.use(previous)
