"""A script whose rank 1 dies right after the training loop while rank 0 sums a final metric with it.

Under torchrun rank 0's ``all_reduce`` raises and the job fails. Under rlaunch the runtime guards
collectives while steps run (a fault there is redone or recovered); after the loop nothing is left to
redo, so the sum must fail the same way, not hand rank 0 its own value as if it were everyone's.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import rlaunch

torch.manual_seed(0)
rt = rlaunch.init()
model = DDP(nn.Linear(4, 1), process_group=rt.group)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
rt.track(model=model, optimizer=opt)
for step in rt.steps(5):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step * 10 + rt.rank))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    rt.optimizer_step(opt)
if rt.rank == 1:
    print("rank 1 dies after the loop", flush=True)
    os._exit(0)  # its connections close; its agent sees a worker that ended
time.sleep(2.0)
correct = torch.tensor([float(rt.rank + 1)])
dist.all_reduce(correct, group=rt.group)
print(f"final metric summed over the ranks: {correct.item()}", flush=True)
