"""What an agent and its workers tell each other about roles and plans: typed records and their JSON.

The agent (:mod:`rlaunch.agent.worker_link`) answers a worker's ``hello`` with a :class:`Hello`
and its ``wait_plan`` with a :class:`MigratePlan`, a :class:`ReplacePlan` or no plan; the worker
runtime (:mod:`rlaunch.runtime.runtime`) reads them back with :meth:`Hello.from_json` and
:func:`plan_from_json`. Both sides import this module, so it needs nothing but the standard
library (no torch, no asyncio, no etcd client).

The codec is explicit: ``to_json()`` gives the JSON object sent over the control socket, and
``from_json`` checks every field's presence, type and range, refuses unknown fields and kinds,
and raises :class:`~rlaunch.errors.MessageError` with a sentence naming the field. No pickle.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, ClassVar

from rlaunch.errors import MessageError

__all__ = [
    "Hello",
    "MigratePlan",
    "Plan",
    "PlanKind",
    "ReplacePlan",
    "Role",
    "StartRole",
    "plan_from_json",
    "plan_to_json",
]

#: The answer to ``wait_plan`` when no plan came within the wait: the worker asks again.
_NO_PLAN = 0
_FIX = "the agent and its workers must run the same rlaunch version"


class StartRole(str, enum.Enum):
    """How a worker starts, as its ``hello`` answer says.

    - ``active``: it holds ranks of the current generation and trains at once.
    - ``standby``: it runs sandbox iterations, then waits for a plan that makes it a ``joiner``.
    """

    ACTIVE = "active"
    STANDBY = "standby"


class Role(str, enum.Enum):
    """A node's part in a migration or a replacement (the same for all its workers).

    - ``survivor``: keeps its processes and ranks; rebuilds the groups that touch the moved ranks,
      and in a replacement sends a replica's state to the ranks it serves.
    - ``leaver`` (migration only): hands its ranks' state to the joiner at the switch, then exits 0.
    - ``joiner``: a warm standby's workers (or a failed node's restarted ones) take the moved
      ranks and receive their state.
    """

    SURVIVOR = "survivor"
    LEAVER = "leaver"
    JOINER = "joiner"


class PlanKind(str, enum.Enum):
    """What a plan does: ``migrate`` (planned: a leaver hands over) or ``replace`` (after a fault)."""

    MIGRATE = "migrate"
    REPLACE = "replace"


def _bad(what: str, name: str, value: Any, expected: str) -> MessageError:
    shown = value.value if isinstance(value, enum.Enum) else value
    return MessageError(f"The {what} has {name}={shown!r}, which is not {expected}; {_FIX}.")


def _fields(what: str, obj: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """``obj`` as a JSON object with every ``required`` field and nothing beyond ``optional`` ones."""
    if not isinstance(obj, dict):
        raise MessageError(f"The {what} is {type(obj).__name__} {obj!r}, not a JSON object; {_FIX}.")
    for name in required:
        if name not in obj:
            raise MessageError(f"The {what} lacks the field {name!r}; {_FIX}.")
    for name in obj:
        if name not in required and name not in optional:
            raise MessageError(f"The {what} has an unknown field {name!r}; {_FIX}.")
    return obj


def _int(what: str, name: str, value: Any, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``low..high`` (``high`` included; no bound if None); bools are not ints."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= low and (high is None or value <= high):
        return value
    bound = f"from {low} to {high}" if high is not None else f"of {low} or more"
    raise _bad(what, name, value, f"an integer {bound}")


def _enum(what: str, name: str, value: Any, kind: type[enum.Enum], allowed: tuple[Any, ...] = ()) -> Any:
    """``value`` as a member of ``kind`` (one of ``allowed`` if given)."""
    choices = allowed or tuple(kind)
    for member in choices:
        if value == member.value and isinstance(value, str):
            return member
    raise _bad(what, name, value, "one of " + ", ".join(m.value for m in choices))


def _ranks(what: str, name: str, value: Any, world_size: int) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _bad(what, name, value, "a list of ranks")
    ranks = tuple(_int(what, name, r, 0, world_size - 1) for r in value)
    if len(set(ranks)) != len(ranks):
        raise _bad(what, name, value, "a list of distinct ranks")
    return ranks


def _check_rank(what: str, rank: int, world_size: int, low: int = 0) -> None:
    _int(what, "rank", rank, low, world_size - 1)


@dataclasses.dataclass(frozen=True)
class Hello:
    """The agent's answer to a worker's ``hello``: how it starts, its rank and generation.

    A standby has rank -1 and generation 0 (it owns no ranks yet) and runs ``sandbox_steps``
    sandbox iterations before it waits for a plan.
    """

    role: StartRole
    rank: int
    world_size: int
    generation: int
    sandbox_steps: int = 3

    WHAT: ClassVar[str] = "hello answer from the agent"

    def __post_init__(self) -> None:
        what = self.WHAT
        object.__setattr__(self, "role", _enum(what, "role", self.role, StartRole))
        _int(what, "world_size", self.world_size, 0)
        _int(what, "generation", self.generation, 0)
        _int(what, "sandbox_steps", self.sandbox_steps, 0)
        if self.role is StartRole.STANDBY:
            _int(what, "rank", self.rank, -1, -1)
        else:
            _int(what, "world_size", self.world_size, 1)
            _check_rank(what, _int(what, "rank", self.rank, 0), self.world_size)

    def to_json(self) -> dict[str, Any]:
        return {
            "role": self.role.value,
            "rank": self.rank,
            "world_size": self.world_size,
            "generation": self.generation,
            "sandbox_steps": self.sandbox_steps,
        }

    @classmethod
    def from_json(cls, obj: Any) -> Hello:
        what = cls.WHAT
        fields = _fields(what, obj, ("role", "rank", "world_size", "generation"), ("sandbox_steps",))
        return cls(
            role=_enum(what, "role", fields["role"], StartRole),
            rank=_int(what, "rank", fields["rank"], -1),
            world_size=_int(what, "world_size", fields["world_size"], 0),
            generation=_int(what, "generation", fields["generation"], 0),
            sandbox_steps=_int(what, "sandbox_steps", fields.get("sandbox_steps", 3), 0),
        )


_PLAN_FIELDS = ("generation", "kind", "role", "rank", "moved_ranks", "world_size", "sources")


@dataclasses.dataclass(frozen=True)
class MigratePlan:
    """A planned migration to ``generation``, as one local worker takes part in it.

    ``rank`` is the global rank the worker holds in the new generation (for a leaver: the rank it
    hands over); ``moved_ranks`` are the ranks that change hands.
    """

    generation: int
    role: Role
    rank: int
    moved_ranks: tuple[int, ...]
    world_size: int

    kind: ClassVar[PlanKind] = PlanKind.MIGRATE
    ROLES: ClassVar[tuple[Role, ...]] = (Role.SURVIVOR, Role.LEAVER, Role.JOINER)

    def __post_init__(self) -> None:
        _check_plan(self, {})

    def to_json(self) -> dict[str, Any]:
        # "sources" is always sent (empty), as before the records: the wire format did not change.
        return {**_plan_json(self), "sources": {}}


@dataclasses.dataclass(frozen=True)
class ReplacePlan:
    """A live replacement after a fault, to ``generation``, as one local worker takes part in it.

    ``sources`` says which surviving rank sends each moved rank its state (every rank taken as
    a data-parallel replica of the others; a sharded job picks replicas itself). There is no
    leaver: the replaced ranks' processes are gone.
    """

    generation: int
    role: Role
    rank: int
    moved_ranks: tuple[int, ...]
    world_size: int
    sources: Mapping[int, int] = dataclasses.field(default_factory=dict)

    kind: ClassVar[PlanKind] = PlanKind.REPLACE
    ROLES: ClassVar[tuple[Role, ...]] = (Role.SURVIVOR, Role.JOINER)

    def __post_init__(self) -> None:
        _check_plan(self, self.sources)

    def to_json(self) -> dict[str, Any]:
        return {**_plan_json(self), "sources": {str(m): s for m, s in sorted(self.sources.items())}}


Plan = MigratePlan | ReplacePlan


def _what(kind: PlanKind) -> str:
    return f"{kind.value} plan from the agent"


def _check_plan(plan: Plan, sources: Mapping[int, int]) -> None:
    """Validate a plan built in code (the agent's side) as strictly as one read from JSON."""
    what = _what(plan.kind)
    _int(what, "generation", plan.generation, 1)
    object.__setattr__(plan, "role", _enum(what, "role", plan.role, Role, plan.ROLES))
    world = _int(what, "world_size", plan.world_size, 1)
    _check_rank(what, _int(what, "rank", plan.rank, 0), world)
    if not isinstance(plan.moved_ranks, tuple):
        raise _bad(what, "moved_ranks", plan.moved_ranks, "a tuple of ranks")
    _ranks(what, "moved_ranks", list(plan.moved_ranks), world)
    if plan.kind is PlanKind.MIGRATE and sources:
        raise _bad(what, "sources", sources, "empty (a migration's leaver sends the state)")
    for moved, source in sources.items():
        _int(what, "sources", moved, 0, world - 1)
        _int(what, "sources", source, 0, world - 1)
        if moved not in plan.moved_ranks or source in plan.moved_ranks:
            raise _bad(what, "sources", dict(sources), "a map from moved ranks to surviving ranks")


def _plan_json(plan: Plan) -> dict[str, Any]:
    return {
        "generation": plan.generation,
        "kind": plan.kind.value,
        "role": plan.role.value,
        "rank": plan.rank,
        "moved_ranks": list(plan.moved_ranks),
        "world_size": plan.world_size,
    }


def _sources(what: str, value: Any, world_size: int) -> dict[int, int]:
    """The JSON map ``{"<moved rank>": source rank}`` (JSON keys are strings) as ints."""
    if not isinstance(value, dict):
        raise _bad(what, "sources", value, "a map from moved ranks to surviving ranks")
    out: dict[int, int] = {}
    for key, source in value.items():
        if not isinstance(key, str) or not key.isdigit() or str(int(key)) != key:
            raise _bad(what, "sources", value, "a map whose keys are ranks written as decimal strings")
        out[_int(what, "sources", int(key), 0, world_size - 1)] = _int(what, "sources", source, 0, world_size - 1)
    return out


def plan_to_json(plan: Plan | None) -> dict[str, Any]:
    """The answer to ``wait_plan``: the plan's JSON, or ``{"generation": 0}`` for no plan yet."""
    return {"generation": _NO_PLAN} if plan is None else plan.to_json()


def plan_from_json(obj: Any) -> Plan | None:
    """Read an answer to ``wait_plan``: a plan, or None when none came within the wait."""
    what = "plan from the agent"
    if not isinstance(obj, dict):
        raise MessageError(f"The {what} is {type(obj).__name__} {obj!r}, not a JSON object; {_FIX}.")
    if "kind" not in obj:
        generation = obj.get("generation")
        if generation != _NO_PLAN or isinstance(generation, bool):
            raise MessageError(f"The {what} lacks the field 'kind'; {_FIX}.")
        _fields("answer to wait_plan from the agent", obj, ("generation",))
        return None
    kind: PlanKind = _enum(what, "kind", obj["kind"], PlanKind)
    what = _what(kind)
    fields = _fields(what, obj, _PLAN_FIELDS)
    world = _int(what, "world_size", fields["world_size"], 1)
    common: dict[str, Any] = {
        "generation": _int(what, "generation", fields["generation"], 1),
        "role": _enum(what, "role", fields["role"], Role),
        "rank": _int(what, "rank", fields["rank"], 0, world - 1),
        "moved_ranks": _ranks(what, "moved_ranks", fields["moved_ranks"], world),
        "world_size": world,
    }
    sources = _sources(what, fields["sources"], world)
    if kind is PlanKind.MIGRATE:
        if sources:
            raise _bad(what, "sources", fields["sources"], "empty (a migration's leaver sends the state)")
        return MigratePlan(**common)
    return ReplacePlan(**common, sources=sources)
