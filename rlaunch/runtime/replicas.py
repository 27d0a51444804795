"""Which ranks hold equal copies of a tensor: the replica sets that verification compares.

Data parallelism keeps replicas: after every optimizer step, DDP ranks hold the same parameters
and optimizer state, and so do the ranks of HSDP's replicate dimension and the ranks across
which a DTensor is ``Replicate``. Those equalities are what a live replacement relies on (a
replica's state is sent to the replacement) and what the runtime checks while the job runs
(:mod:`rlaunch.runtime.verify`).

A tensor's *pattern* names the mesh dimensions its local data depends on: the dimensions on
which its DTensor placement is not ``Replicate`` (the root mesh's, or those flattened or
unflattened from it). Two ranks hold the same local data exactly when
their coordinates agree on every dimension of the pattern, so the ranks fall into *slots*, one
per coordinate on the pattern's dimensions. A plain tensor's pattern is empty (every rank holds
it: DDP), unless the script declared which ranks hold equal copies (:class:`Declared`, for
tensor or expert parallelism built by hand on ``rt.new_group``): then the slots are its sets.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

#: the pattern of plain tensors when the script declared its replica sets
DECLARED = ("<declared>",)
#: the pattern of a tensor whose layout cannot be read (a mesh that is not rt.device_mesh's): never compared
UNKNOWN = ("<unknown>",)

Pattern = tuple[str, ...]


@dataclass(frozen=True)
class Declared:
    """The script's replica sets (``rt.declare_replicas``): a partition of the ranks."""

    sets: tuple[tuple[int, ...], ...]

    def index(self, rank: int) -> int:
        """The set ``rank`` belongs to."""
        return next(i for i, members in enumerate(self.sets) if rank in members)


def declare(sets: Sequence[Sequence[int]], world_size: int) -> Declared:
    """Validate the script's replica sets: lists of ranks, every rank in exactly one."""
    shown = repr(sets)
    ok = isinstance(sets, (list, tuple)) and all(
        isinstance(m, (list, tuple, range)) and m and all(type(r) is int for r in m) for m in sets
    )
    cleaned = tuple(tuple(sorted(m)) for m in sets) if ok else ()
    flat = sorted(r for members in cleaned for r in members)
    if not ok or flat != list(range(world_size)):
        raise ValueError(
            f"rt.declare_replicas({shown}) must be a list of lists of ranks naming every rank 0..{world_size - 1} "
            "exactly once, each in the set of ranks that hold the same parameters (the data-parallel group of each "
            "rank), e.g. [[0, 2], [1, 3]]."
        )
    return Declared(tuple(sorted(cleaned)))


def _is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def pattern_of(t: torch.Tensor, root_names: Sequence[str], declared: Declared | None) -> Pattern:
    """The mesh dimensions (among ``root_names``: the mesh's and those made from it) ``t``'s local data
    depends on (see the module docstring)."""
    if not _is_dtensor(t):
        return DECLARED if declared is not None else ()
    from torch.distributed.tensor import Replicate

    names = t.device_mesh.mesh_dim_names or ()  # type: ignore[attr-defined]
    dims = {n for n, p in zip(names, t.placements, strict=False) if not isinstance(p, Replicate)}  # type: ignore[attr-defined]
    if not names or not dims <= set(root_names):
        return UNKNOWN
    return tuple(n for n in root_names if n in dims)


@dataclass(frozen=True)
class Slots:
    """The replica slots of one pattern: the slot of every rank, and how many ranks each holds."""

    of_rank: tuple[int, ...]

    @property
    def counts(self) -> tuple[int, ...]:
        found = [0] * (max(self.of_rank) + 1)
        for slot in self.of_rank:
            found[slot] += 1
        return tuple(found)

    @property
    def comparable(self) -> bool:
        """Some slot holds two or more ranks: there is something to compare."""
        return len(set(self.of_rank)) < len(self.of_rank)

    def members(self, slot: int) -> list[int]:
        """The ranks of ``slot``."""
        return [r for r, s in enumerate(self.of_rank) if s == slot]


def slots(pattern: Pattern, world: int, mesh: torch.Tensor | None, names: Sequence[str],
          declared: Declared | None) -> Slots:  # fmt: skip
    """The slots of ``pattern`` (``mesh``: every rank's coordinate on each dimension of ``names``, one row
    per rank, as :func:`rlaunch.runtime.meshlines.coordinates` gives them; or None)."""
    if pattern == UNKNOWN:
        return Slots(tuple(range(world)))  # each rank alone: nothing is compared
    if pattern == DECLARED:
        assert declared is not None
        return Slots(tuple(declared.index(r) for r in range(world)))
    if not pattern or mesh is None:
        return Slots(tuple([0] * world))
    key = torch.zeros(world, dtype=torch.long)
    for name in pattern:
        column = mesh[:, list(names).index(name)]
        key = key * (int(column.max()) + 1) + column
    slot = torch.unique(key, return_inverse=True)[1]  # numbered from 0 (flattened dimensions leave gaps)
    return Slots(tuple(int(k) for k in slot.tolist()))
