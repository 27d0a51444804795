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

- ``SHARED``: every rank's row was the same. A change after the vote is taken to be the same on
  every rank (an average's counter), as for any tracked state found equal: a replica sends the
  buffer as it holds it now;
- ``KEPT``: this rank's buffer is still its row: the lost rank's row is taken to be its buffer;
- ``FROM_RANK0``: it now holds rank 0's row: DDP broadcast it, to the lost rank too, so a replica
  sends it as it holds it now (any rank that saw it tells the others, since rank 0 cannot see it);
- ``COPIED``: it now holds its own row of another buffer (an average's statistics copied from the
  model's): the lost rank's is its row of that buffer;
- ``CHANGED``: anything else. No replica knows what the lost rank's became: a replacement from a
  replica would diverge, and is refused (or rolls back to a host snapshot).

What a survivor reads is a :class:`Reading`; its :meth:`Reading.plan` says, for each buffer not
kept, where the lost rank's comes from, and the survivors' plans are merged before any sends.
Values are compared bit for bit in the vote's float64 (a NaN statistic equals itself).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class Kind(enum.Enum):
    """What became of one of this rank's buffers since the vote that carried it (see the module docstring)."""

    SHARED = "the same on every rank"
    KEPT = "unchanged"
    FROM_RANK0 = "rank 0's"
    COPIED = "a copy of another"
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

    def plan(self, every: bool) -> Plan:
        """Where each buffer not kept comes from; ``every``: also those every rank reads alike (SHARED),
        else only what other ranks may not see (FROM_RANK0, COPIED), for them to merge."""
        out: Plan = {}
        for i, kind in enumerate(self.kinds):
            if kind is Kind.FROM_RANK0 or (every and kind is Kind.SHARED):
                out[i] = None
            elif kind is Kind.COPIED:
                out[i] = self.copies[i]
        return out


def _bits(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """``buffers`` as one row of the vote's float64, read as 64-bit words (one copy to the host)."""
    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in buffers]).cpu().view(torch.int64)


@dataclass(frozen=True)
class Carried:
    """Every rank's buffers as one completed vote carried them."""

    step: int
    rows: torch.Tensor  # (world, elements) float64: one row per rank
    sizes: tuple[int, ...]  # elements of each buffer, in the order of the row

    def _segments(self) -> list[tuple[int, int]]:
        ends = list(itertools.accumulate(self.sizes))
        return [(end - n, end) for n, end in zip(self.sizes, ends, strict=True)]

    def matches(self, buffers: Sequence[torch.Tensor]) -> bool:
        """Whether ``buffers`` are laid out as the rows are."""
        return tuple(t.numel() for t in buffers) == self.sizes

    def _sums(self, values: torch.Tensor) -> list[int]:
        """Each buffer's sum of ``values`` (one per element of the row; as int64, wrapping)."""
        ids = torch.repeat_interleave(torch.arange(len(self.sizes)), torch.tensor(self.sizes, dtype=torch.int64))
        return torch.zeros(len(self.sizes), dtype=torch.int64).index_add_(0, ids, values.to(torch.int64)).tolist()

    def _whole(self, equal: torch.Tensor) -> list[bool]:
        """For each buffer, whether ``equal`` (one flag per element of the row) holds over all of it."""
        return [n == 0 for n in self._sums(~equal)]

    def compare(self, now: Sequence[torch.Tensor], rank: int) -> Reading:
        """What became of each of this rank's (``rank``) buffers, holding ``now``, since its row.

        A few whole-row operations, whatever the number of buffers."""
        rows = self.rows.view(torch.int64)
        held = _bits(now)
        shared = self._whole((rows == rows[:1]).all(dim=0))
        kept = self._whole(held == rows[rank])
        from_rank0 = self._whole(held == rows[0])
        kinds = [
            Kind.SHARED if shared[i] else Kind.KEPT if kept[i] else Kind.FROM_RANK0 if from_rank0[i] else Kind.CHANGED
            for i in range(len(self.sizes))
        ]
        copies = self._copies(held, rows[rank], [i for i, kind in enumerate(kinds) if kind is Kind.CHANGED], shared)
        for i in copies:
            kinds[i] = Kind.COPIED
        return Reading(kinds, copies)

    def _copies(self, held: torch.Tensor, row: torch.Tensor, changed: list[int], shared: list[bool]) -> dict[int, int]:
        """Which of the ``changed`` buffers hold this rank's ``row`` of another buffer. A copy's source differs
        by rank, so that a value alike on every rank (ones) is never taken for one; candidates are found by
        their sums, then compared whole."""
        if not changed:
            return {}
        segments = self._segments()
        mine, theirs = self._sums(held), self._sums(row)
        copies = {}
        for i in changed:
            a, b = segments[i]
            for j, (c, d) in enumerate(segments):
                candidate = j != i and not shared[j] and d - c == b - a and theirs[j] == mine[i]
                if candidate and torch.equal(held[a:b], row[c:d]):
                    copies[i] = j
                    break
        return copies

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
