"""Control-plane benchmark: job formation, fault → committed plan → every node acting, etcd traffic.

Prints one JSON object, ``{"sizes": [...], "uptime_before": ..., "uptime_after": ..., "logs": DIR}``,
one entry per N. Each fault is repeated ``--repeats`` times (default 5; after each, a fresh node
joins as the next standby), and each figure of a fault is ``{"median", "min", "max", "runs"}``.

- ``kind: "real"``: N real ``rlaunch`` agent processes (N-1 active, 1 standby) with a trivial
  worker, on an embedded etcd. The fault is a SIGKILL of one active node (agent and worker).
  ``fault_to_plan_s`` runs from the SIGKILL to the controller's write of the next generation
  (its ``generation`` event); the controller can only learn of the loss when the node's lease
  expires (``--lease-ttl``), which dominates it, so ``lease_expiry_to_plan_s`` (from the deletion
  of the node's record by the expiry, seen on a watch) is reported too. "Acted": every node of
  the new generation publishes ``running`` at it (the worker does not use the runtime: a restart).
- ``kind: "simulated"``: N simulated nodes, dealt over ``--node-procs`` host processes (default 1;
  see scripts/simhosts.py; ``node_procs``), each with its own etcd channels (see scripts/simnodes.py:
  each node runs the agent's own generation watch and state machine, and carries the actions out
  as an agent does, with no processes of its own), and the real :class:`~rlaunch.controller.controller.Controller` and
  planner deciding in a process of their own woken by the leader's watch, which also keeps the
  node records they plan from (rlaunch.controller.feed), as in a leader agent (``--profile FILE``
  writes its cProfile statistics over the fault windows of the runs that do not hold the writes,
  ``--profile-nodes FILE`` each host's over every fault window, to ``FILE.<N>.<host>``). The fault is the revocation
  of one active node's lease, which is what its expiry does, and the plan a live replacement by the
  standby. From the lease's end:
  ``fault_to_plan_s`` to the plan (the generation's ``created_at``: when the planner decided), and
  with ``--survivor-reports`` ``fault_to_lost_found_s`` to the controller's ``node_dead`` event (its
  probe round found the node's port closed and revoked its lease);
  ``fault_to_first_node_saw_plan_s`` and ``fault_to_all_saw_plan_s`` until the first and the last
  node's watch took it (rank map rebuilt); ``fault_to_all_acted_s`` until every node handed it to
  its workers (the agent's ``Offer``: what moves the training); ``fault_to_all_published_s`` until
  every node's record at it was in etcd; ``fault_to_all_running_s`` until every record said
  ``running`` (the job is settled: the next move may be planned). ``fault_window_cpu_s``: the CPU
  seconds etcd, the controller and the simulated nodes used from the fault to all running.
  ``fault_etcd_requests``: the gRPC messages etcd received, by method, from the fault until a
  second after all running (every node's and the controller's, lease keepalives included), and
  ``fault_etcd_requests_per_node`` their sum over N-1. The
  nodes share their host processes (and the machine's cores with etcd and the controller), which
  bounds these figures: ``nodes_cpu_ms_per_node`` is what one node's part costs them (the
  ``nodes`` CPU seconds are the hosts' sum).
  Python's garbage collector is paused over each fault's window, as an agent's does not run
  during a move (see ``scripts.simnodes.pause_collector``: in one heap of many nodes it did).
  ``writes_deferred`` repeats the faults with the nodes' writes held from the fault until every
  node acted (their reads and watches pass), so that no node's writes delay another's receipt of
  the plan in a shared process, as they do not when each agent has a machine of its own (they are
  let go once every host said all its nodes acted: a few milliseconds after the last did).
  ``target_all_acted_s`` is the issue's target (1 s up to 1,024 nodes, 2 s up to 4,096).
- ``floor`` (simulated sizes): what fault → every node acted is when each agent has a machine of
  its own, measured in parts before the simulated job forms (see scripts/fanout.py):
  ``fanout``, a write of a generation head's size timed to the first and the last of N-1 bare
  watchers spread over ``--floor-procs`` processes (``write_to_first_s``, ``write_to_last_s``);
  ``one_node``, one simulated node alone in a job of N, a survivor of live replacements that the
  benchmark writes itself, from the write (``write_to_acted_s``) and from its watch taking the plan
  (``saw_to_acted_s``) to its handing the plan to its workers. ``all_acted_s`` is the sum of the
  ``parts``: the simulated ``fault_to_plan_s`` median, the fan-out's ``write_to_last_s`` median and
  the one node's ``write_to_acted_s`` median (which counts one watcher's delivery a second time);
  ``target_met`` compares it with the target. The watchers share this machine's cores with etcd,
  so the fan-out, and the floor, are bounds from above.
- ``simulation_floor`` (simulated sizes, with ``--node-procs 1`` only; null otherwise): what N-1
  simulated nodes in one process cost with no rlaunch code on the nodes' side (scripts/fanout.py's
  ``one_process``): N-1 bare watchers in the benchmark's process, on as many connections as the
  nodes' host uses, take a write of the key they watch and
  either only note it (``receipt``) or then make the one etcd request a simulated node makes at a
  live replacement (``writes``: its record with its two events). ``all_acted_s`` is the median write
  to last receipt with the writes, the simulation's floor of ``fault_to_all_acted_s`` less the
  plan; ``all_acted_s_writes_deferred`` the same with no writes, the floor of ``writes_deferred``;
  ``target_met`` and ``target_met_writes_deferred`` compare them with the target (medians over the
  rounds that completed; one that did not within its time is null in ``runs``). Where a floor is
  above the target, no agent code meets that target in this simulation on this machine.
- ``steady_etcd_requests_per_s``: every gRPC message etcd received per second over a quiet
  window (its own ``grpc_server_msg_received_total``); ``steady_keepalives_per_s``: the
  ``LeaseKeepAlive`` part of it. The target is that they are equal. A node renews its lease every
  third of its TTL (``lease_ttl_s``), so N nodes send N / (TTL / 3) keepalives per second.
  ``steady_cpu_per_s``: CPU seconds per second over the same window of etcd, the controller and the
  simulated nodes' host processes (their sum; their lease renewals, mostly).
- ``survivors_report`` (``--survivor-reports``): at each fault whose writes are not held, every
  simulated survivor's workers see the loss, as a real job's survivors do, and each node's record
  says it (with their ``recovering`` event: one more request) when an agent's would: after a random
  wait, unless the controller's probe round reached it first (see rlaunch.agent.loss). The lost
  node's lease then ends when the controller's round, on the first report, finds its probe port
  closed, as a real agent's would be. The survivors' waits run from the fault, although their hosts
  hear of it a moment later (``survivors_told_s`` in each run: the fault to the last host's answer).
  Off, they do not, and its lease is revoked at the fault (what its expiry does).
- ``torchrun_form_s``: N ``torchrun --rdzv-backend c10d`` agents on 127.0.0.1 with a trivial
  script, from start to every worker running (null where not run or not formed); see
  :func:`torchrun` for the ``keep_alive_max_attempt`` it is given.

Usage: ``python scripts/bench_control_plane.py [--real 16,64] [--simulated 1024] [--repeats 5] [--no-torchrun]
[--floor-procs 4] [--node-procs 2] [--survivor-reports]``.
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
import statistics
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
from rlaunch.controller.feed import NodeFeed  # noqa: E402
from rlaunch.controller.planner import PlannerConfig  # noqa: E402
from rlaunch.errors import StoreError  # noqa: E402
from rlaunch.events import EventLog  # noqa: E402
from rlaunch.store import generations  # noqa: E402
from rlaunch.store.client import Store, parse_endpoints  # noqa: E402
from rlaunch.store.embedded import EmbeddedEtcd, free_port  # noqa: E402
from rlaunch.store.keys import JobKeys  # noqa: E402
from rlaunch.store.records import Event, Generation, JobSpec, NodeRecord, NodeState, decode, encode  # noqa: E402
from rlaunch.waiting import wait_event  # noqa: E402
from scripts.ending import die_with_parent, end_on_sigterm  # noqa: E402
from scripts.fanout import fanout, one_node, one_process, watchers_main  # noqa: E402
from scripts.simhosts import Host, host_main  # noqa: E402
from scripts.simnodes import SIM_TTL  # noqa: E402

LEASE_TTL = 3
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
    return (await generations.read(store, keys))[1]


def summary(runs: list[float | None], digits: int = 3) -> dict[str, Any]:
    """``median``, ``min``, ``max`` and the ``runs`` of one figure over an event's repeats (None: not reached)."""
    done = [r for r in runs if r is not None]
    if not done:
        return {"median": None, "min": None, "max": None, "runs": runs}
    return {"median": round(statistics.median(done), digits), "min": round(min(done), digits),
            "max": round(max(done), digits), "runs": runs}  # fmt: skip


def cpu_seconds(pids: dict[str, int | list[int]]) -> dict[str, float]:
    """CPU seconds used so far, by name: of one process, or the sum of a list of processes."""
    out = {}
    for name, some in pids.items():
        out[name] = 0.0
        for pid in some if isinstance(some, list) else [some]:
            try:
                times = psutil.Process(pid).cpu_times()
                out[name] += times.user + times.system
            except psutil.NoSuchProcess:
                pass
    return out


# -- the controller, as a leader agent runs it ------------------------------------------------


def leader_ranges(keys: JobKeys) -> tuple[tuple[str, bool], ...]:
    """The keys a leading agent watches (rlaunch.agent.generations' ``ranges`` while leading)."""
    return (
        (keys.generation, True), (keys.leader, True), (keys.nodes_prefix, False), (keys.all_acks_prefix, False),
        (keys.drains_prefix, False), (keys.drained_prefix, False),
    )  # fmt: skip


async def controller_process(endpoint: str, job_id: str, profile: str) -> None:
    """The controller as a leader agent runs it, in a process of its own: a lease kept alive, the
    leader's watch waking the real :class:`Controller`, until SIGTERM. Prints ``leading`` once elected.
    With ``profile`` set, cProfile statistics are written there, of the windows between a SIGUSR1 and the
    next SIGUSR2 (the benchmark's fault windows)."""
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
    feed = NodeFeed()
    ctl = Controller(store, keys, spec, PlannerConfig("ctl", 120.0, 29500, 30.0), lease, events, feed=feed)

    async def watch() -> None:  # as the agent's watch: restarted from the latest revision when it breaks
        while not stop.is_set():
            try:
                _, revision = await store.get_at(keys.generation)
                feed.watching()
                try:
                    wake.set()
                    async for ev in store.watch_many(leader_ranges(keys), start_revision=revision + 1):
                        if ev.key.startswith(keys.nodes_prefix):
                            feed.saw(ev)
                        wake.set()
                finally:
                    feed.blind()  # however the watch ended
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
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, prof.enable)
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, prof.disable)
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


async def found_time(store: Store, keys: JobKeys, since: float, number: int) -> float | None:
    """Wall time at which the controller found a node of generation ``number`` lost (its ``node_dead``
    event, written when it revoked the lease), among the events since wall time ``since``."""
    for kv in await store.get_after(keys.event(int(since * 1e9), ""), keys.events_prefix):
        event = decode(Event, kv.value, kv.key)
        if event.kind == "node_dead" and event.generation == number:
            return event.time
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


# -- simulated nodes --------------------------------------------------------------------------


async def simulated(
    endpoint: str,
    n: int,
    repeats: int,
    etcd_pid: int,
    profile: str,
    node_profile: str,
    per_connection: int = 32,
    floor_procs: int = 4,
    reports: bool = False,
    node_procs: int = 1,
) -> dict[str, Any]:
    """N simulated nodes (N-1 active, 1 standby), dealt over ``node_procs`` host processes (see
    scripts/simhosts.py), form a job; then ``repeats`` times, an active node is lost, its ranks are
    replaced live, and a fresh node joins as the next standby (``reports``: in the runs that do not
    hold the writes, every survivor's workers see the loss and their node says it as an agent's
    would, and the controller's probe round finds the lost node, rather than its lease being revoked
    at the fault). First, the parts of the floor (see scripts/fanout.py), before anything else of this
    size runs."""
    spread = await fanout(endpoint, n - 1, floor_procs, repeats, per_connection)
    alone = await one_node(endpoint, n, repeats)
    shared = await one_process(endpoint, n - 1, repeats, per_connection) if node_procs == 1 else None
    keys = JobKeys(f"bench-sim-{uuid.uuid4().hex[:6]}")
    main = Store(parse_endpoints(endpoint), timeout=30)
    spec = JobSpec(job_id=keys.job_id, nnodes=n - 1, nproc_per_node=1, max_restarts=3, entrypoint="sim",
                   args=[], fingerprint="sim", rlaunch_version="bench")  # fmt: skip
    await main.put(keys.spec, encode(spec))
    ctl = await asyncio.to_thread(start_controller, endpoint, keys.job_id, profile)
    hosts: list[Host] = []
    pids: dict[str, int | list[int]] = {"etcd": etcd_pid, "controller": ctl.pid, "nodes": []}
    ids = [f"s{i:05d}" for i in range(n)]
    owner: dict[str, Host] = {}
    runs: dict[str, list[dict[str, Any]]] = {"inline": [], "deferred": []}
    live = list(ids)

    async def each(op: str, **args: Any) -> list[dict[str, Any]]:
        """Every host's answer to one request; each host answers before the first error is raised."""
        answers = await asyncio.gather(*(host.call(op, **args) for host in hosts), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return answers  # type: ignore[return-value]

    def latest(answers: list[dict[str, Any]]) -> float:
        return max(a["latest"] for a in answers if a["latest"] is not None)

    async def fault(r: int, deferred: bool) -> dict[str, Any]:
        """Lose an active node; its ranks are replaced live; a fresh node joins as the next standby."""
        gen = await read_generation(main, keys)
        assert gen is not None
        number = gen.number + 1
        victim = next(x for x in live[n // 2 + r :] if x in gen.assignment)
        messages = await asyncio.to_thread(etcd_messages, endpoint)
        await each("collector", paused=True)  # as an agent's does not run during a move (see pause_collector)
        cpu = cpu_seconds(pids)
        await each("profile", on=True)
        if profile and not deferred:
            ctl.send_signal(signal.SIGUSR1)  # its profile covers this window
        lease = (await owner[victim].call("fail", id=victim))["lease"]
        if deferred:
            await each("writes", open=False)
        fault_at, fault_wall = time.monotonic(), time.time()
        # Their collectives fail with the node, and the controller's probe round on their first report
        # finds its port closed and ends its lease. (Not in the runs that hold the nodes' writes until all
        # acted: a report made before the plan cannot wait for that.) Otherwise its lease ends at once.
        live.remove(victim)
        if reports and not deferred:
            seeing = [x for x in live if x in gen.assignment]
            told = await asyncio.gather(*(
                host.call("lose_peer", gen=gen.number, nodes=len(gen.assignment),
                          ids=[x for x in seeing if owner[x] is host], wall=fault_wall, mono=fault_at)
                for host in hosts
            ))  # fmt: skip
            # (their reports are due from the fault's moment on, whenever their host heard of it)
            run_told = max(t["at"] for t in told) - fault_at
        else:
            await main.revoke_lease(lease)  # what the lease's expiry does
        run: dict[str, Any] = {"survivors_told_s": run_told} if reports and not deferred else {}
        try:
            run["acted_s"] = latest(await each("until", what="acted", gen=number, timeout=120)) - fault_at
            await each("writes", open=True)
            run["running_s"] = latest(await each("until", what="ran", gen=number, timeout=120)) - fault_at
        except RuntimeError as exc:
            run["error"] = str(exc)
        await each("writes", open=True)
        await each("profile", on=False)
        if profile and not deferred:
            ctl.send_signal(signal.SIGUSR2)
        used = cpu_seconds(pids)
        await each("collector", paused=False)
        run["cpu_s"] = {k: round(used[k] - cpu[k], 2) for k in pids}
        times = await each("times", gen=number)
        seen = [t - fault_at for host in times for t in host["seen"]]
        published = [t - fault_at for host in times for t in host["published"]]
        count = sum(host["live"] for host in times)
        run["first_saw_s"] = min(seen) if seen else None
        run["all_saw_s"] = max(seen) if len(seen) == count else None
        run["published_s"] = max(published) if len(published) == count else None
        planned = await read_generation(main, keys)
        run["plan"] = planned.kind if planned is not None and planned.number == number else None
        run["plan_s"] = planned.created_at - fault_wall if run["plan"] else None
        await asyncio.sleep(1.0)  # the events written in the background after the records
        if reports and not deferred:
            found = await found_time(main, keys, fault_wall, gen.number)
            run["found_s"] = found - fault_wall if found is not None else None
        after = await asyncio.to_thread(etcd_messages, endpoint)
        run["etcd_requests"] = {m: after[m] - messages.get(m, 0.0) for m in after if after[m] > messages.get(m, 0.0)}
        print(json.dumps({"n": n, "repeat": r, "deferred": deferred, **run}), file=sys.stderr, flush=True)
        # a new machine in place of the lost one: a fresh node joins as the next standby
        fresh = f"r{r:03d}"
        owner[fresh] = hosts[r % node_procs]
        await owner[fresh].call("fresh", id=fresh)
        live.append(fresh)
        await asyncio.sleep(1.0)
        return run

    try:
        for h in range(node_procs):
            profile_file = f"{node_profile}.{n}" if node_profile else ""
            hosts.append(await Host.start(endpoint, keys.job_id, h, len(range(h, n, node_procs)), per_connection,
                                          profile_file))  # fmt: skip
            pids["nodes"].append(hosts[-1].pid)  # type: ignore[union-attr]
        owner.update({node_id: hosts[i % node_procs] for i, node_id in enumerate(ids)})
        began = time.monotonic()
        for batch in range(0, n, 64):  # join in join order; the last one is the standby
            joining = ids[batch : batch + 64]
            await asyncio.gather(*(host.call("join", ids=[x for x in joining if owner[x] is host]) for host in hosts))
        # (the nodes of a batch join concurrently: which one is left as the standby is etcd's order)
        end = time.monotonic() + 900
        while True:
            formed = await each("formed")
            if sum(f["acted"] for f in formed) == n - 1 and any(f["standby"] for f in formed):
                break
            if time.monotonic() > end:
                raise RuntimeError(f"the formation of {n} simulated nodes did not happen within 900 s.")
            await asyncio.sleep(0.1)
        form_s = latest(formed) - began
        await asyncio.sleep(3.0)  # let the controller's reaction to the last records settle
        # two renewal periods: the nodes joined within seconds, so their keepalives come in waves
        quiet_s, quiet = 2 * SIM_TTL / 3, cpu_seconds(pids)
        rate, keepalives, methods = await asyncio.to_thread(steady_rates, endpoint, quiet_s)
        steady_cpu = {k: round((v - quiet[k]) / quiet_s, 3) for k, v in cpu_seconds(pids).items()}
        for r in range(2 * repeats):
            deferred = r >= repeats
            runs["deferred" if deferred else "inline"].append(await fault(r, deferred))
    finally:
        ctl.send_signal(signal.SIGTERM)
        await asyncio.to_thread(ctl.wait, 30)
        await asyncio.gather(*(host.close() for host in hosts), return_exceptions=True)

    def figures(done: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "fault_to_plan_s": summary([run["plan_s"] for run in done]),
            **(
                {"fault_to_lost_found_s": summary([run.get("found_s") for run in done])}
                if any("found_s" in run for run in done)
                else {}
            ),
            "fault_to_first_node_saw_plan_s": summary([run["first_saw_s"] for run in done]),
            "fault_to_all_saw_plan_s": summary([run["all_saw_s"] for run in done]),
            "fault_to_all_acted_s": summary([run.get("acted_s") for run in done]),
            "fault_to_all_published_s": summary([run["published_s"] for run in done]),
            "fault_to_all_running_s": summary([run.get("running_s") for run in done]),
            "fault_window_cpu_s": {k: summary([run["cpu_s"][k] for run in done]) for k in pids},
            "fault_etcd_requests_per_node": summary([sum(run["etcd_requests"].values()) / (n - 1) for run in done], 2),
            "fault_etcd_requests": [run["etcd_requests"] for run in done],
            "plans": [run["plan"] for run in done],
            "errors": [run["error"] for run in done if "error" in run],
        }

    target = 1.0 if n <= 1024 else 2.0
    inline, deferred_runs = figures(runs["inline"]), figures(runs["deferred"])
    parts = {
        "fault_to_plan_s": inline["fault_to_plan_s"]["median"],
        "fanout_write_to_last_s": summary(spread["write_to_last_s"])["median"],
        "one_node_write_to_acted_s": summary(alone["write_to_acted_s"], 5)["median"],
    }
    floor = None if None in parts.values() else round(sum(parts.values()), 3)
    met = [f["fault_to_all_acted_s"]["median"] for f in (inline, deferred_runs)]
    shared_floor = [summary(shared[mode]["write_to_last_s"])["median"] if shared else None
                    for mode in ("writes", "receipt")]  # fmt: skip
    result = {
        "n": n, "kind": "simulated", "repeats": repeats, "form_s": round(form_s, 3), **inline,
        "writes_deferred": deferred_runs, "target_all_acted_s": target,
        "target_met": met[0] is not None and met[0] <= target,
        "target_met_writes_deferred": met[1] is not None and met[1] <= target,
        "nodes_cpu_ms_per_node": {
            mode: round(1000 * f["fault_window_cpu_s"]["nodes"]["median"] / (n - 1), 3)
            for mode, f in (("inline", inline), ("writes_deferred", deferred_runs))
            if f["fault_window_cpu_s"]["nodes"]["median"] is not None
        },
        "floor": {
            "all_acted_s": floor, "target_met": floor is not None and floor <= target, "parts": parts,
            "fanout": {**spread, "write_to_first_s": summary(spread["write_to_first_s"]),
                       "write_to_last_s": summary(spread["write_to_last_s"])},
            "one_node": {**alone, "write_to_acted_s": summary(alone["write_to_acted_s"], 5),
                         "saw_to_acted_s": summary(alone["saw_to_acted_s"], 5)},
        },
        "node_procs": node_procs,
        "simulation_floor": {
            "all_acted_s": shared_floor[0], "target_met": shared_floor[0] is not None and shared_floor[0] <= target,
            "all_acted_s_writes_deferred": shared_floor[1],
            "target_met_writes_deferred": shared_floor[1] is not None and shared_floor[1] <= target,
            **{mode: {k: summary(v) for k, v in shared[mode].items()} for mode in ("receipt", "writes")},
        } if shared else None,
        "steady_etcd_requests_per_s": round(rate, 2), "steady_keepalives_per_s": round(keepalives, 2),
        "survivors_report": reports, "steady_methods": methods, "steady_cpu_per_s": steady_cpu,
        "lease_ttl_s": SIM_TTL, "torchrun_form_s": None,
    }  # fmt: skip
    await main.delete_prefix(keys.prefix)
    main.timeout = 1.0
    await main.close()
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


def real(endpoint: str, n: int, repeats: int, tmp: Path) -> dict[str, Any]:
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
        return asyncio.run(_real(endpoint, n, repeats, keys, agent, procs))
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
    endpoint: str, n: int, repeats: int, keys: JobKeys, agent: Any, procs: dict[str, subprocess.Popen[bytes]]
) -> dict[str, Any]:
    """N real agents form a job; then ``repeats`` times an active one is SIGKILLed, the job restarts
    with the standby in its place, and a fresh agent joins as the next standby."""
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

    def standby(node_id: str) -> Any:
        return lambda r: node_id in r and r[node_id].state is NodeState.STANDBY

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
        await wait_nodes(standby(f"r{n - 1:03d}"), 120)
        await asyncio.sleep(3.0)
        rate, keepalives, methods = await asyncio.to_thread(steady_rates, endpoint, QUIET_S)
        runs: list[dict[str, Any]] = []
        for r in range(repeats):
            gen = await read_generation(store, keys)
            assert gen is not None
            number = gen.number + 1
            victim = sorted(gen.assignment)[1 + r % (n - 2)]  # never the first node (it leads)
            _, revision = await store.get_at(keys.node(victim))
            expired = asyncio.create_task(_deleted_at(store, keys.node(victim), revision + 1))
            fault_at, fault_wall = time.monotonic(), time.time()
            _kill_tree(procs[victim], signal.SIGKILL)
            expired_wall = await asyncio.wait_for(expired, 120)
            planned = await plan_time(store, keys, number, 120)
            recs = await wait_nodes(lambda x, g=number: running(x, g) >= n - 1, 300)
            acted_at = time.monotonic() if running(recs, number) >= n - 1 else None
            new = await read_generation(store, keys)
            run = {
                "plan_s": planned - fault_wall if planned else None,
                "lease_expiry_to_plan_s": planned - expired_wall if planned else None,
                "acted_s": acted_at - fault_at if acted_at else None,
                "plan": new.kind if new is not None and new.number >= number else None,
            }
            runs.append(run)
            print(json.dumps({"n": n, "kind": "real", "repeat": r, **run}), file=sys.stderr, flush=True)
            fresh = f"r{n + r:03d}"  # a new machine in place of the lost one joins as the next standby
            procs[fresh] = agent(fresh)
            await wait_nodes(standby(fresh), 120)
            await asyncio.sleep(1.0)
        return {
            "n": n, "kind": "real", "repeats": repeats, "form_s": round(form_s, 3),
            "fault_to_plan_s": summary([run["plan_s"] for run in runs]),
            "lease_expiry_to_plan_s": summary([run["lease_expiry_to_plan_s"] for run in runs]),
            "fault_to_all_acted_s": summary([run["acted_s"] for run in runs]),
            "plans": [run["plan"] for run in runs],
            "steady_etcd_requests_per_s": round(rate, 2), "steady_keepalives_per_s": round(keepalives, 2),
            "steady_methods": methods, "lease_ttl_s": LEASE_TTL, "torchrun_form_s": None,
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
    parser.add_argument("--repeats", type=int, default=5, help="faults per size (each a new event: median and spread)")
    parser.add_argument("--nodes-per-connection", type=int, default=32, help="simulated nodes sharing one etcd "
                        "connection (an agent has its own; 1 costs the host processes more per node)")  # fmt: skip
    parser.add_argument("--floor-procs", type=int, default=4, help="processes the floor's bare watchers are spread "
                        "over (see scripts/fanout.py)")  # fmt: skip
    parser.add_argument("--survivor-reports", action="store_true", help="at each fault every simulated "
                        "survivor sees the loss and says it as an agent does (after a random wait, unless the "
                        "controller's probe round came first), and the round finds the lost node")  # fmt: skip
    parser.add_argument(
        "--profile",
        default="",
        help="write the controller's cProfile stats over the "
        "simulated runs' fault windows (those that do not hold the writes) here",
    )
    parser.add_argument("--profile-nodes", default="", help="write the simulated nodes' cProfile stats over the "
                        "fault windows to FILE.<N>.<host>")  # fmt: skip
    parser.add_argument("--node-procs", type=int, default=1, help="host processes the simulated nodes are dealt "
                        "over (see scripts/simhosts.py)")  # fmt: skip
    parser.add_argument("--node-host", default="", help=argparse.SUPPRESS)  # a host process of simulated nodes
    parser.add_argument("--controller-of", default="", help=argparse.SUPPRESS)  # the controller process
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--watchers-of", default="", help=argparse.SUPPRESS)  # a process of the floor's watchers
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    end_on_sigterm()
    if args.watchers_of:
        watchers_main(args.endpoint, args.watchers_of, args.count, args.nodes_per_connection)
        return
    if args.controller_of:
        asyncio.run(controller_process(args.endpoint, args.controller_of, args.profile))
        return
    if args.node_host:
        host_main(args.endpoint, args.node_host, args.count, args.nodes_per_connection, args.profile_nodes)
        return
    sims = [int(x) for x in args.simulated.split(",") if x]
    if args.node_procs < 1 or any(args.node_procs > n for n in sims):
        parser.error(f"--node-procs {args.node_procs}: give at least 1 and at most the smallest --simulated size "
                     "(each host process holds some of the simulated nodes).")  # fmt: skip
    sizes: list[dict[str, Any]] = []
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="rlaunch-bench-"))  # kept: the agents' and torchrun's logs
    with EmbeddedEtcd() as etcd:
        assert etcd.proc is not None
        for n in sims:
            sizes.append(asyncio.run(simulated(etcd.endpoint, n, args.repeats, etcd.proc.pid, args.profile,
                                               args.profile_nodes, args.nodes_per_connection,
                                               args.floor_procs, args.survivor_reports, args.node_procs)))  # fmt: skip
            print(json.dumps(sizes[-1]), file=sys.stderr, flush=True)
        for n in [int(x) for x in args.real.split(",") if x]:
            try:
                entry = real(etcd.endpoint, n, args.repeats, tmp)
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
