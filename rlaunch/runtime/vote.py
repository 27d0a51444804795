"""The per-step vote: what it carries, how it is read, and what completed votes proved.

The vote is one float64 allreduce after gradient sync, laid out as :class:`Layout` says:

- ``healthy`` (every rank adds 1) and, as the last element, a trailer (1 again): a vote counts
  as complete only if its allreduce succeeded and both read the world size (:meth:`StepVote.complete`);
- ``ready``: the generation this rank has prepared for, and its square: every rank switches at
  this step's end only if all hold the same one (:meth:`StepVote.ready_for`);
- the step's contract digest (see :mod:`rlaunch.runtime.contract`);
- for each fingerprint (each random generator unless ``rt.seed(per_rank=True)`` derives them;
  each tracked object not declared per rank) its value and its square: the sums tell whether
  every rank holds the same value (a replica can then stand in for a lost rank). A tracked
  object that differs is refused at once. A generator that differs matters only once a step
  draws from it (Python's ``random`` is seeded per process at import, and many scripts never
  use it), so each generator also carries "this step drew from it"; one that differs and is
  used is remembered, and a later live replacement is refused;
- named sections other modules fill and read: replica fingerprints (:mod:`rlaunch.runtime.verify`),
  the group catalog (:mod:`rlaunch.runtime.contract`), a sampler's partition (:mod:`rlaunch.runtime.partition`);
- every rank's module buffers, one row per rank (each rank fills its own, the sum is all of
  them), up to :data:`~rlaunch.runtime.stepstate.CARRY_LIMIT` elements: under DDP they differ by
  rank (each rank's BatchNorm statistics after its own batch), and a replaced rank needs its own.

Sums of integers below 2^53 are exact in float64, and so is a float32 buffer in a row of zeros.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlaunch.errors import UsageError
from rlaunch.runtime import contract, rng
from rlaunch.runtime.stepstate import CARRY_LIMIT, StepStart, fingerprint_value, module_buffers, uniform, vote_terms

log = logging.getLogger(__name__)
BUFFERS = "the module buffers (too many for the vote to carry)"


def generator_label(name: str) -> str:
    """How a generator is named in sentences: "the python random number generator"."""
    return f"the {name} random number generator"


class RefusedError(UsageError):
    """The runtime refuses a loop it cannot keep bit-identical; the sentence names the object."""


@dataclass(frozen=True)
class Layout:
    """Where each part lies in one step's vote tensor (see the module docstring)."""

    checked: tuple[str, ...]  # what each fingerprint is of (a tracked name, a generator, or BUFFERS)
    generators: int  # the first ones of ``checked`` are generators, with a "used" term each
    sections: tuple[tuple[str, int], ...]  # named sections after the fingerprints: (name, length)
    row: int  # elements of one rank's buffers (0: none carried)
    world: int

    @property
    def head(self) -> int:
        """Where the named sections start."""
        return FINGERPRINTS + 2 * len(self.checked) + self.generators

    @property
    def buffers(self) -> int:
        """Where the buffer rows start."""
        return self.head + sum(n for _, n in self.sections)

    @property
    def size(self) -> int:
        """Elements of the vote tensor, the trailer included."""
        return self.buffers + self.world * self.row + 1  # the trailer

    def section(self, vote: torch.Tensor, name: str) -> torch.Tensor:
        """The part of ``vote`` (a view) that the section ``name`` fills."""
        at = self.head
        for label, n in self.sections:
            if label == name:
                return vote[at : at + n]
            at += n
        raise KeyError(name)

    def digest(self) -> int:
        """A 64-bit digest of the layout: every rank's vote must be laid out alike."""
        raw = repr((self.checked, self.generators, self.sections, self.row, self.world)).encode()
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


#: [0] healthy, [1:3] ready generation and its square, [3:11] the contract digest's limb terms
HEALTHY, READY, CONTRACT = 0, 1, 3
FINGERPRINTS = CONTRACT + contract.TERMS


class StepVote:
    """Builds each step's vote tensor and keeps what completed votes proved."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        #: what differs from rank to rank without a replica to hold it -> the first step it was seen
        self.differs: dict[str, int] = {}
        #: (step of the vote, every rank's module buffers as that vote carried them, one row per rank)
        self._carried: tuple[int, torch.Tensor] | None = None
        self._used: set[str] = set()  # generators some step drew from
        self._differing: dict[str, int] = {}  # generators whose state differed by rank (first step seen)

    def carried_buffers(self, tracked: dict[str, Any], buffers: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The module buffers the vote carries (none above CARRY_LIMIT)."""
        buffers = module_buffers(tracked) if buffers is None else buffers
        return buffers if self.world_size * sum(t.numel() for t in buffers) <= CARRY_LIMIT else []

    def tensor(
        self, *, ready: int, group_rank: int, start: StepStart | None, tracked: dict[str, Any],
        per_rank: set[str], seeded: bool, sections: Sequence[tuple[str, torch.Tensor]],
        contract_of: Callable[[Layout], int],
    ) -> tuple[torch.Tensor, Layout]:  # fmt: skip
        """This rank's vote: ``ready`` is the generation it has prepared for (0: none), ``sections``
        the named sections other modules built, ``contract_of`` the step's contract digest for a layout."""
        checked: list[str] = []
        prints: list[int] = []
        used: list[float] = []
        if not seeded and start is not None:
            now = rng.fingerprints(rng.capture())
            for name, value in rng.fingerprints(start.rng).items():
                checked.append(generator_label(name))
                prints.append(value)
                used.append(1.0 if now.get(name) != value else 0.0)
        every = start.buffers if start is not None else module_buffers(tracked)
        buffers = self.carried_buffers(tracked, every)
        if not buffers and every:
            checked.append(BUFFERS)
            prints.append(fingerprint_value(every))
        if start is not None:
            for name, state in start.states.items():
                if name not in per_rank:
                    checked.append(name)
                    prints.append(fingerprint_value(state))
        size = sum(t.numel() for t in buffers)
        layout = Layout(
            tuple(checked), len(used), tuple((n, int(t.numel())) for n, t in sections), size, self.world_size
        )
        head = [1.0, float(ready), float(ready) ** 2, *contract.terms(contract_of(layout)), *vote_terms(prints), *used]
        vote = torch.zeros(layout.size, dtype=torch.float64)
        vote[: len(head)] = torch.tensor(head, dtype=torch.float64)
        for name, part in sections:
            layout.section(vote, name).copy_(part)
        if buffers:  # this rank's buffers in its own row (the vote is on the host: gloo carries it)
            at = layout.buffers + group_rank * size
            row = [t.detach().reshape(-1).to(device="cpu", dtype=torch.float64) for t in buffers]
            torch.cat(row, out=vote[at : at + size])
        vote[-1] = 1.0
        return vote, layout

    def knowledge(self) -> dict[str, Any]:
        """What completed votes proved, for a joiner to decide as the other ranks do (JSON values)."""
        return {"differs": dict(self.differs), "used": sorted(self._used), "differing": dict(self._differing)}

    def learn(self, known: dict[str, Any]) -> None:
        """Take what another rank's votes proved (:meth:`knowledge`): a joiner, or a survivor rolled forward."""
        self.differs = {str(k): int(v) for k, v in known["differs"].items()}
        self._used = {str(n) for n in known["used"]}
        self._differing = {str(k): int(v) for k, v in known["differing"].items()}

    def complete(self, vote: torch.Tensor, layout: Layout, succeeded: bool) -> bool:
        """Whether the vote's allreduce completed on every rank's input.

        ``succeeded``: the allreduce itself returned without error here. A failed ring can leave
        some segments fully summed and others not, so a full first element alone proves nothing.
        """
        return succeeded and vote[HEALTHY].item() == self.world_size and vote[-1].item() == self.world_size

    def ready_for(self, vote: torch.Tensor) -> int:
        """The generation every rank has prepared for (0 unless all prepared for the same one)."""
        total, squares = round(vote[READY].item()), round(vote[READY + 1].item())
        n = self.world_size
        if total <= 0 or total % n or n * squares != total * total:
            return 0
        return total // n

    def contract_agrees(self, vote: torch.Tensor) -> bool:
        """Whether every rank's vote carried the same contract digest (see :mod:`rlaunch.runtime.contract`)."""
        return contract.agree(self.world_size, vote[CONTRACT:FINGERPRINTS].tolist())

    def accept(self, vote: torch.Tensor, layout: Layout, step: int, tracked: dict[str, Any], rank: int) -> None:
        """Read a completed vote: refuse a tracked object that differs by rank, keep the rest.

        Raises before anything is stepped; every rank reads the same sums, so all raise alike.
        """
        terms = FINGERPRINTS + 2 * len(layout.checked)
        equal = uniform(self.world_size, vote[FINGERPRINTS:terms].tolist())
        used = vote[terms : layout.head].tolist()
        for i, name in enumerate(layout.checked[: layout.generators]):
            if used[i] > 0:
                self._used.add(name)
            if not equal[i]:
                self._differing.setdefault(name, step)
            if name in self._used and name in self._differing and name not in self.differs:
                self.differs[name] = step
                log.info(
                    "rank %d: %s differs from rank to rank and is used (step %d); a drain moves it, but a live "
                    "replacement will be refused (see the loop patterns in docs/layouts.md).", rank, name, step,
                )  # fmt: skip
        for name, same in zip(layout.checked[layout.generators :], equal[layout.generators :], strict=True):
            if same:
                continue
            if name == BUFFERS:
                if name not in self.differs:
                    self.differs[name] = step
                    log.info(
                        "rank %d: %s differ from rank to rank at step %d; a drain moves them, but a live "
                        "replacement will be refused (see the loop patterns in docs/layouts.md).", rank, name, step,
                    )  # fmt: skip
                continue
            obj = tracked[name]
            shown = obj.generator if isinstance(obj, rng.ScriptGenerator) else obj  # what the script passed
            raise RefusedError(
                f"The tracked object {name!r} ({type(shown).__name__}) holds a different state on "
                f"different ranks at step {step}, so a replica could not stand in for a lost rank; declare it "
                f"with rt.track_per_rank({name}=...) instead of rt.track()."
            )
        if layout.row:
            rows = vote[layout.buffers : layout.buffers + self.world_size * layout.row]
            self._carried = (step, rows.view(self.world_size, layout.row))

    def refusal(self, per_rank: set[str], seeded: bool, start: StepStart | None = None) -> str:
        """Why no replica can stand in for a replaced rank ("" when one can).

        A generator known to differ that this step drew from for the first time counts too (its
        use is only voted at the end of the step).
        """
        if start is not None and not seeded:
            now = rng.fingerprints(rng.capture())
            for name, value in rng.fingerprints(start.rng).items():
                label = generator_label(name)
                if label in self._differing and now.get(name) != value:
                    self.differs.setdefault(label, start.step)
        if per_rank:
            names = ", ".join(sorted(per_rank))
            return f"the tracked state {names} is declared per rank (rt.track_per_rank) and no replica holds it"
        if self.differs:
            what = "; ".join(f"{name} since step {step}" for name, step in self.differs.items())
            why = f"these differ from rank to rank and no replica holds them: {what}"
            if not seeded and any(name.endswith("random number generator") for name in self.differs):
                why += "; rt.seed(seed, per_rank=True) makes per-rank random streams replaceable"
            return why
        return ""

    @contextlib.contextmanager
    def buffers_of(self, moved: int, next_step: int, tracked: dict[str, Any], rank: int) -> Iterator[None]:
        """While sending to replaced rank ``moved``: the module buffers are its own, as the vote carried them."""
        buffers = self.carried_buffers(tracked)
        if not buffers:
            yield
            return
        if self._carried is None or self._carried[0] != next_step - 1:
            held = "none" if self._carried is None else f"step {self._carried[0]}'s"
            raise RefusedError(
                f"rank {rank}: the replaced rank {moved} needs its module buffers (BatchNorm statistics) as of "
                f"step {next_step}, but this replica holds {held}; it stops rather than send another rank's buffers."
            )
        own = [t.detach().clone() for t in buffers]
        row = self._carried[1][moved]
        with torch.no_grad():
            offset = 0
            for t in buffers:
                t.copy_(row[offset : offset + t.numel()].reshape(t.shape).to(t.dtype))
                offset += t.numel()
        try:
            yield
        finally:
            with torch.no_grad():
                for t, mine in zip(buffers, own, strict=True):
                    t.copy_(mine)
