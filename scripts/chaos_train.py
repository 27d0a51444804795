"""examples/train_resilient.py with pause points, so that scripts/chaos.py can fault a moment.

``CHAOS_PAUSE=rank:step:phase:seconds:marker`` makes that rank, at that step, create the file
``marker`` and sleep ``seconds`` at ``phase``: ``forward`` (before the forward pass),
``grad_sync`` (inside backward, while the gradient buckets are being reduced), ``vote``
(right before ``rt.optimizer_step``: the other ranks wait in the vote) or ``optimizer``
(after the vote, inside ``optimizer.step()``). The chaos driver injects its fault meanwhile.
``CHAOS_SLOW=seconds`` makes every step of this process that long slower before its forward
pass (a straggling node, for the straggler detector's test).
Model, data and output are those of train_resilient.py, so the final digests compare with it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from train_resilient import batch, digest, make_model  # noqa: E402

import rlaunch  # noqa: E402


class Pause:
    def __init__(self, spec: str) -> None:
        self.rank = self.step = -1
        self.phase, self.seconds, self.marker = "", 0.0, ""
        if spec:
            rank, step, self.phase, seconds, self.marker = spec.split(":", 4)
            self.rank, self.step, self.seconds = int(rank), int(step), float(seconds)

    def at(self, rt: Any, step: int, phase: str) -> None:
        if (rt.rank, step, phase) == (self.rank, self.step, self.phase) and not rt.standby:
            self.rank = -1  # once
            Path(self.marker).write_text(f"{os.getpid()}\n")
            time.sleep(self.seconds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-time", type=float, default=0.0)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    pause = Pause(os.environ.get("CHAOS_PAUSE", ""))
    slow = float(os.environ.get("CHAOS_SLOW", "0"))
    rt = rlaunch.init()
    model = DDP(make_model(args.seed, 64, 1), process_group=rt.group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rt.track(model=model, optimizer=opt)
    real_step = opt.step
    current = {"step": 0}

    def step_with_pause(*a: Any, **kw: Any) -> Any:
        pause.at(rt, current["step"], "optimizer")
        return real_step(*a, **kw)

    opt.step = step_with_pause  # type: ignore[method-assign]
    first_weight = model.module[0].weight
    first_weight.register_hook(lambda grad: pause.at(rt, current["step"], "grad_sync"))
    started = time.perf_counter()
    for step in rt.steps(args.steps):
        current["step"] = step
        x, y = batch(args.seed, step, rt.rank, 64)
        pause.at(rt, step, "forward")
        if slow and not rt.standby:
            time.sleep(slow)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        pause.at(rt, step, "vote")
        rt.optimizer_step(opt)
        if args.step_time:
            time.sleep(args.step_time)
        if rt.rank == 0 and (step + 1) % 10 == 0 and not rt.standby:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.5f}", flush=True)
    opt_state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    print(
        f"rank {rt.rank} final: steps={args.steps} params={digest(list(model.parameters()))} "
        f"optim={digest(opt_state)} versions={{}} seconds={time.perf_counter() - started:.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
