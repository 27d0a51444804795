"""Drain, live, the nodes Slurm marks for maintenance: the polling loop of ``rlaunch slurm-watch``.

One watcher serves a whole job (the sbatch example runs it in the batch script, on the first node of
the allocation). Every ``interval`` seconds it runs ``scontrol show node -o NODES`` once for all the
job's nodes, one RPC to slurmctld per poll however large the job, and for each node that Slurm marks
(see :func:`rlaunch.integrations.slurm.maintenance`) it asks rlaunch to drain it: the node's ranks
move to a ready standby while the job keeps running, as ``rlaunch drain`` does. rlaunch node ids
are Slurm node names (the sbatch example passes ``--node-id $SLURMD_NODENAME``).

A refused drain (the node is a standby, the job has not started, no standby is ready yet) is asked
again at the next poll, and its sentence logged once. Once drained, and once its agent has exited,
the node is released from the Slurm job (``scontrol update JobId=J NodeList=<the others>``), so
that Slurm's own drain completes (the node turns DRAINED) while the job runs on; the job's batch
host, which runs the batch script (and etcd), stays in the job until it ends. The etcd side is
injected (``drain``, ``announce``, ``release``), so this loop depends on Slurm only through them
and ``read``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable
from enum import Enum

from rlaunch.errors import RlaunchError
from rlaunch.integrations.slurm import SlurmError, SlurmNode, maintenance, parse_fields, parse_nodes
from rlaunch.waiting import wait_event

log = logging.getLogger(__name__)

#: Longest wait for one ``scontrol`` call; slurmctld answers in milliseconds when it is healthy.
SCONTROL_TIMEOUT_S = 30.0

#: Seconds a drained node's agent must have been gone from etcd before its node leaves the Slurm
#: job: the agent revokes its lease just before it exits, and Slurm would end a task still running.
RELEASE_GRACE_S = 3.0


class Mark(str, Enum):
    """Where the watcher stands with one node.

    - ``IN_SERVICE`` -> ``MARKED``: Slurm flagged the node; a drain is asked for at every poll.
    - ``MARKED`` -> ``IN_SERVICE``: Slurm resumed the node before rlaunch drained it.
    - ``MARKED`` -> ``DRAINED``: rlaunch moved the node's ranks away, or found it drained.
    - ``DRAINED`` -> ``RELEASED``: the node left the Slurm job (final). A node that is kept (the
      batch host), or a watcher without ``release``, stays ``DRAINED`` (final).
    """

    IN_SERVICE = "in_service"
    MARKED = "marked"
    DRAINED = "drained"
    RELEASED = "released"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one request (drain, release) came to: ``done``, or not for now; ``message`` says which."""

    done: bool
    message: str


ReadNodes = Callable[[], Awaitable[dict[str, SlurmNode]]]
Drain = Callable[[str], Awaitable[Outcome]]
Release = Callable[[str], Awaitable[Outcome]]
Announce = Callable[[SlurmNode, str], Awaitable[None]]


def decide(mark: Mark, node: SlurmNode | None) -> tuple[Mark, str | None]:
    """The node's next mark, and why to ask for its drain now (None: nothing to ask).

    A node missing from Slurm's answer counts as in service: only a flag Slurm shows drains a node.
    """
    if mark in (Mark.DRAINED, Mark.RELEASED):
        return mark, None
    why = maintenance(node) if node is not None else None
    if why is None:
        return Mark.IN_SERVICE, None
    return Mark.MARKED, why


async def run_scontrol(scontrol: str, *args: str, timeout: float = SCONTROL_TIMEOUT_S) -> str:
    """What ``scontrol ARGS`` prints, or :class:`SlurmError` with what it said when it fails."""
    said_as = " ".join([scontrol, *args])
    try:
        proc = await asyncio.create_subprocess_exec(
            scontrol, *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
    except OSError as exc:
        raise SlurmError(
            f"{scontrol} could not be run ({exc}); run the watcher on a node of the Slurm cluster or pass --scontrol."
        ) from exc
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise SlurmError(f"`{said_as}` did not answer within {timeout:.0f} s.") from None
    if proc.returncode != 0:
        said = err.decode(errors="replace").strip() or out.decode(errors="replace").strip()
        raise SlurmError(f"`{said_as}` exited with code {proc.returncode}: {said}")
    return out.decode(errors="replace")


async def read_nodes(nodes: str, scontrol: str = "scontrol") -> dict[str, SlurmNode]:
    """The nodes of the hostlist ``nodes`` (``n[1-4]``, ``a,b``) as ``scontrol show node -o`` describes them."""
    return parse_nodes(await run_scontrol(scontrol, "show", "node", "-o", nodes))


async def release_node(job_id: str, node: str, scontrol: str = "scontrol") -> bool:
    """Take ``node`` out of running Slurm job ``job_id``; False when it was not in the job (any more).

    Slurm keeps the job's steps running on the other nodes; the node's own tasks must have ended,
    or Slurm ends them.
    """
    job = parse_fields(await run_scontrol(scontrol, "show", "job", "-o", job_id))
    names = (await run_scontrol(scontrol, "show", "hostnames", job.get("NodeList", ""))).split()
    if node not in names:
        return False
    rest = [name for name in names if name != node]
    if not rest:
        raise SlurmError(f"Node {node} is the last node of Slurm job {job_id}; it is not released.")
    await run_scontrol(scontrol, "update", f"JobId={job_id}", f"NodeList={','.join(rest)}")
    return True


def job_nodes() -> str:
    """The hostlist of the current Slurm job's nodes, from ``SLURM_JOB_NODELIST``."""
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodes:
        raise SlurmError(
            "SLURM_JOB_NODELIST is not set: run the watcher inside a Slurm job or name the nodes with --nodes."
        )
    return nodes


class Releaser:
    """Releases a drained node from Slurm job ``slurm_job`` once its agent has been gone a while.

    ``present(node)`` says whether the node's agent is still registered in the rlaunch job;
    ``shrink(node)`` takes the node out of the Slurm job (False: it was not in it any more).
    """

    def __init__(
        self,
        slurm_job: str,
        present: Callable[[str], Awaitable[bool]],
        shrink: Callable[[str], Awaitable[bool]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.slurm_job = slurm_job
        self._present = present
        self._shrink = shrink
        self.clock = clock
        self.gone_since: dict[str, float] = {}

    async def __call__(self, node: str) -> Outcome:
        waiting = Outcome(False, f"Node {node} leaves Slurm job {self.slurm_job} once its rlaunch agent has exited.")
        try:
            present = await self._present(node)
        except RlaunchError as exc:
            return Outcome(False, str(exc))
        if present:
            self.gone_since.pop(node, None)
            return waiting
        now = self.clock()
        if now - self.gone_since.setdefault(node, now) < RELEASE_GRACE_S:
            return waiting
        try:
            released = await self._shrink(node)
        except RlaunchError as exc:
            return Outcome(False, str(exc))
        if not released:
            return Outcome(True, f"Node {node} is no longer in Slurm job {self.slurm_job}.")
        return Outcome(
            True, f"Node {node} released from Slurm job {self.slurm_job}: Slurm may take it for maintenance."
        )


class SlurmDrainWatch:
    """Polls Slurm and drains the job's marked nodes until ``stop`` is set.

    ``release`` (None: nodes stay in the Slurm job) hands a drained node back to Slurm; nodes in
    ``keep`` are never released.
    """

    def __init__(
        self,
        read: ReadNodes,
        drain: Drain,
        announce: Announce,
        interval: float,
        stop: asyncio.Event,
        release: Release | None = None,
        keep: frozenset[str] = frozenset(),
    ):
        self._read = read
        self._drain = drain
        self._announce = announce
        self._release = release
        self.keep = keep
        self.interval = interval
        self.stop = stop
        self.marks: dict[str, Mark] = {}
        self._said: dict[str, str] = {}  # the last sentence logged per node (or "" for Slurm itself)

    async def run(self) -> None:
        while not self.stop.is_set():
            await self.poll()
            await wait_event(self.stop, self.interval)

    async def poll(self) -> None:
        """One look at Slurm, and a drain request for each node it marks."""
        try:
            nodes = await self._read()
        except SlurmError as exc:
            self._say("", logging.WARNING, f"{exc} Trying again in {self.interval:g} s.")
            return
        self._said.pop("", None)
        for name in sorted(set(nodes) | set(self.marks)):
            before = self.marks.get(name, Mark.IN_SERVICE)
            after, why = decide(before, nodes.get(name))
            self.marks[name] = after
            if before is Mark.MARKED and after is Mark.IN_SERVICE:
                self._say(name, logging.INFO, f"Slurm put node {name} back in service before it was drained.")
            if why is not None:
                if before is Mark.IN_SERVICE:
                    log.info("%s Draining it from the rlaunch job.", why)
                    await self._announce(nodes[name], why)
                outcome = await self._drain(name)
                if outcome.done:
                    self.marks[name] = Mark.DRAINED
                    self._say(name, logging.INFO, outcome.message)
                else:
                    self._say(name, logging.INFO, f"{outcome.message} Asking again in {self.interval:g} s.")
            if self.marks[name] is Mark.DRAINED:
                await self._hand_back(name)

    async def _hand_back(self, name: str) -> None:
        """Release drained node ``name`` from the Slurm job, unless it is kept or there is no ``release``."""
        if self._release is None:
            return
        if name in self.keep:
            self._say(
                name, logging.INFO, f"Node {name} stays in the Slurm job until it ends: it runs the batch script."
            )
            return
        outcome = await self._release(name)
        if outcome.done:
            self.marks[name] = Mark.RELEASED
        self._say(name, logging.INFO, outcome.message)

    def _say(self, key: str, level: int, message: str) -> None:
        """Log ``message`` unless it is what was last said about ``key`` (refusals repeat each poll)."""
        if self._said.get(key) != message:
            self._said[key] = message
            log.log(level, "%s", message)
