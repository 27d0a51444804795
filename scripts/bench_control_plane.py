"""Control-plane benchmark: job formation, fault → committed plan → every node acting, etcd traffic.

Prints one JSON object, ``{"sizes": [...], "uptime_before": ..., "uptime_after": ..., "logs": DIR}``,
one entry per N:

- ``kind: "real"``: N real ``rlaunch`` agent processes (N-1 active, 1 standby) with a trivial
  worker, on an embedded etcd. The fault is a SIGKILL of one active node (agent and worker).
  ``fault_to_plan_s`` runs from the SIGKILL to the controller's write of the next generation
  (its ``generation`` event); the controller can only learn of the loss when the node's lease
  expires (``--lease-ttl``), which dominates it, so ``lease_expiry_to_plan_s`` (from the deletion
  of the node's record by the expiry, seen on a watch) is reported too. "Acted": every node of
  the new generation publishes ``running`` at it.
- ``kind: "simulated"``: N lightweight nodes (asyncio tasks on a few aetcd channels) that hold
  a lease, a node record and a watch on the generation key, and answer a generation as an agent
  does (ack, then ``running`` at it). The real :class:`~rlaunch.controller.controller.Controller`
  and planner decide, in a process of their own woken by the leader's watch, as in a leader agent
  (``--profile FILE`` writes its cProfile statistics). The fault is the revocation of one active
  node's lease, which is what its expiry does: ``fault_to_plan_s`` runs from the lease's end to
  the controller's write of the next generation. "Acted": every simulated node has seen it on its
  watch (all of them live in this one process, which bounds that figure).
- ``steady_etcd_requests_per_s``: every gRPC message etcd received per second over a quiet
  window (its own ``grpc_server_msg_received_total``); ``steady_keepalives_per_s``: the
  ``LeaseKeepAlive`` part of it. The target is that they are equal.
- ``torchrun_form_s``: N ``torchrun --rdzv-backend c10d`` agents on 127.0.0.1 with a trivial
  script, from start to every worker running (null where not run or not formed); see
  :func:`torchrun` for the ``keep_alive_max_attempt`` it is given.

Usage: ``python scripts/bench_control_plane.py [--real 16,64] [--simulated 1024] [--no-torchrun]``.
The machine's load changes the numbers: ``uptime`` is included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rlaunch.controller.controller import Controller  # noqa: E402
from rlaunch.controller.planner import PlannerConfig  # noqa: E402
from rlaunch.errors import StoreError  # noqa: E402
from rlaunch.events import EventLog  # noqa: E402
from rlaunch.store.client import Store, parse_endpoints  # noqa: E402
from rlaunch.store.embedded import EmbeddedEtcd, free_port  # noqa: E402
from rlaunch.store.keys import JobKeys  # noqa: E402
from rlaunch.store.records import Ack, Event, Generation, JobSpec, NodeRecord, NodeState, decode, encode  # noqa: E402
from rlaunch.waiting import wait_event  # noqa: E402
from scripts.ending import die_with_parent, end_on_sigterm  # noqa: E402

LEASE_TTL = 3
#: Simulated nodes' lease TTL: renewed every third of it, as agents do; long enough that a
#: thousand tasks on a loaded machine renew in time.
SIM_TTL = 30
QUIET_S = 6.0
WORKER = "import time\ntime.sleep(3600)\n"
TORCHRUN_WORKER = "import os, time\nprint('formed', os.environ.get('RANK'), time.time(), flush=True)\n"


# -- etcd's own counters ----------------------------------------------------------------------


def etcd_messages(endpoint: str) -> dict[str, float]:
    """gRPC messages etcd has received, by method (a unary call is one message)."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("grpc_server_msg_received_total{"):
            labels, value = line.rsplit(" ", 1)
            method = labels.split('grpc_method="', 1)[1].split('"', 1)[0]
            counts[method] = counts.get(method, 0.0) + float(value)
    return counts


def steady_rates(endpoint: str, seconds: float) -> tuple[float, float, dict[str, float]]:
    before = etcd_messages(endpoint)
    time.sleep(seconds)
    after = etcd_messages(endpoint)
    delta = {m: after[m] - before.get(m, 0.0) for m in after if after[m] - before.get(m, 0.0) > 0}
    return sum(delta.values()) / seconds, delta.get("LeaseKeepAlive", 0.0) / seconds, delta


async def read_nodes(store: Store, keys: JobKeys) -> dict[str, NodeRecord]:
    kvs, _ = await store.get_prefix(keys.nodes_prefix)
    return {keys.node_id_of(kv.key): decode(NodeRecord, kv.value, kv.key) for kv in kvs}


async def read_generation(store: Store, keys: JobKeys) -> Generation | None:
    kv = await store.get(keys.generation)
    return decode(Generation, kv.value, kv.key) if kv is not None else None


# -- simulated nodes --------------------------------------------------------------------------


class SimNode:
    """One simulated node: a lease kept alive, a node record, a watch on the generation key."""

    def __init__(self, node_id: str, store: Store, keys: JobKeys, standby: bool) -> None:
        self.node_id, self.store, self.keys, self.standby = node_id, store, keys, standby
        self.lease = 0
        self.seen: dict[int, float] = {}  # generation number -> when this node saw it
        self.acted: dict[int, float] = {}
        self.join_revision = 0

    def record(self, state: NodeState, generation: int) -> bytes:
        return encode(NodeRecord(
            node_id=self.node_id, host="sim", addr="127.0.0.1", pid=0, nproc=1, standby_only=False,
            state=state, generation=generation, restarts=0, master_port=29500, updated_at=time.time(),
            runtime=True,
        ))  # fmt: skip

    async def join(self) -> None:
        self.lease = await self.store.grant_lease(SIM_TTL)
        await self.store.put(self.keys.node(self.node_id), self.record(NodeState.WAITING, 0), lease=self.lease)

    async def keepalive(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), SIM_TTL / 3)
            except asyncio.TimeoutError:
                pass
            if not stop.is_set() and self.lease:
                try:
                    await self.store.refresh_lease(self.lease)
                except StoreError:  # a loaded machine: try again at the next renewal
                    continue

    async def follow(self, stop: asyncio.Event) -> None:
        """Act on each generation as an agent does: ack, then ``running`` (or ``standby``). A broken
        watch or a failed write (a loaded machine) is retried, as an agent retries."""
        while not stop.is_set():
            try:
                kv, revision = await self.store.get_at(self.keys.generation)
                if kv is not None:
                    await self._act(decode(Generation, kv.value, kv.key))
                async for ev in self.store.watch_prefix(self.keys.generation, start_revision=revision + 1, exact=True):
                    if stop.is_set():
                        return
                    if not ev.deleted:
                        await self._act(decode(Generation, ev.value, ev.key))
            except StoreError:
                await asyncio.sleep(0.5)

    async def _act(self, gen: Generation) -> None:
        self.seen.setdefault(gen.number, time.monotonic())
        if gen.number in self.acted:
            return
        for _ in range(5):
            if self.lease == 0:
                return  # the faulted node: its lease is gone
            try:
                if gen.node_rank(self.node_id) is None:
                    await self.store.put(self.keys.node(self.node_id), self.record(NodeState.STANDBY, gen.number),
                                         lease=self.lease)  # fmt: skip
                else:
                    ack = encode(Ack(node_id=self.node_id, generation=gen.number))
                    await self.store.put(self.keys.ack(gen.number, self.node_id), ack, lease=self.lease)
                    await self.store.put(self.keys.node(self.node_id), self.record(NodeState.RUNNING, gen.number),
                                         lease=self.lease)  # fmt: skip
            except StoreError:
                await asyncio.sleep(0.5)
                continue
            self.acted.setdefault(gen.number, time.monotonic())
            return


def leader_ranges(keys: JobKeys) -> tuple[tuple[str, bool], ...]:
    """The keys a leading agent watches (rlaunch.agent.agent's ``_watch_ranges`` while leading)."""
    return (
        (keys.generation, True), (keys.leader, True), (keys.all_acks_prefix, False), (keys.nodes_prefix, False),
        (keys.drains_prefix, False), (keys.drained_prefix, False),
    )  # fmt: skip


async def controller_process(endpoint: str, job_id: str, profile: str) -> None:
    """The controller as a leader agent runs it, in a process of its own: a lease kept alive, the
    leader's watch waking the real :class:`Controller`, until SIGTERM. Prints ``leading`` once elected.
    With ``profile`` set, cProfile statistics of the whole run are written there."""
    keys = JobKeys(job_id)
    store = Store(parse_endpoints(endpoint), timeout=30)
    kv = await store.get(keys.spec)
    assert kv is not None, "the benchmark writes the spec before it starts the controller"
    spec = decode(JobSpec, kv.value, keys.spec)
    stop, wake = asyncio.Event(), asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    lease = await store.grant_lease(SIM_TTL)
    events = EventLog(store, keys, "ctl", None, time.time)
    events.start()
    ctl = Controller(store, keys, spec, PlannerConfig("ctl", 120.0, 29500, 30.0), lease, events)

    async def watch() -> None:  # as the agent's watch: restarted from the latest revision when it breaks
        while not stop.is_set():
            try:
                _, revision = await store.get_at(keys.generation)
                wake.set()
                async for _ in store.watch_many(leader_ranges(keys), start_revision=revision + 1):
                    wake.set()
            except StoreError:
                await asyncio.sleep(0.5)

    async def keepalive() -> None:
        while not await wait_event(stop, SIM_TTL / 3):
            with contextlib.suppress(StoreError):
                await store.refresh_lease(lease)

    async def announce() -> None:
        while not ctl.leading:
            await asyncio.sleep(0.05)
        print("leading", flush=True)

    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    tasks = [asyncio.create_task(t) for t in (watch(), keepalive(), ctl.run(stop, wake), announce())]
    await stop.wait()
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    for t in tasks:
        t.cancel()
    await asyncio.wait(tasks, timeout=5)
    await events.close()
    store.timeout = 1.0
    await store.close()


async def plan_time(store: Store, keys: JobKeys, number: int, deadline_s: float) -> float | None:
    """Wall time at which the controller wrote generation ``number`` (its ``generation`` event)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        kvs, _ = await store.get_prefix(keys.events_prefix)
        for kv in kvs:
            event = decode(Event, kv.value, kv.key)
            if event.kind == "generation" and event.generation == number:
                return event.time
        await asyncio.sleep(0.2)
    return None


def start_controller(endpoint: str, job_id: str, profile: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, __file__, "--controller-of", job_id, "--endpoint", endpoint, "--profile", profile]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until elected (or the process died)
    if not line.startswith(b"leading"):
        proc.kill()
        raise RuntimeError(f"The controller process did not take the lead (exit code {proc.wait()}).")
    return proc


async def simulated(endpoint: str, n: int, profile: str) -> dict[str, Any]:
    keys = JobKeys(f"bench-sim-{uuid.uuid4().hex[:6]}")
    eps = parse_endpoints(endpoint)
    channels = [Store(eps, timeout=30) for _ in range(max(1, n // 32))]
    main = Store(eps, timeout=30)
    spec = JobSpec(job_id=keys.job_id, nnodes=n - 1, nproc_per_node=1, max_restarts=3, entrypoint="sim",
                   args=[], fingerprint="sim", rlaunch_version="bench")  # fmt: skip
    await main.put(keys.spec, encode(spec))
    stop = asyncio.Event()
    ctl = await asyncio.to_thread(start_controller, endpoint, keys.job_id, profile)
    nodes = [SimNode(f"s{i:05d}", channels[i % len(channels)], keys, standby=i == n - 1) for i in range(n)]
    tasks: list[asyncio.Task[Any]] = []
    try:
        began = time.monotonic()
        for batch in range(0, n, 64):  # join in join order; the last ones left out are standbys
            joining = nodes[batch : batch + 64]
            await asyncio.gather(*(node.join() for node in joining))
            for node in joining:  # each renews its lease and follows the generation from now on
                tasks += [asyncio.create_task(node.keepalive(stop)), asyncio.create_task(node.follow(stop))]
        while not all(1 in node.acted for node in nodes):
            if time.monotonic() - began > 600:
                raise RuntimeError(f"{sum(1 in x.acted for x in nodes)} of {n} simulated nodes formed in 600 s.")
            await asyncio.sleep(0.05)
        form_s = max(node.acted[1] for node in nodes) - began
        await asyncio.sleep(3.0)  # let the controller's reaction to the last records settle
        # two renewal periods: the nodes joined within seconds, so their keepalives come in waves
        rate, keepalives, methods = await asyncio.to_thread(steady_rates, endpoint, 2 * SIM_TTL / 3)
        victim = nodes[n // 2]
        lease, victim.lease = victim.lease, 0
        fault_at, fault_wall = time.monotonic(), time.time()
        await victim.store.revoke_lease(lease)  # what the lease's expiry does
        survivors = [node for node in nodes if node is not victim]
        deadline = time.monotonic() + 120
        while not all(2 in node.seen for node in survivors) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        seen = [node.seen[2] for node in survivors if 2 in node.seen]
        planned = await plan_time(main, keys, 2, 30)
        gen = await read_generation(main, keys)
    finally:
        ctl.send_signal(signal.SIGTERM)
        await asyncio.to_thread(ctl.wait, 30)
    result = {
        "n": n, "kind": "simulated", "form_s": round(form_s, 3),
        "fault_to_plan_s": round(planned - fault_wall, 3) if planned else None,
        "fault_to_all_acted_s": round(max(seen) - fault_at, 3) if len(seen) == len(survivors) else None,
        "steady_etcd_requests_per_s": round(rate, 2), "steady_keepalives_per_s": round(keepalives, 2),
        "torchrun_form_s": None, "plan": gen.kind if gen else None, "lease_ttl_s": SIM_TTL,
        "fault_to_first_node_saw_plan_s": round(min(seen) - fault_at, 3) if seen else None,
        "steady_methods": methods,
    }  # fmt: skip
    print(json.dumps(result), file=sys.stderr, flush=True)
    stop.set()
    for t in tasks:
        t.cancel()
    await asyncio.wait(tasks, timeout=10)
    await main.delete_prefix(keys.prefix)
    for store in (main, *channels):
        store.timeout = 1.0  # closing a channel that had watches on it may not finish: do not wait long
    await asyncio.gather(*(store.close() for store in (main, *channels)), return_exceptions=True)
    return result


# -- real agents ------------------------------------------------------------------------------


def _kill_tree(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for pid in family:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def real(endpoint: str, n: int, tmp: Path) -> dict[str, Any]:
    keys = JobKeys(f"bench-real-{uuid.uuid4().hex[:6]}")
    script = tmp / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def agent(node_id: str) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable, "-m", "rlaunch", "--nnodes", str(n - 1), "--nproc-per-node", "1",
            "--rdzv-endpoint", endpoint, "--rdzv-id", keys.job_id, "--node-id", node_id,
            "--lease-ttl", str(LEASE_TTL), "--rdzv-timeout", "600", str(script),
        ]  # fmt: skip
        log = (tmp / f"{keys.job_id}-{node_id}.log").open("wb")
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=die_with_parent)  # fmt: skip

    try:
        return asyncio.run(_real(endpoint, n, keys, agent, procs))
    finally:
        for p in procs.values():
            _kill_tree(p, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                _kill_tree(p, signal.SIGKILL)
                p.wait(10)
        asyncio.run(_cleanup(Store(parse_endpoints(endpoint), timeout=30), keys))


async def _real(
    endpoint: str, n: int, keys: JobKeys, agent: Any, procs: dict[str, subprocess.Popen[bytes]]
) -> dict[str, Any]:
    store = Store(parse_endpoints(endpoint), timeout=30)

    async def wait_nodes(pred: Any, timeout: float) -> dict[str, NodeRecord]:
        end = time.monotonic() + timeout
        while True:
            recs = await read_nodes(store, keys)
            if pred(recs) or time.monotonic() > end:
                return recs
            await asyncio.sleep(0.05)

    def running(r: dict[str, NodeRecord], g: int) -> int:
        return sum(x.state is NodeState.RUNNING and x.generation == g for x in r.values())

    try:
        began = time.monotonic()
        for i in range(n):  # the first n-1 to register are active; the last is the standby
            node_id = f"r{i:03d}"
            procs[node_id] = agent(node_id)
            await wait_nodes(lambda r, nid=node_id: nid in r, 120)
        recs = await wait_nodes(lambda r: running(r, 1) >= n - 1, 600)
        if running(recs, 1) < n - 1:
            raise RuntimeError(f"{running(recs, 1)} of {n - 1} real agents ran generation 1 within 600 s.")
        form_s = time.monotonic() - began
        await asyncio.sleep(3.0)
        rate, keepalives, methods = await asyncio.to_thread(steady_rates, endpoint, QUIET_S)
        victim = "r001"
        _, revision = await store.get_at(keys.node(victim))
        expired = asyncio.create_task(_deleted_at(store, keys.node(victim), revision + 1))
        fault_at, fault_wall = time.monotonic(), time.time()
        _kill_tree(procs[victim], signal.SIGKILL)
        expired_wall = await asyncio.wait_for(expired, 120)
        planned = await plan_time(store, keys, 2, 120)
        recs = await wait_nodes(lambda r: running(r, 2) >= n - 1, 300)
        acted_at = time.monotonic() if running(recs, 2) >= n - 1 else None
        gen = await read_generation(store, keys)
        return {
            "n": n, "kind": "real", "form_s": round(form_s, 3),
            "fault_to_plan_s": round(planned - fault_wall, 3) if planned else None,
            "fault_to_all_acted_s": round(acted_at - fault_at, 3) if acted_at else None,
            "steady_etcd_requests_per_s": round(rate, 2), "steady_keepalives_per_s": round(keepalives, 2),
            "torchrun_form_s": None, "plan": gen.kind if gen else None, "lease_ttl_s": LEASE_TTL,
            "lease_expiry_to_plan_s": round(planned - expired_wall, 3) if planned else None,
            "steady_methods": methods,
        }  # fmt: skip
    finally:
        store.timeout = 1.0
        await store.close()


async def _deleted_at(store: Store, key: str, revision: int) -> float:
    """Wall time at which ``key`` was deleted (a node record goes with its lease's expiry)."""
    async for ev in store.watch_prefix(key, start_revision=revision, exact=True):
        if ev.deleted:
            return time.time()
    raise RuntimeError(f"The watch on {key} ended before the key was deleted.")


async def _cleanup(store: Store, keys: JobKeys) -> None:
    await store.delete_prefix(keys.prefix)
    await store.close()


def torchrun(n: int, tmp: Path, keep_alive_max_attempt: int, timeout_s: float = 600) -> float | None:
    """Seconds from starting N torchrun c10d agents to every worker running (None: it failed; the
    agents' logs are under ``tmp``).

    ``keep_alive_max_attempt`` goes to ``--rdzv-conf`` (torch's default is 3: a node whose keep-alive
    is 15 s old is dropped from the rendezvous). With 16 agents on one small, loaded machine the
    defaults did not form in 10 minutes: each step of torch's dynamic rendezvous records an event
    whose name comes from two ``inspect.stack()`` calls (13 of 16 agents were sampled there), so an
    agent's state-sync loop takes seconds, and every keep-alive must win a compare-and-set against
    the other agents. With that call stubbed out, or with ``keep_alive_max_attempt=60``, they formed
    in about two minutes (mostly importing torch). On a real cluster each agent has its own CPUs.
    """
    script = tmp / "torchrun_worker.py"
    script.write_text(TORCHRUN_WORKER)
    port = free_port()
    began = time.time()
    conf = f"keep_alive_max_attempt={keep_alive_max_attempt}"
    procs, outs = [], []
    for i in range(n):
        out = tmp / f"torchrun-{n}-{i}.out"
        outs.append(out)
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
            "--rdzv-conf", f"is_host={int(i == 0)},{conf}", "--monitor-interval", "0.1", str(script),
        ]  # fmt: skip
        env = {**os.environ, "LOGLEVEL": "INFO"}  # the logs say how far each agent got
        with out.open("wb") as stdout, (tmp / f"torchrun-{n}-{i}.err").open("wb") as stderr:
            procs.append(subprocess.Popen(argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, env=env))
    try:
        end = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p, signal.SIGKILL)
                p.wait(10)
    formed = [
        float(line.split()[2]) for out in outs for line in out.read_text().splitlines() if line.startswith("formed")
    ]
    if len(formed) < n:
        print(f"torchrun: {len(formed)} of {n} workers started within {timeout_s:.0f} s; logs in {tmp}",
              file=sys.stderr, flush=True)  # fmt: skip
        return None
    return round(max(formed) - began, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", default="16", help="comma-separated N of real agent processes ('' for none)")
    parser.add_argument("--simulated", default="1024", help="comma-separated N of simulated nodes ('' for none)")
    parser.add_argument("--no-torchrun", action="store_true")
    parser.add_argument(
        "--torchrun-keep-alive-max-attempt", type=int, default=60,
        help="torchrun's --rdzv-conf keep_alive_max_attempt (torch's default 3 never forms 16 agents on a loaded "
        "2-core machine; see torchrun())",
    )  # fmt: skip
    parser.add_argument("--torchrun-max-n", type=int, default=64, help="run torchrun only up to this N")
    parser.add_argument("--torchrun-timeout", type=float, default=600, help="seconds torchrun's agents get to form")
    parser.add_argument("--profile", default="", help="write the simulated runs' controller cProfile stats here")
    parser.add_argument("--controller-of", default="", help=argparse.SUPPRESS)  # the controller process
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    end_on_sigterm()
    if args.controller_of:
        asyncio.run(controller_process(args.endpoint, args.controller_of, args.profile))
        return
    sizes: list[dict[str, Any]] = []
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="rlaunch-bench-"))  # kept: the agents' and torchrun's logs
    with EmbeddedEtcd() as etcd:
        for n in [int(x) for x in args.simulated.split(",") if x]:
            sizes.append(asyncio.run(simulated(etcd.endpoint, n, args.profile)))
            print(json.dumps(sizes[-1]), file=sys.stderr, flush=True)
        for n in [int(x) for x in args.real.split(",") if x]:
            try:
                entry = real(etcd.endpoint, n, tmp)
            except RuntimeError as exc:  # say what happened, and go on with the other sizes
                entry = {"n": n, "kind": "real", "form_s": None, "fault_to_plan_s": None,
                         "fault_to_all_acted_s": None, "steady_etcd_requests_per_s": None,
                         "steady_keepalives_per_s": None, "torchrun_form_s": None, "error": str(exc)}  # fmt: skip
            if not args.no_torchrun and n <= args.torchrun_max_n:
                entry["torchrun_form_s"] = torchrun(n, tmp, args.torchrun_keep_alive_max_attempt, args.torchrun_timeout)
                entry["torchrun_keep_alive_max_attempt"] = args.torchrun_keep_alive_max_attempt
            sizes.append(entry)
            print(json.dumps(sizes[-1]), file=sys.stderr, flush=True)
    after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"sizes": sizes, "uptime_before": uptime, "uptime_after": after, "logs": str(tmp)}))


if __name__ == "__main__":
    main()
