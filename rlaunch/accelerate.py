"""``rlaunch.accelerate.prepare``: live moves for a Hugging Face Accelerate training loop.

Start the runtime with :func:`init` before the ``Accelerator`` is built (Accelerate then uses the
runtime's process group), and call :func:`prepare` instead of ``accelerator.prepare``::

    rt = rlaunch.accelerate.init()
    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    model, optimizer, loader, scheduler = rlaunch.accelerate.prepare(accelerator, rt, model, optimizer,
                                                                     loader, scheduler)
    for step in rt.steps(total):                       # one step per optimizer step
        for _ in range(accumulation):
            with accelerator.accumulate(model):
                loss = model(loader.batch())           # the step's batches (the same again if it is redone)
                accelerator.backward(loss)
                optimizer.step(); scheduler.step(); optimizer.zero_grad()

It calls ``accelerator.prepare`` and then:

- tracks what it returned: the models (DDP), the optimizers and schedulers inside Accelerate's
  wrappers, the ``GradScaler``, and Accelerate's gradient-accumulation counter (``accelerator.step``);
  at each optimizer step, the modules given to ``accelerator.register_for_checkpointing()`` (a model
  average) too, and live moves are refused for any other object registered so that the script did
  not track itself (a joiner would not receive it);
- votes in the optimizer's ``step()`` (Accelerate's ``AcceleratedOptimizer.step``) at each step that
  syncs gradients; a discarded step is not applied (``optimizer.step_was_skipped`` is then True, as
  for a step a ``GradScaler`` skipped: update a model average when it is False), and ``rt.steps()``
  yields it again;
- replaces each prepared loader (Accelerate's ``DataLoaderShard``) by one whose ``batch()`` reads
  through ``rt.epochs`` (made at its first ``batch()``, each loader under its own name: ``data``,
  ``data1``...): a joiner resumes at the same sample with its own shard. It avoids the two things
  Accelerate's loader does that a joiner cannot follow: it broadcasts the shuffling generator's
  state from rank 0 at every epoch's start (a joiner that starts mid-epoch would wait in that
  broadcast alone; the adapter broadcasts it once, at the first ``batch()``, and carries its state at
  each epoch's start instead), and it reads one batch ahead (a step's position would be one batch
  off). A loader iterated as it is (an evaluation loader: ``for batch in eval_loader``) is
  Accelerate's own iteration, inside ``rt.steps()`` or outside it;
- after a joiner's state lands, Accelerate's process index is the rank it took (``is_main_process``),
  and so is the shard of each loader iterated as it is.

``prepare`` may be called more than once (the model and optimizer, then the loaders): every call
shares the runtime's one :class:`rlaunch.userloop.UserLoop`.

A loop over the loader's epochs (``for batch in loader``, as Accelerate's tutorials write it) trains
as under Accelerate alone, but its place lives in the script's own variables, so live moves are
refused with a sentence and the job takes the restart path (see :mod:`rlaunch.userloop`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from rlaunch.frameworks import require
from rlaunch.runtime.runtime import report_errors_as_sentences
from rlaunch.userloop import LoopData, UserLoop

if TYPE_CHECKING:
    from rlaunch.runtime.runtime import Runtime

NAME = "rlaunch.accelerate"


def init(timeout_s: float = 300.0) -> Runtime:
    """``rlaunch.init()`` for an Accelerate script: call it before the ``Accelerator`` is built.

    A standby's sandbox has no ``MASTER_ADDR`` (it learns where rank 0 is only when it joins), and
    Accelerate refuses to start a multi-node job without one, although it will not connect with it:
    the runtime's process group is the default group already. So in a standby it names a placeholder.
    """
    import rlaunch

    report_errors_as_sentences()
    require("accelerate", f"{NAME}.init")
    rt = rlaunch.init(timeout_s)
    if rt.standby:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "0")
    return rt


def prepare(accelerator: Any, rt: Runtime, *objects: Any) -> Any:
    """``accelerator.prepare(*objects)``, made movable (see the module docstring); returns what it returns."""
    report_errors_as_sentences()
    require("accelerate", f"{NAME}.prepare")
    from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    loop = UserLoop.of(rt, NAME)
    prepared = accelerator.prepare(*objects)
    out = list(prepared) if isinstance(prepared, tuple) else [prepared]
    for i, obj in enumerate(out):
        if isinstance(obj, AcceleratedOptimizer):
            _vote_in(obj, loop, accelerator)
            loop.track("optimizer", obj.optimizer)
        elif isinstance(obj, AcceleratedScheduler):
            loop.track("scheduler", obj.scheduler)
        elif type(obj) is DataLoaderShard:
            out[i] = _data(loop, obj)
        elif type(obj) is DataLoaderDispatcher:
            out[i] = _dispatched(loop, obj)
        elif isinstance(obj, torch.nn.Module):
            loop.track("model", obj)
    if accelerator.scaler is not None:
        loop.track_once("scaler", accelerator.scaler)
    if loop.track_once("accelerate", _AccelerateState(accelerator, loop)):
        _end_in(accelerator, loop)
    return tuple(out) if isinstance(prepared, tuple) else out[0]


def _end_in(accelerator: Any, loop: UserLoop) -> None:
    """``accelerator.end_training()``, where a tutorial loop's driven steps end (before it destroys the
    process group): the agent learns that this rank is done stepping."""
    original = accelerator.end_training

    def end_training() -> None:
        loop.end()
        original()

    accelerator.end_training = end_training


class _AccelerateState:
    """Accelerate's gradient-accumulation counter (the same on every rank), and, when a joiner's state
    lands, Accelerate's process index made the rank it took (the loaders' shards too)."""

    def __init__(self, accelerator: Any, loop: UserLoop) -> None:
        self._accelerator = accelerator
        self._loop = loop

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self._accelerator.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._accelerator.step = int(state["step"])
        rank = self._loop.rt.rank
        if rank >= 0:
            from accelerate.state import AcceleratorState, PartialState

            for shared in (PartialState._shared_state, AcceleratorState._shared_state):  # each holds a copy
                if "process_index" in shared:
                    shared["process_index"] = rank
            os.environ["RANK"] = str(rank)  # Accelerate set it from a sandbox's environment
            self._loop.joined()


def _vote_in(opt: Any, loop: UserLoop, accelerator: Any) -> None:
    """Accelerate's optimizer step, with the vote where it applies the update."""
    original = opt.step

    def step(closure: Any = None) -> Any:
        if not opt.gradient_state.sync_gradients:  # a micro-step of an accumulation window: nothing applied
            loop.micro_step()
            return None
        if closure is not None:
            loop.refuse(
                "The optimizer's step was given a closure, which it evaluates inside the step, and the per-step vote "
                "cannot split that; call optimizer.step() after accelerator.backward(loss), without a closure."
            )
            return original(closure)
        loop.enter()  # the tutorial's loop over the loader's epochs: the runtime's steps begin here
        if not loop.rt.in_step:
            return loop.vote(opt.optimizer, None, original)  # refuses moves, steps as Accelerate would
        _track_registered(accelerator, loop)
        inner, scaler = opt.optimizer, opt.scaler
        if scaler is None:
            applied = loop.vote(inner, None, original)
            opt._is_overflow = not applied  # a discarded step reads as skipped (optimizer.step_was_skipped)
            return applied
        # Accelerate learns whether the scaler skipped the step (inf gradients) from a patched step method.
        inner.step = opt._optimizer_patched_step_method
        try:
            loop.vote(inner, scaler, original)
        finally:
            inner.step = opt._optimizer_original_step_method
        opt._is_overflow = not opt._accelerate_step_called
        opt._accelerate_step_called = False
        return None

    opt.step = step


def _track_registered(accelerator: Any, loop: UserLoop) -> None:
    """What the script gave ``accelerator.register_for_checkpointing()`` is training state: a module (a
    model average) is tracked as the prepared models are; another object the script did not track
    itself refuses live moves, by name (it may differ by rank, and a copy of it at each step's start,
    which a redone step needs, may be as large as a model)."""
    for obj in accelerator._custom_objects:
        if loop.rt.tracks(obj):
            continue
        if isinstance(obj, torch.nn.Module):
            loop.track("registered", obj)
        else:
            loop.refuse(
                f"An object of type {type(obj).__name__} was given to accelerator.register_for_checkpointing(), and a "
                "joiner would not receive it; track it as well for live moves (rt.track(name=obj), or "
                "rt.track_per_rank(name=obj) if it differs by rank)."
            )


class _ShardPart:
    """The part of the data a rank reads through Accelerate's ``BatchSamplerShard``, in the shape
    ``rt.epochs`` knows (a ``DistributedSampler``'s ``num_replicas``, ``rank`` and ``set_epoch``)."""

    def __init__(self, shard: Any, loader: Any) -> None:
        self._shard = shard  # BatchSamplerShard
        self._loader = loader  # Accelerate's DataLoaderShard, whose set_epoch reaches the samplers

    @property
    def num_replicas(self) -> int:
        return int(self._shard.num_processes)

    @property
    def rank(self) -> int:
        return int(self._shard.process_index)

    @rank.setter
    def rank(self, rank: int) -> None:
        self._shard.process_index = rank

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


def _to_device(shard_loader: Any) -> Any:
    from accelerate.utils import send_to_device

    def to_device(batch: Any) -> Any:
        return send_to_device(batch, shard_loader.device) if shard_loader.device is not None else batch

    return to_device


def _dispatched(loop: UserLoop, loader: Any) -> LoopData:
    """A loader that dispatches batches from rank 0: iterated as Accelerate does, refused when read with ``batch()``."""
    why = (
        "The prepared loader dispatches batches from rank 0 (dispatch_batches=True), so a rank's batches come from "
        "another process and a joiner could not resume them; use Accelerate's default, a loader per process."
    )
    return loop.data(None, loader, _to_device(loader), len(loader), why)


def _data(loop: UserLoop, shard_loader: Any) -> LoopData:
    """A prepared loader's data, read through ``rt.epochs`` from its first ``batch()`` (see the module docstring)."""
    from accelerate.data_loader import BatchSamplerShard

    batch_sampler = shard_loader.base_dataloader.batch_sampler
    to_device = _to_device(shard_loader)
    if type(batch_sampler) is not BatchSamplerShard:
        why = (
            f"The prepared loader's batches come from a {type(batch_sampler).__name__}, not Accelerate's "
            "BatchSamplerShard, so a joiner could not read its own shard at the same sample; pass Accelerate a "
            "DataLoader with batch_size= and a sampler of torch's (shuffle=True or not)."
        )
        return loop.data(None, shard_loader, to_device, len(shard_loader), why)
    part = _ShardPart(batch_sampler, shard_loader)
    part.rank = max(loop.rt.rank, 0)  # a sandbox's process index is -1, whose shard is empty
    return loop.data(lambda name, together: _epochs(loop, shard_loader, part, name, together), shard_loader,
                     to_device, len(shard_loader), "", part, shard_loader.synchronized_generator)  # fmt: skip


def _epochs(loop: UserLoop, shard_loader: Any, part: _ShardPart, name: str, together: bool) -> Any:
    """``rt.epochs`` over a prepared loader (untracked: see :mod:`rlaunch.userloop`): a ``StatefulDataLoader``
    over its dataset and ``BatchSamplerShard``, its state carried, the shuffling generator broadcast
    once when every rank makes it ``together`` (at the first ``batch()``; a position that lands holds
    that generator's state at its epoch's start)."""
    from accelerate.utils import synchronize_rng_states
    from torchdata.stateful_dataloader import StatefulDataLoader

    base = shard_loader.base_dataloader
    generator = shard_loader.synchronized_generator
    if together and generator is not None and shard_loader.rng_types and "generator" in shard_loader.rng_types:
        synchronize_rng_states(["generator"], generator)  # once, as Accelerate does at every epoch's start
    if not isinstance(base, StatefulDataLoader):
        base = StatefulDataLoader(
            base.dataset, batch_sampler=base.batch_sampler, num_workers=base.num_workers, collate_fn=base.collate_fn,
            pin_memory=base.pin_memory, timeout=base.timeout, worker_init_fn=base.worker_init_fn,
            generator=base.generator, **({"prefetch_factor": base.prefetch_factor} if base.num_workers else {}),
        )  # fmt: skip
    return loop.rt.epochs(base, sampler=part, order_rng=generator, name=name, track=False)
