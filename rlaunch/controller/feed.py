"""The job's node records as the leader's watch reports their changes, so that a tick need not read
them all from etcd.

A controller plans from every node record. Read whole at every tick, they cost O(N) per tick: at
4,096 nodes about 1.2 MB from etcd and half of each tick's CPU, about ten ticks a second while a
move's 8,190 record writes come in. The leading agent's watch receives each of those changes
anyway, so :class:`NodeFeed` keeps the records from it, and a tick reads them whole only when the
feed cannot vouch for them:

- ``blind``: no watch of the records runs (not leading yet, or the watch broke and is not back);
  every tick reads them whole, as before.
- ``catching_up``: a watch runs, but no whole read was taken since it started.
- ``following``: a whole read at revision R was taken since the watch started, and every change
  after R is applied in order: the records are those of etcd as of the last change received.

No change is lost between the read and the watch. A whole read is taken only when it began under
the watch that runs now (:meth:`NodeFeed.begin_read` hands out the watch's epoch): that watch was
opened from a revision read before, so every change the read missed comes after R on it. Changes
received while the read is in flight are kept aside and applied after it, those after R.
"""

from __future__ import annotations

import enum

from rlaunch.store.client import KV, WatchEvent


class FeedState(enum.Enum):
    BLIND = "blind"
    CATCHING_UP = "catching_up"
    FOLLOWING = "following"


class NodeFeed:
    """Node records kept from a watch of their prefix (see the module's docstring)."""

    def __init__(self) -> None:
        self.state = FeedState.BLIND
        #: bumped whenever a watch starts or ends: a whole read begun under another watch is refused
        self.epoch = 0
        self._records: dict[str, KV] = {}
        self._revision = 0  # the revision of the whole read the records follow from
        self._aside: list[WatchEvent] = []  # changes received while a whole read was in flight
        self._reading = False  # a whole read is in flight (begun under the watch of this epoch)

    def watching(self) -> None:
        """A watch of the node records starts, from a revision read before this call: what is held
        may have missed changes, and a read begun before is refused."""
        self.epoch += 1
        self.state = FeedState.CATCHING_UP
        self._records, self._aside, self._reading = {}, [], False

    def blind(self) -> None:
        """The watch of the node records ended (it broke, or this node no longer leads)."""
        self.epoch += 1
        self.state = FeedState.BLIND
        self._records, self._aside, self._reading = {}, [], False

    def saw(self, ev: WatchEvent) -> None:
        """A change of a node record, as the watch delivered it (in revision order)."""
        if self.state is FeedState.FOLLOWING:
            self._apply(ev)
        if self._reading:
            self._aside.append(ev)  # (a change the read in flight may not have had: applied after it)

    def begin_read(self) -> int:
        """A whole read of the records begins now: returns the epoch to hand to :meth:`read_whole`."""
        self._aside, self._reading = [], self.state is not FeedState.BLIND
        return self.epoch

    def read_whole(self, epoch: int, records: list[KV], revision: int) -> None:
        """Take a whole read of the records at ``revision``, begun (:meth:`begin_read`) when the
        epoch was ``epoch``; refused if a watch started or ended since."""
        aside, self._aside, self._reading = self._aside, [], False
        if epoch != self.epoch or self.state is FeedState.BLIND:
            return
        self._records = {kv.key: kv for kv in records}
        self._revision = revision
        self.state = FeedState.FOLLOWING
        for ev in aside:
            self._apply(ev)

    def records(self) -> list[KV] | None:
        """The records as etcd holds them as of the last change received; ``None`` unless following."""
        return list(self._records.values()) if self.state is FeedState.FOLLOWING else None

    def _apply(self, ev: WatchEvent) -> None:
        if ev.mod_revision <= self._revision:
            return  # the whole read already had it
        if ev.deleted:
            self._records.pop(ev.key, None)
        else:
            self._records[ev.key] = ev.kv()
