"""A one-rank runtime for unit tests: no agent link (as under plain torchrun), a sandbox world group."""

from __future__ import annotations

import datetime

from torch.distributed import HashStore

from rlaunch.runtime.groups import SandboxComm
from rlaunch.runtime.runtime import Runtime


def plain_runtime() -> Runtime:
    """A one-rank runtime with no agent link (as under plain torchrun)."""
    return Runtime(
        rank=0, world_size=1, generation=1, link=None, store=HashStore(), world_comm=SandboxComm(0, 1),
        standby=False, sandbox_steps=0, timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip
