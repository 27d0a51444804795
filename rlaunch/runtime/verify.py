"""Replicas compared while the job runs: every move verified, silent data corruption caught.

Data-parallel replicas hold the same parameters and optimizer state after every optimizer step
(:mod:`rlaunch.runtime.replicas` says which ranks are replicas of what). A :class:`Verifier`
makes the vote compare them:

- at the job's first vote: what differs already is a layout, not a fault (tensor parallelism
  built by hand, replicas seeded apart): it is remembered, and a live replacement that would
  copy another rank's shard is refused (:attr:`Verifier.differs`);
- at the first vote after every drain and live replacement, before its optimizer step: a
  replica that differs means the move went wrong, and the job stops (:class:`MoveVerificationError`);
- every ``--verify-every`` steps (``auto``: an interval whose cost stays under
  :data:`BUDGET` of the step time, from the cost every rank measured): a replica that differs
  is silent data corruption. :func:`verdict` names the suspect by majority where a slot has
  three or more replicas, else as the one whose state changed since its own last optimizer step
  (each rank digests what its update produced in the step before a scheduled comparison: a bit
  flipped at rest since then names its rank), else by reading the state again (a device whose
  reading changed), else it cannot name one and the job stops rather than train on.

Each compared print is one tracked module's parameters (or one optimizer's state) of one
pattern, digested on its device (:mod:`rlaunch.runtime.digest`); each rank adds the limb terms
of its digest to its slot of the vote section (:mod:`rlaunch.runtime.contract`), so the sums say
whether every slot's members agree. Naming needs every rank's digests: one more allreduce,
only when something differs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rlaunch.errors import RlaunchError, UsageError
from rlaunch.runtime import contract, digest, replicas
from rlaunch.runtime.replicas import Declared, Pattern, Slots

#: ``auto``: verification may take this fraction of the median step time
BUDGET = 0.005
#: the longest ``auto`` interval, in steps
MAX_INTERVAL = 10_000
#: the environment variable the agent sets from ``--verify-every``
ENV = "RLAUNCH_VERIFY_EVERY"
SECTION = "verify"


class MoveVerificationError(RlaunchError):
    """After a move, ranks that must hold equal state do not; the job stops before the step is applied."""


class SilentCorruptionError(RlaunchError):
    """A replica's state differs from its peers' between moves: the sentence names the suspect (or why none)."""


def interval(value: str) -> int | None:
    """``--verify-every`` as the runtime reads it: None for ``auto``, 0 for off, else steps."""
    text = value.strip().lower()
    if text in ("", "auto"):
        return None
    try:
        every = int(text)
    except ValueError:
        every = -1
    if every < 0:
        raise UsageError(f"{ENV} is {value!r}; use a number of steps, 0 (off) or 'auto'.")
    return every


@dataclass(frozen=True)
class Print:
    """One compared digest: the tensors of one tracked object that share a pattern."""

    obj: str
    pattern: Pattern
    slots: Slots
    optimizer: bool  # an optimizer's state (else a module's parameters)
    #: the runtime knows these replicas are kept equal (DDP's parameters and their optimizer state,
    #: DTensors, declared sets): only then is a later difference a fault, not the script's own doing
    kept: bool

    @property
    def key(self) -> tuple[str, Pattern]:
        return (self.obj, self.pattern)

    def label(self) -> str:
        where = "" if self.pattern in ((), replicas.DECLARED) else f" (sharded on {', '.join(self.pattern)})"
        return f"{self.obj!r}{where}"


def _params_of(opt: torch.optim.Optimizer, items: Sequence[tuple[str, Any]]) -> list[Any]:
    """The parameters of an optimizer's state items (named by their index, as :func:`_items` names them)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return [params[int(i)] for i, _ in items]


def _items(obj: Any, root: Sequence[str], declared: Declared | None) -> dict[Pattern, list[tuple[str, Any]]]:
    """A module's parameters, or an optimizer's state, grouped by pattern (buffers differ by rank: not compared)."""
    grouped: dict[Pattern, list[tuple[str, Any]]] = {}
    if isinstance(obj, nn.Module):
        for name, p in obj.named_parameters():
            grouped.setdefault(replicas.pattern_of(p, root, declared), []).append((name, p))
    elif isinstance(obj, torch.optim.Optimizer):
        params = [p for g in obj.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            state = obj.state.get(p)
            if state:
                grouped.setdefault(replicas.pattern_of(p, root, declared), []).append((str(i), dict(state)))
    return grouped


@dataclass
class Verdict:
    """Who is suspected of holding corrupt state, or why nobody can be named."""

    suspects: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # rank -> evidence
    unnamed: list[str] = dataclasses.field(default_factory=list)  # sentences


class Verifier:
    """When the vote compares replicas, what it compares, and what the comparisons found."""

    def __init__(self, every: int | None, world: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.every = every
        self.world = world
        self._clock = clock
        #: the next step whose vote compares replicas without a move (a periodic check)
        self.next_step = 0
        #: prints (object, pattern) compared at least once, and equal then
        self.good: set[tuple[str, Pattern]] = set()
        #: prints that differed at their first comparison: a layout (no replica holds them) -> step
        self.differs: dict[tuple[str, Pattern], int] = {}
        self.last_cost_s = 0.0  # what the last comparison cost this rank (listing and digesting its tensors)
        self.spent_s = 0.0  # what every comparison so far cost this rank
        self.count = 0  # comparisons so far
        #: terms a joiner took as its state landed, for the vote of (generation, step) only (see prime)
        self._primed: tuple[tuple[int, int], digest.Terms] | None = None
        #: (step, print key -> digest) of this rank's state right after that step's optimizer step,
        #: taken before a scheduled comparison: its own witness of what its update produced
        self._after: tuple[int, dict[tuple[str, Pattern], int]] | None = None
        self._after_cost_s = 0.0

    def due(self, step: int, move: bool) -> bool:
        """Whether this step's vote compares replicas: after every move, and on the scheduled steps."""
        return move or self.every_compared(step)

    def prints(self, tracked: dict[str, Any], mesh: torch.Tensor | None, names: Sequence[str],
               declared: Declared | None) -> list[Print]:  # fmt: skip
        """What this vote compares, in an order every rank computes alike."""
        ddp = [obj for obj in tracked.values() if isinstance(obj, DistributedDataParallel)]
        synced = {id(p) for module in ddp for p in module.parameters()}
        out = []
        for obj_name, obj in tracked.items():
            for pattern, items in sorted(_items(obj, names, declared).items()):
                if (obj_name, pattern) in self.differs:
                    continue
                slots = replicas.slots(pattern, self.world, mesh, names, declared)
                if not slots.comparable:
                    continue
                optimizer = isinstance(obj, torch.optim.Optimizer)
                if pattern != ():  # DTensors (FSDP, tensor parallel) or a declared set: kept equal by layout
                    kept = pattern != replicas.UNKNOWN
                elif optimizer:  # the moments of parameters DDP keeps equal are equal too
                    kept = all(id(p) in synced for p in _params_of(obj, items))
                else:
                    kept = isinstance(obj, DistributedDataParallel)
                out.append(Print(obj_name, pattern, slots, optimizer, kept))
        return out

    def digests(self, tracked: dict[str, Any], prints: Sequence[Print], names: Sequence[str],
                declared: Declared | None, known: digest.Terms | None = None) -> list[int]:  # fmt: skip
        """Each print's digest (tensors' terms from ``known`` where it has them)."""
        known = known or digest.Terms()
        by_object: dict[str, dict[Pattern, list[tuple[str, Any]]]] = {}
        out = []
        for p in prints:
            grouped = by_object.setdefault(p.obj, _items(tracked[p.obj], names, declared))
            out.append(digest.of_items(grouped[p.pattern], known))
        return out

    def prime(self, known: digest.Terms, at: tuple[int, int]) -> None:
        """The comparison of the vote at ``at`` (generation, step), a joiner's first, reads its tensors'
        terms from ``known`` (what the joiner digested as its state landed: parameters and optimizer
        state do not change before that vote's optimizer step). Any other vote reads afresh: a step
        that went to recovery never reached that vote, and its recovery may have written the state in
        place, where terms known by memory would no longer describe it."""
        self._primed = (at, known)

    def prepare(self, rank: int, tracked: dict[str, Any], mesh: torch.Tensor | None, names: Sequence[str],
                declared: Declared | None, step_s: float,
                at: tuple[int, int]) -> tuple[list[Print], list[int], torch.Tensor]:  # fmt: skip
        """This rank's comparison at ``at`` (generation, step): what is compared, its digests, and its
        vote section (see :meth:`section`).

        The time it takes (listing the tensors included, not only the digests) is what the
        interval is chosen from, and what :attr:`spent_s` adds up.
        """
        began = self._clock()
        primed, self._primed = self._primed, None
        known = primed[1] if primed is not None and primed[0] == at else None
        prints = self.prints(tracked, mesh, names, declared)
        digests = self.digests(tracked, prints, names, declared, known)
        self.last_cost_s = self._clock() - began
        self.spent_s += self.last_cost_s
        self.count += 1
        part = self.section(rank, prints, digests, step_s)
        self._after_cost_s = 0.0  # counted once, with the comparison it prepared
        return prints, digests, part

    def after_update(self, step: int, tracked: dict[str, Any], mesh: torch.Tensor | None, names: Sequence[str],
                     declared: Declared | None) -> None:  # fmt: skip
        """Right after step ``step``'s optimizer step, when the next vote compares replicas: keep this
        rank's digests of what its update produced. With two replicas a difference cannot be outvoted;
        the one whose state changed since its own update (a flipped bit at rest) then names itself."""
        if not self.every_compared(step + 1):
            return
        began = self._clock()
        prints = self.prints(tracked, mesh, names, declared)
        self._after = (step, dict(zip((p.key for p in prints), self.digests(tracked, prints, names, declared),
                                      strict=True)))  # fmt: skip
        self._after_cost_s = self._clock() - began
        self.spent_s += self._after_cost_s

    def forget_witness(self) -> None:
        """The state was rolled back to a host snapshot: what the last update produced is no witness."""
        self._after = None

    def every_compared(self, step: int) -> bool:
        """Whether step ``step``'s vote is a scheduled comparison (moves aside)."""
        return self.every != 0 and step >= self.next_step

    def changed(self, step: int, prints: Sequence[Print], digests: Sequence[int]) -> list[float]:
        """For each print: 1 where this rank's state differs from what its own last update produced
        (taken by :meth:`after_update` in the step before), else 0 (also when not taken)."""
        after = self._after[1] if self._after is not None and self._after[0] == step - 1 else {}
        return [1.0 if p.key in after and after[p.key] != d else 0.0 for p, d in zip(prints, digests, strict=True)]

    def section(self, rank: int, prints: Sequence[Print], digests: Sequence[int], step_s: float) -> torch.Tensor:
        """This rank's part: its digests in its slots, and what they cost against its step (microseconds)."""
        sizes = [len(p.slots.counts) * contract.TERMS for p in prints]
        out = torch.zeros(sum(sizes) + 2, dtype=torch.float64)
        at = 0
        for p, d, size in zip(prints, digests, sizes, strict=True):
            slot = p.slots.of_rank[rank] * contract.TERMS
            out[at + slot : at + slot + contract.TERMS] = torch.tensor(contract.terms(d), dtype=torch.float64)
            at += size
        out[-2] = float(round((self.last_cost_s + self._after_cost_s) * 1e6))
        out[-1] = float(round(step_s * 1e6))
        return out

    def differing(self, summed: torch.Tensor, prints: Sequence[Print]) -> list[tuple[int, int]]:
        """(print index, slot) of every slot whose members did not all hold the same digest."""
        found = []
        at = 0
        for i, p in enumerate(prints):
            for slot, count in enumerate(p.slots.counts):
                part = summed[at + slot * contract.TERMS : at + (slot + 1) * contract.TERMS].tolist()
                if count > 1 and not contract.agree(count, part):
                    found.append((i, slot))
            at += len(p.slots.counts) * contract.TERMS
        return found

    def settle(self, step: int, summed: torch.Tensor, prints: Sequence[Print],
               differing: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:  # fmt: skip
        """Record a comparison that every rank read alike; return the differences that are faults.

        What differs at the job's first comparison is a layout (remembered in :attr:`differs`), and
        so is, when it first appears, the state of an optimizer whose parameters' pattern is one
        (its moments follow parameters that differ), and so is any difference in state the runtime
        does not know to be kept equal (a plain module: an EMA updated on one rank, experts of a
        hand-built layout that started alike). A difference in state kept equal is a fault. The
        next comparison is scheduled from the cost every rank measured (``auto``) or the fixed
        interval, counted from this one.
        """
        bad = {i for i, _ in differing}
        first = not self.good and not self.differs
        layouts = {k[1] for k in self.differs}
        for i, p in enumerate(prints):
            if i not in bad:
                self.good.add(p.key)
            elif first or not p.kept or (p.optimizer and p.key not in self.good and p.pattern in layouts):
                self.differs[p.key] = step
        faults = [(i, slot) for i, slot in differing if prints[i].key not in self.differs]
        self.next_step = step + self._interval(summed[-2].item(), summed[-1].item())
        return faults

    def _interval(self, cost_us: float, step_us: float) -> int:
        if self.every is not None:
            return self.every if self.every > 0 else MAX_INTERVAL * 100
        if step_us <= 0:
            return 1
        return max(1, min(MAX_INTERVAL, math.ceil(cost_us / (BUDGET * step_us))))

    def refusal(self) -> str:
        """Why no replica can stand in for a replaced rank, by what differed from the start ("" if nothing)."""
        if not self.differs:
            return ""
        what = " and ".join(
            repr(k[0]) if k[1] in ((), replicas.DECLARED) else f"{k[0]!r} (sharded on {', '.join(k[1])})"
            for k in sorted(self.differs)
        )
        return (
            f"the tracked {what} differ from rank to rank since step {min(self.differs.values())}, so no replica "
            "holds them (parameters kept apart by the script, such as an EMA updated on one rank, or tensor or "
            "expert parallelism built on rt.new_group: declare which ranks hold equal copies with "
            "rt.declare_replicas(...), or shard them as DTensors on rt.device_mesh)"
        )

    def knowledge(self) -> dict[str, Any]:
        """What a joiner must know to decide as the other ranks do (JSON values)."""
        return {
            "next_step": self.next_step,
            "good": [[k[0], list(k[1])] for k in sorted(self.good)],
            "differs": [[k[0], list(k[1]), s] for k, s in sorted(self.differs.items())],
        }

    def learn(self, known: dict[str, Any]) -> None:
        """Take another rank's :meth:`knowledge` (a joiner's sender, or the survivor a recovery follows)."""
        self.next_step = int(known["next_step"])
        self.good = {(str(o), tuple(str(d) for d in p)) for o, p in known["good"]}
        self.differs = {(str(o), tuple(str(d) for d in p)): int(s) for o, p, s in known["differs"]}


def verdict(prints: Sequence[Print], faults: Sequence[tuple[int, int]], first: torch.Tensor,
            again: torch.Tensor | None, step: int) -> Verdict:  # fmt: skip
    """Name the suspects of the faulty slots from every rank's row (``first``, world x (4 limbs per
    print, then one "changed since my own update" flag per print: :func:`rows_of`), by majority,
    else as the one member whose state changed since its own update, else by a second reading
    (``again``: the rows after every rank digested its state once more; None when not taken).
    Every rank computes the same verdict."""
    out = Verdict()
    flags = len(prints) * contract.LIMBS

    def value(table: torch.Tensor, rank: int, i: int) -> int:
        return contract.from_limbs(table[rank, i * contract.LIMBS : (i + 1) * contract.LIMBS].tolist())

    for i, slot in faults:
        p = prints[i]
        members = p.slots.members(slot)
        held = {r: value(first, r, i) for r in members}
        counts: dict[int, int] = {}
        for v in held.values():
            counts[v] = counts.get(v, 0) + 1
        majority = max(counts, key=lambda v: counts[v])
        shown = {r: digest.hexed(v) for r, v in held.items()}
        if counts[majority] * 2 > len(members):
            for r, v in held.items():
                if v != majority:
                    found = _evidence(p, step, "majority", shown[r], digest.hexed(majority), members)
                    out.suspects.setdefault(r, found)
            continue
        moved = [r for r in members if first[r, flags + i].item() > 0]
        if len(moved) == 1:  # its state changed after its own update, the others' did not: at rest
            r = moved[0]
            others = [digest.hexed(held[o]) for o in members if o != r]
            out.suspects.setdefault(r, _evidence(p, step, "self-check", shown[r], others[0], members))
            continue
        changed = [r for r in members if again is not None and value(again, r, i) != held[r]]
        if len(changed) == 1:
            r = changed[0]
            others = [digest.hexed(held[o]) for o in members if o != r]
            out.suspects.setdefault(r, _evidence(p, step, "reread", shown[r], others[0], members))
            continue
        how = "and a second reading that changed nothing, " if again is not None else ""
        out.unnamed.append(
            f"the replicas {members} of {p.label()} hold different state at step {step} (digests "
            f"{', '.join(f'rank {r}: {d}' for r, d in shown.items())}), and with {len(members)} of them {how}no one "
            "can be named"
        )
    return out


def _evidence(p: Print, step: int, method: str, mine: str, theirs: str, members: list[int]) -> dict[str, Any]:
    """What the suspect reports to its agent (JSON values): the object, the digests, the replicas, how."""
    return {
        "object": p.obj, "pattern": list(p.pattern), "step": step, "method": method, "digest": mine,
        "replica_digest": theirs, "replicas": members,
    }  # fmt: skip


def rows_of(digests: Sequence[int], changed: Sequence[float]) -> list[float]:
    """This rank's row for the gather that names suspects: its digests as limbs, then its
    :meth:`Verifier.changed` flags."""
    return [*(float(x) for d in digests for x in contract.limbs(d)), *changed]


def describe_suspect(rank: int, evidence: dict[str, Any]) -> str:
    """The sentence that names a suspect, from its evidence (see :func:`verdict`)."""
    how = {
        "majority": "by majority",
        "self-check": "as the one whose state changed since its own last optimizer step",
        "reread": "as the one whose second reading changed",
    }[evidence["method"]]
    peers = [r for r in evidence["replicas"] if r != rank]
    return (
        f"rank {rank}'s copy of {evidence['object']!r} (digest {evidence['digest']}) differs from its replicas' "
        f"(ranks {peers}: {evidence['replica_digest']}) at step {evidence['step']}, named {how}: silent data "
        "corruption is suspected"
    )
