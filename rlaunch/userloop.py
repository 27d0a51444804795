"""A training loop the script writes itself over a framework's prepared objects (Fabric, Accelerate).

Lightning's ``Trainer`` keeps where it stands in objects (its loops' progress), which a joiner can
take. A loop the script writes keeps it in its own variables: ``for epoch in range(n): for batch in
loader:`` holds the epoch and the batch counter in Python locals, and a joiner's locals are where
its sandbox left them. So such a loop moves live only when it is written on the runtime's steps:

    for step in rt.steps(total):          # where the loop stands is the runtime's
        batch = loader.batch()            # the step's batch (rt.epochs: a joiner resumes at the same sample)
        ...
        optimizer.step()                  # the framework's optimizer: the per-step vote, then the step

Each prepared loader gets its own name (``data``, ``data1``, ...) and is read through ``rt.epochs``
from its first ``batch()``. Its position is tracked under that name from ``prepare()`` on, as ``{}``
until that first ``batch()`` (:class:`LoopData` is the stand-in): so a loader first read late (a
second train loader for a later phase) is known to a joiner, whose sandbox never read it, and to
every host snapshot; the one that receives a read position makes ``rt.epochs`` there, and one put
back before the first read makes it again at its next ``batch()``. A loader iterated as it is
(``for batch in loader``) is read as the framework reads it and tracks nothing: an evaluation loader,
inside ``rt.steps()`` or outside it, passes through (a joiner's reads its new rank's part). What
tells a train loader iterated this way apart is an optimizer step while it is read:

- outside ``rt.steps()`` (the framework's tutorial loop over the loader's epochs): it still trains,
  as under the framework alone, and a standby still warms up on it (from then on each of its reads
  after a vote begins a runtime step; a later phase's loop over another loader drives them from its
  first optimizer step on), but live moves are refused with a sentence (:data:`LOOP_REFUSAL`) and
  the job takes the restart path;
- inside a step of ``rt.steps()``, with an iteration of it still open (``next(it)`` on one iterator
  across steps): a joiner would read from its own iterator, so live moves are refused as well.

:class:`UserLoop` (one per runtime, shared by every ``prepare()`` call) holds the pieces an
integration shares: the names of what it tracks, the train data (:meth:`UserLoop.data`), and the
vote in the framework's optimizer step (:meth:`UserLoop.vote`).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from rlaunch.runtime.data import EpochLoader
    from rlaunch.runtime.driven import DrivenSteps
    from rlaunch.runtime.runtime import Runtime

LOOP_REFUSAL = (
    "The training loop iterates the loader's epochs itself (for batch in loader), so where it stands lives in the "
    "script's own variables (its epoch and batch counters), which a joiner cannot take; write the loop on "
    "rt.steps() and read each batch with loader.batch() for live moves."
)

_LOOPS: weakref.WeakKeyDictionary[Any, UserLoop] = weakref.WeakKeyDictionary()


class UserLoop:
    """What a loop the script writes shares with its integration (see the module docstring).

    ``name`` prefixes every refusal ("rlaunch.accelerate"). :meth:`of` gives the runtime's one loop.
    """

    def __init__(self, rt: Runtime, name: str) -> None:
        self.rt = rt
        self.name = name
        self._counts: dict[str, int] = {}  # tracked objects by kind, for their names
        self._loaders: list[LoopData] = []
        self._driven: DrivenSteps | None = None  # the loop is written over a loader's epochs
        self._driving: LoopData | None = None  # that loader: its reads begin the runtime's steps
        self._last_read: LoopData | None = None  # the loader a plain iteration last read, outside a step
        self._latest: LoopData | None = None  # the loader a plain iteration last read
        self._voted = True  # a vote was cast since the driven step began: the next read begins the next
        self._window: int | None = None  # the step of the accumulation window's first micro-step
        self.voted_in: int | None = None  # the runtime step whose vote was cast last

    @classmethod
    def of(cls, rt: Runtime, name: str) -> UserLoop:
        """The runtime's loop (made on first use): every ``prepare()`` of a script shares one."""
        loop = _LOOPS.get(rt)
        if loop is None:
            loop = _LOOPS[rt] = cls(rt, name)
        return loop

    def refuse(self, why: str) -> None:
        self.rt.refuse_moves(f"{self.name}: {why}")

    def track(self, kind: str, obj: Any) -> str:
        """Track ``obj`` under the next free name of its kind (``model``, ``model1``, ...); returns it."""
        n = self._counts.get(kind, 0)
        self._counts[kind] = n + 1
        name = kind if n == 0 else f"{kind}{n}"
        self.rt.track(**{name: obj})
        return name

    def track_once(self, name: str, obj: Any) -> bool:
        """Track ``obj`` as ``name`` unless something was tracked so by an earlier ``prepare()``; True if now."""
        if name in self._counts:
            return False
        self._counts[name] = 1
        self.rt.track(**{name: obj})
        return True

    def data(
        self,
        epochs: Callable[[str, bool], EpochLoader] | None,
        plain: Iterable[Any],
        to_device: Callable[[Any], Any],
        length: int,
        why: str,
        part: Any = None,
        order_rng: torch.Generator | None = None,
    ) -> LoopData:
        """A prepared loader: ``epochs(name, together)`` makes ``rt.epochs`` over it, untracked, at the first
        ``batch()`` (``together``: every rank at once, which may sync the order's generator) or when a
        read position lands (None, with ``why``, when it cannot be resumed at a sample); ``plain`` is the
        framework's own iteration of one epoch; ``part`` is what knows the rank's part of the data
        (``rank``), given the rank a joiner takes while ``rt.epochs`` does not hold it; ``order_rng`` is
        a generator of the loader's own that its order is drawn from (put back with the position)."""
        n = self._counts.get("data", 0)
        self._counts["data"] = n + 1
        name = "data" if n == 0 else f"data{n}"
        data = LoopData(self, name, epochs, plain, to_device, length, why, part, order_rng)
        self._loaders.append(data)
        if epochs is not None:
            self.rt.track(**{name: data.position})
        return data

    def joined(self) -> None:
        """This rank took another's place: the loaders read as they are read its new rank's part."""
        for data in self._loaders:
            data.joined(self.rt.rank)

    def micro_step(self) -> None:
        """A micro-step of a gradient-accumulation window (backward without sync, no optimizer step)."""
        if self._window is None:
            self._window = self.rt.step

    def enter(self) -> None:
        """At an optimizer step: outside a step of the runtime, after a loader was iterated as it is, this
        is the framework's loop over that loader's epochs; the runtime's steps begin here (see :meth:`vote`)."""
        if not self.rt.in_step and self._driven is None and self._last_read is not None:
            self.refuse(LOOP_REFUSAL)
            self._driving = self._last_read
            self._driven = self.rt.drive()
            self._driven.begin()

    def vote(self, optimizer: Any, scaler: Any, plain: Callable[[], Any]) -> Any:
        """The framework's optimizer step: the per-step vote, then the step (``plain`` steps without one).

        Returns whether the step was applied. Outside a step of the runtime, after a loader was
        iterated as it is, this is the framework's loop over that loader's epochs: live moves are
        refused and the runtime's steps begin from its reads, this one first. Outside a step with no
        such loader (the loop reads from something else than the prepared loaders) there is nothing to
        vote in: the step is applied as the framework would, and live moves are refused. So are they
        when the accumulation window this step ends began in an earlier step of ``rt.steps()`` (a
        redone step would not run its earlier micro-batches again), and when a loader iterated as it
        is read this step's batches (see the module docstring).
        """
        self.enter()
        if self._driving is not None and self.rt.in_step and self.voted_in == self.rt.step:
            # A second optimizer step in a driven step: the loop went on to another loader's epochs (a
            # later phase's train loader), whose reads drive the steps from here, this one first; or it
            # steps several optimizers on one batch (a GAN's), each then a step of its own (moves are
            # refused in such a loop: nothing is redone, and it trains as the framework does).
            assert self._driven is not None
            self._driving = self._latest
            self._driven.begin()
        window, self._window = self._window, None
        if window is not None and window != self.rt.step:
            self.refuse(
                "A gradient-accumulation window spans several steps of rt.steps() (its first micro-batch ran in "
                f"step {window}, its optimizer step in step {self.rt.step}), so a redone step would not run the "
                "earlier micro-batches again; run a whole window in each step."
            )
        if not self.rt.in_step:
            self.refuse(
                "The optimizer stepped outside rt.steps() and outside the prepared loaders' epochs, so a step has "
                "no boundary the runtime knows; write the loop on rt.steps() and read each batch with loader.batch()."
            )
            return plain()
        for data in self._loaders:
            if data is not self._driving and data.read_before_vote_in(self.rt.step):
                # Open or closed: each iteration begins another of the loader's epochs (another order), which
                # nothing carries, so a redone step or a joiner would read other batches.
                self.refuse(
                    f"The prepared loader {data.name!r} was read by iterating it (next(iter(loader)) or for batch "
                    f"in loader) in step {self.rt.step} of rt.steps(), before its optimizer step, so a redone step "
                    "or a joiner would read other batches; read the step's batches with loader.batch(), and iterate "
                    "an evaluation loader after the step's optimizer step."
                )
        self._voted = True
        self.voted_in = self.rt.step
        return self.rt.optimizer_step(optimizer, scaler=scaler)

    def before_read(self, data: LoopData) -> None:
        """Before a plain read of ``data``: the loader of a loop over its epochs begins the runtime's next
        step at its first read after a vote."""
        if data is self._driving and self._voted:
            assert self._driven is not None
            self._voted = False
            self._driven.begin()

    def after_read(self, data: LoopData) -> None:
        self._latest = data
        if not self.rt.in_step:
            self._last_read = data

    def end(self) -> None:
        """The framework's loop ended (a loop over the loader's epochs: no more steps are driven, and the
        agent learns that this rank is done stepping). Called where the framework says its training
        ended (Accelerate's ``end_training()``), else at a clean exit (:meth:`rlaunch.runtime.runtime.Runtime.drive`).
        What the loaders read later passes through, and an optimizer step steps as the framework would."""
        if self._driven is not None:
            self._driven.end()
            self._driving = None


class LoopData:
    """A prepared loader of a loop the script writes: ``batch()`` on ``rt.steps()``, or iterated as it is."""

    def __init__(
        self,
        loop: UserLoop,
        name: str,
        epochs: Callable[[str, bool], EpochLoader] | None,
        plain: Iterable[Any],
        to_device: Callable[[Any], Any],
        length: int,
        why: str,
        part: Any,
        order_rng: torch.Generator | None,
    ) -> None:
        self._loop = loop
        self.name = name  # its position's name in rt.track
        self._make = epochs
        self._epochs: EpochLoader | None = None
        self._order_rng = order_rng
        self._rng_at_first: torch.Tensor | None = None  # order_rng's state before the first batch()
        self.position = _Position(self)
        self._plain = plain
        self._to_device = to_device
        self._length = length
        self._why = why
        self._part = part
        self._cycle: Iterator[Any] | None = None
        self._open = 0  # plain iterations begun and not ended
        self._read_at: int | None = None  # the runtime step of the last plain read inside rt.steps()
        self._read_before_vote_at: int | None = None  # ... of the last one before that step's vote
        # Frameworks wrap this object and copy its attributes (Fabric does): the method goes along.
        self.batch = self._batch

    def _batch(self) -> Any:
        """The next batch of the step (the same ones again when the runtime redoes the step)."""
        if self._make is None:
            self._loop.refuse(self._why)
            if self._cycle is None:
                self._cycle = itertools.chain.from_iterable(_epochs(self._plain))
            return next(self._cycle)
        if self._epochs is None:
            if self._order_rng is not None:
                self._rng_at_first = self._order_rng.get_state()
            self._epochs = self._make(self.name, True)
        return self._to_device(self._epochs.batch())

    def position_state(self) -> dict[str, Any]:
        """The position: ``{}`` before the first ``batch()``, then ``rt.epochs``'s."""
        return {} if self._epochs is None else self._epochs.state_dict()

    def load_position(self, state: dict[str, Any]) -> None:
        if not state:
            if self._epochs is not None:  # back before the first batch(): every rank makes it again there
                self._epochs.forget()
                self._epochs = None
                if self._order_rng is not None and self._rng_at_first is not None:
                    self._order_rng.set_state(self._rng_at_first)
            return
        if self._epochs is None:  # a joiner, or back to a snapshot taken after it was read: made here alone
            assert self._make is not None
            self._epochs = self._make(self.name, False)
        self._epochs.load_state_dict(state)

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[Any]:
        """One epoch, as the framework iterates it (see the module docstring)."""
        loop = self._loop
        it = iter(self._plain)
        self._open += 1
        try:
            while True:
                loop.before_read(self)
                try:
                    item = next(it)
                except StopIteration:
                    return
                loop.after_read(self)
                if loop.rt.in_step:
                    self._read_at = loop.rt.step
                    if loop.voted_in != loop.rt.step:
                        self._read_before_vote_at = loop.rt.step
                yield item
        finally:
            self._open -= 1

    def read_before_vote_in(self, step: int) -> bool:
        """An iteration of this loader read a batch in runtime step ``step`` before its vote, or one still
        open read a batch in it."""
        return self._read_before_vote_at == step or (self._open > 0 and self._read_at == step)

    def joined(self, rank: int) -> None:
        """(a joiner) Read the part of ``rank``: ``rt.epochs`` does it for a loader read with ``batch()``."""
        if self._epochs is None and self._part is not None and hasattr(self._part, "rank"):
            self._part.rank = rank


class _Position:
    """A prepared loader's position as the runtime tracks it (see the module docstring), apart from the
    loader the script holds, whose ``state_dict`` stays the framework's."""

    def __init__(self, data: LoopData) -> None:
        self._data = data

    def state_dict(self) -> dict[str, Any]:
        return self._data.position_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._data.load_position(state)


def _epochs(plain: Iterable[Any]) -> Iterator[Iterable[Any]]:
    while True:
        yield plain
