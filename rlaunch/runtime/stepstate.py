"""What a step changes besides parameters and optimizer state, kept so a redone step leaves no trace.

After a fault the commit rule may discard step s and redo it. Parameters and optimizer state are
untouched by a discarded step (the optimizer step never ran), but the forward and the script's
own per-step code changed other things: module buffers (BatchNorm running statistics and
``num_batches_tracked``), the random number generators, a GradScaler's scale and growth
tracker, an LR scheduler, a sampler. :class:`StepSnapshots` takes them at the start of each
step (buffers are copied into tensors allocated once; the rest are small) and puts them back
before the step is redone.

Parameters changed outside the optimizer after a discarded step's ``rt.optimizer_step`` (a model
average updated whatever it returned) would be changed a second time by the redone step, and no
copy of them is kept: :class:`DiscardedParams` digests them when the step is discarded and tells,
at the redo, whether they changed since, so that the runtime refuses rather than diverge.

It also gives the per-step vote its uniformity check: :func:`fingerprints` are small integers
of the RNG states and of each tracked object's state that every rank sums (with their squares)
in the vote. When every rank holds the same value, a replica can serve a lost rank; when they
differ, it cannot, and the runtime refuses rather than diverge (see ``Runtime.optimizer_step``).
"""

from __future__ import annotations

import copy
import hashlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rlaunch.runtime import digest, rng


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
    #: each tracked DDP module's count of forwards that broadcast rank 0's buffers (see :func:`broadcasts`)
    broadcasts: dict[str, int] = field(default_factory=dict)
    #: each tracked optimizer's hyperparameters per parameter group (an LR scheduler changes them)
    hyper: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    #: the tracked modules' persistent buffers (the live tensors, listed once per step)
    buffers: list[torch.Tensor] = field(default_factory=list)
    #: their values at the step's start (copies, written again at each step's start)
    saved: list[torch.Tensor] = field(default_factory=list)
    #: the tracked name of the module each buffer is of
    owners: list[str] = field(default_factory=list)
    #: the tracked modules' parameters no tracked optimizer steps (a model average's), and their version
    #: counters at the step's start
    params: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


def _module_state(tracked: dict[str, Any]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Each tracked module's state_dict() entries (FSDP2's sharded parameters, not gathered ones): the
    tracked name, how the entry is named in sentences, and the tensor."""
    for name, obj in tracked.items():
        if isinstance(obj, nn.Module):
            what = f"of the tracked module {name!r} ({type(obj).__name__})"
            for key, t in obj.state_dict(keep_vars=True).items():
                yield name, f"{key!r} {what}", t


def _state_tensors(tracked: dict[str, Any]) -> tuple[list[torch.Tensor], list[str], list[torch.Tensor]]:
    """The persistent buffers of every tracked module, the tracked name of the module each is of, and the
    parameters, from one walk of their state."""
    buffers: list[torch.Tensor] = []
    owners: list[str] = []
    params: list[torch.Tensor] = []
    for name, _, t in _module_state(tracked):
        if isinstance(t, nn.Parameter):
            params.append(t)
        else:
            buffers.append(t)
            owners.append(name)
    return buffers, owners, params


def _buffers(tracked: dict[str, Any]) -> list[torch.Tensor]:
    """The persistent buffers of every tracked module (what state_dict() holds besides parameters)."""
    return _state_tensors(tracked)[0]


def _named_params(tracked: dict[str, Any]) -> dict[int, tuple[str, torch.Tensor]]:
    """The tracked modules' parameters by id (a tied one once), each with how it is named in sentences."""
    named: dict[int, tuple[str, torch.Tensor]] = {}
    for _, said, t in _module_state(tracked):
        if isinstance(t, nn.Parameter):
            named.setdefault(id(t), (said, t))
    return named


def buffer_names(tracked: dict[str, Any]) -> list[str]:
    """How each of :func:`module_buffers` is named in sentences: "'module.1.running_mean' of the tracked module
    'ema' (AveragedModel)"."""
    return [said for _, said, t in _module_state(tracked) if not isinstance(t, nn.Parameter)]


def buffer_owners(tracked: dict[str, Any]) -> list[str]:
    """The tracked name of the module each of :func:`module_buffers` is of."""
    return _state_tensors(tracked)[1]


def _stepped(tracked: dict[str, Any]) -> set[int]:
    """The ids of the parameters a tracked optimizer steps."""
    return {
        id(p) for obj in tracked.values() if isinstance(obj, torch.optim.Optimizer)
        for group in obj.param_groups for p in group["params"]
    }  # fmt: skip


def is_stateful(obj: Any) -> bool:
    """A tracked object whose state is neither a module's nor an optimizer's."""
    return not isinstance(obj, (nn.Module, torch.optim.Optimizer))


class StepSnapshots:
    """Takes the start of each step and puts it back when the step is redone."""

    def __init__(self) -> None:
        self._live: list[torch.Tensor] = []
        self._saved: list[torch.Tensor] = []

    def take(self, step: int, tracked: dict[str, Any]) -> StepStart:
        live, owners, every = _state_tensors(tracked)
        stepped = _stepped(tracked)
        params = list({id(p): p for p in every if id(p) not in stepped}.values())
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
        return StepStart(
            step=step, rng=rng.capture(), states=states, ddp_flags=flags, hyper=hyper, buffers=live, saved=self._saved,
            owners=owners, params=params, versions=[p._version for p in params], broadcasts=broadcasts(tracked),
        )  # fmt: skip

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


#: each DDP module's count of forwards that broadcast rank 0's buffers, since its first step
_BROADCASTS: weakref.WeakKeyDictionary[nn.Module, list[int]] = weakref.WeakKeyDictionary()


def broadcasts(tracked: dict[str, Any]) -> dict[str, int]:
    """How many forwards of each tracked DDP module broadcast rank 0's buffers to every rank, so far.

    A forward that follows a synchronised one does (an evaluation's, with or without gradients); a
    forward pre-hook counts them from the first call here on (DDP's own flag is no witness: a
    forward with gradients broadcasts and leaves it set).
    """
    counts = {}
    for name, obj in tracked.items():
        if _is_ddp(obj):
            if obj not in _BROADCASTS:
                _BROADCASTS[obj] = [0]
                obj.register_forward_pre_hook(_count_broadcast)
            counts[name] = _BROADCASTS[obj][0]
    return counts


def _count_broadcast(module: nn.Module, args: Any) -> None:
    if module.will_sync_module_buffers():  # type: ignore[operator]
        _BROADCASTS[module][0] += 1


def _load(obj: Any, state: Any) -> None:
    if isinstance(obj, torch.amp.GradScaler):
        # A discarded step may have unscaled gradients: forget that, as update() would.
        obj._per_optimizer_states.clear()
        if not state:  # not used yet at that step's start: back to its lazy initial state
            obj._scale, obj._growth_tracker = None, None
            return
    obj.load_state_dict(state)


def touched(start: StepStart, tracked: dict[str, Any]) -> str:
    """Why redoing ``start``'s step would diverge: parameters no optimizer steps (a model average's) written
    in place since its start, before its vote (an average updated at the top of the step); "" when none were.

    Read from the parameters' version counters, which every in-place write through autograd's view
    of a tensor bumps, at no cost; a write through ``.data`` and a foreach operation on DTensors
    (FSDP2, tensor parallel) bump none, and are not seen here. Parameters an optimizer steps are
    left out: a forward may rewrite them in place alike every time (``nn.Embedding(max_norm=...)``).
    """
    moved = [p for p, v in zip(start.params, start.versions, strict=True) if p._version != v]
    if not moved:
        return ""
    count = "1 parameter" if len(moved) == 1 else f"{len(moved)} parameters"
    first = _named_params(tracked).get(id(moved[0]), ("of a tracked module", moved[0]))[0]
    return (
        f"{count} that no optimizer steps changed in step {start.step} before its vote, first {first}, and the step "
        "is discarded: the redone step would change them a second time (a model average updated before "
        "rt.optimizer_step); make such changes after rt.optimizer_step, when it returns True"
    )


class DiscardedParams:
    """The tracked modules' parameters as a discarded step left them at its recovery: their digests,
    read on their own devices (no copy), compared again when the step is redone."""

    def __init__(self, step: int, tracked: dict[str, Any]) -> None:
        self.step = step
        self._named = list(_named_params(tracked).values())
        self._terms = digest.Terms().read([t for _, t in self._named])

    def changed(self) -> str:
        """Why the redone step would diverge: parameters changed since the recovery ("" when none did)."""
        now = digest.Terms().read([t for _, t in self._named])
        moved = [name for (name, _), a, b in zip(self._named, self._terms, now, strict=True) if a != b]
        if not moved:
            return ""
        count = "1 parameter" if len(moved) == 1 else f"{len(moved)} parameters"
        return (
            f"step {self.step} was discarded and is redone, but {count} changed after rt.optimizer_step returned "
            f"False, first {moved[0]}: the redone step would change them a second time (a model average updated "
            "whatever rt.optimizer_step returned); make such changes only when rt.optimizer_step returns True "
            "(if rt.optimizer_step(opt): ema.update_parameters(model))"
        )


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
