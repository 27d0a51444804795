"""A Hugging Face Accelerate script written as Accelerate's quick tour writes one, and its port to rlaunch.

``--loop epochs`` is Accelerate's own loop (``for epoch ...: for batch in train_dataloader`` with
``accelerator.accumulate``); ``--loop steps`` is the port that moves live: the objects go through
``rlaunch.accelerate.prepare(accelerator, rt, ...)`` and the same body runs on ``rt.steps()``, one
step per gradient-accumulation window, each batch from ``train_dataloader.batch()``.
``--prepare accelerate`` uses ``accelerator.prepare`` itself (as the tutorial does), ``rlaunch`` the
adapter. The model has BatchNorm and dropout, the loader shuffles, an LR scheduler steps with the
optimizer; ``--accum N`` accumulates gradients over N batches, ``--mixed-precision bf16`` runs CPU
autocast. ``--eval`` prepares an evaluation loader with the rest (``prepare(accelerator, rt, model,
optimizer, train_dataloader, eval_dataloader, lr_scheduler)``, as the tutorial does) and evaluates
at each epoch's end, iterating it as the tutorial does (in the port, inside ``rt.steps()``); its
summed loss over every rank's part is in the final line. ``--phase2`` prepares a second train loader
with the others and trains one epoch of it after the main epochs (in the port, first read with
``batch()`` then: a later phase's loader). Test hooks as in ``lightning_train.py``:
``--step-time``, ``--gate FILE:STEP``, ``--die RANK:STEP`` (STEP counts optimizer steps).

At the end every rank prints ``rank R final: params=<digest> optim=<digest> steps=N`` (and
`` eval=<losses>`` with ``--eval``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def digest(values: list[object]) -> str:
    h = hashlib.sha256()
    for v in values:
        if isinstance(v, torch.Tensor):
            h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()[:16]


class Evals:
    """The evaluation losses so far: the port tracks them (``rt.track``), so a joiner continues the list of the
    rank it replaces (a script's own state, as any such loop would keep it)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def state_dict(self) -> dict[str, list[float]]:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.values = list(state["values"])


def hooks(args: argparse.Namespace, rank: int, step: int) -> None:
    """The test's faults and gates, at the start of an optimizer step's window."""
    active = os.environ.get("RLAUNCH_ROLE") == "active"
    for gate in args.gate:
        path, at = gate.rsplit(":", 1)
        if int(at) == step and active:
            deadline = time.monotonic() + 600
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.1)
    if args.die == f"{rank}:{step}" and active:
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> object:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop", choices=["epochs", "steps"], default="epochs")
    ap.add_argument("--prepare", choices=["accelerate", "rlaunch"], default="rlaunch")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--mixed-precision", default="no")
    ap.add_argument("--eval", action="store_true", help="an evaluation loader, evaluated at each epoch's end")
    ap.add_argument("--phase2", action="store_true", help="a second train loader, one epoch after the others")
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--gate", action="append", default=[])
    ap.add_argument("--die", default="")
    ap.add_argument("--ema", action="store_true", help="an average of the weights, registered for checkpointing")
    args = ap.parse_args()

    torch.set_num_threads(1)
    rt = None
    if args.prepare == "rlaunch":
        import rlaunch.accelerate

        rt = rlaunch.accelerate.init()  # before the Accelerator: it then uses the runtime's process group
    set_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=args.accum, mixed_precision=args.mixed_precision, cpu=True)

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(704, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(704, 1, generator=g)
    train_dataloader = DataLoader(TensorDataset(x[:640], y[:640]), batch_size=16, shuffle=True)
    eval_dataloader = DataLoader(TensorDataset(x[640:], y[640:]), batch_size=16)
    phase2_dataloader = DataLoader(TensorDataset(x[:320], y[:320]), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
    objects = (model, optimizer, train_dataloader, eval_dataloader, phase2_dataloader, lr_scheduler)
    if rt is not None:
        prepared = rlaunch.accelerate.prepare(accelerator, rt, *objects)
    else:
        prepared = accelerator.prepare(*objects)
    model, optimizer, train_dataloader, eval_dataloader, phase2_dataloader, lr_scheduler = prepared
    evals = Evals()
    ema = None
    if args.ema:  # as Accelerate's users keep one: registered for its checkpoints, updated where the step applied
        decay = torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
        ema = torch.optim.swa_utils.AveragedModel(accelerator.unwrap_model(model), multi_avg_fn=decay)
        accelerator.register_for_checkpointing(ema)

    def evaluate() -> None:
        model.eval()
        total = torch.zeros(())
        with torch.no_grad():
            for inputs, targets in eval_dataloader:
                total += nn.functional.mse_loss(model(inputs).float(), targets, reduction="sum")
        evals.values.append(float(accelerator.reduce(total, reduction="sum")))
        model.train()

    def train_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        with accelerator.accumulate(model):
            inputs, targets = batch
            loss = nn.functional.mse_loss(model(inputs).float(), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            if ema is not None and accelerator.sync_gradients and not optimizer.step_was_skipped:
                ema.update_parameters(accelerator.unwrap_model(model))
            lr_scheduler.step()
            optimizer.zero_grad()

    model.train()
    if args.loop == "epochs":  # Accelerate's own loop
        for _epoch in range(args.epochs):
            for i, batch in enumerate(train_dataloader):
                if i % args.accum == 0:
                    hooks(args, accelerator.process_index, accelerator.step // args.accum)
                train_batch(batch)
                if args.step_time and accelerator.sync_gradients:
                    time.sleep(args.step_time)
            if args.eval:
                evaluate()
        if args.phase2:
            for i, batch in enumerate(phase2_dataloader):
                if i % args.accum == 0:
                    hooks(args, accelerator.process_index, accelerator.step // args.accum)
                train_batch(batch)
                if args.step_time and accelerator.sync_gradients:
                    time.sleep(args.step_time)
    else:  # the port: one runtime step per accumulation window
        assert rt is not None
        rt.track(evals=evals)
        per_epoch = len(train_dataloader) // args.accum
        phase1 = args.epochs * per_epoch
        for step in rt.steps(phase1 + (len(phase2_dataloader) // args.accum if args.phase2 else 0)):
            hooks(args, accelerator.process_index, step)
            for _ in range(args.accum):
                train_batch(train_dataloader.batch() if step < phase1 else phase2_dataloader.batch())
            if args.step_time:
                time.sleep(args.step_time)
            if args.eval and step < phase1 and (step + 1) % per_epoch == 0:
                evaluate()
    inner = optimizer.optimizer
    optim = [t for s in inner.state.values() for t in s.values()] + [sorted(lr_scheduler.state_dict().items())]
    unwrapped = accelerator.unwrap_model(model)
    averaged = list(ema.state_dict().values()) if ema is not None else []
    shown = f" eval={','.join(repr(v) for v in evals.values)}" if args.eval else ""
    print(
        f"rank {accelerator.process_index} final: params={digest(list(unwrapped.state_dict().values()) + averaged)} "
        f"optim={digest(optim)} steps={lr_scheduler.scheduler.last_epoch}{shown}",
        flush=True,
    )
    # as Accelerate's docs end a script: the process group is released here (left to interpreter
    # teardown, gloo may abort there after the final line is out). The DDP model's reducer holds the
    # group too and frees it, holding the GIL, when main() returns; a gloo thread that still held the
    # last barrier's work then would need the GIL to drop it, and the two would wait on each other for
    # ever. So that work is handed to the caller, which drops it after the group is gone.
    accelerator.wait_for_everyone()
    last = torch.distributed.barrier(async_op=True)
    last.wait()
    accelerator.end_training()
    return last


if __name__ == "__main__":
    last_work = main()
    del last_work
