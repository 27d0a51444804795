"""Refusals for state a script forgot to track, where a move would otherwise diverge in silence.

Checked at a rank's first ``rt.optimizer_step()``, and again at the first one that passes an
optimizer or scaler not seen before, before any optimizer steps:

- An LR scheduler of an optimizer passed to ``rt.optimizer_step()`` that is not tracked. A
  joiner builds its own scheduler when its script starts (and steps it in the sandbox), so after
  a move its learning rate follows another schedule than the other ranks': DDP replicas then
  hold different weights. The schedulers are found by one scan of the heap
  (:func:`live_schedulers`), so a second scheduler beside a tracked one and
  ``ReduceLROnPlateau`` (which leaves no mark on its optimizer) are seen too; one built after
  its optimizer's first step is not.
- A ``GradScaler`` passed to ``rt.optimizer_step(scaler=...)`` that is not tracked: its scale
  would start again on a joiner (a disabled one, ``GradScaler(enabled=False)``, holds nothing).

An object counts as tracked when it is tracked itself, is an attribute of a tracked object (a
Stateful wrapper such as DCP's ``AppState(model, optimizer)``), or is chained inside a tracked
scheduler (``SequentialLR``, ``ChainedScheduler``).

State the runtime cannot see at all (a plain counter) is what the loop patterns of docs/layouts.md tell users to track.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from rlaunch.runtime import heap


def _schedulers(obj: Any) -> Iterator[LRScheduler]:
    """``obj`` if it is a scheduler, and the schedulers it chains (SequentialLR, ChainedScheduler)."""
    if isinstance(obj, LRScheduler):
        yield obj
        for inner in getattr(obj, "_schedulers", ()):
            yield from _schedulers(inner)


def live_schedulers() -> list[LRScheduler]:
    """Every LR scheduler alive in this process (a scan of the heap, made once per new optimizer)."""
    gc.collect()  # a discarded scheduler caught in a reference cycle is garbage, not state
    return heap.instances(LRScheduler)


def untracked_state(
    tracked: dict[str, Any],
    optimizers: Iterable[torch.optim.Optimizer],
    scaler: Any,
    schedulers: Iterable[LRScheduler],
) -> str:
    """A sentence naming the first piece of state a move would lose, or "" if there is none.

    ``schedulers`` are the LR schedulers alive in the process (:func:`live_schedulers`).
    """
    # Tracked objects, then one level into them (wrappers: AppState(model, optimizer) and the like),
    # each with the name it is tracked under.
    reachable = list(tracked.items())
    reachable += [(name, inner) for name, obj in tracked.items() for inner in getattr(obj, "__dict__", {}).values()]
    names: dict[int, str] = {}
    for tracked_as, obj in reachable:
        names.setdefault(id(obj), tracked_as)
    covered = {id(s) for _, obj in reachable for s in _schedulers(obj)}
    stepped = {id(opt): opt for opt in optimizers}
    for opt in stepped.values():
        if id(opt) not in names:
            return (
                f"The optimizer {type(opt).__name__} passed to rt.optimizer_step() is not tracked, so a joiner would "
                f"start it afresh; track it with rt.track(optimizer=...)."
            )
    for sched in schedulers:
        of = stepped.get(id(getattr(sched, "optimizer", None)))
        if of is not None and id(sched) not in covered:
            return (
                f"The tracked optimizer {names[id(of)]!r} ({type(of).__name__}) has an LR scheduler "
                f"({type(sched).__name__}) that is not tracked: a joiner's scheduler would follow its own schedule "
                "and the replicas' weights would drift apart; track it with rt.track(sched=...)."
            )
    enabled = scaler is not None and (not hasattr(scaler, "is_enabled") or scaler.is_enabled())
    if enabled and id(scaler) not in names:
        return (
            f"The {type(scaler).__name__} passed to rt.optimizer_step(scaler=...) is not tracked, so a joiner would "
            "start its scale afresh; track it with rt.track(scaler=...)."
        )
    return ""
