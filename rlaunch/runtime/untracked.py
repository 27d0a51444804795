"""Refusals for state a script forgot to track, where a move would otherwise diverge in silence.

Checked once, at a rank's first ``rt.optimizer_step()``, before any optimizer steps:

- An LR scheduler of a tracked optimizer that is not tracked itself. A joiner builds its own
  scheduler when its script starts (and steps it in the sandbox), so after a move its learning
  rate follows another schedule than the other ranks': DDP replicas then hold different weights.
  Torch marks an optimizer whose scheduler was built by wrapping its ``step`` (the wrapper has
  ``_wrapped_by_lr_sched``), so the check needs no search of the heap.
- A ``GradScaler`` passed to ``rt.optimizer_step(scaler=...)`` that is not tracked: its scale
  would start again on a joiner (a disabled one, ``GradScaler(enabled=False)``, holds nothing).

An object counts as tracked when it is tracked itself or is an attribute of a tracked object (a
Stateful wrapper such as DCP's ``AppState(model, optimizer)``). ``ReduceLROnPlateau`` does not
wrap its optimizer's ``step`` and is not seen: track it (README, "Loop patterns").

State the runtime cannot see at all (a ``torch.Generator`` the script created, a plain counter)
is the README's business ("Loop patterns").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler


def _schedulers(obj: Any) -> Iterator[LRScheduler]:
    """``obj`` if it is a scheduler, and the schedulers it chains (SequentialLR, ChainedScheduler)."""
    if isinstance(obj, LRScheduler):
        yield obj
        for inner in getattr(obj, "_schedulers", ()):
            yield from _schedulers(inner)


def untracked_state(tracked: dict[str, Any], optimizers: Iterable[torch.optim.Optimizer], scaler: Any) -> str:
    """A sentence naming the first piece of state a move would lose, or "" if there is none."""
    # Tracked objects, then one level into them (wrappers: AppState(model, optimizer) and the like),
    # each with the name it is tracked under.
    reachable = list(tracked.items())
    reachable += [(name, inner) for name, obj in tracked.items() for inner in getattr(obj, "__dict__", {}).values()]
    names: dict[int, str] = {}
    for tracked_as, obj in reachable:
        names.setdefault(id(obj), tracked_as)
    scheduled = {id(s.optimizer) for _, obj in reachable for s in _schedulers(obj)}
    for opt in optimizers:
        name = names.get(id(opt))
        if name is None:
            return (
                f"The optimizer {type(opt).__name__} passed to rt.optimizer_step() is not tracked, so a joiner would "
                f"start it afresh; track it with rt.track(optimizer=...)."
            )
        if hasattr(opt.step, "_wrapped_by_lr_sched") and id(opt) not in scheduled:
            return (
                f"The tracked optimizer {name!r} ({type(opt).__name__}) has an LR scheduler that is not tracked: a "
                "joiner's scheduler would follow its own schedule and the replicas' weights would drift apart; "
                "track it with rt.track(sched=...)."
            )
    enabled = scaler is not None and (not hasattr(scaler, "is_enabled") or scaler.is_enabled())
    if enabled and id(scaler) not in names:
        return (
            f"The {type(scaler).__name__} passed to rt.optimizer_step(scaler=...) is not tracked, so a joiner would "
            "start its scale afresh; track it with rt.track(scaler=...)."
        )
    return ""
