"""The resilient worker runtime: what ``rlaunch.init()`` returns.

A script opts in with a few lines (see ``examples/train_resilient.py``)::

    rt = rlaunch.init()                          # instead of init_process_group
    model = DDP(Net(), process_group=rt.group)
    opt = torch.optim.AdamW(model.parameters())
    rt.track(model=model, optimizer=opt)         # anything with state_dict()/load_state_dict()
    for step in rt.steps(total_steps):           # the runtime owns iteration boundaries
        loss = model(batch(step)).mean(); loss.backward()
        rt.optimizer_step(opt)                   # the per-step vote, then opt.step()

Under rlaunch, ``rt.group`` is a :class:`SwitchableGroup` (also the default group, so plain
``torch.distributed`` calls work) built on an etcd-backed store reached through the agent.
A planned migration runs in two phases: in the background the affected groups are rebuilt on
a fresh key prefix and the leaver and joiner open a transfer channel; each step's vote carries
"ready", and when every rank is ready all switch at the same boundary: the leaver sends its
state to the joiner and exits 0, the others swap their affected groups in place (see
:mod:`rlaunch.runtime.migration`).

A standby runs the same script: ``steps()`` first yields a few sandbox iterations on a local
communicator (warming allocator, kernels and the data path), then waits to be given ranks,
receives the leaver's state and yields the real next step. Under plain torchrun the same script
runs without migration.

An unplanned fault (a peer crashed, its node was lost or hung) is recovered without restarting
the survivors, by the commit rule of the per-step vote and a replica's state sent to the
replacement: see :mod:`rlaunch.runtime.recovery`.

The runtime checks itself while the job runs: every step's vote compares the decisions every
rank must make alike (:mod:`rlaunch.runtime.contract`); every move is verified end to end (the
joiner's digests against the sender's, :mod:`rlaunch.runtime.transfer`, then the replicas
against each other at the first vote after it); and every ``--verify-every`` steps the replicas
are compared for silent data corruption, whose suspect is taken out of the job live
(:mod:`rlaunch.runtime.verify`).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import datetime
import gc
import hashlib
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Store
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rlaunch.errors import RlaunchError
from rlaunch.plans import Hello, Role, StartRole
from rlaunch.runtime import backend as backends
from rlaunch.runtime import buckets, contract, devicework, partition, replicas, rng, sandboxgroups, snapshots, verify
from rlaunch.runtime.agent_link import AgentLink, AgentLinkError
from rlaunch.runtime.data import EpochLoader
from rlaunch.runtime.driven import DrivenSteps
from rlaunch.runtime.groups import SandboxComm, SwitchableGroup, alike
from rlaunch.runtime.grouptable import WORLD, GroupTable
from rlaunch.runtime.joining import Joining
from rlaunch.runtime.mesh import RuntimeMesh
from rlaunch.runtime.meshlines import check_shape
from rlaunch.runtime.migration import Migration
from rlaunch.runtime.moves import Moves
from rlaunch.runtime.phases import Phase, report
from rlaunch.runtime.rankstate import RankState
from rlaunch.runtime.recovery import Recovery, after_vote_refusal, commit_point, mesh_sources
from rlaunch.runtime.registry import register, unregister
from rlaunch.runtime.sandbox import SANDBOX_RANK
from rlaunch.runtime.snapshots import HostSnapshots
from rlaunch.runtime.stepstate import DiscardedParams, StepSnapshots, is_stateful, touched
from rlaunch.runtime.store import AgentStore
from rlaunch.runtime.untracked import live_schedulers, untracked_state
from rlaunch.runtime.verify import Verifier
from rlaunch.runtime.vote import RefusedError, StepVote
from rlaunch.runtime.voting import Voting

__all__ = ["RefusedError", "Runtime", "commit_point", "init"]

log = logging.getLogger(__name__)

#: Seconds between heartbeats to the agent (its hang detector; see rlaunch.detectors.hang).
HEARTBEAT_S = 1.0


class Runtime:
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        generation: int,
        link: AgentLink | None,
        store: Store | None,
        world_comm: Any,
        standby: bool,
        sandbox_steps: int,
        timeout: datetime.timedelta,
        backend: backends.Backend = backends.Backend.GLOO,
    ) -> None:
        self._s = RankState(
            rank=rank, world_size=world_size, generation=generation, standby=standby, link=link, store=store,
            timeout=timeout, groups=GroupTable(store, timeout), vote=StepVote(world_size),
        )  # fmt: skip
        self._sandbox_steps = sandbox_steps
        # A standby's rank is -1 until it joins: dist.get_rank() in its sandbox is then -1, as torch
        # answers for a non-member, so rank-0-only code (checkpoints, logging) never runs there.
        self.group = SwitchableGroup(
            WORLD, range(world_size), rank, world_comm, generation, guarded=link is not None, backend=backend
        )
        self._s.groups.add(self.group)
        # Under plain torchrun nothing moves: replicas are compared only under an agent.
        every = verify.interval(os.environ.get(verify.ENV, "auto")) if link is not None else 0
        self._migration: Migration
        self._moves: Moves
        # host snapshots where no replica can serve a lost rank (under an agent only)
        first, auto = snapshots.interval(os.environ.get(snapshots.ENV, "auto")) if link is not None else (0, False)
        self._host = HostSnapshots(
            self._s, first, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), lambda: self._moves.needs_snapshots,
            snapshots.rate(os.environ.get(snapshots.RATE_ENV, "0")), auto,
        )  # fmt: skip
        self._voting = Voting(
            self._s, self.group, Verifier(every, world_size), lambda: self._migration.ready,
            lambda gen: self._migration.agree(gen) if not self.step_failed else None, self._median_step, self._host,
        )  # fmt: skip
        self._moves = Moves(self._s, self._voting, lambda: self._host.every)
        self._recovery = Recovery(  # live replacement after a fault
            self._s, self._moves.replace_refusal, lambda plan, alive: mesh_sources(self._s, plan, alive),
            self._moves.knowledge, self._moves.learn, self._moves.drain_refusal, self._host, self._touched,
        )  # fmt: skip
        # planned moves: phase 1 in the background, then the switch
        self._migration = Migration(
            self._s, self._recovery.on_replace, self._moves.drain_refusal, self._moves.knowledge, self._host
        )
        self._durations: deque[float] = deque(maxlen=50)
        self._snapshots = StepSnapshots()
        self._discarded: DiscardedParams | None = None  # a step the recovery discarded, to be redone
        self._device_wait = False  # blocked until this step's GPU work ends (NCCL groups): waits on peers
        # ids of the optimizers and scalers checked for untracked state (at the first vote of each)
        self._checked: set[int] = set()
        self._voted: str | None = None  # the optimizers of this step's optimizer_step (one per step)
        self._completed = 0  # steps completed (redone ones included): the heartbeat's progress
        self._in_step = False  # a step rt.steps() yielded is under way
        self._own_at_vote: int | None = None  # own_results where this step's vote applied it (None: not applied)
        self._driven: DrivenSteps | None = None  # the steps a framework's loop drives (see drive)
        self._step_began = 0.0
        #: per step, from its start to this rank's last collective before the vote: its own work,
        #: without the time spent waiting for slower peers (the straggler detector compares it)
        self._compute: deque[float] = deque(maxlen=50)
        #: (a standby) its join, and the landing of the state it receives
        self._joining = Joining(self._s, self._migration, self._moves, self._voting, self._host, self._start_listener)
        if link is not None:
            register(self.group, store, {i: i for i in range(world_size)}, default=True)
            atexit.register(self._shutdown)
            if standby:
                sandboxgroups.serve(world_size, store, backend)  # torch's new_group, until the join
            else:
                self._start_listener()
        else:
            # plain torchrun: torch's own group stays the default, and rt.group is made known beside it,
            # so that torch.distributed takes it (dist.get_rank(rt.group), a source given as a global rank)
            register(self.group, None, {i: i for i in range(world_size)})

    # -- where this rank stands (the script reads these) ---------------------------------------

    @property
    def rank(self) -> int:
        return self._s.rank

    @property
    def world_size(self) -> int:
        return self._s.world_size

    @property
    def generation(self) -> int:
        return self._s.generation

    @property
    def standby(self) -> bool:
        return self._s.standby

    @property
    def step(self) -> int:
        return self._s.step

    @property
    def in_step(self) -> bool:
        """A step of ``rt.steps()`` is under way (the loop is between two iterations of it): a vote may be cast."""
        return self._in_step

    # -- the API ------------------------------------------------------------------------------

    def track(self, **objects: Any) -> None:
        """Register the state a joiner must receive: modules, optimizers, schedulers, scalers, loaders...

        Every object but modules and optimizers must hold the same state on every rank (a replica
        serves a lost rank); the per-step vote checks it and refuses the step otherwise. State that
        differs by rank is declared with :meth:`track_per_rank`. A ``torch.Generator`` the script
        made is tracked by its state (:class:`rlaunch.runtime.rng.ScriptGenerator`). An object first
        tracked inside a step (a loader an integration wraps at its first read) starts that step as
        it is now: a redone step puts it back there.
        """
        tracked = self._s.tracked
        for name, obj in objects.items():
            if isinstance(obj, torch.Generator):
                held = tracked.get(name)
                same = isinstance(held, rng.ScriptGenerator) and held.generator is obj
                obj = held if same else rng.ScriptGenerator(obj)
            if not hasattr(obj, "state_dict") or not hasattr(obj, "load_state_dict"):
                raise TypeError(
                    f"rt.track({name}=...) needs an object with state_dict() and load_state_dict() "
                    f"(or a torch.Generator); got {type(obj).__name__}."
                )
            if name in tracked and tracked[name] is not obj:
                raise ValueError(f"rt.track() already tracks another object named {name!r}; give each its own name.")
            start = self._s.start
            in_step = self._in_step and start is not None and start.step == self._s.step
            if in_step and name not in tracked and is_stateful(obj):
                assert start is not None
                start.states[name] = copy.deepcopy(obj.state_dict())
            tracked[name] = obj

    def tracks(self, obj: Any) -> bool:
        """Whether ``obj`` is tracked (under any name; a generator by the holder of its state)."""
        return any(
            held is obj or (isinstance(held, rng.ScriptGenerator) and held.generator is obj)
            for held in self._s.tracked.values()
        )

    def track_per_rank(self, **objects: Any) -> None:
        """Register state that differs from rank to rank (a data loader over this rank's shard).

        A drain moves it with the leaver's other state. No replica holds it, so a live replacement
        after a fault is refused (the job restarts instead, loudly).
        """
        for name, obj in objects.items():
            if not is_stateful(obj):
                raise TypeError(f"rt.track_per_rank({name}=...): modules and optimizers are tracked with rt.track().")
        self.track(**objects)
        self._s.per_rank.update(objects)

    def track_if_same(self, **objects: Any) -> None:
        """Register state that is the same on every rank as long as the script keeps it so, and may not be.

        A framework's bookkeeping is such state: a checkpoint callback's best score is the same on
        every rank when the metric it watches is synced across ranks, and differs when it is not.
        While every rank holds the same state it moves as with :meth:`track`; once the vote finds
        it differs, it is remembered instead of refused: a drain still moves it, and a live
        replacement is refused with a sentence naming it (a replica would hand over another rank's).
        """
        self.track(**objects)
        self._s.vote.lenient.update(objects)

    def refuse_moves(self, reason: str) -> None:
        """Say that this rank's state cannot be moved live, and why (a sentence, shown by ``rlaunch status``).

        For what the runtime cannot see: a framework feature an integration does not carry. Training
        goes on as under torchrun; a drain of this rank's node is refused (the controller restarts
        the job without it) and a fault restarts the job rather than replace a rank live. Called
        again, the first reason stands. State no move will carry cannot be missed by one: an LR
        scheduler left untracked is then not refused at the first vote.
        """
        if not self._s.refused:
            self._s.refused = reason
            if self._s.link is not None and not self.standby:
                log.warning("rank %d: live moves are refused: %s", self.rank, reason)

    def refuse_replacement(self, reason: str) -> None:
        """Say that no replica can stand in for this rank after a fault, and why (a sentence), while a drain
        may still move it: for what the runtime cannot see, such as collectives a framework's step runs
        that a step redone after a fault would not (see ``rlaunch.lightning``). A fault then restarts the
        job. Called again, the first reason stands."""
        if not self._s.refused_replacement:
            self._s.refused_replacement = reason
            if self._s.link is not None and not self.standby:
                log.warning("rank %d: live replacement is refused (a drain still moves it): %s", self.rank, reason)

    @property
    def issued(self) -> int:
        """How many collectives (barriers and point-to-point calls included) this rank issued so far on its
        groups: what a framework's hooks issued can be told by comparing it across them."""
        return sum(g.issued for g in self._s.groups)

    def drive(self) -> DrivenSteps:
        """Steps for a loop this script does not own (a framework's), begun and redone from its hooks.

        See :class:`rlaunch.runtime.driven.DrivenSteps`. Such a loop can redo its current step, not
        steps it has left behind, so the job takes no host snapshots to roll back to: where no replica
        can serve a lost rank, a live replacement is refused and the job restarts. Steps still driven
        when the interpreter exits end there, before the groups are released (a loop that ends
        nowhere the framework says, as Fabric's: the agent learns that this rank is done stepping).
        """
        self._host.turn_off()
        self._s.driven = True
        self._driven = DrivenSteps(self)
        return self._driven

    def declare_replicas(self, sets: Sequence[Sequence[int]]) -> None:
        """Say which ranks hold equal copies of the tracked parameters, when it is not DDP or a mesh.

        For tensor or expert parallelism built by hand on :meth:`new_group`: ``sets`` is every
        data-parallel group of the job (each rank's parameters equal those of the other ranks of its
        set), the same on every rank, e.g. ``rt.declare_replicas([[0, 2], [1, 3]])`` for 2-way tensor
        parallelism over 4 ranks. The runtime then compares each set's members, not every rank, and a
        replaced rank gets its state from its own set. Without it, parameters that differ by rank make
        a live replacement refused (a drain still moves them).
        """
        declared = replicas.declare(sets, self.world_size)
        if self._s.link is not None and not self.group.sandboxed:
            # every rank must declare the same: compared once, here (the votes' sizes depend on it)
            agreed = torch.tensor(contract.terms(hash(declared.sets) & (2**64 - 1)), dtype=torch.float64)
            self.group.allreduce([agreed]).wait()
            if not contract.agree(self.world_size, agreed.tolist()):
                raise ValueError(
                    f"rt.declare_replicas was given other sets on other ranks (rank {self.rank}: "
                    f"{[list(m) for m in declared.sets]}); give every rank the same list."
                )
        self._s.declared = declared

    def epochs(
        self, loader: Any, *, sampler: Any = None, name: str = "data", per_rank: bool = False,
        order_rng: torch.Generator | None = None, track: bool = True,
    ) -> EpochLoader:  # fmt: skip
        """Track ``loader`` (torchdata's ``StatefulDataLoader``) and give its batches step by step.

        ``data.batch()`` (or ``next(data)``) returns the next batch, moving to the next epoch (with
        ``sampler.set_epoch``) when one ends; ``data.epoch`` is the current epoch. A redone step
        gets the same batches again; a joiner resumes at the same sample with the partition of its
        new position: ``sampler.rank`` is set to its global rank, or to its coordinate on the mesh
        dimension the sampler splits over (``DistributedSampler(num_replicas=mesh["dp"].size(),
        rank=...)``: the runtime finds which at the first vote; see :mod:`rlaunch.runtime.partition`).

        The loader's state holds the base seed of its worker processes, drawn from the global
        torch generator at each epoch's start, their random streams once its dataset drew from
        them, and the generators its dataset holds (:mod:`rlaunch.runtime.workerstreams`). With a
        seed per rank (``rt.seed(per_rank=True)`` included) it differs by rank: pass
        ``per_rank=True``, and it is tracked with :meth:`track_per_rank` (a drain moves it, a live
        replacement is refused). A loader with workers, or over a dataset holding generators, whose
        position comes to differ by rank all the same is treated so from then on
        (:meth:`track_if_same`); another is refused by the vote. An ``IterableDataset`` with a state
        of its own whose workers draw from the global streams refuses live moves with a sentence.

        ``order_rng`` is for a sampler that draws its order from a generator at each epoch's start
        (``torch.default_generator`` for a ``RandomSampler`` without one of its own, as Lightning's
        ``DistributedSamplerWrapper`` holds it): the position then holds that generator's state at
        the epoch's start, so a joiner draws the same order (the generator must be the same on every
        rank there, as such a sampler's order must be).

        ``track=False`` leaves the tracking to the caller, under ``name``: an integration tracks a
        stand-in from the start that makes the loader at its first read (see :mod:`rlaunch.userloop`).
        """
        data = EpochLoader(
            loader, sampler, lambda: self._voting.part(name), order_rng, refuse=self.refuse_moves,
            # the streams its position carries may differ by rank (rlaunch.runtime.workerstreams), however tracked
            varies=lambda: self._s.vote.lenient.add(name),
        )  # fmt: skip
        if partition.has_partition(sampler):
            self._voting.samplers[name] = sampler
        if not track:
            return data
        if per_rank:
            self.track_per_rank(**{name: data})
        else:
            self.track(**{name: data})
        return data

    def seed(self, seed: int, *, per_rank: bool = False) -> None:
        """Seed torch (CUDA too), ``random`` and NumPy (when imported) reproducibly.

        ``per_rank=False`` seeds every generator with ``seed`` now, the same on every rank.
        ``per_rank=True`` gives each rank its own streams, derived at the start of every step from
        (``seed``, rank, step): a replacement re-derives the lost rank's streams, so per-rank
        dropout or sampling stays bit-identical through a live replacement. (A seed per rank set
        once, as ``torch.manual_seed(seed + rank)``, is not replaceable: see docs/layouts.md, "Loop patterns".)
        """
        if per_rank:
            self._s.seed = seed
            self._reseed(self.step)
        else:
            self._s.seed = None
            rng.seed_all(seed)

    def _reseed(self, step: int) -> None:
        assert self._s.seed is not None
        digest = hashlib.blake2b(f"{self._s.seed}/{self.rank}/{step}".encode(), digest_size=8).digest()
        rng.seed_all(int.from_bytes(digest, "little") >> 1)

    def new_group(self, name: str, ranks: Sequence[int], backend: str | None = None) -> SwitchableGroup:
        """A named subgroup of global ``ranks``; every rank calls it (non-members get a non-member).

        ``backend`` (``gloo`` or ``nccl``) defaults to ``rt.group``'s (see :mod:`rlaunch.runtime.backend`).
        """
        s = self._s
        members = sorted(set(ranks))
        kind = backends.choose(backend, None, self.group.backend)
        if name in s.groups:
            raise ValueError(f"A group named {name!r} already exists; give each group its own name.")
        if not members or members[0] < 0 or members[-1] >= self.world_size:
            raise ValueError(f"The ranks {list(ranks)} of group {name!r} are not all in 0..{self.world_size - 1}.")
        comm: Any = None
        if s.link is None:
            # plain torchrun: the default group's backend unless one is asked for, as torch does
            comm = dist.new_group(members, backend=backends.torch_backend_string(kind) if backend else None)
        elif s.standby:
            comm = SandboxComm(0, len(members))
        elif self.rank in members:
            comm = s.groups.communicator(name, members, self.rank, s.generation, kind)
        group = SwitchableGroup(name, members, self.rank, comm, s.generation, guarded=s.link is not None, backend=kind)
        s.groups.add(group)
        if s.standby or self.rank in members:
            # known to torch.distributed, so that dist.get_rank(group) and a source given as a global rank
            # (dist.broadcast(t, src=members[0], group=group)) resolve; a standby's rank, -1, is known too
            register(group, s.store, {g: i for i, g in enumerate(members)}, standby=-1 if s.standby else None)
        return group

    def device_mesh(
        self, shape: Sequence[int], names: Sequence[str] | None = None, device_type: str = "cpu"
    ) -> DeviceMesh:
        """A ``DeviceMesh`` of the whole job, as ``init_device_mesh(device_type, shape, mesh_dim_names=names)``.

        Under rlaunch each dimension group is a runtime group (swapped in place, guarded, served
        by the sandbox on a standby, rebuilt only when a moved rank is in it): FSDP2, HSDP and
        tensor parallelism on this mesh take part in live drains and replacements. Slice it as
        usual (``mesh["shard"]``). Every rank calls it once, with the same arguments. Dimensions
        torch flattens or unflattens from it (``mesh["replicate", "shard"]._flatten("dp")``,
        ``mesh._unflatten(0, (2, 2), ("dp", "tp"))``) get runtime groups too (see
        :mod:`rlaunch.runtime.mesh`).
        """
        s = self._s
        chosen = check_shape(shape, names, self.world_size)
        if s.link is None:
            return init_device_mesh(device_type, tuple(shape), mesh_dim_names=chosen)
        if s.mesh is not None:
            raise ValueError(
                "rt.device_mesh() was already called; build one mesh for the job and slice it (mesh['dp'])."
            )
        # A standby lays its model out as rank 0 would (see rlaunch.runtime.mesh), until it joins.
        rank = SANDBOX_RANK if s.standby else self.rank
        kind = backends.choose(None, device_type, self.group.backend)
        mesh = RuntimeMesh(shape, chosen, rank)
        groups = [self._mesh_group(name, members, rank, kind) for name, members in mesh.lines(rank)]
        s.mesh = mesh
        if s.standby:
            mesh.show_rank_to_torch()
        built = mesh.build(device_type, groups, [str(g.registered_name) for g in groups])
        # the dimensions torch flattens or unflattens from it get runtime groups too
        mesh.serve_torch(lambda name, members: self._mesh_group(name, members, mesh.rank, kind))
        return built

    def _mesh_group(self, name: str, members: list[int], rank: int, kind: backends.Backend) -> SwitchableGroup:
        """The group of the mesh line ``name`` (``members``) of mesh rank ``rank``, built and made known to torch."""
        s = self._s
        if name in s.groups:
            raise ValueError(f"A group named {name!r} already exists; mesh groups are named mesh.<dim>.<line>.")
        if s.standby:
            comm: Any = SandboxComm(members.index(rank), len(members))
        else:
            comm = s.groups.communicator(name, members, rank, s.generation, kind)
        group = SwitchableGroup(name, members, rank, comm, s.generation, guarded=True, backend=kind)
        s.groups.add(group)
        # torch asks for the group rank of the global rank (-1 in a sandbox): the rank it lays the
        # model out as holds it until the standby joins (rebind registers it anew)
        standby = members.index(rank) if s.standby else None
        register(group, s.store, {g: i for i, g in enumerate(members)}, standby=standby)
        return group

    def steps(self, total: int, start: int = 0) -> Iterator[int]:
        """Yield step numbers; between them the runtime may move this rank's state."""
        s = self._s
        step = start
        s.applied = start - 1
        if s.standby:
            yield from self._sandbox(min(self._sandbox_iterations(), total))
            step = self._joining.join()
        last = time.perf_counter()
        try:
            while step < total:
                s.step = step
                self._begin_step(step)
                self._step_began = last
                self._in_step = True
                yield step
                self._in_step = False
                for group in s.groups:
                    group.held = False
                self._check_after_vote(step)
                self._joining.land()  # a joiner's first step that never voted: its state is whole before the next
                now = time.perf_counter()
                self._after_step(now - last)
                self._host.stepped(now - last)  # what a host snapshot costs the steps it overlaps
                if s.resume_at is not None:
                    step, s.resume_at = s.resume_at, None
                    if self._recovery.rollback is not None:
                        # Back to the committed host snapshot, before its copies are sent to the joiners.
                        self._host.restore(step)
                        self._voting.verifier.forget_witness()
                    elif step == s.step and s.start is not None:
                        # The step is redone: as if never run. Before the replicas are sent, so that a
                        # replacement starts from the same step start as the survivors.
                        if self._discarded is not None:
                            self._recovery.refuse_redo(self._discarded.changed())
                        self._snapshots.restore(s.start, s.tracked)
                    self._discarded = None
                    self._recovery.send_replicas(step)
                    last = time.perf_counter()
                    continue
                last = time.perf_counter()
                if self._migration.due:  # its time counts in the next step's: that step's excess is the downtime
                    self._migration.switch(step + 1)
                step += 1
        except GeneratorExit:  # the loop left early (a break, or a framework's loop ended): done stepping too
            self._in_step = False
            self._joining.land()  # what the script does after its loop may read the optimizer state: whole
            with contextlib.suppress(OSError, AgentLinkError):  # the agent may be gone (at exit)
                self._done_stepping()
            raise
        self._joining.land()  # a joiner given the job's last step has nothing left to run: its state is whole too
        self._done_stepping()

    def _done_stepping(self) -> None:
        """Take no more plans, stop guarding the groups (a collective that cannot run from now on
        raises: no vote is left to redo it), and tell the agent that what follows (saving, teardown)
        is not a hang, however long it takes."""
        s = self._s
        if s.link is not None and not s.stopped.is_set():
            s.stopped.set()
            s.groups.stop_guarding(f"rank {s.rank}'s training loop ended")
            verifier = self._voting.verifier
            s.link.call(
                "done", rank=s.rank, steps=self._completed, step_s=self._median_step(), verify_s=verifier.spent_s,
                verifications=verifier.count,
            )  # fmt: skip

    def _begin_step(self, step: int) -> None:
        """At a step's start: derive per-rank streams (rt.seed) and keep what the step may change."""
        self._voted = None
        self._mark(Phase.FIRST_STEP_START)
        if self._host.due(step):  # before anything of the step draws from the generators
            self._joining.land()  # a snapshot copies the optimizer state: all of it
            if self._host.take(step):  # a move's first step takes one (HostSnapshots.due)
                self._mark(Phase.SNAPSHOT_TAKEN)
        if self._s.seed is not None:
            self._reseed(step)
        self._s.start = self._snapshots.take(step, self._s.tracked)
        self._mark(Phase.WORK_START)

    def _mark(self, phase: Phase) -> None:
        """Mark ``phase`` of the move this rank's first step in a new generation follows (no move: nothing)."""
        if self._s.after_move is not None:
            self._s.after_move.mark(phase)

    def optimizer_step(self, *optimizers: torch.optim.Optimizer, scaler: Any = None) -> bool:
        """Join the per-step vote, then step every optimizer; return whether the step was applied.

        One call per step, with every optimizer the step updates (``rt.optimizer_step(opt1,
        opt2)``); a second call in the same step is refused. With a ``torch.amp.GradScaler``
        pass ``scaler=``: the runtime then calls ``scaler.step(opt)`` for each and ``scaler.update()``
        (its inf-skip works as usual); do not call them yourself.

        The vote is a small allreduce after gradient sync; it also carries "ready for the next
        generation", so every rank decides to switch at the same boundary, the step's contract
        (generation, step and commit point, compared across ranks), fingerprints of the RNG states
        and the tracked objects' states, so state that differs by rank without being declared is
        refused before anything is stepped, and, every few steps and after every move, digests of
        the replicas' parameters and optimizer state. A rank steps only if its vote completed;
        after a fault, this is where the step is rolled forward or discarded (see the module
        docstring). A discarded step is redone from its start: buffers, RNG states and tracked
        objects (a scheduler, a scaler) are put back, so per-step code may run unconditionally.
        """
        s = self._s
        self._mark(Phase.WORK_DONE)
        self._joining.land()  # a joiner's first step: its state is whole and verified before its vote
        if not optimizers:
            raise TypeError("rt.optimizer_step() needs the optimizer(s) of the step: rt.optimizer_step(opt).")
        names = ", ".join(type(o).__name__ for o in optimizers)
        if self._voted is not None:
            raise RefusedError(
                f"rt.optimizer_step() was called a second time in step {s.step} (first for {self._voted}, now for "
                f"{names}); a step has one vote: pass every optimizer of the step to one call, "
                "rt.optimizer_step(opt1, opt2)."
            )
        self._voted = names
        if s.link is not None and not s.refused:  # with live moves refused, nothing untracked can be missed
            objects = {id(o) for o in (*optimizers, scaler) if o is not None}
            if not objects <= self._checked:  # an optimizer first stepped late (a GAN's second) is checked then
                self._checked |= objects
                why = untracked_state(s.tracked, optimizers, scaler, live_schedulers())
                if why:
                    raise RefusedError(why)

        def apply() -> None:
            for opt in optimizers:
                if scaler is not None:
                    scaler.step(opt)
                else:
                    opt.step()
            if scaler is not None:
                scaler.update()

        if self.group.sandboxed:
            apply()
            return True
        if not self.step_failed:
            issued = max(g.last_issue for g in s.groups.mine())
            if issued > self._step_began:
                self._compute.append(issued - self._step_began)
            self._finish_device_work()
            if not self.step_failed and self._voting.cast():
                self._mark(Phase.VOTED)
                self._moves.report()
                at_vote = self.own_results  # before the step: an optimizer's own collectives (ZeRO's) count
                apply()
                self._voting.after_update()
                self._own_at_vote = at_vote
                return True
        at_recovery: list[int] = []

        def rolled_forward() -> None:
            at_recovery.append(self.own_results)
            apply()

        applied = self._recovery.recover(rolled_forward)
        if not applied and self._recovery.rollback is None:  # what the script does next must not touch parameters
            self._discarded = DiscardedParams(s.step, s.tracked)
        for group in s.groups.mine():
            group.held = True  # until the boundary: the rebuilt groups' other members are there
        self._own_at_vote = at_recovery[0] if applied and at_recovery else None
        return applied

    def _touched(self) -> str:
        """Why redoing the step under way would diverge: parameters it wrote before its vote ("" if none)."""
        start = self._s.start
        return touched(start, self._s.tracked) if start is not None and start.step == self._s.step else ""

    def _check_after_vote(self, step: int) -> None:
        """At the end of a step ``rt.steps()`` yielded: if collectives issued after its vote applied it
        handed this rank its own inputs (a fault came after the vote), the coming recovery must not let a
        replica stand in for the lost rank (see :func:`~rlaunch.runtime.recovery.after_vote_refusal`)."""
        s = self._s
        at_vote, self._own_at_vote = self._own_at_vote, None
        if at_vote is None or s.after_vote or s.driven:  # a framework's loop says why in its own words
            return
        s.after_vote = after_vote_refusal(step, self.own_results - at_vote)
        if not s.after_vote:
            return
        log.warning("rank %d: a fault after step %d's vote: %s", self.rank, step, s.after_vote)
        if s.resume_at is not None:  # this step rolled forward in a recovery, then went on from own values
            self._recovery.refuse_tainted(s.after_vote)

    def _finish_device_work(self) -> None:
        """With NCCL groups, wait until this step's GPU work is done, and act on what failed.

        See :mod:`rlaunch.runtime.devicework`: afterwards a full vote means what it means under
        gloo, every rank's sync ended. A dead peer leaves this wait blocked until the replacement
        plan or torch's watchdog aborts the communicator (the step then goes to recovery);
        meanwhile the heartbeat says this rank waits on its peers.
        """
        s = self._s
        groups = [g for g in s.groups.mine() if g.backend is backends.Backend.NCCL]
        if not groups:
            return
        self._device_wait = True
        try:
            found = devicework.finish(groups)
        finally:
            self._device_wait = False
        if self.step_failed:
            return  # a plan cut a group meanwhile (its aborted kernels may fail the wait): recovery
        if found.wait:
            raise self._voting.stop(devicework.refusal(self.rank, s.step, found.wait))
        if found.errors:
            why = f"torch's NCCL watchdog found an error at step {s.step}: {found.describe()}"
            log.warning("rank %d: %s; the step goes to recovery instead of its vote", self.rank, why)
            for group, _ in found.errors:
                group.abandon(why)
            self.group.abandon(why)  # the world group: every peer's vote fails at once, all recover together

    @property
    def step_failed(self) -> bool:
        """A collective of this step failed or was abandoned: its results are this rank's inputs.

        The step will be rolled forward or redone in ``optimizer_step``; until then, code should
        not act on collective results (``rt.steps()`` yields the step again if it is redone).
        """
        return self._recovery.planned or any(g.failed or g.held for g in self._s.groups.mine())

    @property
    def own_results(self) -> int:
        """How many collectives so far handed this rank its own inputs instead of their result (its
        group had failed, was paused for a replacement, or abandoned them in flight), barriers, sends
        and those issued inside :meth:`alike` aside.

        Before a step's vote such results are let go: the step is rolled forward or redone. Work that
        runs after the vote and that no redone step runs again (a framework's hooks after its optimizer
        step) can compare the count across its stretch: a change means it went on from values that
        were this rank's own, not every rank's.

        On NCCL a collective's result is handed over when it is queued on the GPU, before it ran there:
        such collectives count too when their communicator is aborted, or records an error, or the wait
        for the GPU fails, before the runtime knew their GPU work done (it knows that once it has waited
        for the GPU ahead of each step's vote); so after a fault the count can take up to a step's NCCL
        collectives, queued before the fault was seen.
        """
        return sum(g.own_results for g in self._s.groups)

    @staticmethod
    def alike() -> contextlib.AbstractContextManager[None]:
        """``with rt.alike():`` the collectives issued inside (on this thread) have inputs that are the same
        on every rank, so a failed group's handing back each rank's own inputs gives every rank the same result:
        they are left out of :attr:`own_results`."""
        return alike()

    def group_version(self, name: str) -> int:
        """The generation whose communicator group ``name`` holds (changes only when rebuilt)."""
        return self._s.groups[name].version

    def _shutdown(self) -> None:
        """At exit, release every communicator now, in order, on this thread.

        Left to interpreter teardown, the groups would be destroyed by C++ static destructors
        after Python has gone, which can abort the process ("terminate called without an
        active exception"). Steps a framework's loop still drives end first, while the agent is
        there to be told, unless the script ends on an uncaught exception (Python keeps it in
        ``sys.last_value`` for exit handlers): that rank is not done stepping, it failed, and a
        joiner's landing may wait on a peer that is gone.
        """
        if self._driven is not None and getattr(sys, "last_value", None) is None:
            try:
                self._driven.end()
            except Exception as exc:  # the groups are released all the same
                log.warning("rank %d: the driven steps did not end cleanly at exit: %s", self.rank, exc)
        self._s.stopped.set()
        self._host.close()
        sandboxgroups.close()
        for group in self._s.groups:
            unregister(group)
            backends.current().release(group.comm)  # an NCCL communicator is aborted, not left to teardown
            group.comm = None
        gc.collect()

    # -- sandbox and joining ------------------------------------------------------------------

    def _sandbox_iterations(self) -> int:
        """Sandbox iterations to run: as asked, but enough with a DDP model that a joiner's DDP has
        rebuilt its gradient buckets, as the ranks it joins have (see :mod:`rlaunch.runtime.buckets`)."""
        return buckets.sandbox_iterations(self._s.tracked, self._sandbox_steps)

    def _sandbox(self, n: int) -> Iterator[int]:
        for step in range(n):
            self._s.step = step
            self._voted = None
            self._in_step = True
            yield step
            self._in_step = False
        assert self._s.link is not None
        self._s.link.call("warm", steps=n)

    # -- background threads --------------------------------------------------------------------

    def _start_listener(self) -> None:
        threading.Thread(target=self._migration.listen, name="rlaunch-plans", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="rlaunch-heartbeat", daemon=True).start()

    def _heartbeat(self) -> None:
        """Tell the agent, about once a second, how far this rank got and whether it waits on peers."""
        s = self._s
        assert s.link is not None
        while not s.stopped.wait(HEARTBEAT_S):
            durations, compute = tuple(self._durations), tuple(self._compute)  # one C call each: thread-safe
            waiting = self._recovery.active or self._device_wait or any(g.busy for g in s.groups.mine())
            try:
                s.link.call(
                    "heartbeat", steps=self._completed, waiting=waiting, rank=s.rank, applied=s.applied,
                    step_s=_median(durations) if durations else 0.0,
                    compute_s=_median(compute) if compute else 0.0,
                )  # fmt: skip
            except (OSError, AgentLinkError) as exc:
                log.warning("rank %d: heartbeats to the agent stopped: %s", s.rank, exc)
                return  # the agent is gone; it stops this worker anyway

    def _median_step(self) -> float:
        """The median step time, or (before any step ended) how long this one has run."""
        return _median(self._durations) if self._durations else time.perf_counter() - self._step_began

    def _after_step(self, seconds: float) -> None:
        s = self._s
        self._completed += 1
        moved, s.after_move = s.after_move, None
        if moved is not None:
            moved.mark(Phase.FIRST_STEP_END)
            self._host.first_step_ended()
            survivor = moved.role != Role.JOINER.value  # a joiner's own time is in its "joined" report
            if s.link is not None and survivor:  # this step's excess over the median step is its downtime
                median = _median(self._durations) if self._durations else 0.0
                s.link.call(
                    "switched", generation=moved.generation, rank=s.rank,
                    downtime_ms=max(0.0, seconds - median) * 1000, step_ms=seconds * 1000,
                    median_ms=median * 1000, verify_ms=self._voting.verifier.last_cost_s * 1000,
                )  # fmt: skip
            report(s.link, s.rank, moved)
            if survivor:
                return
        self._durations.append(seconds)


def _median(values: Sequence[float]) -> float:
    """The median of a non-empty sequence, as ``statistics.median`` gives it.

    Not that module: it imports ``decimal`` and ``fractions``, 0.5 MB of RSS in every worker.
    """
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def report_errors_as_sentences() -> None:
    """An uncaught rlaunch error ends the worker with its sentence, not a traceback through the
    script: it names the object at fault and what to do, and the script's frames add nothing."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if isinstance(exc, RlaunchError):
            sys.stderr.write(f"rlaunch: error: {exc}\n")
        else:
            previous(kind, exc, tb)

    sys.excepthook = hook


def init(timeout_s: float = 300.0) -> Runtime:
    """Start the runtime in this worker (instead of ``init_process_group``)."""
    report_errors_as_sentences()
    timeout = datetime.timedelta(seconds=timeout_s)
    addr = os.environ.get("RLAUNCH_AGENT_ADDR")
    kind = backends.default_backend(os.environ, backends.visible_gpus())
    if kind is backends.Backend.NCCL:
        torch.cuda.set_device(backends.cuda_device(os.environ))
    if not addr:
        # Plain torchrun (or any env:// launcher): the same script runs, without migration.
        if not dist.is_initialized():
            dist.init_process_group(backends.torch_backend_string(kind), timeout=timeout)
        return Runtime(
            rank=dist.get_rank(), world_size=dist.get_world_size(), generation=0, link=None, store=None,
            world_comm=c10d._get_default_group(), standby=False, sandbox_steps=0, timeout=timeout, backend=kind,
        )  # fmt: skip
    link = AgentLink(addr, int(os.environ.get("LOCAL_RANK", "0")))
    hello = Hello.from_json(link.call("hello", pid=os.getpid()))
    store = AgentStore(link, timeout)
    standby = hello.role is StartRole.STANDBY
    rank, world, gen = hello.rank, hello.world_size, hello.generation
    comm: Any = (
        SandboxComm(0, world)
        if standby
        else backends.build(store, f"g{gen}/{WORLD}/", rank, world, timeout, kind, range(world))
    )
    return Runtime(
        rank=rank, world_size=world, generation=gen, link=link, store=store, world_comm=comm,
        standby=standby, sandbox_steps=hello.sandbox_steps, timeout=timeout, backend=kind,
    )  # fmt: skip
