"""The one owner of a rank's groups: their names, versions, members and build order.

Every rank must build the same groups in the same order (a group's communicators meet on a store
prefix named after the group and the generation, and gloo and NCCL builds block until every
member arrives), so the order lives here, in one list, and nowhere else. The runtime adds groups
as the script creates them (``rt.group``, ``rt.new_group``, ``rt.device_mesh``); a planned move
(:mod:`rlaunch.runtime.migration`) and a live replacement (:mod:`rlaunch.runtime.recovery`)
ask it which groups a move touches and have it build their next communicators; a joiner renames
its mesh groups to its new lines *in place* (:meth:`GroupTable.rename`), so its build order stays
the survivors'. :meth:`GroupTable.describe` is that order, which the first vote after every move
compares across each group's members (see :mod:`rlaunch.runtime.contract`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch.distributed import Store

from rlaunch.runtime import backend as backends
from rlaunch.runtime.groups import SwitchableGroup

#: the name of the group of every rank (rt.group)
WORLD = "world"
#: builds a communicator: (store, prefix, rank, size, timeout, backend) -> ProcessGroup
Builder = Callable[[Store, str, int, int, datetime.timedelta, backends.Backend, Sequence[int] | None], Any]


class GroupTable:
    """A rank's groups in build order, and the communicators of their next versions."""

    def __init__(self, store: Store | None, timeout: datetime.timedelta, build: Builder = backends.build) -> None:
        self._store = store
        self._timeout = timeout
        self._build = build
        self._groups: list[SwitchableGroup] = []
        #: why no recovery follows any more ("" while steps run): see stop_guarding
        self._unguarded = ""

    def __contains__(self, name: object) -> bool:
        return any(g.label == name for g in self._groups)

    def __getitem__(self, name: str) -> SwitchableGroup:
        for group in self._groups:
            if group.label == name:
                return group
        raise KeyError(name)

    def __iter__(self) -> Iterator[SwitchableGroup]:
        return iter(list(self._groups))  # a snapshot: safe from other threads

    def names(self) -> list[str]:
        return [g.label for g in self._groups]

    def add(self, group: SwitchableGroup) -> None:
        """Append ``group`` (the next one in build order); names are unique."""
        if group.label in self:
            raise ValueError(f"A group named {group.label!r} already exists; give each group its own name.")
        self._groups.append(group)
        if self._unguarded:
            group.stop_guarding(self._unguarded)

    def stop_guarding(self, why: str) -> None:
        """The training loop ended (``why``): every group of this rank, and any made later (a final
        evaluation's ``rt.new_group``), stops guarding its collectives (see
        :meth:`SwitchableGroup.stop_guarding`)."""
        self._unguarded = why
        for group in self.mine():
            group.stop_guarding(why)

    def rename(self, old: str, new: str) -> None:
        """(joiner) Group ``old`` now goes by ``new``, at the same place in the build order."""
        group = self[old]
        if new != old and new in self:
            raise ValueError(f"A group named {new!r} already exists; mesh groups are named mesh.<dim>.<line>.")
        group.label = new

    def mine(self) -> list[SwitchableGroup]:
        """The groups this rank is a member of (a snapshot: safe from other threads)."""
        return [g for g in list(self._groups) if g.group_rank >= 0]

    def touched(self, rank: int, moved: Iterable[int], also: Iterable[str] = ()) -> list[str]:
        """In build order: the groups ``rank`` is a member of that contain a moved rank (or are named in ``also``)."""
        moved, extra = set(moved), set(also)
        return [g.label for g in self._groups if rank in g.members and (moved & set(g.members) or g.label in extra)]

    def build(self, names: Sequence[str], rank: int, gen: int) -> dict[str, Any]:
        """Communicators of generation ``gen`` for ``names`` (in build order), as global rank ``rank``."""
        assert self._store is not None
        comms: dict[str, Any] = {}
        for name in names:
            group = self[name]
            prefix = f"g{gen}/{name}/"
            comms[name] = self._build(
                self._store, prefix, group.members.index(rank), len(group.members), self._timeout, group.backend,
                group.members,
            )  # fmt: skip
        return comms

    def communicator(self, name: str, members: Sequence[int], rank: int, gen: int, kind: backends.Backend) -> Any:
        """The communicator of a group being created (``rt.new_group``, ``rt.device_mesh``)."""
        assert self._store is not None
        members = list(members)
        prefix = f"g{gen}/{name}/"
        return self._build(self._store, prefix, members.index(rank), len(members), self._timeout, kind, members)

    def channel(self, gen: int, side: int, moved_rank: int, kind: backends.Backend) -> Any:
        """The sender (side 0: leaver or replica) and joiner (side 1) of a moved rank meet under its name."""
        assert self._store is not None
        # no global ranks for torch: a joiner does not know its sender's
        return self._build(self._store, f"g{gen}/transfer/{moved_rank}/", side, 2, self._timeout, kind, None)

    def swap(self, comms: dict[str, Any], gen: int) -> None:
        """Put the communicators of generation ``gen`` in place (channels are not groups: skipped)."""
        for group in list(self._groups):
            if group.label in comms:
                group.swap(comms[group.label], gen)

    def describe(self) -> list[tuple[str, int, tuple[int, ...], str]]:
        """(name, version, members, backend) of every group, in build order."""
        return [(g.label, g.version, tuple(g.members), g.backend.value) for g in self._groups]
