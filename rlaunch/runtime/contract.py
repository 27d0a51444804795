"""The cross-rank contract: what every rank must decide alike, carried in the vote and compared.

A distributed runtime's worst bugs are ranks that disagree without knowing it: one applies
another plan's generation, builds its groups in another order, lays its vote out differently, or
commits another step. Each such decision is made a value here and compared across ranks:

- every step, the vote carries one 64-bit digest of the generation, the step, the last applied
  step and the vote's own layout (:class:`StepContract`); every rank must hold the same;
- at the first vote after every move (and the job's first), the vote also carries one slot per
  group of the job (:class:`GroupCatalog`): each member of a group writes a digest of where the
  group sits in its build order, its version, members and backend, and every member must agree.

A 64-bit digest rides in the float64 vote as four 16-bit *limbs*, each with its square: the sums
over n ranks say whether all were equal (n * sum of squares == square of the sum; exact below
2^53). When they disagree, one more allreduce gathers every rank's values (:func:`rows`) so that
every rank can name the ranks that differ and what differs (:func:`explain`), instead of hanging
or diverging. Only votes of one size can meet in an allreduce: everything that sets the size of a
vote (what is tracked, when replicas are compared: ``--verify-every`` is in the job's spec) must
be the same on every rank before the contract can compare the rest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlaunch.errors import RlaunchError

LIMBS = 4
TERMS = 2 * LIMBS  # each limb and its square
_MASK = (1 << 16) - 1


class ContractError(RlaunchError):
    """Ranks disagree on a decision every rank must make alike; the sentence names them."""


def limbs(value: int) -> list[int]:
    """A 64-bit value as four 16-bit limbs, low first."""
    return [(value >> (16 * i)) & _MASK for i in range(LIMBS)]


def from_limbs(parts: Sequence[float]) -> int:
    """The 64-bit value of four limbs (as :func:`limbs` gives them, summed over one rank's row)."""
    return sum(int(round(p)) << (16 * i) for i, p in enumerate(parts))


def terms(value: int) -> list[float]:
    """What one rank adds to a compared slot: each limb and its square."""
    return [float(x) for limb in limbs(value) for x in (limb, limb * limb)]


def agree(count: int, sums: Sequence[float]) -> bool:
    """Whether ``count`` ranks that each added :func:`terms` of their value all held the same value."""
    for i in range(0, len(sums), 2):
        total, squares = round(sums[i]), round(sums[i + 1])
        if count * squares != total * total:
            return False
    return True


def _digest(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class StepContract:
    """What every rank's vote of one step must agree on."""

    generation: int
    step: int
    applied: int
    #: the host snapshot a drain kept while its joiner waits for the leaver's copies (-1: none; see
    #: rlaunch.runtime.handover): a joiner that missed it would leave the job unprotected unseen
    kept: int
    layout: int  # the vote layout's digest

    def digest(self) -> int:
        """The 64-bit value every rank's vote carries (its limbs and their squares)."""
        return _digest(self.generation, self.step, self.applied, self.kept, self.layout)

    def row(self) -> list[float]:
        """This rank's values, for the gather that names the ranks that disagree (:func:`explain`)."""
        values = (self.generation, self.step, self.applied, self.kept)
        return [*map(float, values), *map(float, limbs(self.layout))]


ROW = 4 + LIMBS


def rows(group: Any, mine: Sequence[float], rank: int, world: int) -> torch.Tensor:
    """Every rank's ``mine`` (all the same length), gathered by one allreduce on ``group``: world x len."""
    table = torch.zeros(world, len(mine), dtype=torch.float64)
    table[rank] = torch.tensor(list(mine), dtype=torch.float64)
    group.allreduce([table]).wait()
    return table


def explain(table: torch.Tensor) -> str:
    """Name the ranks that differ, component by component, from every rank's :meth:`StepContract.row`."""
    parts = []
    names = (
        "the generation being applied", "the step being voted", "the last applied step (the commit point)",
        "the host snapshot a drain kept (-1: none)",
    )  # fmt: skip
    for col, what in enumerate(names):
        parts += _split(what, [int(round(v)) for v in table[:, col].tolist()])
    layouts = [from_limbs(r[len(names) : ROW]) for r in table.tolist()]
    parts += _split("the layout of the vote", [f"0x{v:016x}" for v in layouts])
    return "; ".join(parts) if parts else "their votes' digests differ"


def _split(what: str, values: Sequence[Any]) -> list[str]:
    by_value: dict[Any, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(value, []).append(rank)
    if len(by_value) < 2:
        return []
    held = ", ".join(f"ranks {ranks} have {value}" for value, ranks in by_value.items())
    return [f"{what} differs ({held})"]


class GroupCatalog:
    """One vote slot per group of the job, in an order every rank computes alike.

    ``names`` are every group of the job, sorted: the ones this rank's table holds (``rt.group``,
    every ``rt.new_group``, which every rank creates, members or not) and every line of the mesh
    (a rank holds only its own lines).
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(sorted(set(names)))

    def section(self, described: Sequence[tuple[str, int, tuple[int, ...], str]], rank: int) -> torch.Tensor:
        """This rank's slots: for each group it is a member of, a digest of its place in the build order,
        version, members and backend (``described``: :meth:`GroupTable.describe`, every group this rank
        holds in build order)."""
        out = torch.zeros(len(self.names) * TERMS, dtype=torch.float64)
        # The place in the whole table: every rank holds every rt.new_group (members or not) and one
        # line per mesh dimension, so two members of a group built alike give it the same place.
        for position, (name, version, members, backend) in enumerate(described):
            if rank not in members:
                continue
            at = self.names.index(name) * TERMS
            held = _digest(position, version, members, backend)
            out[at : at + TERMS] = torch.tensor(terms(held), dtype=torch.float64)
        return out

    def disagreeing(self, summed: torch.Tensor, members: dict[str, int]) -> list[str]:
        """The groups whose members did not all write the same slot (``members``: each group's size)."""
        found = []
        for i, name in enumerate(self.names):
            count = members.get(name, 0)
            if count and not agree(count, summed[i * TERMS : (i + 1) * TERMS].tolist()):
                found.append(name)
        return found
