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
  object that differs is refused at once, unless it was tracked with ``rt.track_if_same``: then
  it is remembered, like the module buffers, and a later live replacement is refused. A
  generator that differs matters only once a step draws from it (Python's ``random`` is seeded
  per process at import, and many scripts never use it), so each generator also carries "this
  step drew from it"; one that differs and is used is remembered, and a later live replacement
  is refused;
- named sections other modules fill and read: replica fingerprints (:mod:`rlaunch.runtime.verify`),
  the group catalog (:mod:`rlaunch.runtime.contract`), a sampler's partition (:mod:`rlaunch.runtime.partition`);
- every rank's module buffers, one row per rank (each rank fills its own, the sum is all of
  them), up to :data:`~rlaunch.runtime.stepstate.CARRY_LIMIT` elements: under DDP they differ by
  rank (each rank's BatchNorm statistics after its own batch), and a replaced rank needs its own.
  With them, the section :data:`LATE` says which buffers some rank changed after the previous
  vote, past what a replica can know of a lost rank's (:mod:`rlaunch.runtime.carried`): they are
  remembered, and a later live replacement rolls back to a host snapshot or is refused.

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
from rlaunch.runtime.carried import Carried, Plan, Reading, row_of
from rlaunch.runtime.stepstate import (
    CARRY_LIMIT,
    StepStart,
    broadcasts,
    buffer_names,
    buffer_owners,
    fingerprint_value,
    module_buffers,
    uniform,
    vote_terms,
)

log = logging.getLogger(__name__)
BUFFERS = "the module buffers (too many for the vote to carry)"
#: the vote's section of buffers changed after the previous vote: one term per carried buffer
LATE = "late buffers"
#: the steps at which every rank reads its buffers for changes after the previous vote: the first ones, then
#: one in LATE_EVERY
LATE_FIRST, LATE_EVERY = 16, 8


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
    sizes: tuple[int, ...]  # elements of each carried buffer (none: no buffers carried)
    world: int

    @property
    def row(self) -> int:
        """Elements of one rank's buffers (0: none carried)."""
        return sum(self.sizes)

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
        raw = repr((self.checked, self.generators, self.sections, self.sizes, self.world)).encode()
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
        #: every rank's module buffers as the last completed vote carried them
        self._carried: Carried | None = None
        self._late_known = False  # a vote found some rank's buffers changed after the previous vote
        self._used: set[str] = set()  # generators some step drew from
        self._differing: dict[str, int] = {}  # generators whose state differed by rank (first step seen)
        #: tracked objects that may differ by rank (rt.track_if_same): remembered in ``differs``, not refused
        self.lenient: set[str] = set()

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
        if buffers:
            sections = [*sections, (LATE, self._late(start, group_rank, buffers))]
        size = sum(t.numel() for t in buffers)
        layout = Layout(
            tuple(checked), len(used), tuple((n, int(t.numel())) for n, t in sections),
            tuple(int(t.numel()) for t in buffers), self.world_size,
        )  # fmt: skip
        head = [1.0, float(ready), float(ready) ** 2, *contract.terms(contract_of(layout)), *vote_terms(prints), *used]
        vote = torch.zeros(layout.size, dtype=torch.float64)
        vote[: len(head)] = torch.tensor(head, dtype=torch.float64)
        for name, part in sections:
            layout.section(vote, name).copy_(part)
        if buffers:  # this rank's buffers in its own row (the vote is on the host: gloo carries it)
            at = layout.buffers + group_rank * size
            vote[at : at + size] = row_of(buffers)
        vote[-1] = 1.0
        return vote, layout

    def _late(self, start: StepStart | None, rank: int, buffers: list[torch.Tensor]) -> torch.Tensor:
        """This rank's :data:`LATE` terms: 1 for the first buffer it changed between the last vote and this
        step's start past what a replica can know.

        Read at the first :data:`LATE_FIRST` steps, then at one step in :data:`LATE_EVERY` (the same steps
        on every rank, a joiner's included: the vote waits for the slowest), and no more once one is known; a
        fault reads it in any case (``Recovery``)."""
        late = torch.zeros(len(buffers), dtype=torch.float64)
        carried = self._carried
        if start is None or carried is None or carried.step != start.step - 1 or not carried.matches(start.saved):
            return late
        if self._late_known or (start.step >= LATE_FIRST and start.step % LATE_EVERY):
            return late
        if carried.unchanged(start.saved, rank):
            return late
        changed = carried.compare(start.saved, rank, carried.broadcast(start.broadcasts, start.owners)).changed
        if changed is not None:
            late[changed] = 1.0
        return late

    @property
    def carried_step(self) -> int | None:
        """The step of the last completed vote that carried every rank's buffers (None: none did)."""
        return self._carried.step if self._carried is not None else None

    def knowledge(self) -> dict[str, Any]:
        """What completed votes proved, for a joiner to decide as the other ranks do (JSON values)."""
        return {
            "differs": dict(self.differs), "used": sorted(self._used), "differing": dict(self._differing),
            "late": self._late_known,
        }  # fmt: skip

    def learn(self, known: dict[str, Any]) -> None:
        """Take what another rank's votes proved (:meth:`knowledge`): a joiner, or a survivor rolled forward."""
        self.differs = {str(k): int(v) for k, v in known["differs"].items()}
        self._late_known = bool(known["late"])
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
            if name == BUFFERS or name in self.lenient:
                if name not in self.differs:
                    self.differs[name] = step
                    log.info(
                        "rank %d: %s differ(s) from rank to rank at step %d; a drain moves it, but a live "
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
            changed = [i for i, n in enumerate(layout.section(vote, LATE).tolist()) if n > 0]
            if changed:
                name = (
                    f"the buffer {buffer_names(tracked)[changed[0]]}, which changes after rt.optimizer_step, after "
                    "the vote that carries every rank's"
                )
                self.differs.setdefault(name, step)
                self._late_known = True
                log.info(
                    "rank %d: %s (seen at step %d): no replica holds a lost rank's, so a live replacement will roll "
                    "back to a host snapshot or be refused (see the loop patterns in docs/layouts.md).",
                    rank, name, step,
                )  # fmt: skip
            rows = vote[layout.buffers : layout.buffers + self.world_size * layout.row]
            counts = tuple(broadcasts(tracked).items())
            self._carried = Carried(step, rows.view(self.world_size, layout.row), layout.sizes, counts)

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

    def serving(
        self, next_step: int, now: list[torch.Tensor], counts: dict[str, int], rank: int, tracked: dict[str, Any]
    ) -> Reading | str:
        """Whether this rank, holding ``now`` as its module buffers at step ``next_step``'s start (its DDP modules
        having made ``counts`` broadcasts), can give a lost rank its own: what became of each since its row, or why
        it cannot (a sentence)."""
        if not self.carried_buffers(tracked, now):
            return Reading([], {})
        carried = self._carried
        if carried is None or carried.step != next_step - 1 or not carried.matches(now):
            held = "none" if carried is None else f"step {carried.step}'s"
            return (
                f"a replaced rank needs its module buffers (BatchNorm statistics) as of step {next_step}, but the "
                f"replica on rank {rank} holds {held}"
            )
        reading = carried.compare(now, rank, carried.broadcast(counts, buffer_owners(tracked)))
        if reading.changed is not None:
            return (
                f"the buffer {buffer_names(tracked)[reading.changed]} differs from rank to rank and changed after step "
                f"{carried.step}'s vote, which carried every rank's (the script changes it after rt.optimizer_step: a "
                "model average's update, a forward in training mode), so no replica holds a lost rank's"
            )
        return reading

    @contextlib.contextmanager
    def buffers_of(self, moved: int, tracked: dict[str, Any], plan: Plan) -> Iterator[None]:
        """While sending to replaced rank ``moved``: the module buffers are its own, as the vote carried them and
        ``plan`` says (see :mod:`rlaunch.runtime.carried`)."""
        buffers = self.carried_buffers(tracked)
        if not buffers or self._carried is None:
            yield
            return
        own = [t.detach().clone() for t in buffers]
        self._carried.fill(buffers, moved, plan)
        try:
            yield
        finally:
            with torch.no_grad():
                for t, mine in zip(buffers, own, strict=True):
                    t.copy_(mine)
