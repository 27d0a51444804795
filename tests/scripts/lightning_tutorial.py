"""A PyTorch Lightning script as Lightning's own tutorials write one, trained on random tensors.

It imports the unified package, ``import lightning as L``, as Lightning's docs do.

A ``LightningModule`` (a small MLP), ``self.log`` with ``prog_bar=True``, a validation step logging
``val_loss`` with ``sync_dist=True``, ``configure_optimizers`` returning an optimizer and a step-interval
scheduler, a shuffled ``DataLoader``, ``seed_everything``, and the ``Trainer``'s default callbacks
(checkpointing, progress bar, model summary) and logger left on. The one line rlaunch asks for is the
strategy; ``--strategy ddp`` gives Lightning's own for the baseline. The scheduler's length is
``self.trainer.estimated_stepping_batches``, as Lightning's docs size a ``OneCycleLR``. The data come from
a ``LightningDataModule`` as Lightning's MNIST tutorial writes one: ``prepare_data`` "downloads" the sets
once per node (it writes them to ``--data-dir``, which Lightning runs behind a barrier of its own group),
``setup`` reads them. ``--workers N`` reads the train set in N loader worker processes, and ``--augment``
adds a random jitter to each sample as a dataset's transform does (drawn in the workers, or in the main
process without them). ``--ema`` keeps an exponential moving average of the weights with Lightning's
``EMAWeightAveraging`` callback (validation runs on the average, and the model ends as the average).
After the fit, ``trainer.test`` runs the test loop (and ``prepare_data`` again), as the tutorials end.

Test hooks (only with ``--step-time``): each training batch sleeps that long and prints
``epoch E batch B`` so a test can choose where to inject a fault, and ``--hold FILE`` keeps the active
ranks at batch 4 of epoch 0 until FILE exists (so that standbys can warm up first). At the end every
rank writes ``rank R final: params=<digest> optim=<digest> sched=<digest> steps=N eval=<test loss>`` in one
``os.write``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import rlaunch.lightning


class LitRegressor(L.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> dict[str, object]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=self.hparams.lr,
            total_steps=self.trainer.estimated_stepping_batches,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Pace(L.Callback):
    """The test hooks: a sleep per training batch, a progress line, a hold at batch 4."""

    def __init__(self, step_time: float, hold: str) -> None:
        self.step_time = step_time
        self.hold = hold

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: object, i: int) -> None:
        if self.hold and (trainer.current_epoch, i) == (0, 4) and os.environ.get("RLAUNCH_ROLE") == "active":
            while not os.path.exists(self.hold):
                time.sleep(0.1)
        print(f"epoch {trainer.current_epoch} batch {i}", flush=True)

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: object) -> None:
        time.sleep(self.step_time)


class Jittered(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A dataset whose samples get a random transform when read: a jitter from torch's RNG in the reading
    process, and a scale from a NumPy generator the reading process makes at its first read (the way
    tutorials give each loader worker a stream of its own)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data
        self.rng: np.random.Generator | None = None

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rng is None:
            self.rng = np.random.default_rng(torch.initial_seed() % 2**32)
        x, y = self.data[i]
        return (x + 0.05 * torch.randn_like(x)) * float(self.rng.uniform(0.9, 1.1)), y


class RandomDataModule(L.LightningDataModule):
    def __init__(self, data_dir: str, workers: int, augment: bool) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.workers = workers
        self.augment = augment

    def prepare_data(self) -> None:
        # the "download": every node's local rank 0 writes the sets, as a dataset's download=True does
        os.makedirs(self.data_dir, exist_ok=True)
        for name, n, seed in (("train", 384, 0), ("val", 128, 1)):
            path = os.path.join(self.data_dir, f"{name}.pt")
            if not os.path.exists(path):
                part = f"{path}.{os.getpid()}"
                torch.save(make_data(n, seed).tensors, part)
                os.replace(part, path)

    def setup(self, stage: str) -> None:
        def load(name: str) -> TensorDataset:
            return TensorDataset(*torch.load(os.path.join(self.data_dir, f"{name}.pt"), weights_only=True))

        self.train_set, self.val_set = load("train"), load("val")

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        data = Jittered(self.train_set) if self.augment else self.train_set
        return DataLoader(data, batch_size=16, shuffle=True, num_workers=self.workers)

    def val_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(self.val_set, batch_size=32)

    def test_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(self.val_set, batch_size=32)


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True).sin() + 0.1 * torch.randn(n, 1, generator=g))


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
    ap.add_argument("--strategy", choices=["rlaunch", "ddp"], default="rlaunch")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--root", default="lightning_runs")
    ap.add_argument("--data-dir", default="")
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--hold", default="")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--augment", action="store_true")
    ap.add_argument("--ema", action="store_true")
    args = ap.parse_args()

    L.seed_everything(42)
    data = RandomDataModule(args.data_dir or os.path.join(args.root, "data"), args.workers, args.augment)
    model = LitRegressor()
    callbacks: list[L.Callback] = [EMAWeightAveraging()] if args.ema else []
    if args.step_time:
        callbacks.append(Pace(args.step_time, args.hold))
    trainer = L.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.nodes,
        strategy=rlaunch.lightning.Strategy() if args.strategy == "rlaunch" else "ddp",
        default_root_dir=args.root,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=data)
    line = (
        f"rank {trainer.global_rank} final: params={digest(model.state_dict())} "
        f"optim={digest(trainer.optimizers[0].state_dict())} "
        f"sched={digest(trainer.lr_scheduler_configs[0].scheduler.state_dict())} steps={trainer.global_step}"
    )
    tested = trainer.test(model, datamodule=data)  # prepare_data again, behind Lightning's barrier
    os.write(1, f"{line} eval={tested[0]['test_loss']:.6f}\n".encode())


if __name__ == "__main__":
    main()
