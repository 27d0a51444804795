"""Shards on the move: who holds a replica, and a different shard refused before any byte."""

from __future__ import annotations

import datetime
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlaunch.runtime import shards
from rlaunch.runtime.mesh import RuntimeMesh
from rlaunch.runtime.meshlines import check_shape, layout, line_of
from rlaunch.store.embedded import free_port


def coordinates(names: tuple[str, ...], shape: tuple[int, ...]) -> torch.Tensor:
    return RuntimeMesh(shape, names, 0).coordinates()


def test_hsdp_ranks_get_their_shards_from_the_replicate_row() -> None:
    mesh = coordinates(("replicate", "shard"), (2, 2))  # ranks 0,1 and 2,3 hold the same shards
    sources, why = shards.replica_sources(mesh, ("replicate", "shard"), ["shard"], {2, 3}, [0, 1])
    assert (sources, why) == ({2: 0, 3: 1}, "")


def test_replicas_are_spread_over_the_survivors() -> None:
    mesh = coordinates(("dp",), (4,))  # plain data parallel: everyone is a replica
    sources, _ = shards.replica_sources(mesh, ("dp",), [], {0, 1}, [2, 3])
    assert sources == {0: 2, 1: 3}


def test_pure_fsdp_has_no_replica_and_says_which_rank() -> None:
    mesh = coordinates(("shard",), (4,))
    sources, why = shards.replica_sources(mesh, ("shard",), ["shard"], {1}, [0, 2, 3])
    assert sources == {}
    assert "rank 1 (mesh coordinate (1,)) has no surviving replica" in why and "'shard'" in why


def test_tensor_parallel_replicated_over_dp_takes_the_same_tp_coordinate() -> None:
    mesh = coordinates(("dp", "tp"), (2, 2))
    sources, why = shards.replica_sources(mesh, ("dp", "tp"), ["tp"], {0, 1}, [2, 3])
    assert (sources, why) == ({0: 2, 1: 3}, "")
    _, why = shards.replica_sources(mesh, ("dp", "tp"), ["dp", "tp"], {0, 1}, [2, 3])
    assert "has no surviving replica" in why


def test_a_different_shard_is_named_in_the_refusal() -> None:
    mine = {"mesh_dims": ["shard"], "placements": ["S(0)"], "global_shape": [8, 4], "offset": [4, 0],
            "coordinate": {"0": 1}}  # fmt: skip
    theirs = {**mine, "offset": [0, 0], "coordinate": {"0": 0}}
    why = shards.mismatch("model.0.weight", mine, theirs)
    assert "model.0.weight" in why and "global offset [0, 0]" in why and "different shard" in why
    assert shards.mismatch("w", mine, dict(mine)) == ""
    assert "only on the sender's side" in shards.mismatch("w", None, mine)


def test_mesh_lines_and_a_joiner_rebinding_to_its_rank() -> None:
    ranks = layout((2, 3))
    assert line_of(ranks, 4, 0) == (1, [1, 4]) and line_of(ranks, 4, 1) == (1, [3, 4, 5])
    mesh = RuntimeMesh((2, 3), ("dp", "tp"), 0)
    assert mesh.lines(0) == [("mesh.dp.0", [0, 3]), ("mesh.tp.0", [0, 1, 2])]
    assert mesh.coordinate(5) == (1, 2)
    with pytest.raises(ValueError, match="holds 6 ranks but the job has 4"):
        check_shape((2, 3), None, 4)
    with pytest.raises(ValueError, match="distinct names"):
        check_shape((2, 2), ("a", "a"), 4)


def _transfer_between_shards(rank: int, port: int, results: Any) -> None:
    """Rank 0 sends its shard of a Shard(0) DTensor; rank 1 (the other shard) must refuse it."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from rlaunch.runtime import rng
    from rlaunch.runtime.transfer import TransferError, recv_state, send_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    mesh = dist.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    module = torch.nn.Linear(4, 8)
    with torch.no_grad():
        module.weight = torch.nn.Parameter(distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)]))
    before = module.weight.to_local().clone()
    odd = torch.nn.Linear(4, 5)  # 5 rows over 2 ranks: 3 and 2
    odd.weight = torch.nn.Parameter(distribute_tensor(odd.weight.detach(), mesh, [Shard(0)]))
    results.put((f"refusal {rank}", shards.move_refusal({"model": module, "odd": odd})))
    channel = dist.new_group([0, 1])
    try:
        if rank == 0:
            try:
                send_state(channel, {"model": module}, step=3, rng_state=rng.capture())
                results.put((rank, "sent"))
            except RuntimeError:  # the receiver refused and closed the channel
                results.put((rank, "closed by the receiver"))
        else:
            try:
                recv_state(channel, {"model": module})
                results.put((rank, "accepted"))
            except TransferError as exc:
                assert isinstance(module.weight, DTensor)
                untouched = torch.equal(module.weight.to_local(), before)
                results.put((rank, f"refused untouched={untouched}: {exc}"))
    finally:
        dist.destroy_process_group()


def test_the_wrong_shard_is_refused_before_any_tensor_is_written() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_transfer_between_shards, args=(free_port(), results), nprocs=2, start_method="spawn")
    got = dict(results.get() for _ in range(4))
    assert got["refusal 0"] == got["refusal 1"] == "", "an uneven DTensor on the CPU can be re-laid out, so it moves"
    assert got[1].startswith("refused untouched=True"), got
    assert "model.weight" in got[1] and "different shard" in got[1]


def test_finding_a_joiners_mesh_views_raises_no_deprecation_warning(tmp_path: Any) -> None:
    """A joiner scans the heap for its meshes; touching torch's deprecated objects on the way
    printed a FutureWarning (torch.distributed.reduce_op) on every FSDP joiner."""
    import warnings

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        root = dist.device_mesh.init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
        mesh = RuntimeMesh((1,), ("shard",), 0)
        mesh.device_mesh = root
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert mesh._views() == [root]
    finally:
        dist.destroy_process_group()


def test_a_model_sharded_on_an_unflattened_dimension_takes_its_shards_from_that_dimension() -> None:
    """torchtitan's layout: a 1-D world mesh of 8 unflattened into (replicate, shard) = (2, 4), FSDP on
    shard. Rank 5 (shard coordinate 1) gets its shards from rank 1, not from a rank of the same world
    coordinate; the world dimension alone (no unflatten known) would name no replica at all."""
    mesh = RuntimeMesh((8,), ("world",), 0)
    mesh.dims += [("replicate", [[0, 4], [1, 5], [2, 6], [3, 7]]), ("shard", [[0, 1, 2, 3], [4, 5, 6, 7]])]
    names = mesh.dim_names()
    sources, why = shards.replica_sources(mesh.coordinates(), names, ["shard"], {5, 6}, [0, 1, 2, 3, 4, 7])
    assert (sources, why) == ({5: 1, 6: 2}, "")
    _, why = shards.replica_sources(mesh.coordinates(), names, ["world"], {5}, [0, 1, 2, 3, 4, 7])
    assert "rank 5 (mesh coordinate (5, 1, 1)) has no surviving replica" in why
