"""A sharded training loop as users write it (FSDP2, HSDP or 2-D tensor x data parallel) on rt.device_mesh.

``--layout fsdp``: ``fully_shard`` over all ranks (1-D mesh ``shard``).
``--layout hsdp``: ``fully_shard`` on a ``(replicate, shard)`` mesh (shards replicated across the first dimension).
``--layout tp_dp``: tensor parallel (colwise then rowwise) on ``tp`` plus FSDP2 on ``dp``.

``--model uneven`` puts GPT-2's 50,257-row embedding in front and a one-output head at the end:
FSDP2 gives each shard ``ceil(50257 / n)`` embedding rows but the last one fewer (2 shards: 25,129
and 25,128), and the head's single row to shard 0 alone, so ranks hold differently shaped shards
(the tensor-parallel layers stay even).

Every rank prints ``rank R final: params=<digest> optim=<digest>`` of its local shards at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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
        mesh = rt.device_mesh((2, world // 2), ("replicate", "shard"))
        data_dim = ""  # every rank gets its own batch: both dimensions are data parallel
    else:
        mesh = rt.device_mesh((world // 2, 2), ("dp", "tp"))
        parallelize_module(model, mesh["tp"], {colwise: ColwiseParallel(), rowwise: RowwiseParallel()})
        data_dim = "dp"
    fsdp_mesh = mesh["dp"] if args.layout == "tp_dp" else mesh
    for layer in model:
        if isinstance(layer, (nn.Linear, nn.Embedding)):
            fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt.track(model=model, optimizer=opt)

    for step in rt.steps(args.steps):
        coord = mesh.get_coordinate()
        assert coord is not None
        # Ranks of one tensor-parallel group must see the same batch; data-parallel ranks differ.
        who = coord[mesh.mesh_dim_names.index(data_dim)] if data_dim else coord[0] * mesh.shape[1] + coord[1]
        g = torch.Generator().manual_seed(step * 1009 + who)
        x = torch.randint(0, VOCAB, (8, 4), generator=g) if uneven else torch.randn(8, 16, generator=g)
        loss = model(x).sin().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        rt.optimizer_step(opt)
        if args.step_time:
            time.sleep(args.step_time)
        if rt.rank == 0 and not rt.standby and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.5f}", flush=True)
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    print(f"rank {rt.rank} final: params={digest(list(model.parameters()))} optim={digest(states)}", flush=True)


if __name__ == "__main__":
    main()
