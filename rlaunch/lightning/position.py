"""Where a Trainer's fit loop stands at a step's start: what a joiner takes to continue in its place.

A standby runs the user's script through Lightning's real loop (its sandbox steps are real
Lightning batches), so when it joins it is inside the fit loop at its own sandbox position. Both
the rank it replaces and the joiner are then at the same point of Lightning's code: inside the
fetch of a step's first batch, before it is read (see ``rlaunch.lightning.strategy``). What tells
Lightning where it is there lives in the fit loop's progress objects (epochs, batches, optimizer
steps, scheduler steps, validation batches), the epoch loop's ``_batches_that_stepped``, the
data fetcher's ``fetched`` count and the trainer's ``accumulate_grad_batches`` (a
``GradientAccumulationScheduler`` sets it at each epoch's start: a joiner's is its sandbox's
epoch's); all are the same on every rank, so a replica holds them as well as the leaver.
:class:`LoopPosition` reads them at each step's start and writes them into a joiner's loop.
These are private attributes of Lightning: ``rlaunch.frameworks`` pins the versions they were
read from. :class:`Monitored` carries the logged values that callbacks decide from.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from rlaunch.lightning import packages

_Loop = packages.trainer("loops")._Loop
_BaseProgress = packages.trainer("loops.progress")._BaseProgress


def progress_of(loop: Any, prefix: str = "") -> dict[str, Any]:
    """Every progress object of ``loop`` and of its child loops, by attribute path (as Lightning's
    own ``_Loop.state_dict`` walks them)."""
    found: dict[str, Any] = {}
    for name, value in vars(loop).items():
        if isinstance(value, _BaseProgress):
            found[prefix + name] = value
        elif isinstance(value, _Loop):
            found.update(progress_of(value, f"{prefix}{name}."))
    return found


class LoopPosition:
    """The fit loop's position at the last step's start (a tracked object: see the module docstring).

    :meth:`capture` reads it where a step begins; :meth:`state_dict` gives what was captured (the
    runtime takes it at the step's start and sends it to a joiner, and a replica sends it after
    the step was redone, when the live loop is past it); :meth:`load_state_dict` only holds what
    was received, and :meth:`apply` writes it into the loop of a rank that just joined.
    """

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self._held: dict[str, Any] = {}

    def capture(self) -> None:
        fit = self._trainer.fit_loop
        fetcher = fit._data_fetcher
        self._held = {
            "progress": {path: p.state_dict() for path, p in progress_of(fit).items()},
            "batches_that_stepped": int(fit.epoch_loop._batches_that_stepped),
            "fetched": int(fetcher.fetched) if fetcher is not None else 0,
            "should_stop": bool(self._trainer.should_stop),
            "skip_next_val": bool(fit.epoch_loop._skip_next_val),
            "accumulate_grad_batches": int(self._trainer.accumulate_grad_batches),
        }

    def state_dict(self) -> dict[str, Any]:
        return self._held

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._held = copy.deepcopy(state)

    def apply(self) -> None:
        """Put the held position into the live fit loop (a joiner, inside its first step's fetch)."""
        fit = self._trainer.fit_loop
        held = self._held
        live = progress_of(fit)
        missing = sorted(set(held["progress"]) ^ set(live))
        if missing:
            raise RuntimeError(
                f"The fit loop's progress received from the rank this one replaces names {missing}, which this "
                "rank's loop does not have (or the reverse): both must run the same Lightning version."
            )
        for path, state in held["progress"].items():
            live[path].load_state_dict(copy.deepcopy(state))
        fit.epoch_loop._batches_that_stepped = held["batches_that_stepped"]
        if fit._data_fetcher is not None:
            fit._data_fetcher.fetched = held["fetched"]
        self._trainer.should_stop = held["should_stop"]
        fit.epoch_loop._skip_next_val = held["skip_next_val"]
        self._trainer.accumulate_grad_batches = held["accumulate_grad_batches"]


class Monitored:
    """The logged values that callbacks and plateau schedulers decide from (``monitor=``), as the
    trainer's ``callback_metrics`` last stored them: a tracked object, so a joiner decides from the values the
    rank it replaces would have (its own are its sandbox's until the next validation). The strategy
    tracks it with ``rt.track_if_same``: a value logged without ``sync_dist=True`` differs by rank, and
    a drain still moves it while a live replacement is refused."""

    def __init__(self, trainer: Any, keys: list[str]) -> None:
        self._trainer = trainer
        self._keys = sorted(keys)

    def state_dict(self) -> dict[str, Any]:
        # The stored values, not trainer.callback_metrics: that property computes the running epoch
        # values, whose sync_dist=True is a collective (a leaver sends its state alone).
        metrics = self._trainer._logger_connector._callback_metrics
        return {key: torch.as_tensor(metrics[key]).detach().clone() for key in self._keys if key in metrics}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        metrics = self._trainer._logger_connector._callback_metrics
        for key in self._keys:
            if key in state:
                metrics[key] = state[key].detach().clone()
            else:
                metrics.pop(key, None)
