"""Optimizer state still landing on a joiner: whoever reads it first waits for it.

A joiner runs its first forward and backward while its optimizer state lands (see
:class:`rlaunch.runtime.transfer.Landing`); the runtime finishes the landing before the first
vote. Nothing in a usual step reads the optimizer state before then, but a script may (a
checkpoint saved at the top of a step, a log of Adam's moments). :func:`hold` makes any such
read wait for the landing: each held optimizer's class is swapped, in place, for a subclass of
itself whose ``state`` is a property that first calls ``land`` (which, once the state is whole,
releases every hold, so the classes are the originals again) and then reads ``state`` as usual. ``isinstance`` and the
class's name are unchanged; a reference to the state dict taken before the hold is not guarded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch


class Held:
    """Optimizers whose ``state`` waits for ``land``; :meth:`release` gives them their class back."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer], land: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._held: list[tuple[torch.optim.Optimizer, type, type]] = []
        #: every optimizer is held (False: one's class could not be swapped, so nothing guards its
        #: state; the caller must land at once)
        self.whole = True
        unique = {id(opt): opt for opt in optimizers}  # one optimizer tracked under two names is held once
        for opt in unique.values():
            original = type(opt)
            guarded = _guarded(original, land)
            try:
                opt.__class__ = guarded
            except TypeError:  # a class whose layout a subclass cannot share (__slots__ of its own)
                self.whole = False
                continue
            self._held.append((opt, original, guarded))

    def release(self) -> None:
        """Every held optimizer is itself again (idempotent, from any thread)."""
        with self._lock:
            held, self._held = self._held, []
        for opt, original, guarded in reversed(held):
            if type(opt) is guarded:
                opt.__class__ = original


def hold(optimizers: Iterable[torch.optim.Optimizer], land: Callable[[], None]) -> Held:
    """Make reading or setting ``state`` on any of ``optimizers`` call ``land`` first. ``land`` must
    release the hold before it returns, even when it fails, and must not read the state before.
    Reads from several threads at once wait for the one ``land`` (a lock in the caller)."""
    return Held(optimizers, land)


def _guarded(cls: type, land: Callable[[], None]) -> type:
    # After land() the hold is released and the object is of its own class again; these read the
    # instance's own attribute all the same, so that a copy made while held (copy.deepcopy keeps
    # the guarded class) never recurses.
    def read(obj: Any) -> Any:
        land()
        if "state" in obj.__dict__:
            return obj.__dict__["state"]
        return super(guarded, obj).state

    def write(obj: Any, value: Any) -> None:
        land()
        obj.__dict__["state"] = value

    def reduce_ex(obj: Any, protocol: Any) -> Any:
        # Pickled or copied (torch.save, copy.deepcopy) as its own class, with its state whole.
        land()
        if type(obj) is guarded:
            obj.__class__ = cls
        return obj.__reduce_ex__(protocol)

    guarded = type(cls.__name__, (cls,), {
        "state": property(read, write), "__reduce_ex__": reduce_ex,
        "__qualname__": cls.__qualname__, "__module__": cls.__module__,
    })  # fmt: skip
    return guarded
