"""Which data partition a sampler reads: found from every rank's sampler at the first vote."""

from __future__ import annotations

from types import SimpleNamespace

from rlaunch.runtime import partition
from rlaunch.runtime.mesh import RuntimeMesh
from rlaunch.runtime.replicas import declare

NAMES = ("dp", "tp")
MESH = RuntimeMesh((2, 2), NAMES, 0).coordinates()  # dp x tp: ranks [[0, 1], [2, 3]]


def _vote(samplers: list[SimpleNamespace], declared: object = None) -> str | None:
    rules = partition.candidates(NAMES, declared)  # type: ignore[arg-type]
    summed = [0.0] * len(rules)
    for rank, sampler in enumerate(samplers):
        for i, rule in enumerate(rules):
            summed[i] += partition.follows(sampler, rule, rank, 4, MESH, NAMES, declared)  # type: ignore[arg-type]
    return partition.choose(rules, summed, 4)


def test_a_sampler_over_the_data_parallel_dimension_is_found_though_rank_0_cannot_tell() -> None:
    samplers = [SimpleNamespace(num_replicas=2, rank=r // 2) for r in range(4)]  # rank = dp coordinate
    one = [partition.follows(samplers[0], rule, 0, 4, MESH, NAMES, None) for rule in ("mesh:dp", "mesh:tp")]
    assert one == [True, True], "rank 0 alone follows both rules"
    rule = _vote(samplers)
    assert rule == "mesh:dp"
    # a joiner taking rank 3 reads dp coordinate 1 (its global rank 3 crashed DistributedSampler before)
    assert partition.part(rule, 3, 4, MESH, NAMES, None) == (2, 1)


def test_the_global_rank_comes_first_and_no_rule_is_none() -> None:
    assert _vote([SimpleNamespace(num_replicas=4, rank=r) for r in range(4)]) == "global"
    assert _vote([SimpleNamespace(num_replicas=2, rank=(r + 1) % 2) for r in range(4)]) is None


def test_a_declared_replica_set_gives_the_position_in_it() -> None:
    declared = declare([[0, 2], [1, 3]], 4)
    samplers = [SimpleNamespace(num_replicas=2, rank=[0, 0, 1, 1][r]) for r in range(4)]
    assert _vote(samplers, declared) == "mesh:dp", "the mesh rule comes first when both hold"
    assert partition.part("declared", 2, 4, None, (), declared) == (2, 1)


def test_a_sampler_over_a_flattened_dimension_reads_its_coordinate_there() -> None:
    """A (2, 2, 2) mesh (dp, cp, tp) with dp and cp flattened into dp_cp: ranks 0, 1 hold coordinate 0,
    ranks 6, 7 coordinate 3; a sampler over dp_cp is found, and a joiner taking rank 6 reads part 3."""
    mesh = RuntimeMesh((2, 2, 2), ("dp", "cp", "tp"), 0)
    mesh.dims.append(("dp_cp", [[0, 2, 4, 6], [1, 3, 5, 7]]))
    names, table = mesh.dim_names(), mesh.coordinates()
    rules = partition.candidates(names, None)
    samplers = [SimpleNamespace(num_replicas=4, rank=r // 2) for r in range(8)]
    summed = [sum(float(partition.follows(samplers[r], rule, r, 8, table, names, None)) for r in range(8))
              for rule in rules]  # fmt: skip
    assert partition.choose(rules, summed, 8) == "mesh:dp_cp"
    assert partition.part("mesh:dp_cp", 6, 8, table, names, None) == (4, 3)
