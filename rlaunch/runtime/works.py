"""The futures and ``Work`` handles that runtime groups and the sandbox hand back to their callers.

A collective's caller waits on a ``dist.Work``; the sandbox, and a guarded group whose operation
was given up, complete it at once with the caller's own tensors. On a GPU the future is
CUDA-aware, so that a waiter synchronizes with the stream current when it is completed, as it
would with NCCL's own work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future


def cuda_devices(tensors: Sequence[Any]) -> list[torch.device]:
    """The CUDA devices among ``tensors``' devices: what a future holding them must know of."""
    return sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)


def future(tensors: Sequence[torch.Tensor]) -> Future[Any]:
    """A future for ``tensors``: CUDA-aware when they are on a GPU, so that its waiters
    synchronize with the stream current when it is completed (the sandbox: the current stream)."""
    devices = cuda_devices(tensors)
    return Future(devices=devices) if devices else Future()


def done(result: Any) -> dist.Work:
    """A ``Work`` already completed with ``result`` (the tensors the caller gave)."""
    fut = future(flat([result]))
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def flat(args: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors in ``args``, nested lists and tuples flattened, in order."""
    out: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(flat(a))
    return out
