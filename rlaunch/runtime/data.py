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

A read may draw from the global generators: an iterator created at an epoch's start draws its
workers' base seed, a sampler without a generator of its own (torch's or torchdata's
``RandomSampler``, and Lightning's ``DistributedSamplerWrapper`` over one) draws its order, and a
dataset read in this process may draw for its random transforms (one read in worker processes draws
from theirs, which the loader's position carries: :mod:`rlaunch.runtime.workerstreams`). So each
read remembers the generators' states before and after it: a redone step that gets the batch again
takes the same draw. A sampler that draws its order from a generator at each epoch's start
(``order_rng``: the global torch generator, for a ``RandomSampler`` without one of its own, or the
generator that Accelerate shares between ranks) needs one thing more: the position then holds that
generator's state at the epoch's start, and a joiner's resumed iterator is created from it, so the
joiner reads the same order as the rank it replaces.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlaunch.runtime import rng, workerstreams
from rlaunch.runtime.stepstate import fingerprint_value
from rlaunch.runtime.streamchecks import StreamChecks

#: Batches remembered for a redone step (a step reads at most this many: accumulation included).
HISTORY = 256


@dataclass(frozen=True)
class _Read:
    """One batch, the loader positions before and after it, and the RNG draw it made (see the module
    docstring): the fingerprint of the generators' states before the read and their states after it."""

    rank: int  # read for this rank (a sandbox reads for rank -1: never given to a joiner)
    before: dict[str, Any]
    before_print: int
    batch: Any
    after: dict[str, Any]
    draw: tuple[int, rng.RngState] | None


class EpochLoader:
    """The batches of the current step from a ``StatefulDataLoader``, across epochs (see the module doc)."""

    def __init__(
        self, loader: Any, sampler: Any, rank: Callable[[], int], order_rng: torch.Generator | None = None,
        refuse: Callable[[str], None] | None = None, varies: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        if not (hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")):
            raise TypeError(
                f"rt.epochs() needs a loader that saves its position (torchdata's StatefulDataLoader); got "
                f"{type(loader).__name__}, which a joiner could not resume at the same sample."
            )
        workerstreams.carry(loader)  # what its dataset draws moves with its position
        self._loader, self._sampler, self._rank = loader, sampler, rank
        self._checks = StreamChecks(loader, refuse, varies)
        self._order_rng = order_rng
        self.epoch = 0
        self._it: Any = None
        self._resumed = False  # the next iterator resumes a loaded position (not an epoch start)
        self._epoch_rng: torch.Tensor | None = None  # order_rng's state at the epoch's start
        # The start: an empty loader state (asking a fresh StatefulDataLoader for its state would create
        # its first iterator now, drawing its base seed from the global generator earlier than a loader
        # that is only iterated does).
        self._position: dict[str, Any] = {"epoch": 0, "loader": {}}
        self._reader = rank()  # the rank the position was read for (the sampler's partition)
        self._history: deque[_Read] = deque(maxlen=HISTORY)
        self._again: deque[_Read] = deque()  # a redone step's batches, to give again

    def __iter__(self) -> EpochLoader:
        return self

    def __next__(self) -> Any:
        return self.batch()

    def batch(self) -> Any:
        """The next batch (the same ones again when the step is redone)."""
        if self._again:
            read = self._again.popleft()
            if read.draw is not None and rng.fingerprint(rng.capture()) == read.draw[0]:
                rng.restore(read.draw[1])  # the draw the first reading made
            self._position = read.after
            self._history.append(read)
            return read.batch
        before = self._position
        self._checks.before_read()
        drawn_from = rng.fingerprint(rng.capture())
        while True:
            if self._it is None:
                self._start_iterator()
            try:
                item = next(self._it)
                break
            except StopIteration:
                self._it = None
                self.epoch += 1
        after = rng.capture()
        draw = (drawn_from, after) if rng.fingerprint(after) != drawn_from else None
        self._position = {"epoch": self.epoch, "loader": self._loader.state_dict()}
        self._checks.read(self._position["loader"])
        if self._epoch_rng is not None:
            self._position["rng"] = self._epoch_rng
        self._reader = self._rank()
        self._history.append(_Read(self._reader, before, fingerprint_value(before), item, self._position, draw))
        return item

    def _start_iterator(self) -> None:
        if self._sampler is not None:
            self._sampler.set_epoch(self.epoch)
        if self._resumed:
            # The sender's iterator was created at its epoch's start: so is this one, from the same
            # state of the generator its order comes from; the global streams are left as they were.
            self._resumed = False
            kept = rng.capture()
            if self._order_rng is not None and self._epoch_rng is not None:
                self._order_rng.set_state(self._epoch_rng)
            self._it = iter(self._loader)
            rng.restore(kept)
            return
        if self._order_rng is not None:
            self._epoch_rng = self._order_rng.get_state()
        workerstreams.first_read(self._loader)
        self._it = iter(self._loader)

    def forget(self) -> None:
        """This reader is dropped to be made again from its start (a snapshot from before its first
        read): the generators its dataset holds go back as that read found them."""
        workerstreams.settle(self._loader, {})

    @property
    def position(self) -> dict[str, Any]:
        """Where the loader stands (what :meth:`state_dict` gives, without letting older batches go)."""
        return self._position

    def state_dict(self) -> dict[str, Any]:
        """The position (the runtime takes it at each step's start: older batches are let go)."""
        self._checks.before_read()
        self._history.clear()
        return self._position

    def load_state_dict(self, state: dict[str, Any]) -> None:
        wanted = fingerprint_value(state)
        reads = list(self._history)
        for i, read in enumerate(reads):
            if read.before_print == wanted and read.rank == self._rank():  # a redone step: its batches again
                self._again = deque(reads[i:])
                for _ in reads[i:]:
                    self._history.pop()
                self._position = read.before
                return
        if wanted == fingerprint_value(self._position) and self._reader == self._rank():
            return  # already there
        # A joiner (or a rank sent a replica's position): resume the loader where the sender is.
        if self._sampler is not None and hasattr(self._sampler, "rank"):
            self._sampler.rank = self._rank()
        self.epoch = int(state["epoch"])
        self._it, self._again = None, deque()
        self._history.clear()
        self._loader.load_state_dict(state["loader"])
        workerstreams.settle(self._loader, state)
        self._checks.loaded(state)
        self._epoch_rng = state.get("rng")
        self._resumed = True
        self._position, self._reader = state, self._rank()
