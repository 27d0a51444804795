"""Simulated nodes spread over processes, for scripts/bench_control_plane.py (``--node-procs P``).

Each real agent is a process of its own, on a machine of its own. N simulated nodes in one process
share one core: at 4,096 nodes that process alone used 3.2 CPU seconds in a fault's window, and
every node waited for the others' turns. Here the nodes are dealt over P host
processes (node ``i`` to host ``i % P``), each with its own etcd channels and event loop, so that
the nodes' work can use every core the machine has left after etcd and the controller.

A host is the benchmark's own child: once its channels are open it says ``{"ready": true}``, then
reads the benchmark's requests on its stdin and answers each on its stdout, in order, one JSON object
a line (no other bytes reach it: JSON, never pickle). Times
are ``time.monotonic()``, one clock (CLOCK_MONOTONIC) for every process of the machine, so the
benchmark compares them with its own.

Requests (``{"op": ..., ...}``; an answer has ``"error"`` where the request failed):

- ``join`` ``ids``: register these fresh nodes together and start them;
- ``formed``: how many nodes acted on generation 1, the latest time one did, and whether one is a
  ready standby (what the planner takes as one);
- ``until`` ``what`` (``acted`` or ``ran``), ``gen``, ``timeout``: answers once every live node of the
  host did that at ``gen``, with the latest time one did (null where the host has no live node), or
  with an ``error`` when they did not within ``timeout`` seconds;
- ``fail`` ``id``: the node is lost (its tasks end, nothing more is written); answers its lease;
- ``lose_peer`` ``gen``, ``nodes``, ``ids``, ``wall``, ``mono``: those nodes' workers saw a collective
  fail in ``gen``, of ``nodes`` nodes, at that time (see SimNode.lose_peer); answers when it took them
  (``at``);
- ``writes`` ``open``: hold or let go the nodes' writes (their reads and watches pass);
- ``collector`` ``paused``: pause Python's garbage collector over a fault's window, or resume it;
- ``profile`` ``on``: the host's cProfile over a fault's window;
- ``times`` ``gen``: when each live node saw and published ``gen`` (those that did), and how many live;
- ``fresh`` ``id``: a new node joins and is started; answers once it is a ready standby;
- ``close``: end every node, write the profile, answer ``{}`` and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import json
import subprocess
import sys
import time
from typing import Any

from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.keys import JobKeys
from scripts.ending import die_with_parent
from scripts.simnodes import GatedWrites, SimNode, pause_collector, ready_standby, resume_collector, until


class Host:
    """The benchmark's end of one host process."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._turn = asyncio.Lock()  # one request at a time: answers come in order

    @classmethod
    async def start(cls, endpoint: str, job_id: str, index: int, nodes: int, per_connection: int,
                    profile: str) -> Host:  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            sys.executable, sys.argv[0], "--node-host", job_id, "--endpoint", endpoint, "--count", str(nodes),
            "--nodes-per-connection", str(per_connection), "--profile-nodes", f"{profile}.{index}" if profile else "",
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=die_with_parent,
            limit=2**24,
        )  # fmt: skip
        host = cls(proc)
        assert proc.stdout is not None
        line = await proc.stdout.readline()  # its imports and channels are ready: not a part of any figure
        if not line:
            raise RuntimeError(f"Node host {proc.pid} ended as it started (exit code {await proc.wait()}).")
        return host

    async def call(self, op: str, **args: Any) -> dict[str, Any]:
        """Send one request and read its answer; raises RuntimeError with the host's error."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        async with self._turn:
            self.proc.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
            await self.proc.stdin.drain()
            line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"Node host {self.pid} ended (exit code {await self.proc.wait()}) during {op!r}.")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"Node host {self.pid}: {op!r} failed: {answer['error']}")
        return answer

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.call("close"), 30)
        except (RuntimeError, asyncio.TimeoutError, ConnectionError):
            if self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
        await self.proc.wait()


class _Nodes:
    """A host's side: its nodes, their etcd channels and their writes' gate."""

    def __init__(self, endpoint: str, keys: JobKeys, count: int, per_connection: int, profile: str) -> None:
        eps = parse_endpoints(endpoint)
        self.keys = keys
        self.channels = [Store(eps, timeout=30) for _ in range(max(1, count // per_connection))]
        self.gate = asyncio.Event()  # open, except from a fault until every node acted in the deferred runs
        self.gate.set()
        self.gated = [GatedWrites(channel, self.gate) for channel in self.channels]
        self.nodes: dict[str, SimNode] = {}
        self.live: dict[str, SimNode] = {}
        self.profile = profile
        self.prof = cProfile.Profile() if profile else None

    def _node(self, node_id: str) -> SimNode:
        node = SimNode(node_id, self.gated[len(self.nodes) % len(self.gated)], self.keys)  # type: ignore[arg-type]
        self.nodes[node_id] = self.live[node_id] = node
        return node

    async def answer(self, req: dict[str, Any]) -> dict[str, Any]:  # noqa: PLR0911 - one branch per request
        op = req["op"]
        if op == "join":
            joining = [self._node(node_id) for node_id in req["ids"]]
            await asyncio.gather(*(node.join() for node in joining))
            for node in joining:
                node.start()
            return {}
        if op == "formed":
            acted = [x.acted[1] for x in self.live.values() if 1 in x.acted]
            return {"acted": len(acted), "latest": max(acted, default=None),
                    "standby": any(map(ready_standby, self.live.values()))}  # fmt: skip
        if op == "until":
            what, gen = req["what"], req["gen"]
            doing = {"acted": "acting on", "ran": "running"}[what]
            await until(lambda: all(gen in getattr(x, what) for x in self.live.values()), req["timeout"],
                        f"every node of this host {doing} {gen}")  # fmt: skip
            return {"latest": max((getattr(x, what)[gen] for x in self.live.values()), default=None)}
        if op == "fail":
            node = self.live.pop(req["id"])
            return {"lease": await node.fail()}
        if op == "lose_peer":
            for node_id in req["ids"]:
                if node_id in self.live:
                    self.live[node_id].lose_peer(req["gen"], req["nodes"], req["wall"], req["mono"])
            return {"at": time.monotonic()}
        if op == "writes":
            (self.gate.set if req["open"] else self.gate.clear)()
            return {}
        if op == "collector":
            (pause_collector if req["paused"] else resume_collector)()
            return {}
        if op == "profile":
            if self.prof is not None:
                (self.prof.enable if req["on"] else self.prof.disable)()
            return {}
        if op == "times":
            gen = req["gen"]
            live = self.live.values()
            return {"seen": [x.seen[gen] for x in live if gen in x.seen],
                    "published": [x.published[gen] for x in live if gen in x.published], "live": len(live)}  # fmt: skip
        if op == "fresh":
            node = self._node(req["id"])
            await node.join()
            node.start()
            await until(lambda: ready_standby(node), 120, f"the fresh node {req['id']} as a ready standby")
            return {}
        return {"error": f"unknown request {op!r}"}

    async def close(self) -> None:
        await asyncio.gather(*(node.close() for node in self.nodes.values()), return_exceptions=True)
        if self.prof is not None:
            self.prof.dump_stats(self.profile)
        for store in self.channels:
            store.timeout = 1.0  # closing a channel that had watches on it may not finish: do not wait long
        await asyncio.gather(*(store.close() for store in self.channels), return_exceptions=True)


async def _serve(endpoint: str, job_id: str, count: int, per_connection: int, profile: str) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    nodes = _Nodes(endpoint, JobKeys(job_id), count, per_connection, profile)
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    try:
        while line := await reader.readline():
            req = json.loads(line)
            if req["op"] == "close":
                break
            try:
                answer = await nodes.answer(req)
            except Exception as exc:  # said to the benchmark, which stops
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()
    finally:
        await nodes.close()
    sys.stdout.write("{}\n")
    sys.stdout.flush()


def host_main(endpoint: str, job_id: str, count: int, per_connection: int, profile: str) -> None:
    """A host process's body (``--node-host JOB``): serve the benchmark's requests until ``close``."""
    asyncio.run(_serve(endpoint, job_id, count, per_connection, profile))
