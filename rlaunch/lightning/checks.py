"""What the Lightning integration cannot carry, found when ``trainer.fit()`` sets up, in sentences.

Each sentence names the feature and what to do instead. Such a feature does not stop training:
the job trains as under Lightning's DDP, but a drain of the node is refused and a fault restarts
the job from the user's checkpoint, rather than move a rank live and diverge (the strategy hands
the sentence to ``rt.refuse_moves``; ``rlaunch status`` shows it). :func:`stepping` names what
needs Lightning's own optimizer step (no vote at all), :func:`refusals` what only refuses moves;
:func:`logged_in_training`, :func:`validation_mid_window`, :func:`validation_after_fault` and
:func:`collectives_after_fault` what can only be seen once the fit runs.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import torch

from rlaunch.lightning import packages

LightningModule = packages.trainer().LightningModule
_callbacks, _precision = packages.trainer("callbacks"), packages.trainer("plugins.precision")
BaseFinetuning, ModelPruning = _callbacks.BaseFinetuning, _callbacks.ModelPruning
StochasticWeightAveraging, WeightAveraging = _callbacks.StochasticWeightAveraging, _callbacks.WeightAveraging
DoublePrecision, HalfPrecision = _precision.DoublePrecision, _precision.HalfPrecision
MixedPrecision, Precision = _precision.MixedPrecision, _precision.Precision
is_overridden = packages.trainer("utilities.model_helpers").is_overridden
is_param_in_hook_signature = packages.trainer("utilities.signature_utils").is_param_in_hook_signature

#: precision plugins whose optimizer step the strategy reproduces around the vote
CARRIED_PRECISION = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)
#: Lightning's callbacks that change the model, its optimizer or its schedulers by epoch, or keep a model
#: of their own, outside what a joiner receives (GradientAccumulationScheduler's window is carried, and
#: WeightAveraging's model: see averaged_models)
UNCARRIED_CALLBACKS = (BaseFinetuning, StochasticWeightAveraging, ModelPruning)


#: Why a live replacement is refused once a batch hook inside a step issued a collective (a drain still moves)
HOOK_COLLECTIVE = (
    "A collective was issued in a batch hook inside a step (on_train_batch_start, a batch transfer hook, or "
    "on_train_batch_end of a batch that does not step the optimizer: a self.log(..., sync_dist=True) there, or, "
    "with gradient accumulation, Trainer(max_time=...) or a ModelCheckpoint saving by time or every few steps), "
    "which a step redone after a fault does not run again while its replacement does, so their collectives would "
    "no longer pair up; a drain still moves this rank live, and a fault restarts the job. Sync such values in "
    "training_step."
)


def stepping(trainer: Any, precision: Any, optimizers: list[torch.optim.Optimizer]) -> str:
    """Why the strategy must leave the optimizer step to Lightning, without a vote ("" when it need not)."""
    if type(precision) not in CARRIED_PRECISION:
        return (
            f"The precision plugin {type(precision).__name__} steps the optimizer its own way, which the per-step "
            "vote cannot wrap; use precision '32-true', '64-true', '16-true', 'bf16-true', 'bf16-mixed' or "
            "'16-mixed'."
        )
    for opt in optimizers:
        if isinstance(opt, torch.optim.LBFGS):
            return (
                "The LBFGS optimizer evaluates its closure several times inside one step, which a vote cannot "
                "split; use another optimizer."
            )
    return ""


def refusals(trainer: Any, strategy: Any) -> list[str]:
    """Features of this fit the integration does not carry (one sentence each)."""
    found = []
    if trainer.limit_train_batches != 1.0:
        found.append(
            f"Trainer(limit_train_batches={trainer.limit_train_batches}) ends epochs before their loader does, "
            "which the data position a joiner takes does not follow; use the whole loader each epoch (a smaller "
            "dataset instead)."
        )
    if trainer.overfit_batches:
        found.append(
            f"Trainer(overfit_batches={trainer.overfit_batches}) replaces the train loader's sampler, whose "
            "position a joiner cannot take; use the whole loader each epoch (a smaller dataset instead)."
        )
    if trainer.reload_dataloaders_every_n_epochs:
        found.append(
            f"Trainer(reload_dataloaders_every_n_epochs={trainer.reload_dataloaders_every_n_epochs}) makes a new "
            "train loader, whose position a joiner could not take; make the train loader once."
        )
    if getattr(trainer, "_val_check_time_interval", None) is not None:
        found.append(
            "A time-based val_check_interval decides on each rank's own clock, which a joiner does not have; "
            "validate by batches or epochs."
        )
    module = trainer.lightning_module
    if is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True):
        found.append(
            "The training_step takes dataloader_iter and reads batches itself, so a step's batches cannot be given "
            "again; take the batch Lightning gives (training_step(self, batch, batch_idx))."
        )
    if module.automatic_optimization and is_overridden("optimizer_step", module, LightningModule):
        found.append(
            f"{type(module).__name__}.optimizer_step is overridden, and a step the vote discards is redone inside "
            "optimizer.step(), without running the code of your override again (an LR warm-up there would be "
            "lost); move that code to an LR scheduler or to on_before_optimizer_step, and leave optimizer_step "
            "to Lightning."
        )
    if strategy._ddp_comm_hook is not None or strategy._model_averaging_period is not None:
        found.append(
            "A DDP communication hook or model averaging changes what a step's gradients are, which a redone step "
            "cannot reproduce; use plain DDP."
        )
    for callback in trainer.callbacks:
        why = _uncarried(callback)
        if why:
            found.append(why)
    return found


def averaged_models(trainer: Any) -> dict[str, torch.nn.Module]:
    """The models of the fit's ``WeightAveraging`` callbacks (``EMAWeightAveraging`` among them), to track
    beside the model, by name.

    Each callback made its ``AveragedModel`` in its ``setup`` (before the strategy's) and updates it in
    ``on_train_batch_end``, after the step's vote: only after a step that applied, since a discarded step
    is redone inside the strategy's ``optimizer_step``. Its one counter of updates travels in its
    ``state_dict()`` with the other callbacks' states.
    """
    averaging = [c for c in trainer.callbacks if isinstance(c, WeightAveraging) and c._average_model is not None]
    return {f"average{i}" if len(averaging) > 1 else "average": c._average_model for i, c in enumerate(averaging)}


def average_replaced(trainer: Any, tracked: dict[str, torch.nn.Module]) -> str:
    """Why the averages tracked at the fit's setup (``tracked``) no longer serve ("" while they do): a
    callback replaced its average model since, which a joiner would not take."""
    now = averaged_models(trainer)
    if now.keys() == tracked.keys() and all(now[name] is tracked[name] for name in now):
        return ""
    return (
        "A WeightAveraging callback replaced its average model after the fit was set up, where the strategy "
        "tracks it beside the model, so a joiner would not take the new one; keep the one its setup() built."
    )


def carried_callbacks(trainer: Any) -> list[Any]:
    """The callbacks whose ``state_dict()`` holds state a joiner must take (and can: see :func:`_uncarried`)."""
    return [c for c in trainer.callbacks if not _uncarried(c) and c.state_dict()]


def _uncarried(callback: Any) -> str:
    """Why ``callback``'s state cannot travel to a joiner ("" when it can, or it has none).

    The transfer loads received state with ``torch.load(weights_only=True)`` (nothing received is
    unpickled freely), so the state must be tensors, numbers, strings, lists and dicts. Some of
    Lightning's own callbacks change more than their state (:data:`UNCARRIED_CALLBACKS`).
    """
    if isinstance(callback, WeightAveraging) and callback._average_model is None:
        return (
            f"The callback {type(callback).__name__} had no average model when the fit was set up, where the "
            "strategy tracks it beside the model, so a joiner would not take the one it builds later; build it "
            "in the callback's setup(), as Lightning's WeightAveraging does, or leave it out for live moves."
        )
    if isinstance(callback, UNCARRIED_CALLBACKS):
        return (
            f"The callback {type(callback).__name__} changes the model, its optimizer or its schedulers by "
            "epoch, or keeps a model of its own, outside what a joiner receives (its sandbox's would stand); "
            "leave it out for live moves."
        )
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
            f"The callback {type(callback).__name__} keeps state that cannot travel to a joiner safely "
            f"({str(exc).splitlines()[0][:120].rstrip('.')}); keep its state_dict() to tensors, numbers, strings, "
            "lists and dicts."
        )
    return ""


def monitors(trainer: Any) -> dict[str, str]:
    """What decides from a logged value: the key each callback's ``monitor=`` and each plateau scheduler
    reads, and how the sentences name the reader (``ModelCheckpoint(monitor='val_loss')``)."""
    found: dict[str, str] = {}
    for callback in trainer.callbacks:
        key = getattr(callback, "monitor", None)
        if isinstance(key, str) and key:
            found.setdefault(key, f"{type(callback).__name__}(monitor={key!r})")
    for config in trainer.lr_scheduler_configs:
        if config.reduce_on_plateau and config.monitor:
            name = type(config.scheduler).__name__
            found.setdefault(config.monitor, f"The {name} scheduler's monitor={config.monitor!r}")
    return found


def logged_in_training(results: Iterable[Any], watched: dict[str, str]) -> str:
    """Why what the training hooks logged (Lightning's ``_ResultMetric`` objects) cannot be carried
    ("" when it can).

    An epoch-level value (``self.log(..., on_epoch=True)``) is each rank's running sum: a joiner's
    covers only its own steps since it joined (no replica holds a lost rank's sums), so a callback or
    a plateau scheduler that decides from it would decide otherwise than in an uninterrupted run. A
    torchmetrics ``Metric`` keeps its running state outside everything the runtime puts back (a redone
    step updates it twice, a joiner has its sandbox's): what reads it decides otherwise the same way.
    Either is refused only when something decides from it; logged for the logger alone, it shows
    the joiner's own count there and training does not change.
    """
    for result in results:
        meta = result.meta
        if not result.is_tensor:
            reader = _reader(meta, watched, (meta.name, meta.forked_name(True), meta.forked_name(False)))
            if reader:
                kind = type(getattr(result, "value", result)).__name__
                return (
                    f"{reader} a torchmetrics {kind} logged from the training loop (self.log({meta.name!r}, ...)), "
                    "whose running state a redone step updates twice and a joiner does not have, so the decision "
                    "would differ from an uninterrupted run's; monitor a validation value, or log the value of each "
                    "step from torchmetrics.functional (self.log(name, torchmetrics.functional.accuracy(preds, "
                    "target, ...), on_epoch=False)), which keeps no state."
                )
            continue
        if not meta.on_epoch:
            continue
        reader = _reader(meta, watched, (meta.name, meta.forked_name(False)))
        if reader:
            return (
                f"{reader} an epoch-level value logged in training (self.log(..., on_epoch=True)), and a joiner's "
                "covers only the steps it ran since it joined, so the decision would differ from an uninterrupted "
                "run's; monitor a validation value, or log it on_step only and monitor that."
            )
    return ""


def _reader(meta: Any, watched: dict[str, str], keys: Iterable[str]) -> str:
    """What decides from a logged value under one of ``keys`` ("ModelCheckpoint(monitor='x') reads 'x',"), or ""."""
    for key in keys:
        if key in watched:
            return f"{watched[key]} reads {key!r},"
    return ""


def logged_metrics(results: Iterable[Any]) -> set[int]:
    """The ids of the torchmetrics ``Metric`` objects logged in training (``self.log(name, metric)``):
    their state is read by the logger (and by what monitors it: :func:`logged_in_training`)."""
    return {id(result.value) for result in results if not result.is_tensor}


def metrics_updated(counts: dict[int, int], metrics: Iterable[Any], logged: set[int]) -> str:
    """Why torchmetrics ``Metric`` modules updated during a training step cannot be carried ("" when none
    was): ``counts`` is each one's ``_update_count`` at the step's start, by ``id``. One logged from
    training (``logged``, by ``id``) is left to :func:`logged_in_training`; one that is not logged has
    readers the runtime cannot see (the script's own ``compute()``), which might decide from it."""
    for metric in metrics:
        if id(metric) in logged:
            continue
        if metric._update_count != counts.get(id(metric), metric._update_count):
            return (
                f"A torchmetrics {type(metric).__name__} of the model is updated in training_step and not logged, "
                "and its running state is neither put back when a step is redone (it would count the step twice) "
                "nor sent to a joiner; log it (self.log(name, metric)) if only the logger reads it, update it in "
                "validation, or compute each step's value with torchmetrics.functional "
                "(torchmetrics.functional.accuracy(preds, target, ...)), which keeps no state."
            )
    return ""


def validation_mid_window(trainer: Any) -> str:
    """Why validation may run between the micro-batches of an accumulation window ("" when it cannot).

    A discarded step is redone inside its optimizer step, micro-batch after micro-batch; Lightning's
    validation (and whatever collectives it issues) between two of them would not run again. Known
    once the fit loop has set its train data up (``trainer.val_check_batch``), and checked again
    when the window changes (a ``GradientAccumulationScheduler`` changes it at an epoch's start).
    """
    accumulate = trainer.accumulate_grad_batches
    every = trainer.val_check_batch
    if accumulate == 1 or not trainer.enable_validation or every is None or every == float("inf"):
        return ""
    at_epoch_end = trainer.check_val_every_n_epoch is not None and every >= trainer.num_training_batches
    if every % accumulate == 0 or at_epoch_end:
        return ""
    return (
        f"Validation runs every {every} batches, inside gradient-accumulation windows of {accumulate} batches, and "
        "a redone step cannot run it again between its micro-batches; validate at epoch ends or every multiple of "
        "accumulate_grad_batches."
    )


def validation_after_fault(what: str, step: int) -> str:
    """The sentence for a fault seen after ``what`` (validation, an epoch's end) ran past step ``step``'s vote."""
    return (
        f"A fault was seen after {what} ran past step {step}'s vote: its collectives (self.log(sync_dist=True), "
        "a checkpoint's or early stopping's decision across ranks) gave this rank's own values, which the callbacks "
        "and a plateau scheduler may have taken, and a redone step does not run it again; so the job restarts from "
        "your checkpoint instead of moving a rank live."
    )


def collectives_after_fault(count: int, step: int) -> str:
    """The sentence for a fault seen after step ``step``'s vote, where ``count`` collectives issued since
    (in ``on_train_batch_end``, a callback) handed this rank its own inputs instead of every rank's result."""
    what = "a collective" if count == 1 else f"{count} collectives"
    return (
        f"A fault was seen after step {step}'s vote, and {what} issued since (such as self.log(sync_dist=True) "
        "in on_train_batch_end, or a callback's reduce or broadcast) gave this rank its own values instead of the "
        "result across ranks, which a callback or a step-interval ReduceLROnPlateau may have taken, and a redone "
        "step does not run them again; so the job restarts from your checkpoint instead of moving a rank live "
        "(sync such values in training_step, before the optimizer step, where a fault's step is redone)."
    )
