"""A node's local worker processes: spawn, watch, and stop whole process trees.

Each worker starts in its own session (so its whole process group can be signalled) with
``PR_SET_PDEATHSIG=SIGKILL`` (so it dies with its agent, leaving no orphan even when the agent
is SIGKILLed). The agent is a child subreaper, so descendants that outlive their worker are
reparented to it and reaped here: stopping a group leaves neither orphans nor zombies.

Reaping orphans must never reap a worker: ``Popen.poll()`` on a pid someone else has waited for
gets ECHILD and reports exit code 0, so a crashed worker would be recorded as a success. Every
worker's ``Popen`` is therefore registered here from its spawn until it has collected its own
status, and :func:`reap_orphans` leaves registered pids alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence

import psutil

from rlaunch.agent.config import Std
from rlaunch.agent.logs import LogPolicy, StreamPump, console_streams

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


#: pid -> the Popen that owns its exit status, from spawn until that Popen has collected it.
_owned: dict[int, subprocess.Popen[bytes]] = {}
_owned_lock = threading.Lock()


def own(proc: subprocess.Popen[bytes]) -> None:
    """Register ``proc``: its exit status is collected by its ``Popen``, never by :func:`reap_orphans`.

    Call it on the thread that spawned ``proc``, before that thread can run :func:`reap_orphans`.
    """
    with _owned_lock:
        _owned[proc.pid] = proc


def _owned_pids() -> set[int]:
    """Pids whose status a ``Popen`` has not collected yet (others are forgotten: the pid may be reused)."""
    with _owned_lock:
        for pid in [pid for pid, proc in _owned.items() if proc.returncode is not None]:
            del _owned[pid]
        return set(_owned)


def become_subreaper() -> None:
    """Make orphaned descendants of this process its children, so it can reap them."""
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _child_setup() -> None:  # runs in the child between fork and exec
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class WorkerGroup:
    """The ``nproc`` workers of one node for one generation.

    Must be started from a thread that lives as long as the workers (the event loop's):
    PDEATHSIG fires when the spawning *thread* exits.
    """

    def __init__(
        self, cmd: Sequence[str], envs: Sequence[dict[str, str]], labels: Sequence[int | str], policy: LogPolicy
    ) -> None:
        """``labels[i]`` names local worker ``i`` on the console: its rank, or ``s<i>`` on a standby."""
        self._cmd = list(cmd)
        self._envs = list(envs)
        self._labels = list(labels)
        self._policy = policy
        self.procs: list[subprocess.Popen[bytes]] = []
        self._pumps: list[list[StreamPump]] = []  # [stdout, stderr] of each local worker

    def start(self) -> None:
        out, err = console_streams()
        for local_rank, (env, label) in enumerate(zip(self._envs, self._labels, strict=True)):
            proc = subprocess.Popen(
                self._cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_child_setup,  # noqa: PLW1509 - only calls prctl
            )
            own(proc)
            self.procs.append(proc)
            prefix = self._policy.prefix(label, local_rank)
            pumps = []
            for stream, pipe, console in ((Std.OUT, proc.stdout, out), (Std.ERR, proc.stderr, err)):
                to_console, path = self._policy.targets(local_rank, stream)
                assert pipe is not None
                pumps.append(StreamPump(pipe, prefix, console if to_console else None, path))
            self._pumps.append(pumps)

    def relabel(self, labels: Sequence[int | str]) -> None:
        """New console labels (a standby's workers took ranks ``labels``)."""
        for local_rank, (pumps, label) in enumerate(zip(self._pumps, labels, strict=True)):
            for pump in pumps:
                pump.prefix = self._policy.prefix(label, local_rank).encode()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def kill(self, local_rank: int) -> None:
        """SIGKILL one worker's process tree (a hung worker may ignore SIGTERM)."""
        _killpg(self.procs[local_rank].pid, signal.SIGKILL)

    def poll(self) -> list[int | None]:
        """Exit code of each local worker (``None`` while running; ``-N`` for signal N)."""
        return [p.poll() for p in self.procs]

    def stop(self, grace: float = 30.0) -> list[int | None]:
        """SIGTERM every process of the group's trees, SIGKILL after ``grace``, reap all.

        ``grace <= 0``: SIGKILL at once, without a SIGTERM (stale workers of a fenced node must not
        run a single line more, such as a signal handler that saves a checkpoint).
        """
        family: dict[int, psutil.Process] = {}
        for p in self.procs:
            try:
                for child in psutil.Process(p.pid).children(recursive=True):
                    family[child.pid] = child
            except psutil.NoSuchProcess:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL) if grace > 0 else (signal.SIGKILL,):
            for p in self.procs:
                if p.poll() is None:
                    _killpg(p.pid, sig)
            for child in family.values():
                try:
                    child.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            end = time.monotonic() + (grace if sig == signal.SIGTERM else 10.0)
            for p in self.procs:
                try:
                    p.wait(max(0.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            _, alive = psutil.wait_procs(list(family.values()), timeout=max(0.0, end - time.monotonic()))
            if all(p.poll() is not None for p in self.procs) and not alive:
                break
            log.warning("[%s] workers did not stop within %.0f s of %s", self._policy.node_id, grace, sig.name)
        for pumps in self._pumps:
            for pump in pumps:
                pump.join(2.0)
        return self.poll()


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def reap_orphans(keep: Sequence[int] = ()) -> list[int]:
    """Reap zombie children that no ``Popen`` owns (descendants reparented to us); return their pids.

    Workers (registered with :func:`own`) are never reaped here, whatever their state.
    ``keep``: further pids owned by a ``Popen`` elsewhere (the embedded etcd).
    """
    try:
        children = psutil.Process().children()
    except psutil.NoSuchProcess:
        return []
    # Workers are spawned on the thread that calls this (the event loop's), so none of them is
    # between fork and own() while this runs.
    skip = _owned_pids() | set(keep)
    reaped = []
    for child in children:
        if child.pid in skip:
            continue
        try:
            if child.status() == psutil.STATUS_ZOMBIE and os.waitpid(child.pid, os.WNOHANG)[0] == child.pid:
                reaped.append(child.pid)
        except (psutil.NoSuchProcess, ChildProcessError):
            pass
    return reaped
