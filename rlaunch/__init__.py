"""rlaunch: a torchrun-compatible launcher that keeps jobs running through machine faults.

``rlaunch.init()`` starts the resilient worker runtime (see :mod:`rlaunch.runtime.runtime`).
It is imported lazily so that the agent and the CLI never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlaunch.runtime.runtime import Runtime

__version__ = "0.1.0"


def init(timeout_s: float = 300.0) -> Runtime:
    """Start the worker runtime: instead of ``init_process_group`` in a training script."""
    from rlaunch.runtime.runtime import init as _init

    return _init(timeout_s)


def __getattr__(name: str) -> type[Exception]:
    """``rlaunch.RefusedError``, imported lazily (it lives with the runtime, which imports torch)."""
    if name == "RefusedError":
        from rlaunch.runtime.vote import RefusedError

        return RefusedError
    raise AttributeError(f"module 'rlaunch' has no attribute {name!r}")
