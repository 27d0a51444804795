"""Every collective a training script may call, checked where it runs: on active ranks for real, in a
standby's sandbox as the sandbox serves it (``rlaunch.runtime.sandbox``).

``check(rt, sub, where)`` calls them on the default group and on ``sub`` (a group of
``rt.new_group`` holding every rank), asserts what each returned, and prints
``collectives ok (WHERE) standby=S rank=R``. It touches no model, optimizer or random state, so a
run that calls it stays bit-identical to another that does. A wrong result raises: on a standby
its sandbox fails, and the standby is never warm.
"""

from __future__ import annotations

import datetime
import warnings
from typing import Any

import torch
import torch.distributed as dist


def _equal(got: Any, want: Any, what: str) -> None:
    if isinstance(want, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and torch.equal(got, want)
    elif isinstance(want, list) and want and isinstance(want[0], torch.Tensor):
        ok = len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    else:
        ok = got == want
    if not ok:
        raise AssertionError(f"{what}: got {got!r}, expected {want!r}")


def check(rt: Any, sub: Any, where: str) -> None:
    world, standby, me = dist.get_world_size(), rt.standby, dist.get_rank()
    _equal((me, world), (-1 if standby else rt.rank, rt.world_size), "get_rank, get_world_size")
    _equal((dist.get_rank(sub), dist.get_world_size(sub)), (me, world), "get_rank, get_world_size of the subgroup")
    ranks = range(world)

    # object collectives: every rank passes its own (Lightning's broadcast), or only the source does
    objs: list[Any] = [f"name-{me}", {"lr": 0.1, "by": me}]
    dist.broadcast_object_list(objs, src=0)
    _equal(objs, [f"name-{me}", {"lr": 0.1, "by": me}] if standby else ["name-0", {"lr": 0.1, "by": 0}], "bcast obj")
    cfg: list[Any] = [{"run": "r7"}] if me == 0 else [None]
    dist.broadcast_object_list(cfg, src=0)
    _equal(cfg, [None] if standby else [{"run": "r7"}], "broadcast_object_list from the source only")
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"rank": me})
    _equal(gathered, [{"rank": me}] * world if standby else [{"rank": r} for r in ranks], "all_gather_object")
    at_dst: list[Any] = [None] * world
    dist.gather_object({"rank": me}, at_dst if me == 0 else None, dst=0)
    _equal(at_dst, [{"rank": r} for r in ranks] if me == 0 else [None] * world, "gather_object")
    out: list[Any] = ["unset"]
    dist.scatter_object_list(out, [f"piece-{r}" for r in ranks] if me == 0 else None, src=0)
    _equal(out, ["unset"] if standby else [f"piece-{me}"], "scatter_object_list")
    in_sub: list[Any] = [f"sub-{me}"]
    dist.broadcast_object_list(in_sub, src=sub.members[0], group=sub)
    _equal(in_sub, [f"sub-{me}"] if standby else ["sub-0"], "broadcast_object_list on a subgroup")

    dist.barrier()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    dist.barrier(group=sub)

    # tensor collectives: rank r holds r + 2 (a standby, -1, holds 1)
    v = float(me + 2)
    total = float(sum(r + 2 for r in ranks))
    for group in (None, sub):
        t = torch.full((3,), v)
        dist.all_reduce(t, group=group)
        _equal(t, torch.full((3,), v if standby else total), "all_reduce")
    t = torch.full((3,), v)
    dist.broadcast(t, src=0)
    _equal(t, torch.full((3,), v if standby else 2.0), "broadcast")
    t = torch.full((3,), v)
    dist.reduce(t, dst=0)
    if me <= 0:
        _equal(t, torch.full((3,), v if standby else total), "reduce")
    parts = [torch.zeros(2) for _ in ranks]
    dist.all_gather(parts, torch.full((2,), v))
    _equal(parts, [torch.full((2,), v if standby else r + 2.0) for r in ranks], "all_gather")
    flat, piece = torch.zeros(2 * world), torch.zeros(2)
    with warnings.catch_warnings():  # torch 2.13 names them all_gather_single and reduce_scatter_single
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(flat, torch.full((2,), v))
        dist.reduce_scatter_tensor(piece, torch.arange(2.0 * world) + 10 * v)
    _equal(flat, torch.cat([torch.full((2,), v if standby else r + 2.0) for r in ranks]), "all_gather_into_tensor")
    lay = 0 if standby else me  # the sandbox lays out as rank 0
    want = torch.arange(2.0 * world)[2 * lay : 2 * lay + 2]
    _equal(piece, want + 10 * v if standby else want * world + 10 * total, "reduce_scatter_tensor")
    mixed = torch.zeros(world)
    dist.all_to_all_single(mixed, torch.tensor([10 * v + j for j in ranks]))
    _equal(mixed, torch.tensor([10 * v + j for j in ranks] if standby else [10 * (r + 2.0) + me for r in ranks]), "a2a")
    slots = [torch.zeros(2) for _ in ranks]
    dist.gather(torch.full((2,), v), slots if me == 0 else None, dst=0)
    if me == 0:
        _equal(slots, [torch.full((2,), r + 2.0) for r in ranks], "gather")
    got = torch.full((2,), -7.0)
    dist.scatter(got, [torch.full((2,), r + 100.0) for r in ranks] if me == 0 else None, src=0)
    _equal(got, torch.full((2,), -7.0 if standby else me + 100.0), "scatter")
    work = dist.all_reduce(torch.ones(1), async_op=True)
    assert work is not None and work.wait()
    print(f"collectives ok ({where}) standby={standby} rank={me}", flush=True)
