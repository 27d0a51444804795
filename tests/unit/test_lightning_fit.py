"""What ``rlaunch.lightning.Strategy`` refuses or carries, seen in real one-rank fits of a tiny model
(a runtime without an agent, as under plain torchrun; nothing moves, so the refusals are read from
the runtime and the carried state from the tracked objects)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from rlaunch.runtime.registry import register, unregister
from rlaunch.runtime.runtime import Runtime
from rlaunch.runtime.vote import RefusedError
from tests.one_rank import plain_runtime

pl = pytest.importorskip("pytorch_lightning")
torchmetrics = pytest.importorskip("torchmetrics")

import rlaunch.lightning  # noqa: E402 - after the skip: it imports Lightning


class Tiny(pl.LightningModule):
    """A linear regressor that logs its loss in training (``log_on_epoch``) and validation."""

    def __init__(self, log_on_epoch: bool = True, metric: bool = False, log_metric: bool = True) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.log_on_epoch = log_on_epoch
        self.mean = torchmetrics.aggregation.MeanMetric() if metric else None
        self.log_metric = log_metric

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=self.log_on_epoch)
        if self.mean is not None:
            self.mean(loss.detach())
            if self.log_metric:
                self.log("mean_loss", self.mean, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WarmUp(Tiny):
    """An LR warm-up written in an overridden ``optimizer_step``, as Lightning's docs show one."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, (self.trainer.global_step + 1) / 4)
        optimizer.step(closure=optimizer_closure)


def _fit(rt: Runtime, module: pl.LightningModule, tmp: Path, epochs: int = 2, **trainer: Any) -> Any:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    fit = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, strategy=rlaunch.lightning.Strategy(rt=rt), logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp, **trainer,
    )  # fmt: skip
    fit.fit(module, DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))
    return fit


def _sentence(refused: str) -> str:
    prefix = "rlaunch.lightning: "
    assert refused.startswith(prefix), refused
    why = refused[len(prefix) :]
    assert why[0].isupper() and why.endswith("."), f"not a sentence: {why!r}"
    return why


def test_a_monitor_on_an_epoch_level_value_logged_in_training_refuses_moves(tmp_path: Path) -> None:
    rt = plain_runtime()
    checkpoint = pl.callbacks.ModelCheckpoint(monitor="train_loss_epoch", dirpath=tmp_path)
    _fit(rt, Tiny(), tmp_path, callbacks=[checkpoint])
    assert _sentence(rt._s.refused).startswith(
        "ModelCheckpoint(monitor='train_loss_epoch') reads 'train_loss_epoch', an epoch-level value logged in training"
    )
    # the plain name reads the epoch value too at an epoch's end; a plateau scheduler is named as well
    rt = plain_runtime()
    _fit(rt, Tiny(), tmp_path, callbacks=[pl.callbacks.EarlyStopping(monitor="train_loss", patience=5)])
    assert "EarlyStopping(monitor='train_loss') reads 'train_loss'" in rt._s.refused


def test_a_monitor_on_a_validation_value_moves_and_its_value_is_carried(tmp_path: Path) -> None:
    rt = plain_runtime()
    trainer = _fit(rt, Tiny(), tmp_path, callbacks=[pl.callbacks.EarlyStopping(monitor="val_loss", patience=5)])
    assert rt._s.refused == ""
    monitored = rt._s.tracked["monitored"]
    state = monitored.state_dict()
    assert set(state) == {"val_loss"} and torch.equal(state["val_loss"], trainer.callback_metrics["val_loss"])
    # A joiner's callback_metrics are its sandbox's until it validates: it takes the sender's.
    joiner = pl.Trainer(logger=False)
    type(monitored)(joiner, ["val_loss"]).load_state_dict(state)
    assert torch.equal(joiner.callback_metrics["val_loss"], state["val_loss"])


def test_a_torchmetrics_metric_logged_in_training_refuses_moves_only_when_something_decides_from_it(
    tmp_path: Path,
) -> None:
    """Its running state is not carried (a redone step counts twice, a joiner has its sandbox's): for the
    logger alone that changes no training; a monitor on it would decide otherwise, and a Metric updated
    and never logged has readers the runtime cannot see."""
    rt = plain_runtime()
    trainer = _fit(rt, Tiny(log_on_epoch=False, metric=True), tmp_path)
    assert rt._s.refused == "" and "mean_loss" in trainer.callback_metrics
    rt = plain_runtime()
    checkpoint = pl.callbacks.ModelCheckpoint(monitor="mean_loss", dirpath=tmp_path)
    _fit(rt, Tiny(log_on_epoch=False, metric=True), tmp_path, callbacks=[checkpoint])
    assert _sentence(rt._s.refused).startswith(
        "ModelCheckpoint(monitor='mean_loss') reads 'mean_loss', a torchmetrics MeanMetric logged from the training"
    )
    rt = plain_runtime()
    _fit(rt, Tiny(log_on_epoch=False, metric=True, log_metric=False), tmp_path)
    assert _sentence(rt._s.refused).startswith("A torchmetrics MeanMetric of the model is updated in training_step and")


def test_an_overridden_optimizer_step_refuses_moves_at_start(tmp_path: Path) -> None:
    rt = plain_runtime()
    _fit(rt, WarmUp(log_on_epoch=False), tmp_path, epochs=1)
    assert _sentence(rt._s.refused).startswith("WarmUp.optimizer_step is overridden")


class Position(pl.Callback):
    """What the loop position held at each step's start (``on_train_batch_start`` runs after the fetch)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.held: list[int] = []

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.held.append(self.rt._s.tracked["lightning"].state_dict()["accumulate_grad_batches"])


def test_the_loop_position_carries_a_scheduled_accumulation(tmp_path: Path) -> None:
    """A GradientAccumulationScheduler sets accumulate_grad_batches at each epoch's start; a joiner's is
    its sandbox epoch's, so the position carries the sender's."""
    rt = plain_runtime()
    seen = Position(rt)
    scheduler = pl.callbacks.GradientAccumulationScheduler({0: 1, 1: 2})
    trainer = _fit(rt, Tiny(log_on_epoch=False), tmp_path, callbacks=[scheduler, seen])
    assert rt._s.refused == ""
    assert seen.held == [1, 1, 1, 1, 2, 2, 2, 2], "each batch of epoch 1 is read with the position of epoch 1's steps"
    position = rt._s.tracked["lightning"]
    trainer.accumulate_grad_batches = 1  # as a joiner's sandbox in epoch 0 has it
    position.apply()
    assert trainer.accumulate_grad_batches == 2


def test_a_fault_seen_after_validation_refuses_the_live_move(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed group hands back each rank's own values: a fault during the epoch's end (validation, the
    callbacks' decisions) is seen at the next step's first read, and refuses the move there."""
    failed = [False]
    monkeypatch.setattr(Runtime, "step_failed", property(lambda self: failed[0]))

    class FaultInValidation(pl.Callback):
        def on_validation_end(self, trainer: Any, module: Any) -> None:
            failed[0] = not trainer.sanity_checking and trainer.current_epoch == 0

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            failed[0] = False  # the step's vote would go to recovery: here it is applied as usual

    rt = plain_runtime()
    _fit(rt, Tiny(log_on_epoch=False), tmp_path, callbacks=[FaultInValidation()])
    assert _sentence(rt._s.refused).startswith("A fault was seen after an epoch's end ran past step 3's vote")

    # Validation in the middle of an epoch (every 2 batches), the same.
    class FaultInMidEpochValidation(pl.Callback):
        def on_validation_end(self, trainer: Any, module: Any) -> None:
            failed[0] = trainer.global_step == 2

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            failed[0] = False

    rt = plain_runtime()
    _fit(rt, Tiny(log_on_epoch=False), tmp_path, callbacks=[FaultInMidEpochValidation()], val_check_interval=2)
    assert _sentence(rt._s.refused).startswith("A fault was seen after validation ran past step 1's vote")

    # In the last epoch's validation no step follows to refuse at: the fit ends with the sentence.
    class FaultInLastValidation(pl.Callback):
        def on_validation_end(self, trainer: Any, module: Any) -> None:
            failed[0] = not trainer.sanity_checking and trainer.current_epoch == 1

    with pytest.raises(RefusedError, match=r"^rank 0: A fault was seen after an epoch's end ran past step 7's vote"):
        _fit(plain_runtime(), Tiny(log_on_epoch=False), tmp_path, callbacks=[FaultInLastValidation()])
    failed[0] = False
    # A fault inside a step (seen at its second micro-batch's read), after the validation that ended the step
    # before it, is redone with the step: no refusal.
    rt = plain_runtime()

    class FaultInStep(pl.Callback):
        seen_at_read = False

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            FaultInStep.seen_at_read |= failed[0]  # it was there when this batch was read
            failed[0] = failed[0] or trainer.global_step == 1

        def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, batch_idx: int) -> None:
            failed[0] = failed[0] and batch_idx % 2 == 0  # until the step's vote (here applied as usual)

    monkeypatch.setattr(Runtime, "optimizer_step", lambda self, *opts, scaler=None: [o.step() for o in opts] and True)
    _fit(
        rt,
        Tiny(log_on_epoch=False),
        tmp_path,
        callbacks=[FaultInStep()],
        accumulate_grad_batches=2,
        val_check_interval=2,
    )
    assert FaultInStep.seen_at_read and rt._s.refused == ""


class SyncedAfterStep(Tiny):
    """Logs a synced value in ``on_train_batch_end``: its collective runs after the step's vote."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.log("end_loss", outputs["loss"].detach(), sync_dist=True)


class FailAfterVote(pl.Callback):
    """The world group fails right after step 2's vote (a peer is gone, seen by the next collective);
    the next step's vote would go to recovery: here the failure is let go once that step began."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == 3:  # global_step counts the steps applied: step 2's vote was the last
            self.rt.group.failed = "a peer is gone"

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        self.rt.group.failed = ""


def test_a_fault_seen_after_a_collective_that_followed_the_vote_refuses_the_live_move(tmp_path: Path) -> None:
    """A failed group hands back each rank's own inputs: a value synced in on_train_batch_end (after the
    vote) is then this rank's own, which a callback or a step-interval plateau scheduler may take, and no
    redone step logs it again. The fault is seen at the next step's first read, and refuses the move."""
    rt = plain_runtime()
    register(rt.group, rt._s.store, {0: 0}, default=True)  # torch.distributed is up: self.log syncs through it
    try:
        trainer = _fit(rt, SyncedAfterStep(log_on_epoch=False), tmp_path, epochs=1, callbacks=[FailAfterVote(rt)])
        assert rt.own_results == 1, "the allreduce of end_loss at step 2 (its barrier has no result)"
        assert _sentence(rt._s.refused).startswith(
            "A fault was seen after step 2's vote, and a collective issued since (such as self.log(sync_dist=True) in "
            "on_train_batch_end"
        )
        # Lightning's broadcast of its SIGTERM flag before each read (with more than one rank) is issued inside
        # rt.alike(): the flag is 0 on every rank, so a rank's own value is everyone's.
        rt.group.failed = "a peer is gone"
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
        assert rt.own_results == 1
        torch.distributed.broadcast(torch.zeros(1), src=0)  # any other broadcast counts
        assert rt.own_results == 2
    finally:
        unregister(rt.group)
    # The same fault with nothing synced after the vote (the values synced in training_step were, before it):
    # no collective went on from this rank's own values, and the move goes on live.
    rt = plain_runtime()
    register(rt.group, rt._s.store, {0: 0}, default=True)
    try:
        _fit(rt, Tiny(log_on_epoch=False), tmp_path, epochs=1, callbacks=[FailAfterVote(rt)])
        assert rt._s.refused == ""
    finally:
        unregister(rt.group)


class HookCollective(pl.Callback):
    """A collective in a batch hook, as a value synced there would issue: an all_reduce at a batch's start
    (``start``), at its end (``end``) or after its backward pass (``backward``), a barrier at its start
    (``barrier``), or an all_reduce there inside rt.alike() (``alike``)."""

    def __init__(self, where: str, rt: Runtime) -> None:
        self.where = where
        self.rt = rt

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
        if self.where == "start":
            torch.distributed.all_reduce(torch.ones(1))
        elif self.where == "barrier":
            torch.distributed.barrier()
        elif self.where == "alike":
            with self.rt.alike():
                torch.distributed.all_reduce(torch.ones(1))

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
        if self.where == "end":
            torch.distributed.all_reduce(torch.ones(1))

    def on_after_backward(self, trainer: Any, module: Any) -> None:
        if self.where == "backward":
            torch.distributed.all_reduce(torch.ones(1))


def test_a_collective_in_a_batch_hook_inside_a_step_refuses_the_live_replacement_not_the_drain(tmp_path: Path) -> None:
    """A step redone after a fault runs its training_step calls again, not the batch hooks around them, while
    the replacement runs them: their collectives would not pair up (a hang, or two values that are not the
    same). The end of a batch that steps the optimizer is past the vote, and is not redone by anyone; the
    hooks of a backward pass are run again by the redo."""
    cases = (
        ("start", 1, True), ("end", 2, True), ("barrier", 1, True), ("alike", 1, True),
        ("end", 1, False), ("backward", 2, False), ("", 2, False),
    )  # fmt: skip
    for where, accumulate, refused in cases:
        rt = plain_runtime()
        register(rt.group, rt._s.store, {0: 0}, default=True)  # torch.distributed is up: the hook's call reaches it
        try:
            _fit(rt, Tiny(log_on_epoch=False), tmp_path, epochs=1, callbacks=[HookCollective(where, rt)],
                 accumulate_grad_batches=accumulate)  # fmt: skip
        finally:
            unregister(rt.group)
        assert rt._s.refused == "", "a drain still moves it"
        said = rt._s.refused_replacement
        assert bool(said) == refused, (where, accumulate, said)
        if refused:
            assert _sentence(said).startswith("A collective was issued in a batch hook inside a step")
            assert rt._moves.replace_refusal() == said


class Estimated(Tiny):
    """A OneCycleLR sized by the Trainer's estimate, as Lightning's docs size one (in configure_optimizers,
    during the strategy's setup: the estimate sets up the train loader there, once)."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        total = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_a_train_loader_set_up_by_the_estimate_in_configure_optimizers_begins_every_step(tmp_path: Path) -> None:
    rt = plain_runtime()
    trainer = _fit(rt, Estimated(log_on_epoch=False), tmp_path)
    assert rt._s.refused == ""
    assert trainer.global_step == 8 and rt._s.step == 7, "each of the 8 steps (from 0) began before its batch was read"
    (train,) = trainer.fit_loop._combined_loader.flattened
    assert isinstance(train, rlaunch.lightning.data.TrainData) and train.data is not None, "read through rt.epochs"
    assert rt._s.tracked["scheduler0"].total_steps == 8


class Unhanded(rlaunch.lightning.Strategy):
    """A Lightning that reads a train loader it never passed to the strategy (none does today)."""

    def process_dataloader(self, dataloader: object) -> object:
        return dataloader


def test_an_optimizer_step_with_no_step_begun_says_what_lightning_did(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    fit = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, strategy=Unhanded(rt=plain_runtime()), logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    with pytest.raises(rlaunch.errors.RlaunchError) as raised:
        fit.fit(Tiny(log_on_epoch=False), DataLoader(data, batch_size=8))
    assert (
        f"Lightning {pl.__version__} stepped the optimizer SGD on a train batch from a loader it never passed to "
        "the strategy's process_dataloader" in str(raised.value)
    )
    assert "second time" not in str(raised.value)


def test_a_checkpoint_callback_joins_with_what_its_sender_decided_from_not_its_sandboxs(tmp_path: Path) -> None:
    """Lightning's ``ModelCheckpoint.load_state_dict`` leaves ``current_score`` and the step it last saved
    at: a joiner whose sandbox validated kept its own, so what landed digested otherwise than what was
    sent (the move refused, the job restarted), and it skipped a save its peers made, with its collectives."""
    from rlaunch.lightning.strategy import CallbackStates
    from rlaunch.runtime.stepstate import fingerprint_value

    def checkpoint(score: float, step: int) -> Any:
        callback = pl.callbacks.ModelCheckpoint(monitor="val_loss", dirpath=tmp_path, save_top_k=2)
        callback.current_score = callback.best_model_score = torch.tensor(score)
        callback._last_global_step_saved, callback._last_checkpoint_saved = step, str(tmp_path / f"s{step}.ckpt")
        return callback

    sender, joiner = CallbackStates([checkpoint(0.88, 3)]), CallbackStates([checkpoint(0.91, 5)])
    blob = io.BytesIO()
    torch.save(sender.state_dict(), blob)
    blob.seek(0)
    joiner.load_state_dict(torch.load(blob, weights_only=True))
    assert fingerprint_value(joiner.state_dict()) == fingerprint_value(sender.state_dict())
    (landed,) = joiner._callbacks
    assert landed.current_score == torch.tensor(0.88) and landed._last_global_step_saved == 3
