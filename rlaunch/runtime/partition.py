"""Which partition of the data a rank's sampler reads: its global rank, or a coordinate.

A ``DistributedSampler`` splits the dataset into ``num_replicas`` parts and reads part ``rank``.
Under pure data parallelism that is the global rank; under tensor x data parallelism it is the
rank's coordinate on the data-parallel mesh dimension (``num_replicas`` is that dimension's
size), and ranks of one tensor-parallel group read the same part. A joiner must read the part
of the position it takes, so the runtime must know the rule, and one rank alone cannot tell it:
rank 0 has coordinate 0 on every dimension.

So every candidate rule (:func:`candidates`: the global rank, each mesh dimension's coordinate
(the mesh's own and those flattened or unflattened from it: ``mesh["dp", "cp"]._flatten("dp_cp")``),
the index in the script's declared replica set) is checked on every rank at the first vote
after ``rt.epochs`` (each rank adds 1 for each rule its sampler follows) and the first rule all
ranks follow is taken (:func:`choose`). A joiner learns it from its sender. With none, the
loader cannot be moved live, and the runtime says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlaunch.runtime.replicas import Declared

GLOBAL = "global"
DECLARED = "declared"
SECTION = "partition"


def candidates(mesh_names: Sequence[str], declared: Declared | None) -> list[str]:
    """The rules a sampler may follow, in the order they are preferred."""
    rules = [GLOBAL, *(f"mesh:{n}" for n in mesh_names)]
    if declared is not None:
        rules.append(DECLARED)
    return rules


def part(rule: str, rank: int, world: int, mesh: torch.Tensor | None, names: Sequence[str],
         declared: Declared | None) -> tuple[int, int]:  # fmt: skip
    """(number of parts, the part of ``rank``) under ``rule`` (``mesh``: every rank's coordinate on each
    dimension of ``names``, one row per rank, as :func:`rlaunch.runtime.meshlines.coordinates` gives them)."""
    if rule == GLOBAL:
        return world, rank
    if rule == DECLARED:
        assert declared is not None
        # a rank's part is its position in its replica set: ranks at one position form a data-parallel group
        mine = next(s for s in declared.sets if rank in s)
        return len(mine), mine.index(rank)
    name = rule.removeprefix("mesh:")
    assert mesh is not None, rule
    column = mesh[:, list(names).index(name)]  # every rank's coordinate on the dimension
    return int(column.max()) + 1, int(column[rank])


def follows(sampler: Any, rule: str, rank: int, world: int, mesh: torch.Tensor | None, names: Sequence[str],
            declared: Declared | None) -> bool:  # fmt: skip
    """Whether ``sampler`` (with ``num_replicas`` and ``rank``) reads ``rank``'s part under ``rule``."""
    parts, mine = part(rule, rank, world, mesh, names, declared)
    return int(sampler.num_replicas) == parts and int(sampler.rank) == mine


def choose(rules: Sequence[str], summed: Sequence[float], world: int) -> str | None:
    """The first rule every rank's sampler follows (from the vote's sums), or None."""
    return next((r for r, total in zip(rules, summed, strict=True) if round(total) == world), None)


def has_partition(sampler: Any) -> bool:
    """Whether ``sampler`` reads one part of several (a ``DistributedSampler``)."""
    return sampler is not None and hasattr(sampler, "num_replicas") and hasattr(sampler, "rank")
