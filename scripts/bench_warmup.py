#!/usr/bin/env python3
"""What the first steps of a fresh process pay on this machine, part by part: what a standby's
sandbox steps pay before it is needed, and a cold standby pays during its first real step.

One process, the benchmarks' model (``bench_train.make_model``: 25M parameters, AdamW), one
thread, on a gloo group of one rank (DDP around the model, or FSDP2 over a mesh of one): each of
``--steps`` iterations is timed in three parts (forward, backward, optimizer step), with the
minor page faults each part took (``getrusage``: memory touched for the first time, which the
allocator then keeps). The first iterations are set against the median of the last half. What
this cannot show: a GPU's own warm-up (CUDA context, cuBLAS and cuDNN handles and autotuning,
the caching allocator's first ``cudaMalloc``s, lazily loaded kernels, compiled graphs), which a
sandbox pays the same way. Prints one JSON object. Usage: scripts/bench_warmup.py [--layout ddp|fsdp]
[--steps 8]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.bench_train import batch, make_model  # noqa: E402

PARTS = ("forward", "backward", "optimizer")


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def build(layout: str, width: int, depth: int) -> nn.Module:
    """The model as bench_train.py lays it out, on a world of one."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1,))
        model = make_model(0, width, depth, out=8)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return nn.parallel.DistributedDataParallel(make_model(0, width, depth))


def measure(layout: str, steps: int, width: int, depth: int, size: int) -> dict[str, Any]:
    model = build(layout, width, depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = []
    for step in range(steps):
        x, y = batch(0, step, 0, size, width)
        row: dict[str, float] = {}
        began, before = time.perf_counter(), faults()
        pred = model(x)
        loss = nn.functional.mse_loss(pred, y.expand_as(pred))
        row["forward_s"], mid, touched = time.perf_counter() - began, time.perf_counter(), faults()
        row["forward_faults"] = touched - before
        opt.zero_grad(set_to_none=True)
        loss.backward()
        row["backward_s"], mid2, touched2 = time.perf_counter() - mid, time.perf_counter(), faults()
        row["backward_faults"] = touched2 - touched
        opt.step()
        row["optimizer_s"] = time.perf_counter() - mid2
        row["optimizer_faults"] = faults() - touched2
        row["step_s"] = time.perf_counter() - began
        rows.append({k: round(v, 4) for k, v in row.items()})
    steady = rows[steps // 2 :]
    median = {k: statistics.median(r[k] for r in steady) for k in rows[0]}
    first = rows[0]
    return {
        "layout": layout,
        "steps": rows,
        "steady_median": {k: round(v, 4) for k, v in median.items()},
        # what the first step pays beyond a steady one: the part a sandbox pays before it is needed
        "first_step_excess_s": {p: round(first[f"{p}_s"] - median[f"{p}_s"], 4) for p in (*PARTS, "step")},
        "first_step_over_steady": round(first["step_s"] / median["step_s"], 3),
        "second_step_over_steady": round(rows[1]["step_s"] / median["step_s"], 3) if steps > 1 else None,
        "first_step_faults": {p: first[f"{p}_faults"] for p in PARTS},
        "steady_faults": {p: median[f"{p}_faults"] for p in PARTS},
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--layout", choices=("ddp", "fsdp"), default="ddp")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    if args.steps < 4:
        ap.error(f"--steps {args.steps} must be at least 4 (the steady median is taken over the last half).")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = measure(args.layout, args.steps, args.width, args.depth, args.batch)
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
