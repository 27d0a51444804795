"""Whether a step's GPU work, its NCCL collectives included, ended well, before its vote.

NCCL completes an operation's future when the kernel is queued, not when it ends (see
:mod:`rlaunch.runtime.nccl`), so neither the guard nor the vote can see an NCCL collective fail:
a full vote would prove only that every rank *issued* its gradient sync. So, before voting, a rank
with NCCL groups waits for its GPU (the collectives' waits put them on the current stream) and
then reads what torch's watchdog recorded on each NCCL communicator. An error found there while no
peer was lost (a watchdog timeout because one rank spent minutes saving a checkpoint, a
communication error) means the step's gradients may be partly reduced: it must not be applied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from rlaunch.errors import RlaunchError
from rlaunch.runtime import backend as backends


class DeviceWorkError(RlaunchError):
    """A step's NCCL work failed while every peer is still in the job: the step is not applied."""


def _sync_current_stream() -> None:
    torch.cuda.current_stream().synchronize()


def finish(groups: Iterable[Any], sync: Callable[[], None] = _sync_current_stream) -> str:
    """Wait for the GPU, then say what went wrong with the NCCL work of ``groups`` ("" if nothing).

    ``groups``: this rank's groups whose backend is NCCL (:class:`rlaunch.runtime.groups.SwitchableGroup`);
    without any, there is nothing to wait for (gloo's operations end on the host).
    """
    groups = list(groups)
    if not groups:
        return ""
    found = []
    try:
        sync()
    except RuntimeError as exc:  # an aborted communicator's kernels, an illegal access
        found.append(f"waiting for the GPU failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    for group in groups:
        error = backends.current().error(group.comm)
        if error:
            found.append(f"group {group.label!r} recorded {error}")
    return "; ".join(found)


def refusal(rank: int, step: int, why: str) -> DeviceWorkError:
    """The sentence of a step whose NCCL work failed with every peer alive."""
    return DeviceWorkError(
        f"rank {rank}: the NCCL work of step {step} failed ({why}) though no peer was lost, so its gradients may "
        "be partly reduced: the step is not applied, and this worker stops; the job takes the restart path."
    )
