"""The node agent's state machine, its vocabulary: states, observations, actions, decisions.

Typed, frozen records only; what moves between the states, and why, is decided by
:func:`rlaunch.agent.transitions.decide` (its docstring has the table).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from rlaunch.errors import RlaunchError
from rlaunch.store.records import Generation, NodeState

#: Exit code of an agent whose job failed, that was signalled or fenced (as torchrun: 1).
EXIT_FAILED = 1
#: How long workers get between SIGTERM and SIGKILL (torchrun's default shutdown timeout).
SHUTDOWN_GRACE_S = 30.0
#: Stale workers (this node was fenced, or its ranks now belong to others) get none: they are
#: SIGKILLed at once, so they never overlap their ranks' new holders.
STALE_GRACE_S = 0.0


class IllegalTransition(RlaunchError):
    """An observation arrived in a state that cannot take it (a bug in the agent, not in the job)."""


class AgentState(str, enum.Enum):
    """What this node's workers are doing. Transitions (decided by ``transitions.decide``):

    - ``idle`` (no workers) → ``starting`` (acked a restart) | ``sandbox`` (standby in a runtime
      job) | ``settling`` (a replacement's joiner, through a fresh sandbox) | ``leaving_done``
    - ``starting`` (waits until every node acked) → ``active`` (the generation says all acked: workers start)
    - ``sandbox`` → ``settling`` (a move's joiner) | ``idle`` (its workers exited: a failed standby)
      | ``starting`` (a restart gives it ranks)
    - ``active`` → ``active`` (a migration's survivor) | ``settling`` (a replacement's survivor)
      | ``leaving`` (its ranks move away) | ``idle`` (workers exited, or stopped) | ``starting``
    - ``settling`` (a move's workers not all joined or recovered) → ``active`` | as ``active``
    - ``leaving`` (workers hand their state over) → ``leaving_done`` | ``active`` (move abandoned)
    - ``leaving_done`` → ``exited`` (drained) | ``idle`` (the move failed, or was moot)
    - any → ``exited`` (the job ended, a signal, fencing); ``exited`` is final.
    """

    IDLE = "idle"
    STARTING = "starting"
    SANDBOX = "sandbox"
    ACTIVE = "active"
    SETTLING = "settling"
    LEAVING = "leaving"
    LEAVING_DONE = "leaving_done"
    EXITED = "exited"

    @property
    def workers_run(self) -> bool:
        return self in _WITH_WORKERS


_WITH_WORKERS = frozenset({AgentState.SANDBOX, AgentState.ACTIVE, AgentState.SETTLING, AgentState.LEAVING})


class SandboxUse(str, enum.Enum):
    """What became of this node's one sandbox (a standby warms its workers at most once).

    - ``unused``: none started yet → ``used`` (started).
    - ``used``: started; running, or its workers took ranks → ``spent`` (stopped while still a
      sandbox: the standby stays ``warming``, never ready again) → ``failed`` (its workers died).
    - ``failed`` is kept: the node is no usable standby.
    """

    UNUSED = "unused"
    USED = "used"
    SPENT = "spent"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class Node:
    """The agent's state and what it remembers across states."""

    state: AgentState = AgentState.IDLE
    #: the generation of the workers last started or offered a move (0: none yet)
    worker_gen: int = 0
    #: the restart generation this node last acknowledged (0: none)
    acked_gen: int = 0
    #: the generation whose move this node was leaving in failed or was outrun by the job's end
    #: (0: none); in that generation it is an ordinary node again, never offered as its leaver twice
    move_ended_in: int = 0
    sandbox: SandboxUse = SandboxUse.UNUSED
    #: a leaver's workers exited 0 without handing their state over (they finished the job)
    finished: bool = False


# -- observations ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Published:
    """The node record last published: its state, generation and exit codes."""

    state: NodeState
    generation: int
    exit_codes: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Look:
    """Bring the node in line with generation ``gen`` (the latest seen; None: none yet)."""

    gen: Generation | None
    node_id: str
    nproc: int
    published: Published | None = None
    #: a fault sentence, once a detector (or the replica check: silent data corruption) found one ("" if none)
    fault: str = ""
    #: local workers that sent their state over in a migration (from the worker link)
    left: frozenset[int] = frozenset()
    #: local sandbox workers done warming up
    warm: int = 0
    #: node records changed since the standby last read them
    nodes_changed: bool = False
    #: the answer to a decision's ``need`` (None: not read)
    uses_runtime: bool | None = None


@dataclasses.dataclass(frozen=True)
class WorkersExited:
    """The running workers' exit codes (``None``: still running), polled by the agent."""

    codes: tuple[int | None, ...]
    #: the current generation's number (a failed sandbox reports it)
    generation: int
    left: frozenset[int] = frozenset()
    #: sentences about local workers killed as hung
    hung: tuple[str, ...] = ()
    #: why a survivor refused a live replacement ("" if none did)
    unrecoverable: str = ""
    #: the node's fault sentence, if a detector or the replica check found one ("" if none)
    fault: str = ""


@dataclasses.dataclass(frozen=True)
class Settled:
    """Every local worker of a move joined (a joiner) or recovered (a survivor)."""


@dataclasses.dataclass(frozen=True)
class Signalled:
    signal: str


@dataclasses.dataclass(frozen=True)
class Fenced:
    reason: str


@dataclasses.dataclass(frozen=True)
class EtcdLost:
    """No etcd member has answered for ``unreachable_s`` seconds, at least ``--rdzv-timeout``."""

    unreachable_s: float
    timeout: float
    #: the state of this node's record as last published (or not yet taken by etcd); None: none
    published: NodeState | None


Observation = Look | WorkersExited | Settled | Signalled | Fenced | EtcdLost


# -- actions --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StopWorkers:
    """Stop the running workers (if any) with ``grace`` s of SIGTERM; a ``workers_stopped`` event in ``event_gen``."""

    grace: float
    event_gen: int


@dataclasses.dataclass(frozen=True)
class StartWorkers:
    gen: Generation


@dataclasses.dataclass(frozen=True)
class StartSandbox:
    gen: Generation


@dataclasses.dataclass(frozen=True)
class Offer:
    """Hand move ``gen`` to the local workers as ``role``; a joiner's workers take their ranks' labels."""

    gen: Generation
    role: str


@dataclasses.dataclass(frozen=True)
class ForgetWorkers:
    """The workers exited 0 by themselves; nothing is left to stop."""


@dataclasses.dataclass(frozen=True)
class ReapFailed:
    """Workers of ``generation`` failed: stop the rest, a ``workers_failed`` event, forget hang sentences."""

    generation: int
    exit_codes: Mapping[str, int]


@dataclasses.dataclass(frozen=True)
class ReapSandbox:
    """Sandbox workers exited: stop what is left of them, quietly; forget what they reported."""


@dataclasses.dataclass(frozen=True)
class Publish:
    state: NodeState
    generation: int
    exit_codes: Mapping[str, int] | None = None
    failure: tuple[str, str] = ("", "")
    #: a failure to send is logged, not raised (the agent is exiting)
    best_effort: bool = False


@dataclasses.dataclass(frozen=True)
class Acknowledge:
    """Put this node's ack of ``gen`` (it stopped its workers), then delete its ack of ``previous`` (0: none)."""

    gen: int
    previous: int


@dataclasses.dataclass(frozen=True)
class MarkDrained:
    gen: int
    replaced_by: str


@dataclasses.dataclass(frozen=True)
class Emit:
    """An event for the event stream (names and fields as documented in docs/operations.md, "rlaunch events");
    ``with_record``: the node record soon follows it, and it may wait to go in that record's request
    (:meth:`rlaunch.events.EventLog.emit_with_record`)."""

    name: str
    gen: int
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    with_record: bool = False


@dataclasses.dataclass(frozen=True)
class Log:
    level: int
    message: str


@dataclasses.dataclass(frozen=True)
class Exit:
    code: int


Action = (
    StopWorkers | StartWorkers | StartSandbox | Offer | ForgetWorkers | ReapFailed | ReapSandbox | Publish
    | Acknowledge | MarkDrained | Emit | Log | Exit
)  # fmt: skip


class Need(str, enum.Enum):
    """A read a decision needs before it can go on (the answer goes into :class:`Look`)."""

    RUNTIME = "runtime"  # whether the job's workers use the runtime (``Look.uses_runtime``)


@dataclasses.dataclass(frozen=True)
class Step:
    """One action, and the node as it stands from the moment the action starts.

    The agent takes ``node`` before it carries ``action`` out, so a change made before an action
    holds even when the action fails (etcd did not answer); a change that must wait for an
    action's success is made after it, in a later step or in :attr:`Decision.node`.
    """

    action: Action
    node: Node


@dataclasses.dataclass(frozen=True)
class Decision:
    node: Node
    steps: tuple[Step, ...] = ()
    need: Need | None = None

    @property
    def actions(self) -> tuple[Action, ...]:
        return tuple(s.action for s in self.steps)

    @property
    def exit_code(self) -> int | None:
        for s in self.steps:
            if isinstance(s.action, Exit):
                return s.action.code
        return None
