"""The job's node records as the leader's watch reports their changes, so that a tick need not read
them all from etcd.

A controller plans from every node record. Read whole at every tick, they cost O(N) per tick: at
4,096 nodes about 1.2 MB from etcd and half of each tick's CPU, about ten ticks a second while a
move's record writes come in (4,096 or more at 4,096 nodes). The leading agent's watch receives each of
those changes anyway, so :class:`NodeFeed` keeps the records from it. A tick reads them whole
when the feed cannot vouch for them, and also (rlaunch.controller.controller) after a lease it
revoked itself, at a tick no change woke (a deadline's), at the tick after a failed one; and the
agent asks for a new whole read when etcd comes back to it (:meth:`NodeFeed.resync`). A watch can
stay open and silent on an etcd member cut off from the others, and then only such ticks run.

- ``blind``: no watch of the records runs (not leading yet, or the watch broke and is not back);
  every tick reads them whole, as before.
- ``catching_up``: a watch runs, but no whole read was taken since it started (or since etcd came
  back).
- ``following``: a whole read at revision R was taken since then, and every change after R is
  applied in order: the records are those of etcd as of the last change received.

No change is lost between the read and the watch. A whole read is taken only when it began in the
feed's present epoch (:meth:`NodeFeed.begin_read` hands it out; a watch's start, its end and a
resync each begin a new one): the watch that runs was opened from a revision read before, and
delivers in order, so every change the read missed comes after R on it. Changes received while
the read is in flight are kept with it (:class:`WholeRead`) and applied after it, those after R.
"""

from __future__ import annotations

import dataclasses
import enum

from rlaunch.store.client import KV, WatchEvent


class FeedState(enum.Enum):
    BLIND = "blind"
    CATCHING_UP = "catching_up"
    FOLLOWING = "following"


@dataclasses.dataclass(eq=False)
class WholeRead:
    """A whole read of the records in flight: the watch it began under, and the changes received
    since it began (those after its revision are applied once it is taken)."""

    epoch: int
    since: list[WatchEvent] = dataclasses.field(default_factory=list)


class NodeFeed:
    """Node records kept from a watch of their prefix (see the module's docstring)."""

    def __init__(self) -> None:
        self.state = FeedState.BLIND
        #: bumped whenever a watch starts or ends: a whole read begun under another watch is refused
        self.epoch = 0
        self._records: dict[str, KV] = {}
        self._revision = 0  # the revision of the whole read the records follow from
        self._reads: list[WholeRead] = []  # whole reads in flight under this epoch's watch

    def watching(self) -> None:
        """A watch of the node records starts, from a revision read before this call: what is held
        may have missed changes, and a read begun before is refused."""
        self._new_epoch(FeedState.CATCHING_UP)

    def blind(self) -> None:
        """The watch of the node records ended (it broke, or this node no longer leads)."""
        self._new_epoch(FeedState.BLIND)

    def resync(self) -> None:
        """etcd was away from this agent: the watch may have been silent meanwhile (on a member cut
        off from the others), so what is held is vouched for again only after a new whole read."""
        if self.state is not FeedState.BLIND:
            self._new_epoch(FeedState.CATCHING_UP)

    def saw(self, ev: WatchEvent) -> None:
        """A change of a node record, as the watch delivered it (in revision order)."""
        if self.state is FeedState.FOLLOWING:
            self._apply(ev)
        for read in self._reads:
            read.since.append(ev)  # (a change that read may not have had: applied after it)

    def begin_read(self) -> WholeRead:
        """A whole read of the records begins now: hand it to :meth:`read_whole` with what it read,
        or to :meth:`abandon` if it failed."""
        read = WholeRead(self.epoch)
        if self.state is not FeedState.BLIND:
            self._reads.append(read)
        return read

    def read_whole(self, read: WholeRead, records: list[KV], revision: int) -> None:
        """Take ``read``, which found ``records`` at ``revision``; refused if a watch started or
        ended since it began."""
        self.abandon(read)
        if read.epoch != self.epoch or self.state is FeedState.BLIND or revision <= 0:
            return  # (revision 0: etcd's answer had no header; not a read to follow from)
        self._records = {kv.key: kv for kv in records}
        self._revision = revision
        self.state = FeedState.FOLLOWING
        for ev in read.since:
            self._apply(ev)

    def abandon(self, read: WholeRead) -> None:
        """``read`` ended without records (it failed): changes are no longer kept for it."""
        if read in self._reads:
            self._reads.remove(read)

    def records(self) -> list[KV] | None:
        """The records as etcd holds them as of the last change received; ``None`` unless following."""
        return list(self._records.values()) if self.state is FeedState.FOLLOWING else None

    def _new_epoch(self, state: FeedState) -> None:
        self.epoch += 1
        self.state = state
        self._records, self._reads = {}, []

    def _apply(self, ev: WatchEvent) -> None:
        if ev.mod_revision <= self._revision:
            return  # the whole read already had it
        if ev.deleted:
            self._records.pop(ev.key, None)
        else:
            self._records[ev.key] = ev.kv()
