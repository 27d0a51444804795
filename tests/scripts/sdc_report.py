"""A runtime training loop that tells its agent what the runtime's replica check will tell it.

The runtime's half of the ``moves`` and ``sdc_suspected`` reports is built apart; until then this
script sends them itself through the runtime's agent link (``rt._s.link.call``), as the runtime will:

- every active rank reports ``moves`` (a drain and a live replacement can both move it) after its
  first step's vote;
- on node ``--suspect`` the rank holds at step ``--hold-at`` (before its forward: its peers wait in
  the gradient allreduce) until the file ``--trigger`` exists, then reports ``sdc_suspected`` with
  the sentence and evidence the replica check would give, and exits 3, as a suspect does.

It prints ``verify_every=<RLAUNCH_VERIFY_EVERY>`` at start, ``step N/M`` on rank 0 every 10 steps,
and at the end ``rank R final: params=<digest>``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import rlaunch
from rlaunch.runtime.runtime import Runtime

SUSPECT_EXIT = 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--step-time", type=float, default=0.05)
    ap.add_argument("--suspect", default="", help="the node whose rank reports itself suspect")
    ap.add_argument("--hold-at", type=int, default=20)
    ap.add_argument("--trigger", default="", help="the suspect reports once this file exists")
    args = ap.parse_args()

    torch.set_num_threads(1)
    print(f"verify_every={os.environ.get('RLAUNCH_VERIFY_EVERY')}", flush=True)
    rt = rlaunch.init()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)), process_group=rt.group)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rt.track(model=model, optimizer=opt)
    suspect = os.environ.get("RLAUNCH_NODE_ID") == args.suspect
    reported = False
    for step in rt.steps(args.steps):
        if suspect and step == args.hold_at and not rt.standby:
            report_suspect(rt, step, args.trigger)
        g = torch.Generator().manual_seed(step * 1009 + max(rt.rank, 0))
        x = torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        rt.optimizer_step(opt)
        if rt.standby:
            continue
        if not reported:
            assert rt._s.link is not None
            rt._s.link.call("moves", drain=True, replace=True, reason="", rank=rt.rank)
            reported = True
        if rt.rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}/{args.steps}", flush=True)
        time.sleep(args.step_time)
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().reshape(-1).numpy().tobytes())
    print(f"rank {rt.rank} final: params={h.hexdigest()[:16]}", flush=True)


def report_suspect(rt: Runtime, step: int, trigger: str) -> None:
    """Wait for the trigger, then report this rank's copy suspect and exit non-zero, as the runtime will."""
    end = time.monotonic() + 120
    while not os.path.exists(trigger):
        if time.monotonic() > end:
            raise SystemExit(f"the trigger {trigger} did not appear within 120 s")
        time.sleep(0.05)
    others = [r for r in range(rt.world_size) if r != rt.rank]
    sentence = (
        f"silent data corruption suspected on rank {rt.rank}: its parameters differ from those of its replicas "
        f"(ranks {others}) at step {step}"
    )
    evidence = {"object": "model", "digest": "0x9e3779b97f4a7c15", "replica_digest": "0x6a09e667f3bcc908",
                "replicas": others, "method": "majority"}  # fmt: skip
    assert rt._s.link is not None
    rt._s.link.call("sdc_suspected", rank=rt.rank, step=step, sentence=sentence, evidence=evidence)
    print(sentence, file=sys.stderr, flush=True)
    sys.exit(SUSPECT_EXIT)


if __name__ == "__main__":
    main()
