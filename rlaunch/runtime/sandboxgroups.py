"""``torch.distributed.new_group`` in a standby's sandbox.

A script or a framework may make a group of its own with torch. Lightning does it around
``prepare_data``: ``new_group(backend="gloo", timeout=...)``, then the group's
``monitored_barrier``, then ``destroy_process_group``. In a sandbox torch asks the default group
for this process's rank, a standby's -1, and gives back ``GroupMember.NON_GROUP_MEMBER``, an
int: the barrier fails, the sandbox stops and the standby never warms up.

While the standby is in its sandbox, :func:`serve` puts :func:`_sandbox_new_group` in torch's
place. A group with the rank the sandbox lays out as (0, see :mod:`rlaunch.runtime.sandbox`) is
a :class:`SandboxTorchGroup`: a :class:`SwitchableGroup` on a sandbox communicator, known to torch
as a group torch made is, so ``dist.get_rank(group)``, every collective, ``monitored_barrier``
and ``destroy_process_group`` work. The runtime counts it among the groups it did not make (see
:func:`rlaunch.runtime.registry.foreign_groups`): while it lives, moves are refused, as they are
on the active ranks, whose twin of it is a real torch group. A group without rank 0 is
``NON_GROUP_MEMBER``, as torch gives rank 0. Either way torch's count of groups moves as on every
active rank: it names the next group, and members meet under that name in the store.

At the join (:func:`leave`) torch's ``new_group`` is put back. A group made in the sandbox and
never destroyed has no peers; it keeps no sandbox communicator (it would answer with made-up
data) but one that raises a sentence at its first use (:class:`_NoPeers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from rlaunch.errors import SandboxError
from rlaunch.runtime import backend as backends
from rlaunch.runtime.groups import SandboxComm, SwitchableGroup
from rlaunch.runtime.registry import register, unregister
from rlaunch.runtime.sandbox import SANDBOX_RANK


class SandboxTorchGroup(SwitchableGroup):
    """A group the script made with torch's ``new_group`` in a sandbox (see the module docstring)."""

    made_by_runtime = False


class _NoPeers:
    """The communicator of a :class:`SandboxTorchGroup` still alive at the join: every use raises."""

    def __init__(self, label: str) -> None:
        self._label = label

    def __getattr__(self, name: str) -> Any:
        raise SandboxError(
            f"The group {self._label} was made with torch.distributed.new_group while this process was a standby, "
            "and was kept past its join: it has no peers, so it cannot carry traffic. Destroy such a group before "
            "training steps begin (dist.destroy_process_group), or make it with rt.new_group."
        )


class _Served:
    """torch's ``new_group`` while it is replaced, and what the groups made in its place are built with."""

    def __init__(self, original: Callable[..., Any], world_size: int, store: Any, kind: backends.Backend) -> None:
        self.original = original
        self.world_size = world_size
        self.store = store
        self.kind = kind


_served: _Served | None = None


def _sandbox_new_group(
    ranks: Iterable[int] | None = None,
    timeout: Any = None,
    backend: Any = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> Any:
    """What ``dist.new_group`` gives in a sandbox, as torch gives rank 0: a sandbox group, or a non-member.

    torch names a group from a counter every rank moves at every ``new_group`` (members or not), and the
    name is where its members meet in the store: the counter moves here too, or a joiner's next group
    would meet under the name of one its peers made and destroyed before. ``timeout``, ``backend`` and the
    rest shape a real communicator, which a sandbox group does not have.
    """
    assert _served is not None
    c10d._get_default_group()  # raises as torch does once the script destroyed the default group
    chosen = list(range(_served.world_size) if ranks is None else ranks)
    if use_local_synchronization and ranks is not None and SANDBOX_RANK not in chosen:
        return None  # torch makes no group and moves no counter for a rank outside it here
    members = sorted(chosen)
    if len(set(members)) != len(members):
        raise ValueError(f"The ranks {chosen} of a new group contain one twice; give each rank once.")
    if members and (members[0] < 0 or members[-1] >= _served.world_size):
        raise ValueError(f"The ranks {chosen} of a new group are not all in 0..{_served.world_size - 1}.")
    name = c10d._process_group_name(members, use_hashed_name=use_local_synchronization)
    if SANDBOX_RANK not in members:
        return c10d.GroupMember.NON_GROUP_MEMBER
    comm = SandboxComm(members.index(SANDBOX_RANK), len(members))
    label = f"torch.new_group.{name}"
    group = SandboxTorchGroup(label, members, SANDBOX_RANK, comm, 0, guarded=False, backend=_served.kind)
    register(group, _served.store, {g: i for i, g in enumerate(members)}, standby=members.index(SANDBOX_RANK))
    return group


def serve(world_size: int, store: Any, kind: backends.Backend) -> None:
    """(standby) Serve torch's ``new_group`` in the sandbox, until :func:`leave`; ``kind``: the
    backend of the groups it makes (``rt.group``'s)."""
    global _served
    if _served is None:
        _served = _Served(c10d.new_group, world_size, store, kind)
        c10d.new_group = dist.new_group = _sandbox_new_group


def _alive() -> list[SandboxTorchGroup]:
    """The groups made in the sandbox that torch still knows (not destroyed)."""
    return [group for group in c10d._world.pg_map if isinstance(group, SandboxTorchGroup)]


def leave() -> None:
    """(joiner) Put torch's ``new_group`` back; the groups made in the sandbox and still alive raise at
    their next use."""
    global _served
    if _served is None:
        return
    c10d.new_group = dist.new_group = _served.original
    for group in _alive():
        group.comm = _NoPeers(group.label)
    _served = None


def close() -> None:
    """(at exit) As :func:`leave`, and torch forgets the groups made in the sandbox still alive."""
    leave()
    for group in _alive():
        unregister(group)
