"""A PyTorch Lightning script written as Lightning's tutorials write one, for the integration's tests.

A ``LightningModule`` with BatchNorm and dropout that logs with ``self.log`` (a step-interval LR
scheduler, validation every epoch), a ``LightningDataModule`` over an in-memory dataset (no
download) with a shuffled ``DataLoader``, ``pl.seed_everything`` and a ``Trainer`` whose defaults
(checkpointing, logging) are left on. The only line rlaunch needs is the strategy
(``--strategy rlaunch``; ``--strategy ddp`` runs Lightning's own DDP, as under plain torchrun).

Flags choose the patterns: ``--accum`` (gradient accumulation), ``--accum-schedule 0:2,1:4`` (a
``GradientAccumulationScheduler``: 2 batches per step in epoch 0, 4 from epoch 1), ``--plateau`` (a
``ReduceLROnPlateau`` on the synced ``val_loss`` instead of the step-interval scheduler; the final line
then lists the values it stepped on), ``--precision 16-mixed`` (AMP with a
``GradScaler`` on CPU, through Lightning's ``MixedPrecision`` plugin), ``--manual`` (manual
optimization), ``--limit`` (``limit_train_batches``, which the integration refuses), ``--loader
stateful`` (torchdata's ``StatefulDataLoader(shuffle=True)``, whose sampler Lightning wraps in its
``DistributedSamplerWrapper``), ``--workers``, ``--augment`` (a random transform in the dataset) and
``--seed-workers`` (``seed_everything(workers=True)``). Test hooks: ``--step-time``
slows steps down, ``--gate FILE:STEP`` holds the active ranks at that global step until FILE exists
(repeatable), ``--die RANK:STEP`` SIGKILLs that rank's node (agent and worker) at the start of that
global step, ``--crash RANK:STEP`` that rank's worker alone, ``--crash-in-validation RANK:EPOCH``
that rank's worker alone at the first batch of that epoch's validation (in the job's first attempt only),
and ``--crash-after-vote RANK:STEP[:RESTARTS]`` that rank's worker alone right after that global step's
vote, before the model's ``on_train_batch_end`` (once per ``--root``, in a run restarted at least RESTARTS
times). ``--step-plateau`` adds a step-interval ``ReduceLROnPlateau`` on ``end_loss``, logged with
``sync_dist=True`` in ``on_train_batch_end`` (its sync runs after the step's vote).

At the end every rank prints ``rank R final: params=<digest> optim=<digest> steps=N val_loss=V``
(and `` plateau=[...]`` with ``--plateau`` or ``--step-plateau``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class LitRegressor(pl.LightningModule):
    def __init__(
        self, lr: float = 1e-2, manual: bool = False, plateau: bool = False, step_plateau: bool = False
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = not manual
        self.plateau_seen: list[float] = []  # the values a plateau scheduler stepped on
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.ReLU(),
            nn.Linear(32, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        if not self.automatic_optimization:
            opt = self.optimizers()
            sched = self.lr_schedulers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            sched.step()
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        if self.hparams.step_plateau:  # a synced value logged after the optimizer step (its sync: after the vote)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.log("end_loss", loss.detach().float(), sync_dist=True)  # type: ignore[union-attr]

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y), sync_dist=True)

    def configure_optimizers(self) -> tuple[list[object], list[dict[str, object]]]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        if self.hparams.plateau:
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
            schedulers = [{"scheduler": plateau, "monitor": "val_loss"}]
        else:
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
            schedulers = [{"scheduler": scheduler, "interval": "step"}]
        if self.hparams.step_plateau:
            on_step = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.8, patience=1)
            schedulers.append({"scheduler": on_step, "monitor": "end_loss", "interval": "step"})
        return [optimizer], schedulers

    def lr_scheduler_step(self, scheduler: object, metric: object) -> None:
        if metric is not None:
            self.plateau_seen.append(float(metric))  # type: ignore[arg-type]
        super().lr_scheduler_step(scheduler, metric)  # type: ignore[arg-type]


class Jittered(TensorDataset):
    """A random augmentation drawn from the global generator of whichever process reads the item."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        x, y = super().__getitem__(i)
        return x + 0.05 * torch.randn_like(x), y


class RandomData(pl.LightningDataModule):
    def __init__(self, loader: str, workers: int, augment: bool = False, batch_size: int = 16) -> None:
        super().__init__()
        self.loader, self.workers, self.augment, self.batch_size = loader, workers, augment, batch_size

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(704, 16, generator=g)
        y = (x[:, :4].sum(dim=1, keepdim=True)).sin() + 0.1 * torch.randn(704, 1, generator=g)
        self.train_set = (Jittered if self.augment else TensorDataset)(x[:640], y[:640])
        self.val_set = TensorDataset(x[640:], y[640:])

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        if self.loader == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(self.train_set, self.batch_size, shuffle=True, num_workers=self.workers)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.workers)

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(self.val_set, batch_size=self.batch_size)


class TestHooks(pl.Callback):
    """Slows steps down, holds them at a gate, or kills this rank's node (see the module docstring)."""

    def __init__(
        self, step_time: float, gates: list[str], die: str, crash: str = "", crash_in_val: str = "",
        crash_after_vote: str = "", root: str = ".",
    ) -> None:  # fmt: skip
        self.step_time = step_time
        self.gates = {int(g.rsplit(":", 1)[1]): g.rsplit(":", 1)[0] for g in gates}
        self.die = tuple(int(v) for v in die.split(":")) if die else None
        self.joined = False
        self.crash = tuple(int(v) for v in crash.split(":")) if crash else None
        self.crash_in_val = tuple(int(v) for v in crash_in_val.split(":")) if crash_in_val else None
        after = [int(v) for v in crash_after_vote.split(":")] if crash_after_vote else None
        self.crash_after_vote = (*after, 0)[:3] if after else None  # rank, step, restarts at least
        self.crashed_after_vote = os.path.join(root, "crashed-after-vote")  # once per job

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: object, i: int) -> None:
        active = os.environ.get("RLAUNCH_ROLE") == "active"  # never on the standby that took the rank
        if not active and trainer.global_rank >= 0 and not self.joined:  # a standby's first batch with a rank
            self.joined = True
            print(f"rank {trainer.global_rank} joined at epoch {trainer.current_epoch} batch {i}", flush=True)
        gate = self.gates.get(trainer.global_step)
        if gate and active:
            deadline = time.monotonic() + 600
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.1)
        if self.die == (trainer.global_rank, trainer.global_step) and active:
            os.kill(os.getppid(), signal.SIGKILL)  # the node is lost: its agent first, then this worker
            os.kill(os.getpid(), signal.SIGKILL)
        if self.crash == (trainer.global_rank, trainer.global_step) and active:
            os.kill(os.getpid(), signal.SIGKILL)  # the worker alone crashes; its agent restarts it in place

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
        if self.step_time:
            time.sleep(self.step_time)
        if self.crash_after_vote and os.environ.get("RLAUNCH_ROLE") == "active":
            rank, step, restarts = self.crash_after_vote
            # global_step counts the optimizer steps taken: STEP + 1 right after step STEP's (its vote's)
            at = (trainer.global_rank, trainer.global_step - 1)
            restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            if at == (rank, step) and restarted >= restarts and not os.path.exists(self.crashed_after_vote):
                os.makedirs(os.path.dirname(self.crashed_after_vote), exist_ok=True)
                open(self.crashed_after_vote, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)  # before the model's on_train_batch_end logs its synced value

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
        first_attempt = os.environ.get("RLAUNCH_ROLE") == "active" and not restarted
        at = (trainer.global_rank, trainer.current_epoch)
        if self.crash_in_val == at and first_attempt and not trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGKILL)  # the worker alone, while the others validate


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
    ap.add_argument("--strategy", choices=["rlaunch", "ddp"], default="rlaunch")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--accum-schedule", default="", help="EPOCH:N,...: a GradientAccumulationScheduler")
    ap.add_argument("--plateau", action="store_true", help="ReduceLROnPlateau on val_loss")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--manual", action="store_true")
    ap.add_argument("--loader", choices=["plain", "stateful"], default="plain")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--seed-workers", action="store_true", help="seed_everything(0, workers=True)")
    ap.add_argument("--augment", action="store_true", help="a random augmentation in the dataset")
    ap.add_argument("--root", default=".")
    ap.add_argument("--limit", type=float, default=1.0, help="Trainer(limit_train_batches=...): refuses moves")
    ap.add_argument("--reload", action="store_true", help="reload_dataloaders_every_n_epochs=1: refuses moves")
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--gate", action="append", default=[])
    ap.add_argument("--die", default="")
    ap.add_argument("--crash", default="", help="RANK:STEP: that rank's worker alone is SIGKILLed there")
    ap.add_argument("--crash-in-validation", default="", help="RANK:EPOCH: ... in that epoch's validation")
    ap.add_argument(
        "--crash-after-vote", default="", help="RANK:STEP[:RESTARTS]: ... right after that global step's vote"
    )
    ap.add_argument("--step-plateau", action="store_true", help="a step-interval ReduceLROnPlateau on end_loss")
    args = ap.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0, workers=args.seed_workers)
    if args.strategy == "rlaunch":
        import rlaunch.lightning

        strategy: object = rlaunch.lightning.Strategy()
    else:
        strategy = "ddp"
    plugins = []
    precision: str | None = args.precision
    if args.precision == "16-mixed":  # fp16 AMP with a GradScaler on CPU (Lightning's CPU default is bf16)
        from pytorch_lightning.plugins.precision import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8)))
        precision = None
    model = LitRegressor(manual=args.manual, plateau=args.plateau, step_plateau=args.step_plateau)
    hooks = TestHooks(
        args.step_time, args.gate, args.die, args.crash, args.crash_in_validation, args.crash_after_vote, args.root
    )  # fmt: skip
    callbacks: list[pl.Callback] = [hooks]
    if args.accum_schedule:
        schedule = dict(tuple(int(v) for v in part.split(":")) for part in args.accum_schedule.split(","))
        callbacks.append(pl.callbacks.GradientAccumulationScheduler(schedule))
    trainer = pl.Trainer(
        max_epochs=args.epochs, limit_train_batches=args.limit, accelerator="cpu", devices=args.devices,
        num_nodes=args.nodes, strategy=strategy, reload_dataloaders_every_n_epochs=int(args.reload),
        precision=precision, plugins=plugins, accumulate_grad_batches=args.accum,
        gradient_clip_val=None if args.manual else 0.5, default_root_dir=args.root, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(model, datamodule=RandomData(args.loader, args.workers, args.augment))
    opt = trainer.optimizers[0]
    optim = [t for s in opt.state.values() for t in s.values()]
    optim += [sorted(config.scheduler.state_dict().items()) for config in trainer.lr_scheduler_configs]
    val = trainer.callback_metrics.get("val_loss")
    seen = f" plateau={','.join(repr(v) for v in model.plateau_seen)}" if args.plateau or args.step_plateau else ""
    line = (
        f"rank {trainer.global_rank} final: params={digest(list(model.state_dict().values()))} "
        f"optim={digest(optim)} steps={trainer.global_step} "
        f"val_loss={float(val) if val is not None else None!r}{seen}\n"
    )
    # One write: under torchrun both ranks share one pipe, and a line the buffer split in two could
    # be cut by the other rank's output.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())


if __name__ == "__main__":
    main()
