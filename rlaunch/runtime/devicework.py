"""Whether a step's GPU work, its NCCL collectives included, ended well, before its vote.

NCCL completes an operation's future when the kernel is queued, not when it ends (see
:mod:`rlaunch.runtime.nccl`), so neither the guard nor the vote can see an NCCL collective fail:
a full vote would prove only that every rank *issued* its gradient sync. So, before voting, a rank
with NCCL groups waits for its GPU (the collectives' waits put them on the current stream) and
then reads what torch's watchdog recorded on each NCCL communicator. What it finds decides:

- a plan already cut a group (a peer is lost; its aborted kernels may fail the wait): the step goes
  to recovery, as under gloo;
- else, the wait itself failed (a CUDA error: the process's GPU context is lost): the rank stops
  before the step is applied, with a sentence, and the job takes the restart path;
- else, a communicator recorded an error (``COMM_ERROR``: a peer died or its link broke;
  ``TIMEOUT``: a collective waited past the group's timeout, because a peer died or spent minutes
  elsewhere): the step's gradients may be partly reduced, so the rank abandons those groups and
  the world group (every peer's vote then fails at once) and the step goes to recovery, as a
  failed gloo collective's does. A lost peer is replaced live there; with every peer alive no
  replacement is planned, so recovery ends the worker with a sentence after the group's timeout,
  and the job goes on as after any worker failure. Either way the step is never applied on
  partly reduced gradients.

The wait also tells each group what became of the collectives queued on its GPU (whose results its
callers already took, see :attr:`rlaunch.runtime.groups.SwitchableGroup.own_results`): after a wait that
ended well, on a communicator that recorded nothing, they are done; otherwise they count as lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from rlaunch.errors import RlaunchError
from rlaunch.runtime import backend as backends


class DeviceWorkError(RlaunchError):
    """Waiting for a step's GPU work failed: the step is not applied."""


@dataclasses.dataclass(frozen=True)
class Found:
    """What went wrong with a step's GPU work."""

    wait: str = ""  # why waiting for the GPU failed ("" if it did not)
    errors: tuple[tuple[Any, str], ...] = ()  # (group, the error its NCCL communicator recorded)

    def describe(self) -> str:
        return "; ".join(f"group {g.label!r} recorded {e}" for g, e in self.errors)


def _sync_current_stream() -> None:
    torch.cuda.current_stream().synchronize()


def finish(groups: Iterable[Any], sync: Callable[[], None] = _sync_current_stream) -> Found:
    """Wait for the GPU, then read what went wrong with the NCCL work of ``groups``.

    ``groups``: this rank's groups whose backend is NCCL (:class:`rlaunch.runtime.groups.SwitchableGroup`);
    without any, there is nothing to wait for (gloo's operations end on the host).
    """
    groups = list(groups)
    if not groups:
        return Found()
    queued = [g.device_queued for g in groups]  # before the wait: what it waits for
    wait = ""
    try:
        sync()
    except RuntimeError as exc:  # an illegal access, an ECC error: CUDA's errors are sticky
        wait = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    errors = tuple((g, e) for g in groups if (e := backends.current().error(g.comm)))
    failed = {id(g) for g, _ in errors}
    for group, mark in zip(groups, queued, strict=True):
        if wait or id(group) in failed:
            group.device_lost()
        else:
            group.device_done(mark)
    return Found(wait, errors)


def refusal(rank: int, step: int, why: str) -> DeviceWorkError:
    """The sentence of a step whose GPU work could not be waited for."""
    return DeviceWorkError(
        f"rank {rank}: waiting for the GPU work of step {step} failed ({why}), so its results cannot be trusted: "
        "the step is not applied, and this worker stops; the job takes the restart path."
    )
