"""The example training script, written for the rlaunch runtime: it survives live migration.

Compared with ``train.py`` it changes four lines (marked ``# rlaunch``). Under rlaunch a drained
node's ranks move to a warm standby between two steps; every other rank keeps its process, and
the final weights and optimizer state are bit-identical to an uninterrupted run. Under plain
torchrun the same script runs, without migration.

    rlaunch --nnodes 2 --rdzv-endpoint HOST:PORT --rdzv-id job examples/train_resilient.py --steps 200
    rlaunch drain NODE --rdzv-endpoint HOST:PORT --rdzv-id job
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import rlaunch


def make_model(seed: int, width: int, depth: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(32, width), nn.Tanh()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def batch(seed: int, step: int, rank: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(size, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step, to make runs last")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument(
        "--subgroup", action="append", default=[], help="also allreduce over a subgroup of these ranks, e.g. 0,1"
    )
    args = ap.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rt = rlaunch.init()  # rlaunch: instead of init_process_group
    model = DDP(make_model(args.seed, args.width, args.depth), process_group=rt.group)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rt.track(model=model, optimizer=opt)  # rlaunch: what a joiner receives
    subs = [rt.new_group(f"sub{i}", [int(r) for r in spec.split(",")]) for i, spec in enumerate(args.subgroup)]
    started = time.perf_counter()
    for step in rt.steps(args.steps):  # rlaunch: the runtime owns the iteration boundaries
        x, y = batch(args.seed, step, rt.rank, args.batch)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for sub in subs:
            if rt.rank in sub.members:
                probe = torch.ones(1)
                torch.distributed.all_reduce(probe, group=sub)
                # after a fault the step's collectives return their inputs; the step is then redone
                assert probe.item() == len(sub.members) or rt.standby or rt.step_failed
        rt.optimizer_step(opt)  # rlaunch: the per-step vote, then opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        if rt.rank == 0 and (step + 1) % args.log_every == 0 and not rt.standby:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.5f}", flush=True)
    opt_state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    versions = {name: rt.group_version(name) for name in ["world", *(f"sub{i}" for i in range(len(subs)))]}
    print(
        f"rank {rt.rank} final: steps={args.steps} params={digest(list(model.parameters()))} "
        f"optim={digest(opt_state)} versions={json.dumps(versions, separators=(',', ':'))} "
        f"seconds={time.perf_counter() - started:.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
