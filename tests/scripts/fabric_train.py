"""A Lightning Fabric script written as Fabric's docs write one, and its port to rlaunch's loop.

``--loop epochs`` is Fabric's own loop (``for epoch ...: for batch in dataloader``); ``--loop steps``
is the port that moves live: the same body on ``rt.steps()``, each batch from ``dataloader.batch()``,
the scheduler tracked with ``rt.track``. ``--strategy ddp`` runs Fabric's own DDP, ``rlaunch`` the
``FabricStrategy``. The model has BatchNorm and dropout, the loader shuffles, the LR scheduler steps
every step; ``--precision 16-mixed`` runs fp16 AMP with a ``GradScaler`` on CPU. ``--eval`` sets an
evaluation loader up with the train loader (``fabric.setup_dataloaders(train, val)``) and evaluates
at each epoch's end, iterating it as Fabric's docs do (in the port, inside ``rt.steps()``); its summed
loss over every rank's part is in the final line. ``--phase2`` sets a second train loader up with the
others and trains one epoch of it after the main epochs (in the port, first read with ``batch()``
then: a later phase's loader). Test hooks as in ``lightning_train.py``:
``--step-time``, ``--gate FILE:STEP``, ``--die RANK:STEP``. ``--package lightning`` takes Fabric from the
unified package (``import lightning as L``, as Lightning's docs now write it) instead of ``lightning_fabric``.

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
    """The test's faults and gates, at the start of a step (see the module docstring)."""
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
    ap.add_argument("--strategy", choices=["rlaunch", "ddp"], default="rlaunch")
    ap.add_argument("--loop", choices=["epochs", "steps"], default="epochs")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--eval", action="store_true", help="an evaluation loader, evaluated at each epoch's end")
    ap.add_argument("--phase2", action="store_true", help="a second train loader, one epoch after the others")
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--gate", action="append", default=[])
    ap.add_argument("--die", default="")
    ap.add_argument("--package", choices=["lightning_fabric", "lightning"], default="lightning_fabric")
    args = ap.parse_args()

    if args.package == "lightning":  # the unified package, as Lightning's docs import it
        import lightning as L
        from lightning.fabric.plugins import MixedPrecision

        fabric_class, seed_everything = L.Fabric, L.seed_everything
    else:
        import lightning_fabric
        from lightning_fabric.plugins import MixedPrecision

        fabric_class, seed_everything = lightning_fabric.Fabric, lightning_fabric.seed_everything
    torch.set_num_threads(1)
    seed_everything(0)
    if args.strategy == "rlaunch":
        import rlaunch.lightning

        strategy: object = rlaunch.lightning.FabricStrategy()
    else:
        strategy = "ddp"
    plugins = None
    if args.precision == "16-mixed":  # fp16 AMP with a GradScaler on CPU (Fabric's CPU default is bf16)
        plugins = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8))
    fabric = fabric_class(
        accelerator="cpu", devices=args.devices, num_nodes=args.nodes, strategy=strategy, plugins=plugins
    )
    fabric.launch()

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(704, 16, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(704, 1, generator=g)
    dataloader = DataLoader(TensorDataset(x[:640], y[:640]), batch_size=16, shuffle=True)
    val_dataloader = DataLoader(TensorDataset(x[640:], y[640:]), batch_size=16)
    phase2_dataloader = DataLoader(TensorDataset(x[:320], y[:320]), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loaders = [dataloader, *([val_dataloader] if args.eval else []), *([phase2_dataloader] if args.phase2 else [])]
    prepared = fabric.setup_dataloaders(*loaders)
    prepared = list(prepared) if len(loaders) > 1 else [prepared]
    dataloader = prepared[0]
    val_dataloader = prepared[1] if args.eval else val_dataloader
    phase2_dataloader = prepared[-1] if args.phase2 else phase2_dataloader
    evals = Evals()

    def evaluate() -> None:
        model.eval()
        total = torch.zeros(())
        with torch.no_grad():
            for inputs, target in val_dataloader:
                total += nn.functional.mse_loss(model(inputs).float(), target, reduction="sum")
        evals.values.append(float(fabric.all_reduce(total, reduce_op="sum")))
        model.train()

    def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        inputs, target = batch
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs).float(), target)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        scheduler.step()
        if args.step_time:
            time.sleep(args.step_time)

    model.train()
    if args.loop == "epochs":  # Fabric's own loop
        step = 0
        for _epoch in range(args.epochs):
            for batch in dataloader:
                hooks(args, fabric.global_rank, step)
                train_step(batch)
                step += 1
            if args.eval:
                evaluate()
        if args.phase2:
            for batch in phase2_dataloader:
                hooks(args, fabric.global_rank, step)
                train_step(batch)
                step += 1
    else:  # the port: the same body on the runtime's steps
        rt = fabric.strategy.rt
        rt.track(scheduler=scheduler, evals=evals)
        phase1 = args.epochs * len(dataloader)
        for step in rt.steps(phase1 + (len(phase2_dataloader) if args.phase2 else 0)):
            hooks(args, fabric.global_rank, step)
            train_step(dataloader.batch() if step < phase1 else phase2_dataloader.batch())
            if args.eval and step < phase1 and (step + 1) % len(dataloader) == 0:
                evaluate()
    optim = [t for s in optimizer.state.values() for t in s.values()] + [sorted(scheduler.state_dict().items())]
    shown = f" eval={','.join(repr(v) for v in evals.values)}" if args.eval else ""
    print(
        f"rank {fabric.global_rank} final: params={digest(list(model.state_dict().values()))} optim={digest(optim)} "
        f"steps={scheduler.last_epoch}{shown}",
        flush=True,
    )
    if args.strategy != "ddp":
        return None
    # torch's group, released now: left to interpreter teardown, gloo may abort there. The DDP model's
    # reducer holds the group too and frees it, holding the GIL, when main() returns; a gloo thread that
    # still held the barrier's work then would need the GIL to drop it, and the two would wait on each
    # other for ever. So the barrier's work is handed to the caller, which drops it after the group is gone.
    last = torch.distributed.barrier(async_op=True)
    last.wait()
    torch.distributed.destroy_process_group()
    return last


if __name__ == "__main__":
    last_work = main()
    del last_work
