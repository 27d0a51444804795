"""Epoch loops on ``rt.steps()``: a data loader whose position moves with the rank's state.

``for epoch ...: sampler.set_epoch(epoch); for batch in loader`` does not fit a runtime that owns
the step boundaries, redoes a step after a fault and hands a rank to a joiner whose loader is
wherever its sandbox left it. :class:`EpochLoader` wraps a ``torchdata`` ``StatefulDataLoader``
(a well-kept loader that saves and restores its position, worker processes included) and its
``DistributedSampler``: ``batch()`` gives the current step's batch, starting the next epoch
(``set_epoch``) when one ends.

Its ``state_dict()`` is the epoch and the loader's position, the same on every rank (every rank
reads the same number of batches), so a replica can serve a lost rank. The runtime takes it at
each step's start like any tracked object:

- a step that is redone gets the batch it had the first time (kept, not read again);
- a joiner loads the position: its sampler takes the joiner's rank, its loader resumes at the
  same sample. Creating the resumed iterator must not draw from the global RNG (an
  uninterrupted run did not draw there), so the draw is undone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlaunch.runtime import rng
from rlaunch.runtime.stepstate import fingerprint_value


@dataclass(frozen=True)
class _Read:
    """One batch and the loader positions before and after it."""

    before: dict[str, Any]
    batch: Any
    after: dict[str, Any]


class EpochLoader:
    """The current step's batch from a ``StatefulDataLoader``, across epochs (see the module doc)."""

    def __init__(self, loader: Any, sampler: Any, rank: Callable[[], int]) -> None:
        if not (hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")):
            raise TypeError(
                f"rt.epochs() needs a loader that saves its position (torchdata's StatefulDataLoader); got "
                f"{type(loader).__name__}, which a joiner could not resume at the same sample."
            )
        self._loader, self._sampler, self._rank = loader, sampler, rank
        self.epoch = 0
        self._it: Any = None
        self._resumed = False  # the next iterator resumes a loaded position (not an epoch start)
        self._position: dict[str, Any] = {"epoch": 0, "loader": loader.state_dict()}
        self._last: _Read | None = None
        self._again: _Read | None = None  # a redone step's batch, to give again

    def batch(self) -> Any:
        """The batch of the current step (the same one again when the step is redone)."""
        if self._again is not None:
            read, self._again = self._again, None
            self._position = read.after
            return read.batch
        before = self._position
        while True:
            if self._it is None:
                self._start_iterator()
            try:
                item = next(self._it)
                break
            except StopIteration:
                self._it = None
                self.epoch += 1
        self._position = {"epoch": self.epoch, "loader": self._loader.state_dict()}
        self._last = _Read(before, item, self._position)
        return item

    def _start_iterator(self) -> None:
        if self._sampler is not None:
            self._sampler.set_epoch(self.epoch)
        if self._resumed:
            self._resumed = False
            kept = rng.capture()
            self._it = iter(self._loader)
            rng.restore(kept)
        else:
            self._it = iter(self._loader)

    def state_dict(self) -> dict[str, Any]:
        return self._position

    def load_state_dict(self, state: dict[str, Any]) -> None:
        last = self._last
        if last is not None and fingerprint_value(state) == fingerprint_value(last.before):
            self._again, self._position = last, last.before  # a redone step: give its batch again
            return
        if fingerprint_value(state) == fingerprint_value(self._position):
            return  # already there
        # A joiner (or a rank sent a replica's position): resume the loader where the sender is.
        if self._sampler is not None and hasattr(self._sampler, "rank"):
            self._sampler.rank = self._rank()
        self.epoch = int(state["epoch"])
        self._it, self._last, self._again = None, None, None
        self._loader.load_state_dict(state["loader"])
        self._resumed = True
        self._position = state
