"""What a vote carried of every rank's module buffers, read once the step went on past it.

Under DDP each rank's module buffers differ (its BatchNorm statistics after its own batch), and no
replica holds a lost rank's: so every step's vote carries each rank's buffers as that rank held
them at its vote, one row per rank (see :mod:`rlaunch.runtime.vote`), and a replica serving a lost
rank sends that rank's row in place of its own buffers.

A script may change buffers after the vote, before the next step starts: DDP broadcasts rank 0's
at a forward that follows a synchronised one (an evaluation), and a model average updates its own
(``AveragedModel.update_parameters``: its counter, and its BatchNorm statistics: copied from the
model's, or averaged with ``use_buffers=True``). The lost rank made those changes too, but they
died with it, so a row may no longer be what it held. Each rank tells, by value and buffer by
buffer, what happened to its own since its row (:meth:`Carried.compare`):

- ``SHARED``: every rank's row was the same, and the buffer is still its row, or is an integer
  (a counter: an average's, BatchNorm's) whose change is taken to be the same on every rank: a
  replica sends it as it holds it now;
- ``KEPT``: this rank's buffer is still its row: the lost rank's row is taken to be its buffer;
- ``FROM_RANK0``: it now holds rank 0's row of it, or of another buffer: DDP broadcast it, to the
  lost rank too, so a replica sends it as it holds it now. Rank 0 cannot see a broadcast by value;
  every rank counts DDP's broadcasts as well (:func:`rlaunch.runtime.stepstate.broadcasts`);
- ``COPIED``: it now holds its own row of another buffer (an average's statistics copied from the
  model's): the lost rank's is its row of that buffer;
- ``UNSURE``: (rank 0 only) a copy of a buffer DDP broadcast after the vote, which rank 0 cannot
  tell made before or after the broadcast: another survivor says which, or no replica can serve;
- ``CHANGED``: anything else (a float buffer every rank held alike that moved without being a copy
  included). No replica knows what the lost rank's became: a replacement from a replica would
  diverge, and is refused (or rolls back to a host snapshot).

What a survivor reads is a :class:`Reading`: what it tells the other survivors (:meth:`Reading.told`)
and what it sends (:meth:`Reading.sent`) say, for each buffer not kept, where the lost rank's comes
from. Values are compared bit for bit in the vote's float64 (a NaN statistic equals itself), with a
few operations over the whole row, whatever the number of buffers.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode


class Kind(enum.Enum):
    """What became of one of this rank's buffers since the vote that carried it (see the module docstring)."""

    SHARED = "the same on every rank"
    KEPT = "unchanged"
    FROM_RANK0 = "rank 0's"
    COPIED = "a copy of another"
    UNSURE = "a copy, before or after a broadcast"
    CHANGED = "changed"


#: where a lost rank's buffer comes from, by buffer index (absent: its own row of that buffer):
#: None, the buffer as the replica holds it; an index, the lost rank's row of that other buffer
Plan = dict[int, "int | None"]


@dataclass(frozen=True)
class Reading:
    """What became of each of one rank's buffers since its row (:meth:`Carried.compare`)."""

    kinds: list[Kind]
    copies: dict[int, int]  # a COPIED buffer -> the buffer whose row it holds

    @property
    def changed(self) -> int | None:
        """The first buffer no replica can know the lost rank's of (None: there is none)."""
        return self.kinds.index(Kind.CHANGED) if Kind.CHANGED in self.kinds else None

    @property
    def unsure(self) -> set[int]:
        """The buffers another survivor must say the source of."""
        return {i for i, kind in enumerate(self.kinds) if kind is Kind.UNSURE}

    def told(self) -> Plan:
        """What this rank tells the other survivors: the sources they may not see (rank 0 sees no broadcast)."""
        plan: Plan = {i: None for i, kind in enumerate(self.kinds) if kind is Kind.FROM_RANK0}
        plan.update(self.copies)
        return plan

    def sent(self) -> Plan:
        """Where each buffer this rank sends comes from (with what it told, those every rank reads alike)."""
        plan = self.told()
        plan.update({i: None for i, kind in enumerate(self.kinds) if kind is Kind.SHARED})
        return plan


def _cached(make: Callable[..., Any]) -> Callable[..., Any]:
    """``make``, its results kept by argument; not under a dispatch mode (torch's FakeTensorMode), whose
    tensors would be garbage once read outside it."""
    kept = functools.lru_cache(maxsize=16)(make)

    def get(*key: Any) -> Any:
        return make(*key) if _get_current_dispatch_mode() is not None else kept(*key)

    return get


@_cached
def _grouping(key: tuple[tuple[int, torch.dtype, torch.device], ...]) -> tuple[list[list[int]], torch.Tensor]:
    """For buffers of these (elements, dtype, device): the indices of each dtype and device, and where each
    element of the buffers read group by group lies in the row."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, (_, dtype, device) in enumerate(key):
        groups.setdefault((dtype, device), []).append(i)
    starts = [0, *itertools.accumulate(n for n, _, _ in key)]
    order = [i for members in groups.values() for i in members]
    where = [torch.arange(starts[i], starts[i + 1]) for i in order]
    return list(groups.values()), torch.cat(where) if where else torch.zeros(0, dtype=torch.int64)


def row_of(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """``buffers`` as one row of the vote: float64 on the host, one copy to it per dtype and device."""
    groups, where = _grouping(tuple((t.numel(), t.dtype, t.device) for t in buffers))
    parts = [torch.cat([buffers[i].detach().reshape(-1) for i in g]).to(torch.float64).cpu() for g in groups]
    if len(parts) == 1:
        return parts[0]
    row = torch.empty(where.numel(), dtype=torch.float64)
    row[where] = torch.cat(parts)
    return row


@_cached
def _segment_ids(sizes: tuple[int, ...]) -> torch.Tensor:
    """The buffer each element of a row belongs to."""
    return torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes, dtype=torch.int64))


@dataclass(frozen=True)
class Carried:
    """Every rank's buffers as one completed vote carried them."""

    step: int
    rows: torch.Tensor  # (world, elements) float64: one row per rank
    sizes: tuple[int, ...]  # elements of each buffer, in the order of the row
    #: each tracked DDP module's count of forwards that broadcast rank 0's buffers, at the vote
    broadcasts: tuple[tuple[str, int], ...] = ()

    def _segments(self) -> list[tuple[int, int]]:
        ends = list(itertools.accumulate(self.sizes))
        return [(end - n, end) for n, end in zip(self.sizes, ends, strict=True)]

    def matches(self, buffers: Sequence[torch.Tensor]) -> bool:
        """Whether ``buffers`` are laid out as the rows are."""
        return tuple(t.numel() for t in buffers) == self.sizes

    def _sums(self, values: torch.Tensor) -> list[int]:
        """Each buffer's sum of ``values`` (one per element of the row; as int64, wrapping)."""
        sums = torch.zeros(len(self.sizes), dtype=torch.int64)
        return sums.index_add_(0, _segment_ids(self.sizes), values.to(torch.int64)).tolist()

    def _whole(self, equal: torch.Tensor) -> list[bool]:
        """For each buffer, whether ``equal`` (one flag per element of the row) holds over all of it."""
        return [n == 0 for n in self._sums(~equal)]

    def unchanged(self, now: Sequence[torch.Tensor], rank: int) -> bool:
        """Whether this rank's buffers are all still its row (one comparison)."""
        return torch.equal(row_of(now).view(torch.int64), self.rows[rank].view(torch.int64))

    def compare(self, now: Sequence[torch.Tensor], rank: int, broadcast: frozenset[int] = frozenset()) -> Reading:
        """What became of each of this rank's (``rank``) buffers, holding ``now``, since its row.

        ``broadcast``: the buffers DDP broadcast from rank 0 since the vote, as its flag says.
        """
        rows = self.rows.view(torch.int64)
        held = row_of(now).view(torch.int64)
        shared = self._whole((rows == rows[:1]).all(dim=0))
        kept = self._whole(held == rows[rank])
        from_rank0 = self._whole(held == rows[0])
        kinds = []
        for i, t in enumerate(now):
            if i in broadcast and from_rank0[i]:
                kinds.append(Kind.FROM_RANK0)
            elif kept[i] or (shared[i] and not (t.is_floating_point() or t.is_complex())):
                kinds.append(Kind.SHARED if shared[i] else Kind.KEPT)
            elif from_rank0[i]:
                kinds.append(Kind.FROM_RANK0)
            else:
                kinds.append(Kind.CHANGED)
        reading = Reading(kinds, {})
        self._find_copies(reading, held, rows, rank, shared, broadcast)
        return reading

    def _find_copies(
        self, reading: Reading, held: torch.Tensor, rows: torch.Tensor, rank: int, shared: list[bool],
        broadcast: frozenset[int],
    ) -> None:  # fmt: skip
        """Which of the CHANGED buffers hold a row of another buffer that differs by rank (so that a value
        alike on every rank, ones, is never taken for a copy): this rank's own (COPIED; UNSURE on rank 0
        for a buffer DDP broadcast since), or rank 0's (FROM_RANK0). Candidates are found by their sums,
        then compared whole."""
        changed = [i for i, kind in enumerate(reading.kinds) if kind is Kind.CHANGED]
        if not changed:
            return
        segments = self._segments()
        mine, own, first = self._sums(held), self._sums(rows[rank]), self._sums(rows[0])
        by_sum: dict[tuple[int, int], list[tuple[int, int]]] = {}  # (elements, sum) -> (buffer, whose row: 1 own)
        for j, (c, d) in enumerate(segments):
            if not shared[j]:
                by_sum.setdefault((d - c, own[j]), []).append((j, 1))
                by_sum.setdefault((d - c, first[j]), []).append((j, 0))
        for i in changed:
            a, b = segments[i]
            for j, whose in by_sum.get((b - a, mine[i]), []):
                c, d = segments[j]
                if j == i or not torch.equal(held[a:b], rows[rank if whose else 0, c:d]):
                    continue
                if whose and not (rank == 0 and j in broadcast):
                    reading.kinds[i] = Kind.COPIED
                    reading.copies[i] = j
                elif whose:  # rank 0's own row is rank 0's: a copy of a buffer DDP broadcast, from before or after
                    reading.kinds[i] = Kind.UNSURE
                else:
                    reading.kinds[i] = Kind.FROM_RANK0
                break

    def broadcast(self, counts: dict[str, int], owners: Sequence[str]) -> frozenset[int]:
        """The buffers DDP broadcast from rank 0 since the vote: those of the modules that counted a broadcast
        since (``counts``: each tracked DDP module's count now; ``owners``: the tracked module each buffer is of)."""
        since = {owner for owner, at_vote in self.broadcasts if counts.get(owner, at_vote) > at_vote}
        return frozenset(i for i, owner in enumerate(owners) if owner in since)

    def fill(self, buffers: Sequence[torch.Tensor], moved: int, plan: Plan) -> None:
        """Put into ``buffers`` what rank ``moved`` holds as ``plan`` says (those it maps to None stay as held)."""
        segments = self._segments()
        with torch.no_grad():
            for i, t in enumerate(buffers):
                source = plan.get(i, i)
                if source is None:
                    continue
                a, b = segments[source]
                t.copy_(self.rows[moved, a:b].reshape(t.shape).to(t.dtype))
