"""Live migration with real processes: drains leave every rank bit-identical to a run without one."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import pytest

from rlaunch.runtime.phases import breakdown
from tests.cluster import REPO, AgentProc, Cluster, wait_for

RESILIENT = REPO / "examples" / "train_resilient.py"
# Long enough (>= 12.5 s) that a loaded machine still warms the standby before the job ends.
STEPS = 250
ARGS = ("--steps", str(STEPS), "--step-time", "0.05")
FINAL = re.compile(r"rank (\d+) final: steps=\d+ params=(\w+) optim=(\w+) versions=(\S+)")


def finals(*agents: AgentProc) -> dict[int, tuple[str, str, dict[str, int]]]:
    """rank -> (params digest, optimizer digest, group versions) as printed at the end."""
    out = {}
    for agent in agents:
        for m in FINAL.finditer(agent.output()):
            out[int(m.group(1))] = (m.group(2), m.group(3), json.loads(m.group(4)))
    return out


@pytest.fixture(scope="module")
def reference() -> dict[int, tuple[str, str]]:
    """Digests of an uninterrupted 2-rank run (nothing drained)."""
    return _reference(2, ())


@functools.cache  # the same uninterrupted run, once per session: test_recovery compares five jobs with it
def _reference(nproc: int, extra: tuple[str, ...]) -> dict[int, tuple[str, str]]:
    """Digests of an uninterrupted run; ``--step-time`` only sleeps, so the reference skips it."""
    res = subprocess.run(
        [sys.executable, "-m", "rlaunch", "--standalone", "--nproc-per-node", str(nproc), str(RESILIENT),
         "--steps", str(STEPS), "--step-time", "0", *extra],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = {int(m.group(1)): (m.group(2), m.group(3)) for m in FINAL.finditer(res.stdout)}
    assert sorted(got) == list(range(nproc))
    return got


def start(cluster: Cluster, names: list[str], *extra: str, flags: tuple[str, ...] = ()) -> dict[str, AgentProc]:
    agents = dict(zip(names, cluster.agents_in_order(names, RESILIENT, *ARGS, *extra, flags=flags), strict=True))
    wait_for(lambda: warm(cluster, names[-1]), 90, f"standby {names[-1]} to be warm")
    return agents


def warm(cluster: Cluster, node_id: str) -> bool:
    node = cluster.node(node_id)
    return bool(node and node["state"] == "standby" and node["runtime"])


def drain(cluster: Cluster, node: str) -> str:
    res = cluster.cli("drain", node, "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", cluster.job_id, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"node {node} drained" in res.stdout and "downtime" in res.stdout, res.stdout
    return res.stdout


def assert_identical(got: dict[int, tuple[str, str, dict[str, int]]], ref: dict[int, tuple[str, str]]) -> None:
    assert sorted(got) == sorted(ref), got
    for rank, (params, optim, _) in got.items():
        assert (params, optim) == ref[rank], f"rank {rank} diverged from the uninterrupted run"


def test_drain_partway_is_bit_identical(cluster: Cluster, reference: dict[int, tuple[str, str]]) -> None:
    agents = start(cluster, ["a", "b", "c"])
    wait_for(lambda: "step 10/" in agents["a"].output(), 60, "training to make progress")
    drain(cluster, "b")
    status = cluster.status()
    nodes = {n["node_id"]: n for n in status["nodes"]}
    assert nodes["b"]["state"] == "drained" and nodes["b"]["role"] == "none"
    assert (nodes["c"]["role"], nodes["c"]["node_rank"]) == ("active", 1)
    assert [agents[n].wait(120) for n in "abc"] == [0, 0, 0]
    assert "final" not in agents["b"].output(), "the leaver must stop at the switch"
    assert "step 10/" in agents["a"].output(), "the survivor kept its process throughout"
    assert "[c/1] rank 1 final" in agents["c"].output(), "the joiner's lines carry its new rank"
    assert_identical(finals(agents["a"], agents["c"]), reference)
    assert_phases(cluster)


def assert_phases(cluster: Cluster) -> None:
    """Every rank of the drain reported where its time went, on one clock, in the order of the move."""
    res = cluster.cli("events", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", cluster.job_id, "--json")
    assert res.returncode == 0, res.stderr
    events = [json.loads(line) for line in res.stdout.splitlines()]
    reports = {ev["data"]["role"]: ev for ev in events if ev["kind"] == "move_phases"}
    assert sorted(reports) == ["joiner", "leaver", "survivor"], reports
    assert len({ev["generation"] for ev in reports.values()}) == 1
    order = {
        "leaver": ["plan_seen", "prepared", "ready_voted", "boundary", "transfer_start", "transfer_end"],
        "survivor": ["plan_seen", "prepared", "ready_voted", "boundary", "groups_swapped", "first_step_start",
                     "work_start", "work_done", "voted", "first_step_end"],
        # the joiner's first step starts once the parameters landed, while the optimizer state lands: the
        # last tensor may land before or after that start, and is verified before the first vote
        "joiner": ["plan_seen", "prepared", "groups_swapped", "transfer_start", "params_landed", "first_step_start",
                   "work_start", "work_done", "voted", "first_step_end"],
    }  # fmt: skip
    for role, ev in reports.items():
        marks = ev["data"]["marks"]
        apart = ("transfer_end", "verified") if role == "joiner" else ()
        assert [m for m in sorted(marks, key=marks.__getitem__) if m not in apart] == order[role], (role, marks)
    leaver, survivor, joiner = (reports[r]["data"]["marks"] for r in ("leaver", "survivor", "joiner"))
    # (a small state may land whole before the joiner has digested its first part and marked params_landed)
    assert joiner["transfer_start"] <= joiner["transfer_end"] <= joiner["verified"] <= joiner["first_step_end"]
    assert joiner["params_landed"] <= joiner["verified"] <= joiner["voted"]
    assert leaver["transfer_start"] < leaver["transfer_end"]
    assert abs(leaver["boundary"] - survivor["boundary"]) < 5.0, "both switch at the same step boundary"
    assert leaver["transfer_start"] <= joiner["transfer_end"] and survivor["boundary"] < joiner["first_step_end"]
    assert reports["leaver"]["data"]["bytes"] > 0
    got = breakdown([ev["data"] for ev in reports.values()], median_step=0.05)
    assert got["transfer_s"] is not None and 0 < got["transfer_s"] <= got["switch_to_trained_s"]
    assert got["downtime_s"] is not None and got["transfer_bytes"] == reports["leaver"]["data"]["bytes"]
    assert got["joiner_work_s"] is not None and got["survivor_vote_s"] is not None


def test_drain_of_the_rank0_node_is_bit_identical(cluster: Cluster, reference: dict[int, tuple[str, str]]) -> None:
    agents = start(cluster, ["a", "b", "c"])
    wait_for(lambda: "step 10/" in agents["a"].output(), 60, "training to make progress")
    drain(cluster, "a")
    assert [agents[n].wait(120) for n in "abc"] == [0, 0, 0]
    got = finals(agents["b"], agents["c"])
    assert_identical(got, reference)
    assert "rank 0 final" in agents["c"].output(), "the joiner holds rank 0 now"


def test_two_drains_the_second_onto_the_undrained_first_leaver(
    cluster: Cluster, reference: dict[int, tuple[str, str]]
) -> None:
    args = ("--steps", "300", "--step-time", "0.05")
    agents = dict(zip("abc", cluster.agents_in_order(["a", "b", "c"], RESILIENT, *args), strict=True))
    wait_for(lambda: warm(cluster, "c"), 90, "standby c to be warm")
    drain(cluster, "b")
    assert agents["b"].wait(60) == 0
    refused = cluster.agent("b2", RESILIENT, *args, flags=("--node-id", "b"))
    assert refused.wait(30) == 1 and "was drained" in refused.output() and "rlaunch undrain" in refused.output()
    res = cluster.cli("undrain", "b", "--rdzv-endpoint", cluster.endpoint, "--rdzv-id", cluster.job_id)
    assert res.returncode == 0, res.stderr
    back = cluster.agent("b3", RESILIENT, *args, flags=("--node-id", "b"))
    wait_for(lambda: warm(cluster, "b"), 90, "b to be a warm standby again")
    drain(cluster, "c")
    assert [agents["a"].wait(120), agents["c"].wait(60), back.wait(60)] == [0, 0, 0]
    ref = _reference(2, ("--steps", "300"))
    assert_identical(finals(agents["a"], back), ref)


def test_a_drain_and_a_replacement_with_subgroups_rebuild_only_the_touched_ones(cluster: Cluster) -> None:
    # 2 active nodes x 2 ranks: draining b moves ranks 2 and 3 to c. sub0 = {0, 1} lies on node a
    # only and must be kept; sub1 = {1, 2} touches the leaver and must be rebuilt. Then c's rank 3
    # is killed and d takes ranks 2 and 3 live: sub0 kept again, sub1 rebuilt again, and rank 0,
    # which is not in sub1, is not held up by it.
    extra = ("--subgroup", "0,1", "--subgroup", "1,2")
    agents = start(cluster, ["a", "b", "c", "d"], *extra, flags=("--nproc-per-node", "2", "--max-restarts", "1"))
    wait_for(lambda: warm(cluster, "c"), 90, "standby c to be warm")
    wait_for(lambda: "step 10/" in agents["a"].output(), 90, "training to make progress")
    drain(cluster, "b")
    joiner = next(n["node_id"] for n in cluster.status()["nodes"] if n["node_rank"] == 1)
    spare = ({"c", "d"} - {joiner}).pop()
    wait_for(lambda: "event joined" in agents[joiner].output(), 60, f"{joiner} to take b's ranks")
    wait_for(lambda: warm(cluster, spare), 60, f"standby {spare} to be warm still")
    agents[joiner].workers()[1].kill()
    assert [agents[n].wait(180) for n in ("a", "b", spare)] == [0, 0, 0]
    got = finals(agents["a"], agents[spare])
    assert_identical(got, _reference(4, extra))
    # When the kill finds node a's ranks a step apart, one of them is in a sub0 collective the other
    # has not reached: it reports sub0 dirty and the recovery must rebuild it (at generation 3).
    dirty = re.findall(r"event recovered .*'dirty': \[([^\]]*)\]", agents["a"].output())
    assert len(dirty) == 2, "both of a's ranks report their recovery, with the groups found dirty"
    sub0 = 3 if any("'sub0'" in d for d in dirty) else 1
    assert got[0][2] == {"world": 3, "sub0": sub0, "sub1": 1}, "rank 0 is in sub0 only: kept (unless dirty)"
    assert got[1][2] == {"world": 3, "sub0": sub0, "sub1": 3}, "sub0 kept (unless dirty), sub1 rebuilt at each move"
    assert got[2][2]["world"] == 3 and got[2][2]["sub1"] == 3
    assert agents["a"].output().count("event workers_started") == 1, "a kept its processes through both"


def test_the_resilient_script_runs_under_plain_torchrun(reference: dict[int, tuple[str, str]]) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(RESILIENT), *ARGS],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = {int(m.group(1)): (m.group(2), m.group(3)) for m in FINAL.finditer(res.stdout)}
    assert got == reference, "the same script under torchrun must train to the same weights"
