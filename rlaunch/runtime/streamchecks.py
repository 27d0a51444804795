"""What a tracked loader's position says about the random streams it carries, told to the runtime.

:mod:`rlaunch.runtime.workerstreams` puts the streams a loader's dataset draws from in the loader's
position. Three things about them change what a move may do, and :class:`StreamChecks` tells the
runtime each once, as an :class:`~rlaunch.runtime.data.EpochLoader` reads:

- the position holds streams that may differ by rank (``varies``: the vote then remembers a
  difference instead of stopping the job, and a live replacement is refused);
- an ``IterableDataset`` that resumes itself had its workers draw from streams nothing carries
  (``refuse``: live moves are refused with a sentence);
- a generator the dataset holds in this process was drawn from by something other than this
  loader between two of its reads (another loader over the same dataset object, read without
  workers, as ``random_split``'s train and validation parts share it): the position, taken at this
  loader's last read, does not say where that generator stands (without workers), nor where the
  next epoch's workers start from (with them), and a redone step would draw from it again
  (``refuse``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlaunch.runtime import workerstreams


class StreamChecks:
    """The checks of the module docstring for one loader."""

    def __init__(self, loader: Any, refuse: Callable[[str], None] | None, varies: Callable[[], None] | None) -> None:
        self._loader = loader
        self._refuse = refuse
        self._watched = workerstreams.watched(loader)
        self._varies = varies
        self._held: int | None = None  # the held generators' print as this loader's last read left them
        self._check_varies()

    def before_read(self) -> None:
        """Before a read (and at a step's start): did anything else draw from the held generators?"""
        if self._held is None or self._refuse is None:
            return
        if workerstreams.held_print(self._loader) != self._held:
            dataset = type(self._loader.dataset).__name__
            self._say(
                f"the dataset {dataset} holds a random generator that something besides its loader drew from "
                "between two of the loader's reads (another loader over the same dataset object, as random_split's "
                "train and validation parts share it), so the loader's position does not say where that generator "
                "stands; give the other reader a generator of its own, or read it in loader worker processes too, "
                "to move such a rank live"
            )

    def read(self, position: dict[str, Any]) -> None:
        """After a read that gave ``position``."""
        self._check_varies()
        self._held = workerstreams.held_print(self._loader)
        if self._watched and self._refuse is not None:
            drew = workerstreams.not_carried(position)
            if drew:
                self._say(
                    f"the IterableDataset {type(self._loader.dataset).__name__} resumes from its own state_dict, and "
                    f"its loader's worker processes drew from the global {drew} random stream(s), which that state "
                    "does not hold, so a joiner's workers could not continue them; draw from a generator the dataset "
                    "keeps and saves in its state_dict (or make the dataset map-style) to move such a rank live"
                )

    def loaded(self, state: dict[str, Any]) -> None:
        """After this loader was given position ``state`` (its generators are set at its next read)."""
        self._held = None
        if self._varies is not None and workerstreams.carries(state):
            self._varies()  # as the ranks that sent it are, before this rank reads
            self._varies = None

    def _check_varies(self) -> None:
        if self._varies is not None and workerstreams.carried(self._loader):
            self._varies()
            self._varies = None

    def _say(self, reason: str) -> None:
        if self._refuse is not None:
            self._refuse(reason)
            self._refuse = None
