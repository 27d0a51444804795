"""Ranks as the runtime knows them, in the shape Lightning asks for (a ``ClusterEnvironment``).

Lightning reads the global rank and world size from a cluster environment. Under rlaunch they are
the runtime's: -1 in a standby's sandbox (as torch answers for a non-member, so rank-zero-only
code never runs there), and the rank a standby took once it joins, read afresh at every call.
Under plain torchrun they are torch's, as Lightning's own ``TorchElasticEnvironment`` gives them.
Processes are always started outside Lightning (by rlaunch's agent or by torchrun).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlaunch.lightning import packages

ClusterEnvironment = packages.fabric("plugins.environments").ClusterEnvironment

if TYPE_CHECKING:
    from rlaunch.runtime.runtime import Runtime


class RuntimeEnvironment(ClusterEnvironment):  # type: ignore[misc,valid-type]
    """The runtime's ranks; ``runtime`` starts the runtime on first use (``rlaunch.init()``)."""

    def __init__(self, runtime: Callable[[], Runtime]) -> None:
        self._runtime = runtime

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        return "RLAUNCH_AGENT_ADDR" in os.environ

    def world_size(self) -> int:
        return self._runtime().world_size

    def set_world_size(self, size: int) -> None:
        """Ignored: the world size is the job's (the runtime's)."""

    def global_rank(self) -> int:
        return self._runtime().rank

    def set_global_rank(self, rank: int) -> None:
        """Ignored: the rank is the runtime's, and a joiner's changes when it joins."""

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def node_rank(self) -> int:
        """The node of this rank: -1 in a standby's sandbox. Lightning then runs a ``prepare_data`` made
        once per job (``prepare_data_per_node = False``: a shared disk, prepared by global rank 0) only
        on the active ranks, and one made per node (the default) on the standby too, whose node will
        need the data once it joins."""
        rank = self.global_rank()
        if rank < 0:
            return -1
        return rank // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
