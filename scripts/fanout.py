"""The floor of fault → every node acted when each agent has a machine of its own, measured in parts.

Simulated nodes share a few processes (scripts/simnodes.py, scripts/simhosts.py), so their figure
is those processes' CPU, not what a deployment sees. On machines of their own, every node receives the plan from etcd at
once and handles it alone, so fault → every node acted is about

    fault → plan  +  etcd's fan-out of the plan to N watchers  +  one node's own handling of it.

- :func:`fanout`: N bare watchers of one key (each an etcd watch through rlaunch's store client,
  32 to a connection as the simulated nodes, doing nothing but noting when the value arrived),
  spread over ``procs`` processes of their own (:func:`watchers_main`: its own asyncio loop and
  etcd connections, reporting each round's first and last receipt as a JSON line on stdout). A
  write of a generation head's size is timed from just before the put to the last watcher's receipt
  (``CLOCK_MONOTONIC``, one clock for every process of the machine). The watchers' own receipt
  shares this machine's cores with etcd, so the figure bounds etcd's fan-out from above.
- :func:`one_node`: one simulated node (the agent's generation watch, state machine and actions) in
  a job of N nodes whose other nodes are only names in its rank map, alone in this process; the
  benchmark writes the generations itself, as the controller would, and times each live
  replacement (the node a survivor) from just before the write to the node handing the plan to its
  workers (``write_to_acted_s``: its receipt through one watch, decoding, rebuilding the rank map,
  deciding) and from its watch taking the plan to that (``saw_to_acted_s``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
import uuid
from typing import Any

from rlaunch.store import generations
from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Generation, GenerationStatus
from scripts.ending import die_with_parent
from scripts.simnodes import SimNode, pause_collector, resume_collector, until

#: Bytes of the value each fan-out round writes: about a generation head's at 4,096 nodes (374).
VALUE_BYTES = 400
#: Bytes of a simulated node's record and of one of its events, as :func:`one_process` writes them
#: (a ``running`` record encodes to 424, a ``migration_offered`` event to 171).
RECORD_BYTES = 430
EVENT_BYTES = 180
#: How long a round may take before the measurement gives up on it.
ROUND_TIMEOUT_S = 120.0
#: How often a timed wait looks (what it times is a few ms to a few hundred ms long).
TIMED_S = 0.001


async def _watchers(endpoint: str, key: str, count: int, per_connection: int) -> None:
    """``count`` watchers of ``key``; for each round value that all of them received, print
    ``{"round", "first", "last"}`` (monotonic receipt times) as one line."""
    eps = parse_endpoints(endpoint)
    stores = [Store(eps, timeout=30) for _ in range(max(1, count // per_connection))]
    got: dict[int, list[float]] = {}

    async def watch(store: Store) -> None:
        async for ev in store.watch_prefix(key, exact=True):
            stamp = time.monotonic()
            number = int(ev.value.split(b":", 1)[0])
            seen = got.setdefault(number, [])
            seen.append(stamp)
            if len(seen) == count:
                print(json.dumps({"round": number, "first": min(seen), "last": max(seen)}), flush=True)
                del got[number]

    tasks = [asyncio.create_task(watch(stores[i % len(stores)])) for i in range(count)]
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the benchmark closes it
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for store in stores:
        store.timeout = 1.0
    await asyncio.gather(*(store.close() for store in stores), return_exceptions=True)


def watchers_main(endpoint: str, key: str, count: int, per_connection: int) -> None:
    asyncio.run(_watchers(endpoint, key, count, per_connection))


async def fanout(endpoint: str, n: int, procs: int, repeats: int, per_connection: int = 32) -> dict[str, Any]:
    """etcd's fan-out of one write to ``n`` bare watchers in ``procs`` processes, ``repeats`` times."""
    key = JobKeys(f"bench-fanout-{uuid.uuid4().hex[:6]}").generation
    store = Store(parse_endpoints(endpoint), timeout=30)
    shares = [n // procs + (i < n % procs) for i in range(procs)]
    children = [
        await asyncio.create_subprocess_exec(
            sys.executable, sys.argv[0], "--watchers-of", key, "--endpoint", endpoint, "--count", str(share),
            "--nodes-per-connection", str(per_connection),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=die_with_parent,
        )
        for share in shares if share > 0
    ]  # fmt: skip
    reports: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def read(child: asyncio.subprocess.Process) -> None:
        assert child.stdout is not None
        while line := await child.stdout.readline():
            reports.put_nowait({"child": child.pid, **json.loads(line)})

    readers = [asyncio.create_task(read(child)) for child in children]
    number = 0

    async def write_round(timeout: float) -> tuple[float, dict[int, dict[str, Any]]]:
        """Write the next round; its start and each process's report of it (all its watchers got it)."""
        nonlocal number
        number += 1
        value = f"{number}:".encode().ljust(VALUE_BYTES, b"x")
        began = time.monotonic()
        await store.put(key, value)
        done: dict[int, dict[str, Any]] = {}
        end = began + timeout
        while len(done) < len(children):
            try:
                report = await asyncio.wait_for(reports.get(), max(0.01, end - time.monotonic()))
            except asyncio.TimeoutError:
                break
            if report["round"] == number:
                done[report["child"]] = report
        return began, done

    try:
        warm = False  # the watches open in their own time: write until every watcher has one round
        deadline = time.monotonic() + 600
        while not warm:
            _, done = await write_round(2.0)
            warm = len(done) == len(children)
            if not warm and time.monotonic() > deadline:
                raise RuntimeError(f"{n} bare watchers in {procs} processes were not all watching within 600 s.")
        last: list[float | None] = []
        first: list[float | None] = []
        for _ in range(repeats):
            await asyncio.sleep(1.0)
            began, done = await write_round(ROUND_TIMEOUT_S)
            full = len(done) == len(children)
            last.append(round(max(r["last"] for r in done.values()) - began, 4) if full else None)
            first.append(round(min(r["first"] for r in done.values()) - began, 4) if full else None)
        return {"watchers": n, "processes": len(children), "write_to_first_s": first, "write_to_last_s": last}
    finally:
        for child in children:
            if child.stdin is not None:
                child.stdin.close()
        for child in children:
            try:
                await asyncio.wait_for(child.wait(), 10)
            except asyncio.TimeoutError:
                child.kill()
                await child.wait()
        for task in readers:
            task.cancel()
        await store.delete(key)
        store.timeout = 1.0
        await store.close()


async def one_process(endpoint: str, n: int, repeats: int, per_connection: int = 32) -> dict[str, Any]:
    """What ``n`` nodes sharing this one process cost with no rlaunch code on their side.

    ``n`` bare watchers of one key here, on as many connections as the simulated nodes use. Each
    round writes the key ``repeats`` times in each of two ways: ``receipt``, the watchers only note
    the value's arrival; ``writes``, each then makes the one etcd request a simulated node makes at
    a live replacement (its record with its offer and its workers' ``recovered``, in one transaction:
    ``RECORD_BYTES`` and ``EVENT_BYTES`` each, under one lease). Timed from just before
    the write to the last receipt (``write_to_last_s``; in ``writes``, receipts share the process
    with the requests of those that received earlier, as a node's acting shares it with the others'
    writes) and to the last request done (``write_to_last_written_s``); ``cpu_s``, this process's
    CPU time over the round. Python's collector is paused over each round, as over a fault's.
    """
    eps = parse_endpoints(endpoint)
    keys = JobKeys(f"bench-process-{uuid.uuid4().hex[:6]}")
    stores = [Store(eps, timeout=30) for _ in range(max(1, n // per_connection))]
    main = Store(eps, timeout=30)
    lease = await main.grant_lease(600)
    record, event = b"r" * RECORD_BYTES, b"e" * EVENT_BYTES
    received: dict[int, list[float]] = {}
    written: dict[int, list[float]] = {}
    writing = False

    async def watch(i: int, store: Store) -> None:
        node = f"p{i:05d}"
        async for ev in store.watch_prefix(keys.generation, exact=True):
            number = int(ev.value.split(b":", 1)[0])
            received.setdefault(number, []).append(time.monotonic())
            if writing:
                await store.put_each([(keys.node(node), record, lease), (keys.event(2 * number, node), event, lease),
                                      (keys.event(2 * number + 1, node), event, lease)])  # fmt: skip
                written.setdefault(number, []).append(time.monotonic())

    tasks = [asyncio.create_task(watch(i, stores[i % len(stores)])) for i in range(n)]
    number = 0

    async def write_round(timeout: float) -> dict[str, Any]:
        nonlocal number
        number += 1
        pause_collector()
        began, cpu = time.monotonic(), time.process_time()
        await main.put(keys.generation, f"{number}:".encode().ljust(VALUE_BYTES, b"x"))
        try:
            await until(lambda: len(received.get(number, ())) == n, timeout, f"round {number}'s receipt", every=TIMED_S)
            if writing:
                await until(
                    lambda: len(written.get(number, ())) == n, timeout, f"round {number}'s writes", every=TIMED_S
                )
        except RuntimeError:
            return {"write_to_last_s": None, "cpu_s": None} | ({"write_to_last_written_s": None} if writing else {})
        finally:
            resume_collector()
        times = {"write_to_last_s": round(max(received[number]) - began, 4)}
        if writing:
            times["write_to_last_written_s"] = round(max(written[number]) - began, 4)
        return {**times, "cpu_s": round(time.process_time() - cpu, 3)}

    try:
        deadline = time.monotonic() + 600  # the watches open in their own time: until all took one round
        while (await write_round(2.0))["write_to_last_s"] is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} bare watchers in one process were not all watching within 600 s.")
        out: dict[str, Any] = {"watchers": n}
        for mode in ("receipt", "writes"):
            writing = mode == "writes"
            rounds = []
            for _ in range(repeats):
                await asyncio.sleep(1.0)
                rounds.append(await write_round(ROUND_TIMEOUT_S))
            out[mode] = {name: [r[name] for r in rounds] for name in rounds[0]}
        return out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await main.revoke_lease(lease)
        await main.delete_prefix(keys.prefix)
        for store in (main, *stores):
            store.timeout = 1.0
        await asyncio.gather(*(store.close() for store in (main, *stores)), return_exceptions=True)


async def one_node(endpoint: str, n: int, repeats: int) -> dict[str, Any]:
    """One simulated node alone, a survivor of ``repeats`` live replacements in a job of ``n`` nodes."""
    keys = JobKeys(f"bench-one-{uuid.uuid4().hex[:6]}")
    eps = parse_endpoints(endpoint)
    store, ctl = Store(eps, timeout=30), Store(eps, timeout=30)
    node = SimNode("s00000", store, keys)
    others = [f"s{i:05d}" for i in range(1, n - 1)]
    gen = Generation(
        number=1, status=GenerationStatus.RUNNING, assignment={x: i for i, x in enumerate([node.node_id, *others])},
        nnodes=n - 1, nproc_per_node=1, master_addr="127.0.0.1", master_port=29500, restart_count=0,
        reason="formed", controller="bench", created_at=time.time(),
    )  # fmt: skip
    write_to_acted: list[float | None] = []
    saw_to_acted: list[float | None] = []
    try:
        await node.join()
        node.start()
        await generations.write(ctl, keys, gen, None, 0)
        await until(
            lambda: node.record is not None and node.record.generation == 1, 60, "the node's ack", every=TIMED_S
        )
        revision, _ = await generations.read(ctl, keys)
        acked = dataclasses.replace(gen, all_acked=True)
        await generations.write(ctl, keys, acked, gen, revision)  # the restart barrier, passed
        await until(lambda: 1 in node.ran, 60, "the node running generation 1", every=TIMED_S)
        spare = n - 1
        for r in range(repeats):
            prev = acked if r == 0 else gen
            revision, _ = await generations.read(ctl, keys)
            leaver = others[r]
            assignment = dict(prev.assignment)
            rank = assignment.pop(leaver)
            joiner = f"s{spare + r:05d}"
            assignment[joiner] = rank
            gen = dataclasses.replace(
                prev, number=prev.number + 1, kind="replace", assignment=assignment, leavers=[leaver],
                joiners=[joiner], reason=f"{leaver} was lost", created_at=time.time(), all_acked=False,
            )  # fmt: skip
            await asyncio.sleep(0.5)
            began = time.monotonic()
            await generations.write(ctl, keys, gen, prev, revision)
            try:
                await until(lambda g=gen.number: g in node.acted, 30, f"the node acting on {gen.number}", every=TIMED_S)
            except RuntimeError:
                write_to_acted.append(None)
                saw_to_acted.append(None)
                continue
            write_to_acted.append(round(node.acted[gen.number] - began, 5))
            saw_to_acted.append(round(node.acted[gen.number] - node.seen[gen.number], 5))
            await until(lambda g=gen.number: g in node.ran, 30, f"the node running {gen.number}", every=TIMED_S)
        return {"nodes_in_map": n - 1, "write_to_acted_s": write_to_acted, "saw_to_acted_s": saw_to_acted}
    finally:
        await node.close()
        await ctl.delete_prefix(keys.prefix)
        for s in (store, ctl):
            s.timeout = 1.0
        await asyncio.gather(store.close(), ctl.close(), return_exceptions=True)
