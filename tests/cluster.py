"""Test harness: real rlaunch agents as subprocesses against a real etcd, and leftover checks.

Every process a test starts carries ``RLAUNCH_TEST_TAG=<unique tag>`` in its environment
(workers inherit it), so :func:`leftovers` finds anything a test left behind, orphans included.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from rlaunch.errors import StoreUnavailableError
from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Event, decode

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "examples" / "train.py"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TAG_VAR = "RLAUNCH_TEST_TAG"


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``pred`` until truthy; fail the test naming ``what`` after ``timeout`` seconds.

    A poll that read etcd and got no answer in time (the test's own ``Cluster.status``, on a loaded
    machine) counts as not yet: only the deadline fails the test, with the last such error.
    """
    end = time.monotonic() + timeout
    unanswered: StoreUnavailableError | None = None
    while time.monotonic() < end:
        try:
            value = pred()
        except StoreUnavailableError as exc:
            unanswered, value = exc, None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}") from unanswered


#: a committed host snapshot in an agent's log: the rank and the step (rlaunch.runtime.snapshots)
SNAPSHOT_COMMITTED = re.compile(r"event snapshot_committed \(generation \d+\) \{'rank': (\d+), 'step': (\d+),")


def after_a_scheduled_snapshot(agent: AgentProc, every: int = 20, timeout: float = 120) -> int:
    """Wait until ``agent`` logs a new committed snapshot of a scheduled step (a multiple of ``every``)
    and return its step: a fault right after it comes long before the next snapshot starts, outside
    the window in which a fault can only restart the job (see docs/layouts.md, "Host snapshots")."""

    def scheduled() -> set[int]:
        return {int(m.group(2)) for m in SNAPSHOT_COMMITTED.finditer(agent.output()) if int(m.group(2)) % every == 0}

    seen = scheduled()
    return int(
        wait_for(lambda: max(scheduled() - seen, default=0), timeout, f"a new scheduled snapshot on {agent.name}")
    )


def reap_zombies() -> None:
    """Wait for this process's zombie children (pytest is a subreaper: orphans land here)."""
    for child in psutil.Process().children():
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(child.pid, os.WNOHANG)
        except (psutil.NoSuchProcess, ChildProcessError):
            pass


def kill_leftovers(tag: str) -> list[tuple[int, list[str]]]:
    """Kill the live processes carrying ``tag``; their pids and command lines, for the assertion."""
    left = leftovers(tag)
    named = [(p.pid, p.info.get("cmdline") or []) for p in left]  # read before the kill makes them zombies
    for proc in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    return named


def leftovers(tag: str) -> list[psutil.Process]:
    """Live (non-zombie) processes carrying ``tag`` in their environment."""
    found = []
    for proc in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            if proc.environ().get(TAG_VAR) == tag:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


class AgentProc:
    """One ``rlaunch`` agent process; its combined output goes to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"agent {self.name} did not exit within {timeout:.0f} s; its output:\n{self.output()[-4000:]}"
            ) from None

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def workers(self) -> list[psutil.Process]:
        try:
            return [c for c in psutil.Process(self.pid).children() if "etcd" not in c.name()]
        except psutil.NoSuchProcess:
            return []

    def kill_with_workers(self) -> None:
        """SIGKILL the agent, its workers and their own children (data loader workers) at once, as a
        machine loss would."""
        workers = self.workers()
        victims = [psutil.Process(self.pid), *workers]
        for worker in workers:
            try:
                victims += worker.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        for p in victims:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(10)

    def close(self) -> None:
        """Stop the agent as a user would (SIGTERM), and SIGKILL it if it does not exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


class Cluster:
    """Agents of one job (its own job id) against the shared test etcd."""

    def __init__(self, endpoint: str, tmp: Path, tag: str) -> None:
        self.endpoint = endpoint
        self.job_id = "job-" + uuid.uuid4().hex[:8]
        self.tmp = tmp
        self.tag = tag
        self.agents: dict[str, AgentProc] = {}
        #: the TMPDIR of everything the cluster starts (the agents' control sockets, their workers'
        #: files), removed at close: an agent killed on purpose cannot remove its own. In /tmp
        #: whatever this process's TMPDIR: a Unix socket's path must fit in 108 bytes.
        self.scratch = Path(tempfile.mkdtemp(prefix="rlaunch-test-", dir="/tmp"))

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env[TAG_VAR] = self.tag
        env["TMPDIR"] = str(self.scratch)
        env.pop("OMP_NUM_THREADS", None)
        env.update(extra or {})
        return env

    def agent(
        self,
        node_id: str,
        script: Path | str = TRAIN,
        *script_args: str,
        nnodes: int = 2,
        flags: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        where: tuple[str, ...] = (),
        endpoint: str = "",
    ) -> AgentProc:
        """Start agent ``node_id``; ``where``: the command prefix that runs it on another host (netns);
        ``endpoint``: the etcd endpoints it is given, where not the cluster's own (another network's)."""
        argv = [
            *where, sys.executable, "-m", "rlaunch",
            "--nnodes", str(nnodes), "--nproc-per-node", "1",
            "--rdzv-endpoint", endpoint or self.endpoint, "--rdzv-id", self.job_id,
            "--node-id", node_id, "--lease-ttl", "3", "--rdzv-timeout", "60",
            *flags, str(script), *script_args,
        ]  # fmt: skip
        agent = AgentProc(node_id, argv, self.env(env), self.tmp / f"agent-{node_id}.log")
        self.agents[node_id] = agent
        return agent

    def agents_in_order(
        self, node_ids: list[str], script: Path | str, *script_args: str, **kwargs: Any
    ) -> list[AgentProc]:
        """Start agents one after another, each once the previous one has registered.

        Join order decides node ranks (the first ``--nnodes`` are active, the rest standbys).
        """
        started = []
        for node_id in node_ids:
            started.append(self.agent(node_id, script, *script_args, **kwargs))
            self.registered(started[-1])
        return started

    def registered(self, agent: AgentProc, timeout: float = 30) -> dict[str, Any]:
        """Wait until the node of ``agent`` (started by :meth:`agent`: its name is its node id) registered
        and return its record; an agent that exits before its node is seen (a port taken meanwhile, a
        refused flag) fails the test at once, with its output."""

        def seen() -> dict[str, Any] | None:
            record = self.node(agent.name)
            if record is None and agent.proc.poll() is not None:
                raise AssertionError(
                    f"agent {agent.name} exited ({agent.proc.returncode}) before its node was seen registered; its "
                    f"output:\n{agent.output()[-4000:]}"
                )
            return record

        return wait_for(seen, timeout, f"node {agent.name} to register")

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "rlaunch", *args], env=self.env(), capture_output=True, text=True, timeout=timeout
        )

    def status(self) -> dict[str, Any]:
        """What ``rlaunch status --json`` prints: read in-process (faster than the CLI), and by the CLI when
        the in-process read got no answer in time (an etcd client of this long-lived pytest process has
        been seen to get none for 30 s while every agent's did)."""
        from rlaunch.cli.status import fetch_status

        try:
            found = asyncio.run(fetch_status(self.endpoint, self.job_id, 5.0))
        except StoreUnavailableError:
            res = self.cli("status", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.job_id, "--json")
            if res.returncode != 0 and "no job" not in res.stderr:
                raise
            found = json.loads(res.stdout) if res.returncode == 0 else None
        return found or {"generation": 0, "nodes": []}

    def node(self, node_id: str) -> dict[str, Any] | None:
        return next((n for n in self.status()["nodes"] if n["node_id"] == node_id), None)

    def written_events(self) -> list[Event]:
        """The job's events as etcd holds them (what reached etcd, not the agents' logs)."""

        async def read() -> list[Event]:
            store = Store(parse_endpoints(self.endpoint), timeout=10)
            try:
                kvs, _ = await store.get_prefix(JobKeys(self.job_id).events_prefix)
            finally:
                await store.close()
            return [decode(Event, kv.value, kv.key) for kv in kvs]

        return asyncio.run(read())

    def close(self) -> None:
        for agent in self.agents.values():
            agent.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def etcd_counters(endpoint: str, *metrics: str) -> dict[str, dict[str, float]]:
    """etcd's own gRPC counters (``grpc_server_msg_received_total``...), each by method, from one read
    of its Prometheus page."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    counts: dict[str, dict[str, float]] = {metric: {} for metric in metrics}
    for line in text.splitlines():
        metric = line.split("{", 1)[0]
        if metric in counts and 'grpc_method="' in line:
            labels, value = line.rsplit(" ", 1)
            method = labels.split('grpc_method="', 1)[1].split('"', 1)[0]
            counts[metric][method] = counts[metric].get(method, 0.0) + float(value)
    return counts


def run_store(endpoint: str, coro_fn: Callable[[Any], Any], security: Any = None, timeout: float = 5) -> Any:
    """Run ``coro_fn(store)`` against the test etcd (``security``: its TLS; ``timeout``: the store's
    request timeout) on a fresh event loop."""
    from rlaunch.store.client import Store, parse_endpoints

    async def go() -> Any:
        store = Store(parse_endpoints(endpoint), timeout=timeout, security=security)
        try:
            return await coro_fn(store)
        finally:
            await store.close()

    return asyncio.run(go())


def checksums(text: str) -> set[str]:
    """The ``checksum=...`` values the example script prints at the end."""
    return {line.rsplit("checksum=", 1)[1].split()[0] for line in text.splitlines() if "checksum=" in line}
