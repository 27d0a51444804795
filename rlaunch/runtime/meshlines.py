"""Which ranks form each line of a device mesh's dimensions: pure layout logic for :mod:`rlaunch.runtime.mesh`.

A mesh dimension falls into *lines*, the ranks that share every other coordinate; each line is one
group (``mesh.<dim>.<line>``). The mesh's own dimensions are read from its rank tensor
(:func:`dim_lines`); a dimension torch flattens or unflattens from it comes as a layout, the offsets
of its coordinates from a line's first rank (:func:`lines_at`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlaunch.errors import UsageError


def layout(shape: Sequence[int]) -> torch.Tensor:
    """Global ranks arranged in ``shape`` (row-major), as ``init_device_mesh`` arranges them."""
    return torch.arange(_numel(shape), dtype=torch.int).reshape(tuple(shape))


def dim_lines(mesh: torch.Tensor, dim: int) -> list[list[int]]:
    """Every line of ``mesh`` along ``dim``: the ranks that share every other coordinate."""
    return [[int(r) for r in members] for members in mesh.transpose(dim, -1).reshape(-1, mesh.shape[dim]).tolist()]


def line_of(mesh: torch.Tensor, rank: int, dim: int) -> tuple[int, list[int]]:
    """The line of ``rank`` along ``dim``: its index among that dimension's lines, and its members."""
    return find_line(dim_lines(mesh, dim), rank)


def find_line(lines: Sequence[Sequence[int]], rank: int) -> tuple[int, list[int]]:
    """The line that holds ``rank``: its index and its members."""
    for index, members in enumerate(lines):
        if rank in members:
            return index, list(members)
    raise ValueError(f"Rank {rank} is in none of the lines {[list(m) for m in lines]}.")


def lines_at(offsets: Sequence[int], world: int) -> list[list[int]]:
    """The lines of a dimension whose coordinates sit at ``offsets`` from its line's first rank.

    ``offsets`` is torch's layout of a flattened or unflattened dimension, in coordinate order
    (``_FlatLayout.all_ranks_from_zero()``: ``mesh[a, b]._flatten()`` of a ``(2, 2, 2)`` mesh
    ``(a, b, c)`` is ``[0, 2, 4, 6]``); its lines are that pattern moved to each rank it does not
    cover yet, in the order of their first rank.
    """
    if not offsets or offsets[0] != 0:
        raise ValueError(f"The layout offsets {list(offsets)} must start at 0.")
    covered = [False] * world
    lines = []
    for first in range(world):
        if covered[first]:
            continue
        line = [first + o for o in offsets]
        if len(set(line)) != len(line) or any(r < 0 or r >= world or covered[r] for r in line):
            raise ValueError(f"The layout offsets {list(offsets)} do not tile {world} ranks into lines.")
        for r in line:
            covered[r] = True
        lines.append(line)
    return lines


def coordinates(dims: Sequence[tuple[str, Sequence[Sequence[int]]]], world: int) -> torch.Tensor:
    """Every global rank's coordinate on each of ``dims`` (its place in its line there): one row per rank.

    What the replica and sampler rules read a rank's place from (:mod:`rlaunch.runtime.shards`,
    :mod:`rlaunch.runtime.replicas`, :mod:`rlaunch.runtime.partition`), the mesh's own dimensions
    and those flattened or unflattened from it alike; a dimension's size is its largest coordinate
    plus one.
    """
    table = torch.zeros(world, len(dims), dtype=torch.long)
    for column, (_, lines) in enumerate(dims):
        for line in lines:
            table[list(line), column] = torch.arange(len(line))
    return table


def coordinate(mesh: torch.Tensor, rank: int) -> tuple[int, ...]:
    found = (mesh == rank).nonzero()
    if found.size(0) != 1:
        raise ValueError(f"Rank {rank} is not in the mesh of shape {tuple(mesh.shape)}.")
    return tuple(int(c) for c in found[0].tolist())


def group_name(dim_name: str, line: int) -> str:
    return f"mesh.{dim_name}.{line}"


def check_shape(shape: Sequence[int], names: Sequence[str] | None, world_size: int) -> tuple[str, ...]:
    """Validate a mesh request; return its dimension names (``dim0``, ``dim1``... by default)."""
    dims = tuple(int(s) for s in shape)
    if not dims or any(s < 1 for s in dims):
        raise ValueError(f"The mesh shape {tuple(shape)} must be one or more positive sizes.")
    if _numel(dims) != world_size:
        raise ValueError(
            f"The mesh shape {dims} holds {_numel(dims)} ranks but the job has {world_size}; "
            "give a shape whose sizes multiply to the world size."
        )
    chosen = tuple(names) if names is not None else tuple(f"dim{i}" for i in range(len(dims)))
    if len(chosen) != len(dims) or len(set(chosen)) != len(chosen):
        raise ValueError(f"The mesh dimension names {chosen} must be {len(dims)} distinct names.")
    return chosen


def check_derived(name: str, lines: list[list[int]], dims: Sequence[tuple[str, list[list[int]]]]) -> int | None:
    """Where a flattened or unflattened dimension ``name`` with ``lines`` already is among ``dims`` (None: new).

    Refused: the name of another dimension with other lines (its groups would share names), and lines
    not in increasing rank order (a runtime group orders its members by rank; torch's coordinates
    would then disagree with the group ranks).
    """
    for index, (known, held) in enumerate(dims):
        if known == name:
            if sorted(held) != sorted(lines):  # the same lines, perhaps listed in another order
                raise UsageError(
                    f"The mesh dimension {name!r} made by _flatten or _unflatten has the lines {lines}, but a "
                    f"dimension of that name already has the lines {held}; give each mesh dimension its own name."
                )
            return index
    if any(line != sorted(line) for line in lines):
        raise UsageError(
            f"The mesh dimension {name!r} made by _flatten or _unflatten orders its ranks as {lines}, not by rank, "
            "which rlaunch's groups cannot follow; flatten or unflatten dimensions in the mesh's own order."
        )
    return None


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
