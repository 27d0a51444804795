"""A sharded training loop as users write it (FSDP2, HSDP or 2-D tensor x data parallel) on rt.device_mesh.

``--layout fsdp``: ``fully_shard`` over all ranks (1-D mesh ``shard``).
``--layout hsdp``: ``fully_shard`` on a ``(replicate, shard)`` mesh (shards replicated across the first dimension).
``--layout tp_dp``: tensor parallel (colwise then rowwise) on ``tp`` plus FSDP2 on ``dp``.

``--model uneven`` puts GPT-2's 50,257-row embedding in front and a one-output head at the end:
FSDP2 gives each shard ``ceil(50257 / n)`` embedding rows but the last one fewer (2 shards: 25,129
and 25,128), and the head's single row to shard 0 alone, so ranks hold differently shaped shards
(the tensor-parallel layers stay even).

``--replicas N``: HSDP's replicate dimension (2 by default). ``--unflatten`` (HSDP): the mesh is
built as torchtitan builds it, a 1-D ``world`` mesh unflattened into ``(replicate, shard)``, and
``mesh["replicate", "shard"]._flatten("dp")`` picks each rank's batch (its coordinate) and
all-reduces the last step's loss, printed with the final digests (``reduced=``).

``--loader``: the batches come from a StatefulDataLoader whose ``DistributedSampler`` splits the
data over the data-parallel dimension only (``num_replicas`` its size, ``rank`` the coordinate on
it), as tensor-parallel users write it. ``--metrics-group``: a group of every rank made after the
mesh (``rt.new_group``), which averages the loss every 10 steps. ``--flip RANK:STEP``: that rank's
first weight shard gets one flipped bit at the step's start (silent data corruption).
``--gate FILE:STEP``: the active ranks wait at that step's start until FILE exists (a test holds
the job there until its standbys are warm).

Every rank prints ``rank R final: params=<digest> optim=<digest>`` of its local shards at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import rlaunch

VOCAB = 50257  # GPT-2's


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        h.update(local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=["fsdp", "hsdp", "tp_dp"], required=True)
    ap.add_argument("--model", choices=["even", "uneven"], default="even")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--unflatten", action="store_true")
    ap.add_argument("--loader", action="store_true")
    ap.add_argument("--metrics-group", action="store_true")
    ap.add_argument("--flip", default="")
    ap.add_argument("--gate", default="")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    rt = rlaunch.init()
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    uneven = args.model == "uneven"
    if uneven:
        model = nn.Sequential(
            nn.Embedding(VOCAB, 8), nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1)
        )
        colwise, rowwise = "1", "3"
    else:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
        colwise, rowwise = "0", "2"
    if args.layout == "fsdp":
        mesh = rt.device_mesh((world,), ("shard",))
        data_dim = "shard"
    elif args.layout == "hsdp":
        shape, names = (args.replicas, world // args.replicas), ("replicate", "shard")
        if args.unflatten:  # as torchtitan's ParallelDims: a 1-D world mesh, unflattened
            mesh = rt.device_mesh((world,), ("world",))._unflatten(0, shape, names)
        else:
            mesh = rt.device_mesh(shape, names)
        data_dim = ""  # every rank gets its own batch: both dimensions are data parallel
    else:
        mesh = rt.device_mesh((world // 2, 2), ("dp", "tp"))
        parallelize_module(model, mesh["tp"], {colwise: ColwiseParallel(), rowwise: RowwiseParallel()})
        data_dim = "dp"
    fsdp_mesh = mesh["dp"] if args.layout == "tp_dp" else mesh
    # both HSDP dimensions flattened: a rank's batch and the reduced loss
    flat = mesh["replicate", "shard"]._flatten("dp") if args.unflatten else None
    for layer in model:
        if isinstance(layer, (nn.Linear, nn.Embedding)):
            fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt.track(model=model, optimizer=opt)
    metrics = rt.new_group("metrics", range(world)) if args.metrics_group else None
    data = None
    if args.loader:
        g = torch.Generator().manual_seed(1)
        n = 4 * 8 * 20
        xs = torch.randint(0, VOCAB, (n, 4), generator=g) if uneven else torch.randn(n, 16, generator=g)
        # over the data-parallel dimension (its coordinate), or over every rank (the global rank)
        dp = mesh[data_dim] if data_dim else None
        parts, part = (dp.size(), max(dp.get_local_rank(), 0)) if dp else (world, max(rt.rank, 0))
        sampler = DistributedSampler(TensorDataset(xs), num_replicas=parts, rank=part, seed=3)
        data = rt.epochs(StatefulDataLoader(TensorDataset(xs), sampler=sampler, batch_size=8), sampler=sampler)
    flip_rank, flip_step = (int(v) for v in args.flip.split(":")) if args.flip else (-2, -2)
    gate, gate_step = (Path(args.gate.rsplit(":", 1)[0]), int(args.gate.rsplit(":", 1)[1])) if args.gate else (None, -1)

    for step in rt.steps(args.steps):
        coord = mesh.get_coordinate()
        assert coord is not None
        if gate is not None and step == gate_step and not rt.standby:
            deadline = time.monotonic() + 600
            while not gate.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        if (rt.rank, step) == (flip_rank, flip_step) and os.environ.get("RLAUNCH_ROLE") == "active":
            with torch.no_grad():  # one bit of this rank's first weight shard
                first = next(p for p in model.parameters() if p.to_local().numel())
                first.to_local().view(-1).view(torch.int32)[0] ^= 1 << 21
            print(f"rank {rt.rank}: flipped a bit of its first weight shard at step {step}", flush=True)
            flip_rank = -2
        if data is not None:
            (x,) = data.batch()
        else:
            # Ranks of one tensor-parallel group must see the same batch; data-parallel ranks differ.
            if flat is not None:
                who = flat.get_local_rank()
            elif data_dim:
                who = coord[mesh.mesh_dim_names.index(data_dim)]
            else:
                who = coord[0] * mesh.shape[1] + coord[1]
            g = torch.Generator().manual_seed(step * 1009 + who)
            x = torch.randint(0, VOCAB, (8, 4), generator=g) if uneven else torch.randn(8, 16, generator=g)
        loss = model(x).sin().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if metrics is not None and (step + 1) % 10 == 0:  # before the vote: a fault's step is redone
            mean = loss.detach().reshape(1) / world
            dist.all_reduce(mean, group=metrics)  # a group made after the mesh
        rt.optimizer_step(opt)
        if args.step_time:
            time.sleep(args.step_time)
        if rt.rank == 0 and not rt.standby and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.5f}", flush=True)
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    reduced = ""
    if flat is not None:
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total, group=flat.get_group())
        reduced = f" reduced={total.item().hex()}"
    params = digest(list(model.parameters()))
    print(f"rank {rt.rank} final: params={params} optim={digest(states)}{reduced}", flush=True)


if __name__ == "__main__":
    main()
