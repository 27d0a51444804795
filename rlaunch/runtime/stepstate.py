"""What a step changes besides parameters and optimizer state, kept so a redone step leaves no trace.

After a fault the commit rule may discard step s and redo it. Parameters and optimizer state are
untouched by a discarded step (the optimizer step never ran), but the forward and the script's
own per-step code changed other things: module buffers (BatchNorm running statistics and
``num_batches_tracked``), the random number generators, a GradScaler's scale and growth
tracker, an LR scheduler, a sampler. :class:`StepSnapshots` takes them at the start of each
step (buffers are copied into tensors allocated once; the rest are small) and puts them back
before the step is redone.

It also gives the per-step vote its uniformity check: :func:`fingerprints` are small integers
of the RNG states and of each tracked object's state that every rank sums (with their squares)
in the vote. When every rank holds the same value, a replica can serve a lost rank; when they
differ, it cannot, and the runtime refuses rather than diverge (see ``Runtime.optimizer_step``).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rlaunch.runtime import rng


@dataclass
class StepStart:
    """The state of one step's start that parameters and optimizer state do not hold."""

    step: int
    rng: rng.RngState
    #: tracked objects other than modules and optimizers: a deep copy of their state_dict()
    states: dict[str, Any] = field(default_factory=dict)
    #: each tracked DDP module's "the next forward broadcasts rank 0's buffers" flag (set by the
    #: previous forward: an evaluation under no_grad or a no_sync() micro-step clears it)
    ddp_flags: dict[str, bool] = field(default_factory=dict)
    #: each tracked optimizer's hyperparameters per parameter group (an LR scheduler changes them)
    hyper: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: the tracked modules' persistent buffers (the live tensors, listed once per step)
    buffers: list[torch.Tensor] = field(default_factory=list)


def _buffers(tracked: dict[str, Any]) -> list[torch.Tensor]:
    """The persistent buffers of every tracked module (what state_dict() holds besides parameters)."""
    out = []
    for obj in tracked.values():
        if isinstance(obj, nn.Module):
            out += [t for t in obj.state_dict(keep_vars=True).values() if not isinstance(t, nn.Parameter)]
    return out


def is_stateful(obj: Any) -> bool:
    """A tracked object whose state is neither a module's nor an optimizer's."""
    return not isinstance(obj, (nn.Module, torch.optim.Optimizer))


class StepSnapshots:
    """Takes the start of each step and puts it back when the step is redone."""

    def __init__(self) -> None:
        self._live: list[torch.Tensor] = []
        self._saved: list[torch.Tensor] = []

    def take(self, step: int, tracked: dict[str, Any]) -> StepStart:
        live = _buffers(tracked)
        if len(live) != len(self._live) or any(a is not b for a, b in zip(live, self._live, strict=True)):
            self._live, self._saved = live, [t.detach().clone() for t in live]  # allocated once
        else:
            with torch.no_grad():
                for saved, t in zip(self._saved, live, strict=True):
                    saved.copy_(t)
        states = {name: copy.deepcopy(obj.state_dict()) for name, obj in tracked.items() if is_stateful(obj)}
        flags = {name: bool(obj.require_forward_param_sync) for name, obj in tracked.items() if _is_ddp(obj)}
        hyper = {
            name: [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in obj.param_groups]
            for name, obj in tracked.items()
            if isinstance(obj, torch.optim.Optimizer)
        }
        return StepStart(step=step, rng=rng.capture(), states=states, ddp_flags=flags, hyper=hyper, buffers=live)

    def restore(self, start: StepStart, tracked: dict[str, Any]) -> None:
        with torch.no_grad():
            for saved, t in zip(self._saved, self._live, strict=True):
                t.copy_(saved)
        for name, state in start.states.items():
            _load(tracked[name], copy.deepcopy(state))
        for name, groups in start.hyper.items():
            for group, values in zip(tracked[name].param_groups, groups, strict=True):
                group.update(copy.deepcopy(values))
        for name, flag in start.ddp_flags.items():
            tracked[name].require_forward_param_sync = flag
        rng.restore(start.rng)


def _is_ddp(obj: Any) -> bool:
    return isinstance(obj, DistributedDataParallel)


def _load(obj: Any, state: Any) -> None:
    if isinstance(obj, torch.amp.GradScaler):
        # A discarded step may have unscaled gradients: forget that, as update() would.
        obj._per_optimizer_states.clear()
        if not state:  # not used yet at that step's start: back to its lazy initial state
            obj._scale, obj._growth_tracker = None, None
            return
    obj.load_state_dict(state)


def fingerprint_value(value: Any) -> int:
    """A small integer of a state_dict() (tensors by their bytes, the rest by repr; a dict's keys in
    sorted order, as the same state may be merged in another order on another rank: torchdata's
    loader workers add new keys of a dataset's state in a set's order)."""
    h = hashlib.blake2b(digest_size=8)

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            h.update(str((v.dtype, tuple(v.shape))).encode())
            h.update(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, dict):
            h.update(b"{")
            for k in sorted(v, key=repr):
                h.update(repr(k).encode())
                walk(v[k])
            h.update(b"}")
        elif isinstance(v, (list, tuple)):
            h.update(b"[")
            for x in v:
                walk(x)
            h.update(b"]")
        else:
            h.update(repr(v).encode())

    walk(value)
    return int.from_bytes(h.digest(), "little") % rng.FINGERPRINT_MOD


def vote_terms(fingerprints: Sequence[int]) -> list[float]:
    """Each fingerprint and its square: summed over ranks by the vote (exact in float64)."""
    return [float(x) for f in fingerprints for x in (f, f * f)]


def uniform(world: int, summed: Sequence[float]) -> list[bool]:
    """For each fingerprint's (sum, sum of squares) over ``world`` ranks: were all ranks equal?

    Equal values are exactly the case where the variance is zero: world * sum(f^2) == sum(f)^2.
    """
    out = []
    for i in range(0, len(summed), 2):
        total, squares = round(summed[i]), round(summed[i + 1])
        out.append(world * squares == total * total)
    return out


#: The vote carries every rank's module buffers while world size x buffer elements stays under this
#: (2 MB of float64); above it buffers that differ by rank make a live replacement refused.
CARRY_LIMIT = 1 << 18


def module_buffers(tracked: dict[str, Any]) -> list[torch.Tensor]:
    """The persistent buffers of every tracked module, in a fixed order.

    Under DDP they differ from rank to rank at a step boundary (each rank's BatchNorm statistics
    after its own batch; DDP overwrites them with rank 0's only at a forward that follows a
    synchronised one), so a replica does not hold a lost rank's buffers: the vote carries them.
    """
    return _buffers(tracked)
