"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rlaunch.runtime import backend as backends
from rlaunch.runtime.backend import Communicators
from tests.unit import gloo_groups
from tests.unit.test_backend import GPU, FakeNccl


@pytest.fixture(scope="session", autouse=True)
def kept_groups() -> Iterator[None]:
    """Every communicator a unit test builds, itself or through the runtime, lives until the session
    ends (see tests.unit.gloo_groups: a gloo group dropped right after its last work can hang)."""
    build = Communicators.build

    def keeping(self: Communicators, *args: Any, **kwargs: Any) -> Any:
        return gloo_groups.kept(build(self, *args, **kwargs))

    Communicators.build = keeping  # type: ignore[method-assign]
    yield
    Communicators.build = build  # type: ignore[method-assign]
    gloo_groups.drop_kept()


@pytest.fixture
def fake() -> Iterator[FakeNccl]:
    """The process's communicator layer, over a fake NCCL that records its calls."""
    nccl = FakeNccl()
    previous = backends.use(Communicators(nccl, device=lambda: GPU))
    yield nccl
    backends.use(previous)
