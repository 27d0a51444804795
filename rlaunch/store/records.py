"""Typed records stored in etcd: frozen dataclasses with a validating JSON codec.

Every value rlaunch writes is one of these records. :func:`decode` checks the JSON against the
dataclass's field types and raises :class:`~rlaunch.errors.RecordError` with the key and the
offending field, so a malformed record is reported, never crashes the reader.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from typing import Any, TypeVar

from rlaunch.errors import RecordError

R = TypeVar("R")


class NodeState(str, enum.Enum):
    """What a node's agent is doing, as written on its node record.

    Transitions (by the node's own agent):
    - ``waiting`` → ``running`` (assigned ranks in a generation) | ``standby`` (not assigned)
      | ``warming`` (not assigned, in a job whose workers use the runtime)
    - ``warming`` → ``standby`` (its sandbox iterations are done: a ready standby)
    - ``standby`` → ``running`` (given ranks)
    - ``running`` → ``draining`` (it leaves in a migration) → ``drained`` (its state was handed
      over; the agent exits 0 and leaves a ``drained/`` mark until ``rlaunch undrain``)
    - ``running`` → ``succeeded`` | ``failed`` (its workers ended) | ``restarting``
    - ``restarting`` → ``running`` (all nodes of the new generation are ready) | ``standby``
    - ``succeeded`` | ``failed`` → ``restarting`` (a new generation) | removed (job ended)
    - any → ``stopping`` (the agent received SIGTERM/SIGINT) → removed
    """

    WAITING = "waiting"
    WARMING = "warming"
    STANDBY = "standby"
    RESTARTING = "restarting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPING = "stopping"
    DRAINING = "draining"
    DRAINED = "drained"


class LiveMoves(str, enum.Enum):
    """Which live moves a node's ranks allow, as its workers' runtime reported them.

    ``drain``: a planned drain can move the ranks live; ``replacement``: a live replacement after a
    fault can serve them (a replica holds their state). ``unknown`` until every local worker reported;
    then it changes only when a report changes (see :mod:`rlaunch.agent.moves`).
    """

    UNKNOWN = "unknown"
    BOTH = "drain and replacement"
    DRAIN_ONLY = "drain only"
    REPLACEMENT_ONLY = "replacement only"
    NONE = "none"

    @classmethod
    def of(cls, drain: bool, replace: bool) -> LiveMoves:
        if drain:
            return cls.BOTH if replace else cls.DRAIN_ONLY
        return cls.REPLACEMENT_ONLY if replace else cls.NONE

    @property
    def allows_drain(self) -> bool:
        return self in (LiveMoves.BOTH, LiveMoves.DRAIN_ONLY)

    @property
    def allows_replacement(self) -> bool:
        return self in (LiveMoves.BOTH, LiveMoves.REPLACEMENT_ONLY)


class GenerationStatus(str, enum.Enum):
    """The job-wide state of a generation, written only by the controller.

    - ``running``: the assigned nodes run workers; → a newer generation, ``succeeded`` or ``failed``.
    - ``waiting``: a node was lost and no replacement is available yet; every agent stops its
      workers; → a newer ``running`` generation once nodes are there, or ``failed`` at ``deadline``.
    - ``succeeded`` / ``failed``: terminal; every agent stops and exits.
    """

    RUNNING = "running"
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (GenerationStatus.SUCCEEDED, GenerationStatus.FAILED)


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What every agent of a job must agree on; written once by the first agent."""

    job_id: str
    nnodes: int
    nproc_per_node: int
    max_restarts: int
    entrypoint: str
    args: list[str]
    fingerprint: str
    rlaunch_version: str
    #: --verify-every ("auto", "0" or a number of steps): it sets the size of the per-step vote on
    #: the steps it compares, so every agent's workers must use the same
    verify_every: str = "auto"

    def differences(self, other: JobSpec) -> list[str]:
        """Human-readable ``field: ours vs theirs`` lines for fields that differ."""
        out = []
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                out.append(f"{field.name}: {theirs!r} (job) vs {mine!r} (this agent)")
        return out


@dataclasses.dataclass(frozen=True)
class NodeRecord:
    """A node as its agent describes it; attached to the node's lease."""

    node_id: str
    host: str
    addr: str
    pid: int
    nproc: int
    standby_only: bool
    state: NodeState
    generation: int
    restarts: int
    master_port: int
    updated_at: float
    exit_codes: dict[str, int] = dataclasses.field(default_factory=dict)
    message: str = ""
    #: every local worker called ``rlaunch.init()``: the job can migrate live
    runtime: bool = False
    #: a fault (a sentence): a GPU fault a detector found, or silent data corruption the runtime's replica
    #: check suspected; such a node holds no ranks any more
    fault: str = ""
    #: why its workers failed, typed: ``exit`` (non-zero code), ``signal``, ``hang``, ``refused`` (a live
    #: replacement was refused) or ``fault`` (the node's fault ended them); ``message`` says more
    failure: str = ""
    #: TCP port where the agent answers liveness probes (0: none; see rlaunch.detectors.liveness)
    probe_port: int = 0
    #: when one of its workers saw a collective fail (a peer may be gone), said unless a probe round came
    #: first (see rlaunch.agent.loss): the controller probes
    peer_lost_at: float = 0.0
    #: its workers' median compute time per step, in seconds (0: not known; see detectors.straggler)
    compute_s: float = 0.0
    #: which live moves its ranks allow, as its workers reported (see rlaunch.agent.moves)
    live_moves: LiveMoves = LiveMoves.UNKNOWN
    #: why not both (the first reason its ranks gave; "" when both are possible or not known yet)
    moves_reason: str = ""
    #: when its agent last probed the other nodes because its workers waited on peers too long
    #: (wall clock; 0: they are not stalled, no current probe report; see rlaunch.agent.reach)
    probed_at: float = 0.0
    #: the nodes whose agents that probe could not reach (a network cut; see rlaunch.controller.cutoff)
    unreachable: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Generation:
    """One configuration of the job: which node holds which node rank, and its status.

    The whole record is what the controller plans with and every reader acts on. etcd holds it as
    two records written in one transaction (see :mod:`rlaunch.store.generations`), so that what
    every node receives of a new generation does not grow with the job: the
    :class:`GenerationHead` (every field but the rank map, and how the map changed) at
    ``generation``, which every node watches, and the :class:`Assignment` (the whole map) at
    ``assignment``, read only by a reader that cannot rebuild the map from the head.

    A generation number names one rank map: a generation written again under its number (a new
    status, a deadline) keeps its ``assignment``.
    """

    number: int
    status: GenerationStatus
    assignment: dict[str, int]
    nnodes: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    restart_count: int
    reason: str
    controller: str
    created_at: float
    deadline: float = 0.0
    #: ``restart``: every worker starts anew; ``migrate``: leavers hand their ranks to joiners
    #: live (``joiners[i]`` takes the node rank of ``leavers[i]``); others keep their processes
    kind: str = "restart"
    leavers: list[str] = dataclasses.field(default_factory=list)
    joiners: list[str] = dataclasses.field(default_factory=list)
    #: a restart's barrier is passed: every node it assigns acknowledged it (it stopped the workers of
    #: earlier generations), so their workers start. Written by the controller, under the same number.
    all_acked: bool = False

    @property
    def waits_for_acks(self) -> bool:
        """A restart whose assigned nodes have not all acknowledged it yet (their workers wait)."""
        return self.kind == "restart" and self.status is GenerationStatus.RUNNING and not self.all_acked

    def node_rank(self, node_id: str) -> int | None:
        return self.assignment.get(node_id)

    def ranks_of(self, node_id: str) -> list[int]:
        node_rank = self.assignment.get(node_id)
        if node_rank is None:
            return []
        base = node_rank * self.nproc_per_node
        return list(range(base, base + self.nproc_per_node))

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def head(self, previous: Generation | None) -> GenerationHead:
        """This generation's head, with its rank map told as a change of ``previous``'s (the one it
        replaces in etcd; ``None``: none). Written again under its own number, the change is from
        itself (nothing); from no previous generation, ``given`` is the whole map."""
        given: dict[str, int]
        taken: list[str]
        if previous is not None and previous.number == self.number:
            base, given, taken = self.number, {}, []
        elif previous is None:
            base, given, taken = 0, dict(self.assignment), []
        else:
            before = previous.assignment
            base = previous.number
            given = {n: r for n, r in self.assignment.items() if before.get(n) != r}
            taken = sorted(n for n in before if n not in self.assignment)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "assignment"}
        return GenerationHead(**fields, base=base, given=given, taken=taken, assigned=len(self.assignment))


@dataclasses.dataclass(frozen=True)
class GenerationHead:
    """A :class:`Generation` as every node reads it (the etcd value at ``generation``): every field
    but ``assignment``, and how its rank map differs from generation ``base``'s, so that its size is
    that of the change, not of the job.

    ``base`` 0 means from no map (``given`` is the whole map); ``base`` equal to ``number``, that the
    map is this generation's own (the generation was written again under its number).
    """

    number: int
    status: GenerationStatus
    nnodes: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    restart_count: int
    reason: str
    controller: str
    created_at: float
    #: the generation whose rank map ``given`` and ``taken`` change into this one's
    base: int
    #: node ranks this generation gives that ``base`` did not (new holders, or a changed rank)
    given: dict[str, int]
    #: nodes holding ranks in ``base`` that hold none in this generation
    taken: list[str]
    #: how many nodes hold ranks (checks a map rebuilt from ``base``)
    assigned: int
    deadline: float = 0.0
    kind: str = "restart"
    leavers: list[str] = dataclasses.field(default_factory=list)
    joiners: list[str] = dataclasses.field(default_factory=list)
    all_acked: bool = False

    def follow(self, held: Generation | None) -> Generation | None:
        """The whole generation, its rank map rebuilt from ``held`` (the generation the reader acts
        on); ``None`` when ``held`` is not the base nor this generation, or the map does not add up:
        then the reader reads the :class:`Assignment`."""
        if held is not None and held.number == self.number:
            assignment = held.assignment  # one number, one map (records are never changed in place)
        elif self.base == 0:
            assignment = dict(self.given)
        elif held is not None and held.number == self.base:
            # ``copy()``, not ``dict()``: a map that lost a node keeps a hole where it was, and
            # ``dict()`` copies a map with holes item by item (85 us for 4,096 nodes, in one heap
            # of 4,095 simulated nodes 125 us a node at every move with the head's decoding, 65 us with
            # ``copy()``), ``copy()`` whole (12 us).
            assignment = held.assignment.copy()
            for node in self.taken:
                assignment.pop(node, None)
            assignment.update(self.given)
        else:
            return None
        return self.whole(assignment) if len(assignment) == self.assigned else None

    def whole(self, assignment: dict[str, int]) -> Generation:
        """The :class:`Generation` of this head with ``assignment`` as its rank map (every other field
        taken by name, so that a field added to both records is carried; lists copied)."""
        fields: dict[str, Any] = {}
        for f in dataclasses.fields(Generation):
            if f.name != "assignment":
                value = getattr(self, f.name)
                fields[f.name] = list(value) if isinstance(value, list) else value
        return Generation(**fields, assignment=assignment)


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A generation's whole rank map (the etcd value at ``assignment``), written with its head."""

    number: int
    nodes: dict[str, int]


@dataclasses.dataclass(frozen=True)
class DrainRequest:
    """``rlaunch drain NODE``: move the node's ranks to a ready standby."""

    node_id: str
    requested_at: float


@dataclasses.dataclass(frozen=True)
class DrainedMark:
    """Left by a drained node's agent; a node with a mark may rejoin only after undrain."""

    node_id: str
    generation: int
    replaced_by: str
    at: float


@dataclasses.dataclass(frozen=True)
class SuspectMark:
    """Left by an agent whose worker's replica check suspected silent data corruption on its node.

    Not leased: it outlives the agent, so the node takes no ranks again in this job (a restarted
    agent with its node id is refused). It goes with the job's other keys when a new run clears them.
    """

    node_id: str
    generation: int
    rank: int
    step: int
    fault: str
    at: float


@dataclasses.dataclass(frozen=True)
class Ack:
    """A node's statement that it stopped the previous generation's workers and is ready."""

    node_id: str
    generation: int


@dataclasses.dataclass(frozen=True)
class Event:
    """One entry of the job's structured event stream."""

    time: float
    node_id: str
    kind: str
    generation: int
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


def encode(record: Any) -> bytes:
    """JSON bytes of a record (enums as their values).

    The record's fields are taken as they are, not deep-copied as ``dataclasses.asdict`` does (a
    fifth of an agent's CPU per etcd write went there): every field is a JSON value, an enum, or a
    record inside an event's data, which ``_default`` converts."""
    fields = {name: getattr(record, name) for name, _, _ in _fields(type(record))}
    return json.dumps(fields, sort_keys=True, default=_default).encode()


def _default(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"cannot encode {type(value).__name__}")


def decode(cls: type[R], raw: bytes, where: str) -> R:
    """Parse and validate ``raw`` as a ``cls`` record; ``where`` names the key for errors."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"The record at {where} is not valid JSON ({exc}); delete or rewrite that key.") from exc
    if not isinstance(obj, dict):
        raise RecordError(f"The record at {where} is not a JSON object; delete or rewrite that key.")
    kwargs: dict[str, Any] = {}
    for name, tp, has_default in _fields(cls):
        if name not in obj:
            if has_default:
                continue
            raise RecordError(f"The record at {where} lacks the field {name!r}; delete or rewrite that key.")
        kwargs[name] = _check(tp, obj[name], where, name)
    return cls(**kwargs)


_FIELDS: dict[type[Any], tuple[tuple[str, Any, bool], ...]] = {}


def _fields(cls: type[Any]) -> tuple[tuple[str, Any, bool], ...]:
    """``(name, type, has_default)`` of each field of a record class, resolved once: resolving the
    annotations is most of a decode's cost, and a controller decodes every node record it reads."""
    fields = _FIELDS.get(cls)
    if fields is None:
        hints = typing.get_type_hints(cls)
        missing = dataclasses.MISSING
        fields = _FIELDS[cls] = tuple(
            (f.name, hints[f.name], f.default is not missing or f.default_factory is not missing)
            for f in dataclasses.fields(cls)
        )
    return fields


#: Types whose JSON values are valid exactly when their type is the type itself (``type(v) is int``
#: also refuses a bool, as :func:`_check` does): items of these are checked without a call each.
_EXACT = (str, int)


def _check(tp: Any, value: Any, where: str, name: str) -> Any:
    """Validate ``value`` against type ``tp``; return it converted (enums)."""
    # Plain fields first, without typing's introspection: they are most of every record, and a
    # decode runs once per watch event (every node decodes each generation's head).
    if tp is str or tp is bool or tp is int:  # (``type(v) is int`` refuses a bool, as JSON's types are exact)
        if type(value) is tp:
            return value
        raise _bad(where, name, value, tp)
    if tp is float:
        if type(value) is float or type(value) is int:
            return float(value)
        raise _bad(where, name, value, tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _check(option, value, where, name)
            except RecordError:
                continue
        raise _bad(where, name, value, tp)
    if tp is type(None):
        if value is None:
            return None
        raise _bad(where, name, value, tp)
    if tp is Any:
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise _bad(where, name, value, tp) from None
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise _bad(where, name, value, tp)
        if item in _EXACT and all(type(v) is item for v in value):  # the common case, without a call per item
            return list(value)
        return [_check(item, v, where, name) for v in value]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _bad(where, name, value, tp)
        if (  # a generation's assignment has an entry per node: 4,096 calls per decode otherwise
            key_tp in _EXACT and val_tp in _EXACT
            and all(type(k) is key_tp for k in value) and all(type(v) is val_tp for v in value.values())
        ):  # fmt: skip
            return dict(value)
        return {_check(key_tp, k, where, name): _check(val_tp, v, where, name) for k, v in value.items()}
    if isinstance(value, tp):
        return value
    raise _bad(where, name, value, tp)


def _bad(where: str, name: str, value: Any, tp: Any) -> RecordError:
    shown = getattr(tp, "__name__", str(tp))
    return RecordError(
        f"The record at {where} has {name}={value!r}, which is not a valid {shown}; delete or rewrite that key."
    )
