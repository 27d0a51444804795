"""A Hugging Face Accelerate script as Accelerate's tutorials write one, ported to rlaunch as
docs/frameworks.md says, trained on random tensors (a small MLP classifier).

``--loop steps`` (the default) is the port: ``rlaunch.accelerate.init()`` before the ``Accelerator``,
``rlaunch.accelerate.prepare`` instead of ``accelerator.prepare``, and the loop on ``rt.steps()`` with
one whole accumulation window per step read through ``train_dataloader.batch()``. ``--loop tutorial``
is the tutorial's own loop (``for epoch ...: for batch in train_dataloader``) on Accelerate alone,
without rlaunch. Both use ``accelerator.accumulate``, ``accelerator.backward``,
``accelerator.clip_grad_norm_``, an LR scheduler, an evaluation loop with
``accelerator.gather_for_metrics`` and ``accelerator.print`` at each epoch's end, and end with
``accelerator.wait_for_everyone()`` and ``accelerator.end_training()``.

Test hooks (only with ``--step-time``): each training batch sleeps that long and prints
``epoch E batch B``; ``--hold FILE`` keeps the active ranks at batch 4 of epoch 0 (the third step's
first) until FILE exists.
At the end every rank writes ``rank R final: params=<digest> optim=<digest> sched=<digest> steps=N
eval=<last accuracy>`` in one ``os.write`` (the list of earlier epochs' accuracies is a plain variable,
which a joiner does not receive).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

EPOCHS = 3
ACCUM = 2


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, (x[:, :4].sum(dim=1) > 0).long() + (x[:, 4:8].sum(dim=1) > 1).long())


def digest(obj: object) -> str:
    h = hashlib.sha256()

    def walk(v: object) -> None:
        if isinstance(v, torch.Tensor):
            h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v, key=repr):
                h.update(repr(k).encode())
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)
        else:
            h.update(repr(v).encode())

    walk(obj)
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop", choices=["steps", "tutorial"], default="steps")
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--hold", default="")
    args = ap.parse_args()

    rt = None
    if args.loop == "steps":
        import rlaunch.accelerate

        rt = rlaunch.accelerate.init()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    set_seed(42)
    train_dataloader = DataLoader(make_data(384, 0), batch_size=16, shuffle=True)
    eval_dataloader = DataLoader(make_data(128, 1), batch_size=32)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    total = EPOCHS * len(train_dataloader) // ACCUM
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / total))
    objects = (model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    if rt is None:
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(*objects)
    else:
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = rlaunch.accelerate.prepare(
            accelerator, rt, *objects
        )
    accuracies: list[float] = []

    def pace(epoch: int, batch: int) -> None:
        if not args.step_time:
            return
        if args.hold and (epoch, batch) == (0, 4) and os.environ.get("RLAUNCH_ROLE") == "active":
            while not os.path.exists(args.hold):
                time.sleep(0.1)
        print(f"epoch {epoch} batch {batch}", flush=True)
        time.sleep(args.step_time)

    def train_on(x: torch.Tensor, y: torch.Tensor) -> None:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()

    def evaluate(epoch: int) -> None:
        model.eval()
        correct = seen = 0
        for x, y in eval_dataloader:
            with torch.no_grad():
                predictions = model(x).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, y))
            correct += int((predictions == references).sum())
            seen += references.numel()
        accuracies.append(correct / seen)
        accelerator.print(f"epoch {epoch}: accuracy {correct / seen:.4f}")
        model.train()

    model.train()
    if rt is None:
        for epoch in range(EPOCHS):
            for i, (x, y) in enumerate(train_dataloader):
                pace(epoch, i)
                train_on(x, y)
            evaluate(epoch)
    else:
        per_epoch = len(train_dataloader) // ACCUM
        for step in rt.steps(EPOCHS * per_epoch):
            for k in range(ACCUM):
                pace(step // per_epoch, step % per_epoch * ACCUM + k)
                x, y = train_dataloader.batch()
                train_on(x, y)
            if (step + 1) % per_epoch == 0:
                evaluate(step // per_epoch)

    accelerator.wait_for_everyone()
    unwrapped: Any = accelerator.unwrap_model(model)
    line = (
        f"rank {accelerator.process_index} final: params={digest(unwrapped.state_dict())} "
        f"optim={digest(optimizer.state_dict())} sched={digest(lr_scheduler.state_dict())} "
        f"steps={lr_scheduler.scheduler.last_epoch} eval={accuracies[-1]:.6f}\n"
    )
    os.write(1, line.encode())
    accelerator.end_training()


if __name__ == "__main__":
    main()
