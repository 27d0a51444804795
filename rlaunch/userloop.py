"""A training loop the script writes itself over a framework's prepared objects (Fabric, Accelerate).

Lightning's ``Trainer`` keeps where it stands in objects (its loops' progress), which a joiner can
take. A loop the script writes keeps it in its own variables: ``for epoch in range(n): for batch in
loader:`` holds the epoch and the batch counter in Python locals, and a joiner's locals are where
its sandbox left them. So such a loop moves live only when it is written on the runtime's steps:

    for step in rt.steps(total):          # where the loop stands is the runtime's
        batch = loader.batch()            # the step's batch (rt.epochs: a joiner resumes at the same sample)
        ...
        optimizer.step()                  # the framework's optimizer: the per-step vote, then the step

A loop over the loader's epochs (``for batch in loader``) still trains, as under the framework alone,
and a standby still warms up on it, but live moves are refused with a sentence (:data:`LOOP_REFUSAL`)
and the job takes the restart path. :class:`UserLoop` holds the pieces an integration shares: the
train data (:meth:`UserLoop.data`), the vote in the framework's optimizer step (:meth:`UserLoop.vote`),
and the runtime's steps driven from the loader when the loop is written over its epochs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlaunch.runtime.data import EpochLoader
    from rlaunch.runtime.driven import DrivenSteps
    from rlaunch.runtime.runtime import Runtime

LOOP_REFUSAL = (
    "the training loop iterates the loader's epochs itself (for batch in loader), so where it stands lives in the "
    "script's own variables (its epoch and batch counters), which a joiner cannot take; write the loop on "
    "rt.steps() and read each batch with loader.batch() for live moves"
)


class UserLoop:
    """What a loop the script writes shares with its integration (see the module docstring).

    ``name`` prefixes every refusal ("rlaunch.accelerate").
    """

    def __init__(self, rt: Runtime, name: str) -> None:
        self.rt = rt
        self._name = name
        self._driven: DrivenSteps | None = None  # the loop is written over the loader's epochs
        self._voted = True  # a vote was cast since the driven step began: the next read begins the next
        self._window: int | None = None  # the step of the accumulation window's first micro-step

    def refuse(self, why: str) -> None:
        self.rt.refuse_moves(f"{self._name}: {why}")

    def data(
        self, epochs: EpochLoader | None, plain: Iterable[Any], to_device: Callable[[Any], Any], length: int, why: str
    ) -> LoopData:
        """The train data: ``epochs`` (``rt.epochs`` over the loader) for ``batch()``, or None with ``why``
        it cannot be resumed at a sample; ``plain`` is the framework's own iteration of one epoch."""
        return LoopData(self, epochs, plain, to_device, length, why)

    def micro_step(self) -> None:
        """A micro-step of a gradient-accumulation window (backward without sync, no optimizer step)."""
        if self._window is None:
            self._window = self.rt.step

    def vote(self, optimizer: Any, scaler: Any, plain: Callable[[], Any]) -> Any:
        """The framework's optimizer step: the per-step vote, then the step (``plain`` steps without one).

        Returns whether the step was applied. Outside a step of the runtime (the loop reads from
        something else than the prepared loader) there is nothing to vote in: the step is applied as
        the framework would, and live moves are refused. So are they when the accumulation window
        this step ends began in an earlier step of ``rt.steps()``: a redone step would not run its
        earlier micro-batches again.
        """
        window, self._window = self._window, None
        if window is not None and window != self.rt.step:
            self.refuse(
                "a gradient-accumulation window spans several steps of rt.steps() (its first micro-batch ran in "
                f"step {window}, its optimizer step in step {self.rt.step}), so a redone step would not run the "
                "earlier micro-batches again; run a whole window in each step"
            )
        if not self.rt.in_step:
            self.refuse(
                "the optimizer stepped outside rt.steps() and outside the prepared loader's epochs, so a step "
                "has no boundary the runtime knows"
            )
            return plain()
        self._voted = True
        return self.rt.optimizer_step(optimizer, scaler=scaler)

    def before_read(self) -> None:
        """(a loop over the loader's epochs) The first read after a vote begins the runtime's next step."""
        if self._voted:
            if self._driven is None:
                self._driven = self.rt.drive()
            self._voted = False
            self._driven.begin()

    def end(self) -> None:
        """The framework's loop ended (a loop over the loader's epochs: no more steps are driven)."""
        if self._driven is not None:
            self._driven.end()


class LoopData:
    """The train data of a loop the script writes: ``batch()`` on ``rt.steps()``, or iterated by epochs."""

    def __init__(
        self,
        loop: UserLoop,
        epochs: EpochLoader | None,
        plain: Iterable[Any],
        to_device: Callable[[Any], Any],
        length: int,
        why: str,
    ) -> None:
        self._loop = loop
        self._epochs = epochs
        self._plain = plain
        self._to_device = to_device
        self._length = length
        self._why = why
        self._cycle: Iterator[Any] | None = None
        # Frameworks wrap this object and copy its attributes (Fabric does): the method goes along.
        self.batch = self._batch

    def _batch(self) -> Any:
        """The next batch of the step (the same ones again when the runtime redoes the step)."""
        if self._epochs is None:
            self._loop.refuse(self._why)
            if self._cycle is None:
                self._cycle = itertools.chain.from_iterable(_epochs(self._plain))
            return next(self._cycle)
        return self._to_device(self._epochs.batch())

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[Any]:
        """One epoch, as the framework iterates it (live moves refused: see the module docstring)."""
        loop = self._loop
        if loop.rt.in_step and loop._driven is None:
            raise RuntimeError(
                f"{loop._name}: the prepared loader is iterated inside rt.steps(); read the step's batches with "
                "loader.batch() instead"
            )
        loop.refuse(LOOP_REFUSAL)
        it = iter(self._plain)
        while True:
            loop.before_read()
            try:
                item = next(it)
            except StopIteration:
                return
            yield item


def _epochs(plain: Iterable[Any]) -> Iterator[Iterable[Any]]:
    while True:
        yield plain
