"""What one rank of the runtime knows of itself, shared by the runtime, migration and recovery.

:class:`~rlaunch.runtime.runtime.Runtime` (the script's API and the step loop),
:class:`~rlaunch.runtime.migration.Migration` (planned moves) and
:class:`~rlaunch.runtime.recovery.Recovery` (live replacement) read and update one
:class:`RankState`: where the rank stands (rank, generation, step, the last step it applied),
what it tracks and how it talks to its agent. Keeping it here, rather than in the runtime's
private attributes, is what lets the two move protocols live in modules of their own without
importing the runtime.
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
from typing import Any

from torch.distributed import Store

from rlaunch.runtime.agent_link import AgentLink
from rlaunch.runtime.grouptable import GroupTable
from rlaunch.runtime.mesh import RuntimeMesh
from rlaunch.runtime.phases import MovePhases
from rlaunch.runtime.replicas import Declared
from rlaunch.runtime.stepstate import StepStart
from rlaunch.runtime.vote import StepVote


@dataclasses.dataclass(eq=False)
class RankState:
    """One rank's position in the job and the objects it moves (see the module docstring)."""

    rank: int
    world_size: int
    generation: int
    standby: bool
    link: AgentLink | None
    store: Store | None
    timeout: datetime.timedelta
    groups: GroupTable
    vote: StepVote
    #: the objects a joiner receives (rt.track), by name
    tracked: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: tracked objects whose state differs by rank, as declared (rt.track_per_rank)
    per_rank: set[str] = dataclasses.field(default_factory=set)
    #: rt.seed(per_rank=True): each step's streams derive from this
    seed: int | None = None
    #: the ranks that hold equal copies of the parameters, as the script declared them (rt.declare_replicas)
    declared: Declared | None = None
    mesh: RuntimeMesh | None = None
    step: int = 0
    #: the last step whose optimizer step this rank applied
    applied: int = -1
    #: the votes this process cast (DDP's bucket rebuild comes within its first few: rlaunch.runtime.buckets)
    votes: int = 0
    #: where rt.steps() goes on after a recovery
    resume_at: int | None = None
    #: what the current step changes besides parameters and optimizers
    start: StepStart | None = None
    #: the next vote verifies that replicas hold equal state (set at every move's boundary)
    verify_due: bool = True
    #: the move whose first step in the new generation is under way: that step ends it, reporting
    #: the move's phases (and a survivor's downtime)
    after_move: MovePhases | None = None
    #: the last vote said some rank has no replica to serve it: the job takes host snapshots
    #: (a joiner learns it with its state; see rlaunch.runtime.snapshots)
    snapshots_wanted: bool = False
    #: a framework's loop drives the steps (rt.drive): it issues collectives between a step's vote and the
    #: next step's start (Lightning's SIGTERM broadcast), so no survivor may roll forward (see Recovery)
    driven: bool = False
    #: why this rank's state must not move live, as the script said (rt.refuse_moves); "" when it may
    refused: str = ""
    #: why no replica may stand in for this rank after a fault, as the script said (rt.refuse_replacement),
    #: while a drain may move it; "" when one may
    refused_replacement: str = ""
    #: why the coming recovery must not let a replica stand in for a lost rank: a fault after a step's
    #: vote handed the rest of that step collectives' own inputs (recovery.after_vote_refusal); "" when
    #: none did. Set at that step's end, cleared by the recovery
    after_vote: str = ""
    #: the host snapshots' interval in steps, alike on every rank (0: none; a joiner learns it with its state)
    snapshot_every: int = 0
    #: rt.steps() has ended: no more plans are taken
    stopped: threading.Event = dataclasses.field(default_factory=threading.Event)
