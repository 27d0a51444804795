"""What the Lightning integration cannot carry, found when ``trainer.fit()`` sets up, in sentences.

Each sentence names the feature and what to do instead. Such a feature does not stop training:
the job trains as under Lightning's DDP, but a drain of the node is refused and a fault restarts
the job from the user's checkpoint, rather than move a rank live and diverge (the strategy hands
the sentence to ``rt.refuse_moves``; ``rlaunch status`` shows it). :func:`stepping` names what
needs Lightning's own optimizer step (no vote at all), :func:`refusals` what only refuses moves.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from pytorch_lightning.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from pytorch_lightning.utilities.signature_utils import is_param_in_hook_signature

#: precision plugins whose optimizer step the strategy reproduces around the vote
CARRIED_PRECISION = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


def stepping(trainer: Any, precision: Any, optimizers: list[torch.optim.Optimizer]) -> str:
    """Why the strategy must leave the optimizer step to Lightning, without a vote ("" when it need not)."""
    if type(precision) not in CARRIED_PRECISION:
        return (
            f"the precision plugin {type(precision).__name__} steps the optimizer its own way; use precision "
            "'32-true', '64-true', '16-true', 'bf16-true', 'bf16-mixed' or '16-mixed'"
        )
    for opt in optimizers:
        if isinstance(opt, torch.optim.LBFGS):
            return "the LBFGS optimizer evaluates its closure several times inside one step, which a vote cannot split"
    return ""


def refusals(trainer: Any, strategy: Any) -> list[str]:
    """Features of this fit the integration does not carry (one sentence each)."""
    found = []
    if trainer.limit_train_batches != 1.0:
        found.append(
            f"Trainer(limit_train_batches={trainer.limit_train_batches}) ends epochs before their loader does, "
            "which the data position a joiner takes does not follow"
        )
    if trainer.overfit_batches:
        found.append(f"Trainer(overfit_batches={trainer.overfit_batches}) replaces the train loader's sampler")
    if trainer.reload_dataloaders_every_n_epochs:
        found.append(
            f"Trainer(reload_dataloaders_every_n_epochs={trainer.reload_dataloaders_every_n_epochs}) makes a new "
            "train loader, whose position a joiner could not take"
        )
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        found.append("a time-based val_check_interval decides on each rank's own clock, which a joiner does not have")
    module = trainer.lightning_module
    if is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True):
        found.append("training_step(dataloader_iter) reads batches itself, so a step's batches cannot be given again")
    if strategy._ddp_comm_hook is not None or strategy._model_averaging_period is not None:
        found.append("a DDP communication hook or model averaging changes what a step's gradients are")
    for callback in trainer.callbacks:
        why = _uncarried(callback)
        if why:
            found.append(why)
    return found


def carried_callbacks(trainer: Any) -> list[Any]:
    """The callbacks whose ``state_dict()`` holds state a joiner must take (and can: see :func:`_uncarried`)."""
    return [c for c in trainer.callbacks if c.state_dict() and not _uncarried(c)]


def _uncarried(callback: Any) -> str:
    """Why ``callback``'s state cannot travel to a joiner ("" when it can, or it has none).

    The transfer loads received state with ``torch.load(weights_only=True)`` (nothing received is
    unpickled freely), so the state must be tensors, numbers, strings, lists and dicts.
    """
    state = callback.state_dict()
    if not state:
        return ""
    buf = io.BytesIO()
    try:
        torch.save(state, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means it cannot travel
        return (
            f"the callback {type(callback).__name__} keeps state that cannot travel to a joiner safely "
            f"({str(exc).splitlines()[0][:120]}); keep its state_dict() to tensors, numbers, strings, lists and dicts"
        )
    return ""


def validation_mid_window(trainer: Any) -> str:
    """Why validation may run between the micro-batches of an accumulation window ("" when it cannot).

    A discarded step is redone inside its optimizer step, micro-batch after micro-batch; Lightning's
    validation (and whatever collectives it issues) between two of them would not run again. Known
    once the fit loop has set its train data up (``trainer.val_check_batch``).
    """
    accumulate = trainer.accumulate_grad_batches
    every = trainer.val_check_batch
    if accumulate == 1 or not trainer.enable_validation or every is None or every == float("inf"):
        return ""
    at_epoch_end = trainer.check_val_every_n_epoch is not None and every >= trainer.num_training_batches
    if every % accumulate == 0 or at_epoch_end:
        return ""
    return (
        f"validation runs every {every} batches, inside gradient-accumulation windows of {accumulate} batches, and a "
        "redone step cannot run it again between its micro-batches; validate at epoch ends or every multiple of "
        "accumulate_grad_batches"
    )
