"""The per-step vote, cast and read: what it must prove before a step is applied.

:class:`Voting` casts one rank's vote (built by :class:`~rlaunch.runtime.vote.StepVote`) on the
world group after gradient sync and reads the sums, in this order, every rank alike:

1. complete: the allreduce succeeded and every rank's head and trailer are in it;
2. the step's contract: every rank is in the same generation, step and commit point, with the
   same vote layout (:mod:`rlaunch.runtime.contract`); at the first vote after a move, every
   group's members also built it alike;
3. the partition each ``rt.epochs`` sampler reads (the first vote after ``rt.epochs``,
   :mod:`rlaunch.runtime.partition`);
4. the replicas' digests, at the first vote after a move and every ``--verify-every`` steps
   (:mod:`rlaunch.runtime.verify`);
5. which ranks hold the host snapshot being taken, in a job that takes them: when all do, it is
   committed (:mod:`rlaunch.runtime.snapshots`);
6. the fingerprints of tracked state and generators, and the module buffers (``StepVote.accept``).

A broken contract or replicas that differ after a move stop every rank with a sentence that
names the ranks (one more allreduce gathers what each holds); a suspect of silent data
corruption reports itself to its agent and stops, and the others wait in recovery for its
replacement.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from rlaunch.errors import RlaunchError
from rlaunch.runtime import contract, digest, partition, verify
from rlaunch.runtime.contract import ContractError, GroupCatalog, StepContract
from rlaunch.runtime.groups import SwitchableGroup
from rlaunch.runtime.rankstate import RankState
from rlaunch.runtime.snapshots import SECTION as SNAPSHOT
from rlaunch.runtime.snapshots import HostSnapshots
from rlaunch.runtime.verify import MoveVerificationError, SilentCorruptionError, Verifier
from rlaunch.runtime.vote import Layout

log = logging.getLogger(__name__)
GROUPS = "groups"


class Voting:
    """Casts and reads one rank's per-step votes (see the module docstring).

    ``ready`` gives the generation this rank has prepared for (0: none), ``agree`` is told the one
    every rank is ready for, ``step_s`` is the median step time (for the verification interval).
    """

    def __init__(
        self,
        state: RankState,
        group: SwitchableGroup,
        verifier: Verifier,
        ready: Callable[[], int],
        agree: Callable[[int], None],
        step_s: Callable[[], float],
        host: HostSnapshots,
    ) -> None:
        self._s = state
        self._group = group
        self.verifier = verifier
        self._ready = ready
        self._agree = agree
        self._step_s = step_s
        self._host = host
        #: rt.epochs loaders with a sampler, by name, and the partition rule found for each
        self.samplers: dict[str, Any] = {}
        self.partitions: dict[str, str] = {}  # loader name -> rule ("": no candidate rule holds)

    def part(self, name: str) -> int:
        """The data partition this rank reads for loader ``name`` (-1 in a sandbox)."""
        s = self._s
        if s.standby:
            return -1
        sampler, rule = self.samplers.get(name), self.partitions.get(name)
        if rule:
            return partition.part(rule, s.rank, s.world_size, *self._mesh(), s.declared)[1]
        return int(sampler.rank) if sampler is not None else s.rank

    def _mesh(self) -> tuple[torch.Tensor | None, tuple[str, ...]]:
        mesh = self._s.mesh
        return (mesh.coordinates(), mesh.dim_names()) if mesh is not None else (None, ())

    def cast(self) -> bool:
        """The step's vote: True if every rank's vote completed and nothing forbids applying the step.

        Raises (on every rank alike: all read the same sums) when ranks break the contract, when
        replicas differ after a move, or when silent data corruption cannot be taken out live.
        False sends the step to recovery: the vote failed, or a suspect of silent data corruption
        is being replaced.
        """
        s = self._s
        s.votes += 1
        # Before the snapshot terms: an exchange that ends in between then counts in both (a rank that
        # votes ready for a drain once its exchange ended also says it holds that snapshot).
        ready = self._ready()
        checking = s.link is not None
        move = checking and s.verify_due
        verifying = checking and self.verifier.due(s.step, move)
        mesh, names = self._mesh()
        sections: list[tuple[str, torch.Tensor]] = []
        prints: list[verify.Print] = []
        digests: list[int] = []
        if verifying:
            prints, digests, part = self.verifier.prepare(
                s.rank, s.tracked, mesh, names, s.declared, self._step_s(), (s.generation, s.step)
            )
            sections.append((verify.SECTION, part))
        catalog = self._catalog() if move else None
        if catalog is not None:
            sections.append((GROUPS, catalog.section(s.groups.describe(), s.rank)))
        pending = sorted(n for n in self.samplers if n not in self.partitions) if checking else []
        rules = partition.candidates(names, s.declared)
        if pending:
            bits = [
                1.0 if partition.follows(self.samplers[n], r, s.rank, s.world_size, mesh, names, s.declared) else 0.0
                for n in pending
                for r in rules
            ]
            sections.append((partition.SECTION, torch.tensor(bits, dtype=torch.float64)))
        snapshots = checking and self._host.enabled
        if snapshots:
            sections.append((SNAPSHOT, torch.tensor(self._host.terms(), dtype=torch.float64)))
        vote, layout = s.vote.tensor(
            ready=ready, group_rank=self._group.group_rank, start=s.start, tracked=s.tracked,
            per_rank=s.per_rank, seeded=s.seed is not None, sections=sections,
            contract_of=lambda lay: self._contract(lay).digest(),
        )  # fmt: skip
        self._group.allreduce([vote]).wait()
        # A failed or abandoned vote leaves the tensor partly summed at most; only a vote whose
        # allreduce succeeded, with every rank's head and trailer in it, proves that every rank
        # finished its gradient sync for this step, so that stepping is safe.
        if not s.vote.complete(vote, layout, succeeded=not self._group.failed):
            return False
        if not s.vote.contract_agrees(vote):
            table = self._gather(self._contract(layout).row())
            what = contract.explain(table) if table is not None else "naming them failed (a peer is gone)"
            raise self.stop(
                ContractError(
                    f"rank {s.rank}: the ranks disagree on what every rank must decide alike at step {s.step}: "
                    f"{what}. This worker stops rather than hang or diverge; the job takes the restart path."
                )
            )
        if catalog is not None:
            self._check_groups(catalog, layout.section(vote, GROUPS))
        if pending:
            summed = layout.section(vote, partition.SECTION).tolist()
            for i, n in enumerate(pending):
                found = partition.choose(rules, summed[i * len(rules) : (i + 1) * len(rules)], s.world_size)
                self.partitions[n] = found or ""
        if verifying and not self._compare(layout.section(vote, verify.SECTION), prints, digests, move):
            return False
        s.verify_due = False
        s.vote.accept(vote, layout, s.step, s.tracked, s.rank)
        if snapshots:
            self._host.commit(layout.section(vote, SNAPSHOT).tolist())
        s.applied = s.step
        ready = s.vote.ready_for(vote)
        if ready:
            self._agree(ready)
        return True

    def after_update(self) -> None:
        """Right after this step's optimizer step (see :meth:`Verifier.after_update`)."""
        s = self._s
        if s.link is not None:
            self.verifier.after_update(s.step, s.tracked, *self._mesh(), s.declared)

    def prime(self, known: digest.Terms, step: int) -> None:
        """(joiner) The first vote after joining, ``step``'s, compares the state as it landed, from the
        digest terms the transfer check read (``known``), instead of reading it a second time."""
        s = self._s
        if s.link is not None:
            self.verifier.prime(known, (s.generation, step))

    def _contract(self, layout: Layout) -> StepContract:
        s = self._s
        return StepContract(s.generation, s.step, s.applied, self._host.kept, layout.digest())

    def _lines(self) -> list[tuple[str, list[int]]]:
        return self._s.mesh.every_line() if self._s.mesh is not None else []

    def _catalog(self) -> GroupCatalog:
        """Every group of the job: this rank's table and every line of the mesh (it holds its own)."""
        return GroupCatalog([*self._s.groups.names(), *(n for n, _ in self._lines())])

    def _check_groups(self, catalog: GroupCatalog, summed: torch.Tensor) -> None:
        s = self._s
        sizes = {g.label: len(g.members) for g in s.groups}
        sizes.update({n: len(m) for n, m in self._lines()})
        wrong = catalog.disagreeing(summed, sizes)
        if not wrong:
            return
        mine = [
            f"{name} (members {list(m)}, version {v}, built {i + 1}.)"
            for i, (name, v, m, _) in enumerate(s.groups.describe())
            if s.rank in m
        ]
        raise self.stop(
            ContractError(
                f"rank {s.rank}: the members of group(s) {wrong} did not build them alike (the same place in each "
                f"member's build order, the same version and members) at step {s.step}; this rank holds "
                f"{'; '.join(mine)}. This worker stops rather than wait on a group its peers built differently; "
                "the job takes the restart path."
            )
        )

    def stop(self, error: RlaunchError) -> RlaunchError:
        """``error``, once the agent was told that no live move can follow it: the node's failure is then
        a refusal, and the controller restarts every worker (a live replacement would copy state this
        very check found untrustworthy)."""
        s = self._s
        if s.link is not None:
            s.link.call("unrecoverable", generation=s.generation, reason=str(error))
        return error

    def _gather(self, values: list[float]) -> torch.Tensor | None:
        """Every rank's ``values`` (one allreduce), or None when it failed: the group hands a failed
        collective its own inputs back, and a table of one row and zeros must never name anyone."""
        table = contract.rows(self._group, values, self._group.group_rank, self._s.world_size)
        return None if self._group.failed else table

    def _compare(self, summed: torch.Tensor, prints: list[verify.Print], digests: list[int], move: bool) -> bool:
        """Read the replicas' comparison; False if a suspect of silent data corruption is replaced."""
        s = self._s
        differing = self.verifier.differing(summed, prints)
        faults = self.verifier.settle(s.step, summed, prints, differing)
        if differing and not faults:
            log.warning("rank %d: %s; a live replacement will be refused", s.rank, self.verifier.refusal())
        if not faults:
            return True
        first = self._gather(verify.rows_of(digests, self.verifier.changed(s.step, prints, digests)))
        if move:
            found = verify.verdict(prints, faults, first, None, s.step) if first is not None else None
            what = (
                found.unnamed + [verify.describe_suspect(r, e) for r, e in sorted(found.suspects.items())]
                if found is not None
                else [f"{', '.join(prints[i].label() for i, _ in faults)} (naming the ranks failed: a peer is gone)"]
            )
            raise self.stop(
                MoveVerificationError(
                    f"rank {s.rank}: after the move to generation {s.generation}, ranks that must hold equal state do "
                    f"not: {'; '.join(what)}. The step is not applied: this worker stops and the job takes the restart "
                    "path."
                )
            )
        if first is None:  # a peer went away while the suspects were named: recover the step first
            return False
        found = verify.verdict(prints, faults, first, None, s.step)
        if found.unnamed:  # every rank reads the same table, so all read their state again alike
            reread = self.verifier.digests(s.tracked, prints, self._mesh()[1], s.declared)
            again = self._gather(verify.rows_of(reread, [0.0] * len(prints)))
            if again is None:
                return False
            found = verify.verdict(prints, faults, first, again, s.step)
        if found.unnamed:
            raise self.stop(
                SilentCorruptionError(
                    f"rank {s.rank}: {'; '.join(found.unnamed)}. The job stops rather than train on possibly corrupt "
                    "state; run with three or more replicas for the suspect to be named and replaced live, test the "
                    "machines, and restart from your checkpoint."
                )
            )
        evidence = found.suspects.get(s.rank)
        if evidence is not None:
            sentence = verify.describe_suspect(s.rank, evidence)
            assert s.link is not None
            s.link.call("sdc_suspected", rank=s.rank, step=s.step, sentence=sentence, evidence=evidence)
            raise SilentCorruptionError(
                f"rank {s.rank}: {sentence}. This worker stops: its node is taken out of the job, and a standby "
                "takes its ranks live from healthy replicas."
            )
        log.warning(
            "rank %d: %s; the step is not applied, and waits for the suspects' replacement",
            s.rank, "; ".join(verify.describe_suspect(r, e) for r, e in sorted(found.suspects.items())),
        )  # fmt: skip
        return False
