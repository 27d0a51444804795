"""A training loop written the way users write them, with the patterns chosen by flags.

Patterns: BatchNorm buffers (``--bn``), dropout (``--dropout``), two optimizers
(``--optimizers 2``), CPU AMP with a GradScaler whose inf-skip is exercised (``--scaler``),
gradient accumulation under ``no_sync()`` (``--accum``), gradient clipping (``--clip``), an LR
scheduler stepped unconditionally (``--sched``), an evaluation ``all_reduce`` every N steps
(``--eval-every``; with ``--plateau`` its result also steps a ``ReduceLROnPlateau``, after the
vote, as users write it), draws from ``random`` and NumPy, and seeds: the same on every rank
(``--seed-mode same``), one per rank set once as nanoGPT does (``rank-once``), or per rank
through the runtime (``rt``). ``--ema MODE`` keeps an exponential moving average of the weights
(``torch.optim.swa_utils.AveragedModel``, tracked): ``guarded`` updates it when
``rt.optimizer_step`` returns True (its buffers as built), ``ignored`` after every
``rt.optimizer_step`` whatever it returned, its BatchNorm statistics averaged too
(``use_buffers=True``). ``--flip RANK:STEP`` and ``--flip-after-move RANK`` inject silent data
corruption: one flipped bit in one rank's parameter. ``--die-after-vote FILE:RANK:STEP`` loses
that rank's node right after its vote in that step (once: FILE is made first). ``--collectives``
calls every collective and object collective (``collective_checks.py``) before the steps, in
steps 0 to 2 (a standby's sandbox steps) and at the end, and checks what each returned. ``--ckpt
DIR`` writes a checkpoint on rank 0 (``dist.get_rank() == 0``) every 5 steps (step 0 included: a
sandbox runs a few) and logs who wrote it. ``--misuse`` exercises a refusal.

At the end each rank prints ``rank R final: steps=N params=<model state digest>
optim=<optimizers, scheduler and scaler digest> versions={}``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import signal
import time

import collective_checks  # beside this script
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import rlaunch


def make_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)
    layers: list[nn.Module] = [nn.Linear(16, 32)]
    if args.bn:
        layers.append(nn.BatchNorm1d(32))
    layers.append(nn.Tanh())
    if args.dropout:
        layers.append(nn.Dropout(args.dropout))
    layers += [nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)]
    return nn.Sequential(*layers)


def batch(seed: int, step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank * 101 + micro)
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def digest(values: list[object]) -> str:
    h = hashlib.sha256()
    for v in values:
        if isinstance(v, torch.Tensor):
            h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seed-mode", choices=["same", "rank-once", "rt"], default="same")
    ap.add_argument("--bn", action="store_true")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--optimizers", type=int, default=1)
    ap.add_argument("--scaler", action="store_true")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--clip", action="store_true")
    ap.add_argument("--sched", action="store_true")
    ap.add_argument("--eval-every", type=int, default=0)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--collectives", action="store_true", help="call and check every collective (see the docstring)")
    ap.add_argument("--loader", action="store_true", help="epochs of a StatefulDataLoader with 2 workers")
    ap.add_argument("--own-gen", action="store_true", help="input noise from a torch.Generator of the script's own")
    ap.add_argument("--die", default="", help="RANK:STEP: that rank's node (agent and worker) is SIGKILLed there")
    ap.add_argument("--die-after-vote", default="", help="FILE:RANK:STEP: as --die, after the step's vote, once")
    ap.add_argument("--plateau", action="store_true", help="a ReduceLROnPlateau stepped on each evaluation")
    ap.add_argument("--ema", choices=["", "guarded", "ignored"], default="", help="a model average (see the docstring)")
    ap.add_argument("--gate", default="", help="active ranks wait at step --gate-at until this file exists")
    ap.add_argument("--gate-at", type=int, default=20)
    ap.add_argument("--flip", default="", help="RANK:STEP: flip a bit of its first weight then")
    ap.add_argument("--flip-after-move", type=int, default=-1, help="RANK: flip a bit at its first step after a move")
    ap.add_argument(
        "--misuse", choices=["", "two-votes", "rank-state", "untracked-sched", "late-untracked-sched"], default=""
    )
    args = ap.parse_args()

    torch.set_num_threads(1)
    rt = rlaunch.init()
    model = DDP(make_model(args), process_group=rt.group)
    body = [p for n, p in model.named_parameters() if not n.startswith(f"module.{len(model.module) - 1}.")]
    head = list(model.module[-1].parameters())
    if args.optimizers == 2:
        optimizers = [torch.optim.SGD(body, lr=0.05, momentum=0.9), torch.optim.AdamW(head, lr=1e-3)]
    else:
        optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    tracked: dict[str, object] = {"model": model}
    tracked.update({f"opt{i}": o for i, o in enumerate(optimizers)})
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4) if args.scaler else None
    if scaler is not None:
        tracked["scaler"] = scaler
    sched = torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=7, gamma=0.8) if args.sched else None
    if sched is not None and args.misuse not in ("untracked-sched", "late-untracked-sched"):
        tracked["sched"] = sched
    plateau = None
    if args.plateau:
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizers[-1], factor=0.5, patience=1)
        tracked["plateau"] = plateau
    if args.misuse == "rank-state":
        tracked["counter"] = Counter(rt.rank)
    ema = None
    if args.ema:
        decay = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
        ema = torch.optim.swa_utils.AveragedModel(model.module, multi_avg_fn=decay, use_buffers=args.ema == "ignored")
        tracked["ema"] = ema
    rt.track(**tracked)
    data = None
    if args.loader:
        g = torch.Generator().manual_seed(args.seed)
        xs = torch.randn(2 * 32 * 40, 16, generator=g)
        dataset = TensorDataset(xs, xs.sum(dim=1, keepdim=True).sin())
        sampler = DistributedSampler(dataset, num_replicas=rt.world_size, rank=max(rt.rank, 0), seed=args.seed)
        loader = StatefulDataLoader(dataset, sampler=sampler, batch_size=32, num_workers=2)
        data = rt.epochs(loader, sampler=sampler, per_rank=args.seed_mode != "same")  # worker seeds differ
    own_gen = None
    if args.own_gen:  # made once and tracked; seeded per rank in rank-once mode, so tracked per rank
        if args.seed_mode == "rank-once":
            own_gen = torch.Generator().manual_seed(args.seed + 2 + max(rt.rank, 0))
            rt.track_per_rank(noise=own_gen)
        else:
            own_gen = torch.Generator().manual_seed(args.seed + 2)
            rt.track(noise=own_gen)
    die_rank, die_step = (int(v) for v in args.die.split(":")) if args.die else (-2, -2)
    once, after_vote = "", (-2, -2)
    if args.die_after_vote:
        once, at_rank, at_step = args.die_after_vote.rsplit(":", 2)
        after_vote = (int(at_rank), int(at_step))
    flip_rank, flip_step = (int(v) for v in args.flip.split(":")) if args.flip else (-2, -2)
    started_in = rt.generation
    if args.seed_mode == "rank-once":
        torch.manual_seed(args.seed + 1 + max(rt.rank, 0))  # as nanoGPT: seed + rank, once
        random.seed(args.seed + max(rt.rank, 0))
        np.random.seed(args.seed + max(rt.rank, 0))
    elif args.seed_mode == "rt":
        rt.seed(args.seed + 1, per_rank=True)
    else:  # one seed everywhere, as users write it
        torch.manual_seed(args.seed + 1)
        random.seed(args.seed + 1)
        np.random.seed(args.seed + 1)

    sub = rt.new_group("everyone", range(rt.world_size)) if args.collectives else None
    if sub is not None:
        collective_checks.check(rt, sub, "setup")

    for step in rt.steps(args.steps):
        if sub is not None and step < 3:
            collective_checks.check(rt, sub, f"step {step}")
        if args.gate and step == args.gate_at and not rt.standby:
            deadline = time.monotonic() + 600
            while not os.path.exists(args.gate) and time.monotonic() < deadline:
                time.sleep(0.1)  # the test opens the gate once its standby is warm
        if (rt.rank, step) == (die_rank, die_step) and os.environ.get("RLAUNCH_ROLE") == "active":
            os.kill(os.getppid(), signal.SIGKILL)  # a node lost at a chosen point: the step's start
            os.kill(os.getpid(), signal.SIGKILL)
        active = os.environ.get("RLAUNCH_ROLE") == "active"  # never on a standby that took the rank
        moved = args.flip_after_move == rt.rank and rt.generation != started_in
        if active and ((rt.rank, step) == (flip_rank, flip_step) or moved):
            with torch.no_grad():  # silent data corruption: one bit of one rank's parameter
                model.module[0].weight.view(-1).view(torch.int32)[3] ^= 1 << 21
            print(f"rank {rt.rank}: flipped a bit of its first weight at step {step}", flush=True)
            args.flip, args.flip_after_move, flip_rank = "", -1, -2
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        for micro in range(args.accum):
            x, y = data.batch() if data is not None else batch(args.seed, step, rt.rank, micro)
            if own_gen is not None:
                x = x + 0.01 * torch.randn(x.shape, generator=own_gen)
            sync = contextlib.nullcontext() if micro == args.accum - 1 else model.no_sync()
            with sync:
                amp = torch.autocast("cpu", dtype=torch.bfloat16) if scaler else contextlib.nullcontext()
                with amp:
                    noise = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())
                    loss = nn.functional.mse_loss(model(x).float(), y) * noise / args.accum
                if scaler is not None and step % 9 == 4:
                    loss = loss * float("inf")  # the scaler must skip this step and back off
                (scaler.scale(loss) if scaler else loss).backward()
        if args.clip:
            if scaler is not None:
                for opt in optimizers:
                    scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if args.misuse == "two-votes":
            for opt in optimizers:
                rt.optimizer_step(opt)
        elif args.misuse == "late-untracked-sched" and step == 0:
            rt.optimizer_step(optimizers[-1])  # the scheduled optimizer is first stepped in step 1
        else:
            applied = rt.optimizer_step(*optimizers, **({"scaler": scaler} if scaler else {}))
            if ema is not None and (applied or args.ema == "ignored"):
                ema.update_parameters(model.module)
        if (rt.rank, step) == after_vote and not os.path.exists(once):
            open(once, "w").close()  # a node lost between the vote and the evaluation that follows it
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if sched is not None:
            sched.step()  # unconditionally: a redone step's scheduler state is put back
        if args.eval_every and (step + 1) % args.eval_every == 0:
            with torch.no_grad():
                model.eval()
                metric = nn.functional.mse_loss(model(batch(args.seed, 10**6, rt.rank, 0)[0]), y).reshape(1)
                model.train()
            dist.all_reduce(metric)
            if plateau is not None:
                plateau.step(metric.item())
        if args.ckpt and dist.get_rank() == 0 and step % 5 == 0:
            torch.save(model.state_dict(), os.path.join(args.ckpt, "latest.pt"))
            with open(os.path.join(args.ckpt, "writers.txt"), "a") as f:
                f.write(f"{os.environ.get('RLAUNCH_ROLE')} standby={rt.standby} rank={rt.rank} step={step}\n")
        if args.step_time:
            time.sleep(args.step_time)
        if rt.rank == 0 and (step + 1) % 10 == 0 and not rt.standby:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.5f}", flush=True)
    if sub is not None:
        collective_checks.check(rt, sub, "end")
    averaged = list(ema.state_dict().values()) if ema is not None else []
    others: list[object] = [t for o in optimizers for s in o.state.values() for t in s.values()]
    others += [sorted(sched.state_dict().items()) if sched else None, scaler.state_dict() if scaler else None]
    others += [sorted(plateau.state_dict().items()) if plateau else None]
    print(
        f"rank {rt.rank} final: steps={args.steps} params={digest(list(model.state_dict().values()) + averaged)} "
        f"optim={digest(others)} versions={{}} epoch={data.epoch if data else 0}",
        flush=True,
    )


class Counter:
    """Tracked state that differs by rank (what a per-rank data iterator holds)."""

    def __init__(self, rank: int) -> None:
        self.value = rank

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


if __name__ == "__main__":
    main()
