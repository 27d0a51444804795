"""The benchmarks' training script: one model, two ways of running it.

``--mode rlaunch`` uses the rlaunch runtime (live migration); ``--mode plain`` is a plain DDP
script as torchrun users write it today, which saves a checkpoint when it receives SIGTERM (and
every N steps with ``--ckpt-every N``) and resumes from it after a restart.

``--layout fsdp`` shards the same model with FSDP2 over all ranks instead of DDP: on
``rt.device_mesh`` under rlaunch, on ``init_device_mesh`` under torchrun. Its plain mode saves each
rank's own shards (``CKPT.rank<r>``); since a SIGTERM reaches one node only, every step ends with
a one-flag allreduce "someone was asked to stop", so that all ranks save the same step before
they exit, as a careful FSDP script does on preemption (a few microseconds a step: torchrun's
side pays it, not rlaunch's). Both write one line
per step to ``--timeline`` (append-only, so restarted processes add to it; ``cpu<rank>.txt`` beside
each, the process's CPU time at each step's end) and print their final
digests, peak RSS and the memory at each stage (after imports, after the runtime's or torch's
init, after the model, after the first step, at the end), measured the same way in both modes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

#: Modules of the agent and CLI stack that a worker must never import (etcd client, gRPC, CLI).
HEAVY = ("aetcd", "grpc", "rich", "typer", "rlaunch.agent", "rlaunch.cli", "rlaunch.controller", "rlaunch.store")


def memory_kb() -> dict[str, int]:
    """This process's memory now (kB, from /proc/self/smaps_rollup and status), and its thread count.

    ``rss``: resident now; ``anon``: resident anonymous (heap, tensors, thread stacks); ``file``:
    resident file-backed (shared libraries, mostly torch's); ``peak``: the high-water mark of rss.
    """
    rollup = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                rollup[parts[0].rstrip(":")] = int(parts[1])
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return {
        "rss": rollup["Rss"], "anon": rollup["Anonymous"], "file": rollup["Rss"] - rollup["Anonymous"],
        "peak": int(status["VmHWM"].split()[0]), "threads": int(status["Threads"]),
    }  # fmt: skip


def make_model(seed: int, width: int, depth: int, out: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(width, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, out))


def batch(seed: int, step: int, rank: int, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(size, width, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def save_shards(path: str, model: nn.Module, opt: torch.optim.Optimizer, next_step: int) -> None:
    """FSDP: this rank's own shards of the parameters and of the optimizer state, atomically."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {
        "model": [local(p).detach() for p in params],
        "optimizer": [{k: local(v) for k, v in opt.state[p].items()} for p in params],
        "step": next_step,
    }
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_shards(path: str, opt: torch.optim.Optimizer) -> int:
    """FSDP: write this rank's saved shards into the live parameters and optimizer state."""
    state = torch.load(path, weights_only=True)
    params = [p for g in opt.param_groups for p in g["params"]]
    with torch.no_grad():
        for p, saved, moments in zip(params, state["model"], state["optimizer"], strict=True):
            local(p).copy_(saved)
            opt.state[p] = {
                k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                if v.dim()
                else v
                for k, v in moments.items()
            }
    return int(state["step"])


def save(path: str, model: DDP, opt: torch.optim.Optimizer, next_step: int) -> None:
    """Write a checkpoint atomically: a reader sees the previous one or this one, never a torn file."""
    state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": next_step}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["rlaunch", "plain"], required=True)
    ap.add_argument("--layout", choices=["ddp", "fsdp"], default="ddp")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--timeline", required=True, help="directory for per-rank step timelines")
    ap.add_argument("--ckpt", default="", help="plain mode: checkpoint written on SIGTERM, resumed from")
    ap.add_argument("--ckpt-every", type=int, default=0, help="plain mode: rank 0 also checkpoints every N steps")
    ap.add_argument("--start-file", default="", help="active ranks wait for this file before step 0 (not timed)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    stages = {"imported": memory_kb()}
    stop = {"now": False}
    rt = None
    if args.mode == "rlaunch":
        import rlaunch
        import rlaunch.runtime.runtime  # noqa: F401 - imported here only to measure its RSS apart

        stages["runtime_imported"] = memory_kb()
        rt = rlaunch.init()
        group = rt.group
    else:
        stages["runtime_imported"] = memory_kb()  # nothing to import: torch.distributed is loaded
        dist.init_process_group("gloo")
        group = None
        signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    stages["initialized"] = memory_kb()
    fsdp = args.layout == "fsdp"
    model: nn.Module
    if fsdp:
        world = rt.world_size if rt is not None else dist.get_world_size()
        mesh = rt.device_mesh((world,), ("shard",)) if rt is not None else init_device_mesh("cpu", (world,))
        # a head of 8 outputs: rows that shard evenly over 2 or 4 ranks (rt.track refuses uneven shards)
        model = make_model(0, args.width, args.depth, out=8)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = DDP(make_model(0, args.width, args.depth), process_group=group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if rt is not None:
        rt.track(model=model, optimizer=opt)
    stages["model"] = memory_kb()
    start = 0
    shard_ckpt = f"{args.ckpt}.rank{dist.get_rank()}" if fsdp and args.ckpt and rt is None else ""
    if shard_ckpt and os.path.exists(shard_ckpt):
        start = load_shards(shard_ckpt, opt)
    elif args.mode == "plain" and not fsdp and args.ckpt and os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        del state
    steps = rt.steps(args.steps) if rt is not None else range(start, args.steps)
    role = "standby" if rt is not None and rt.standby else "active"
    for step in steps:
        while args.start_file and not (rt is not None and rt.standby) and not os.path.exists(args.start_file):
            time.sleep(0.05)  # the benchmark's standbys warm up first (before step 0 completes: no hang watch)
        began = time.time()  # the step's own work: time spent inside rt.steps() between steps is not in it
        rank = rt.rank if rt is not None else dist.get_rank()
        x, y = batch(0, step, rank, args.batch, args.width)
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y.expand_as(pred))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if rt is not None:
            rt.optimizer_step(opt)
            role = "sandbox" if rt.standby else "real"
        else:
            opt.step()
        end = time.time()
        if step == start:
            stages["first_step"] = memory_kb()
        with open(os.path.join(args.timeline, f"rank{rank}.txt"), "a") as f:
            f.write(f"{step} {began:.6f} {end:.6f} {role} {os.getpid()}\n")
        with open(os.path.join(args.timeline, f"cpu{rank}.txt"), "a") as f:  # the process's CPU seconds, all threads
            f.write(f"{step} {time.process_time():.6f} {role} {os.getpid()}\n")
        if shard_ckpt:
            asked = torch.tensor([1.0 if stop["now"] else 0.0])
            dist.all_reduce(asked)  # a SIGTERM reaches one node: every rank saves the same step
            if asked.item() > 0:
                save_shards(shard_ckpt, model, opt, step + 1)
                # The rank that was not signalled exits 1, as a DDP rank fails when its peer goes:
                # its torchrun agent then ends at once instead of waiting at its exit barrier for
                # the agent that was stopped.
                raise SystemExit(0 if stop["now"] else 1)
            if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
                save_shards(shard_ckpt, model, opt, step + 1)
            continue
        if stop["now"]:
            if args.ckpt:
                assert isinstance(model, DDP)
                save(args.ckpt, model, opt, step + 1)
            raise SystemExit(0)
        if rt is None and args.ckpt and args.ckpt_every and (step + 1) % args.ckpt_every == 0 and rank == 0:
            assert isinstance(model, DDP)
            save(args.ckpt, model, opt, step + 1)  # DDP replicas are equal: one copy is enough
    opt_state = [local(t) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    rank = rt.rank if rt is not None else dist.get_rank()
    stages["end"] = memory_kb()
    print("FINAL " + json.dumps({
        "rank": rank, "params": digest([local(p) for p in model.parameters()]), "optim": digest(opt_state),
        "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "rss_kb": stages["end"]["rss"],
        "memory_kb": stages, "threads": sorted(t.name for t in threading.enumerate()),
        "modules": len(sys.modules), "heavy_modules": sorted(m for m in HEAVY if m in sys.modules),
    }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
