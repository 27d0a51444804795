"""Expert parallelism built by hand on rt.new_group, as Megatron-style scripts do without a mesh.

Two experts over the ranks: rank r trains expert ``r % 2``, whose replicas are the ranks with the
same expert (``[[0, 2], [1, 3]]`` over 4 ranks); each step averages the gradients over them on a
group chosen by the rank at that step (so a joiner uses its new rank's group), and every 5 steps
averages the loss over an expert-parallel pair (``[0, 1]``, ``[2, 3]``). Parameters differ by rank:
``--declare`` tells the runtime which ranks hold equal copies (``rt.declare_replicas``); without it
a live replacement is refused (a drain still moves them). ``--torch-groups`` makes the pairs with
``dist.new_group``, which the runtime cannot rebuild: no live move at all.

Every rank prints ``rank R final: params=<digest> optim=<digest>`` at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import time

import torch
import torch.distributed as dist
from torch import nn

import rlaunch

EXPERTS = 2


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--declare", action="store_true")
    ap.add_argument("--torch-groups", action="store_true", help="the expert-parallel pairs from dist.new_group")
    args = ap.parse_args()
    torch.set_num_threads(1)

    rt = rlaunch.init()
    world = rt.world_size
    sets = [[r for r in range(world) if r % EXPERTS == e] for e in range(EXPERTS)]
    dp = [rt.new_group(f"dp{e}", members) for e, members in enumerate(sets)]
    pairs = [range(i * EXPERTS, (i + 1) * EXPERTS) for i in range(world // EXPERTS)]
    if args.torch_groups:  # torch's own groups: the runtime cannot rebuild them, so nothing can move live
        ep = [dist.new_group(list(ranks)) for ranks in pairs]
    else:
        ep = [rt.new_group(f"ep{i}", ranks) for i, ranks in enumerate(pairs)]
    if args.declare:
        rt.declare_replicas(sets)
    torch.manual_seed(100 + max(rt.rank, 0) % EXPERTS)  # each expert starts from its own weights
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt.track(model=model, optimizer=opt)

    for step in rt.steps(args.steps):
        expert = rt.rank % EXPERTS  # the rank's expert now (a joiner's is its new rank's)
        g = torch.Generator().manual_seed(step * 1009 + max(rt.rank, 0))
        x = torch.randn(8, 16, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad, group=dp[expert])
            p.grad /= len(sets[expert])
        if step % 5 == 4:  # before the vote: a fault's step is redone
            metric = loss.detach().reshape(1)
            dist.all_reduce(metric, group=ep[max(rt.rank, 0) // EXPERTS])
        rt.optimizer_step(opt)
        if args.step_time:
            time.sleep(args.step_time)
        if rt.rank == 0 and (step + 1) % 10 == 0 and not rt.standby:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.5f}", flush=True)
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    print(f"rank {rt.rank} final: params={digest(list(model.parameters()))} optim={digest(states)}", flush=True)


if __name__ == "__main__":
    main()
