"""A plain torchrun-style DDP training script: runs unchanged under torchrun or rlaunch.

Deterministic given --seed: the model is initialised from the seed and each batch is a
function of (seed, step, rank), so two runs with the same flags end with bit-identical weights.
With --ckpt, rank 0 saves model and optimizer every --ckpt-every steps and every rank resumes
from the file after a restart, as torchrun users do today.

    rlaunch --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST:PORT examples/train.py --steps 50
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def make_model(seed: int, width: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def batch(seed: int, step: int, rank: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(size, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(bytes(p.detach().cpu().contiguous().view(torch.uint8).flatten().tolist()))
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step, to make runs last")
    ap.add_argument("--ckpt", default="", help="checkpoint file (resumed from after a restart)")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # DDP gets a group of its own, which the end of main() can free; see there.
    group = dist.new_group()
    model = DDP(make_model(args.seed, args.width), process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = 0
    if args.ckpt and os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"rank {rank}: resumed from step {start} (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})")
    for step in range(start, args.steps):
        x, y = batch(args.seed, step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        done = step + 1
        if rank == 0 and done % args.log_every == 0:
            print(f"step {done}/{args.steps} loss {loss.item():.5f}", flush=True)
        if args.ckpt and done % args.ckpt_every == 0 and done < args.steps:
            if rank == 0:
                tmp = args.ckpt + ".tmp"
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": done}, tmp)
                os.replace(tmp, args.ckpt)
            dist.barrier()
    print(f"rank {rank}/{world} done: steps={args.steps} checksum={checksum(model.module)}", flush=True)
    # Free DDP's group now, not in the interpreter's finalization. A gloo worker thread drops each
    # finished collective after this thread has moved on, and one launched in backward() holds a
    # Python object: were that drop to wait for the GIL while Python finalizes, the thread would be
    # ended inside C++ and the process abort ("terminate called without an active exception"). The
    # last reference, dropped from Python, joins gloo's worker threads with the GIL released, so they
    # finish first. DDP's reducer holds the group too, so it goes before; the default group cannot be
    # freed (torch.distributed.nn.functional's defaults hold it), which is why DDP does not use it.
    dist.destroy_process_group()
    del model, opt
    gc.collect()
    del group


if __name__ == "__main__":
    main()
