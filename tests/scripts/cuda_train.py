"""examples/train_resilient.py's loop, with BatchNorm and two optimizers, on a chosen device: the GPU check's script.

``--device cuda`` puts the model, its gradients, the optimizer state and every batch on the GPU
(all ranks share GPU ``LOCAL_RANK % device_count``); DDP then reduces CUDA buckets over
``rt.group``, whose backend is ``RLAUNCH_BACKEND`` (gloo when several ranks share one GPU: NCCL
refuses two ranks on one GPU). ``--device cpu`` runs the same code on the CPU: how the check's
plumbing is tested on a machine without a GPU. At the end each rank prints
``rank R final: steps=N params=<digest of parameters and buffers> optim=<digest> versions={...}``.
``--gate FILE`` holds the active ranks at step 20 until FILE exists, so that a drain or a fault
lands mid-run however long the standby takes to warm up.
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


def make_model(seed: int, width: int) -> nn.Module:
    """BatchNorm statistics ride in each step's vote (from the GPU into a host tensor), and the
    head has an optimizer of its own: two optimizers in one ``rt.optimizer_step``."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)
    )


def batch(seed: int, step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(64, 32, generator=g)
    return x.to(device), x.sum(dim=1, keepdim=True).sin().to(device)


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--gate", default="", help="active ranks wait at step 20 until this file exists")
    args = ap.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        # bit-identical runs need deterministic kernels (cuBLAS picks its workspace per process)
        torch.use_deterministic_algorithms(True)
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    rt = rlaunch.init()
    model = DDP(make_model(args.seed, args.width).to(device), process_group=rt.group)
    head = list(model.module[-1].parameters())
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    opt = torch.optim.AdamW(body, lr=1e-3)
    head_opt = torch.optim.SGD(head, lr=1e-2, momentum=0.9)
    rt.track(model=model, optimizer=opt, head_optimizer=head_opt)
    started = time.perf_counter()
    for step in rt.steps(args.steps):
        if args.gate and step == 20 and not rt.standby:
            deadline = time.monotonic() + 300
            while not os.path.exists(args.gate) and time.monotonic() < deadline:
                time.sleep(0.05)  # the check opens the gate once its standby is warm and its fault is set
        x, y = batch(args.seed, step, rt.rank, device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        head_opt.zero_grad(set_to_none=True)
        loss.backward()
        rt.optimizer_step(opt, head_opt)
        if args.step_time:
            time.sleep(args.step_time)
        if rt.rank == 0 and (step + 1) % args.log_every == 0 and not rt.standby:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.5f}", flush=True)
    states = [s for o in (opt, head_opt) for s in o.state.values()]
    opt_state = [t for s in states for t in s.values() if isinstance(t, torch.Tensor)]
    where = sorted({str(t.device) for t in [*model.parameters(), *opt_state, *model.buffers()]})
    print(
        f"rank {rt.rank} final: steps={args.steps} params={digest([*model.parameters(), *model.buffers()])} "
        f"optim={digest(opt_state)} versions={json.dumps({'world': rt.group_version('world')}, separators=(',', ':'))} "
        f"devices={','.join(where)} seconds={time.perf_counter() - started:.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
