"""Silent data corruption caught live: the worker link's ``sdc_suspected`` and ``moves`` ops over a real
control socket, the node's fault (record, event, suspect mark) set before the suspect's reply, the
race with its non-zero exit, and what the planner makes of a suspect node, with a standby and without.

The store is in memory (an etcd answer delay included, so a fault sent after the reply would show).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from rlaunch.agent.control import ControlServer
from rlaunch.agent.faults import Faults
from rlaunch.agent.join import join_job
from rlaunch.agent.record import RecordPublisher
from rlaunch.agent.reports import MovesReport, ReportError, SdcReport
from rlaunch.agent.states import AgentState, Node, Publish, WorkersExited
from rlaunch.agent.transitions import decide
from rlaunch.agent.worker_link import WorkerLink
from rlaunch.controller.planner import plan
from rlaunch.errors import JoinError, StoreError
from rlaunch.runtime.agent_link import AgentLink, AgentLinkError
from rlaunch.store.client import KV
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import GenerationStatus, NodeRecord, NodeState, SuspectMark, decode, encode
from tests.unit.test_config import config
from tests.unit.test_planner import CFG, NOW, gen, rec, spec, view

pytestmark = pytest.mark.timeout(30)

KEYS = JobKeys("sdc")
SENTENCE = "rank 1's parameters differ from those of its replicas (ranks 0 and 2) at step 40"
EVIDENCE = {"object": "model", "digest": "0x9e3779b97f4a7c15", "replica_digest": "0x6a09e667f3bcc908",
            "replicas": [0, 2], "method": "majority"}  # fmt: skip


class MemoryStore:
    """key -> KV in memory; each write waits a little, as a request to etcd does."""

    def __init__(self, delay: float = 0.02) -> None:
        self.kvs: dict[str, KV] = {}
        self.revision = 1
        self.delay = delay
        self.down = False

    async def put(self, key: str, value: bytes, lease: int = 0) -> None:
        await asyncio.sleep(self.delay)
        if self.down:
            raise StoreError("etcd at 127.0.0.1:2379 did not answer within 5.0 s")
        self.revision += 1
        created = self.kvs[key].create_revision if key in self.kvs else self.revision
        self.kvs[key] = KV(key, value, created, self.revision, lease)

    async def get(self, key: str) -> KV | None:
        return self.kvs.get(key)

    async def get_prefix(self, prefix: str) -> tuple[list[KV], int]:
        return [kv for k, kv in sorted(self.kvs.items()) if k.startswith(prefix)], self.revision

    def record(self, node: str = "b") -> NodeRecord:
        return decode(NodeRecord, self.kvs[KEYS.node(node)].value, KEYS.node(node))


class NodeB:
    """Node b's agent-side pieces as the agent wires them: worker link, record publisher, faults."""

    def __init__(self, tmp_path: Path, store: MemoryStore) -> None:
        script = tmp_path / "train.py"
        script.write_text("pass\n")
        self.events: list[tuple[str, int, dict[str, Any]]] = []
        self.woken = 0
        self.link = WorkerLink(store, KEYS, lambda: 0, self.emit, self.wake)  # type: ignore[arg-type]
        self.records = RecordPublisher(
            store, KEYS, config(script, nproc_per_node="1", node_id="b"), self.link, self.emit,  # type: ignore[arg-type]
            addr="127.0.0.1", probe_port=0, lease=lambda: 0, restarts=lambda: 0, fault=lambda: self.faults.sentence,
        )  # fmt: skip
        self.faults = Faults("b", store, KEYS, self.records, self.emit, self.wake, clock=lambda: 7.0)  # type: ignore[arg-type]
        self.link.on_sdc = lambda local, report: self.faults.sdc_suspected(local, report, 1)
        self.server = ControlServer()
        self.link.register(self.server)

    def emit(self, kind: str, generation: int, **data: Any) -> None:
        self.events.append((kind, generation, data))

    def wake(self) -> None:
        self.woken += 1

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """What a worker's runtime does: one request over the control socket (from its own thread)."""
        return await asyncio.to_thread(AgentLink(self.server.path, 0).call, op, **fields)


def run(tmp_path: Path, scenario: Any, store: MemoryStore | None = None) -> Any:
    async def go() -> Any:
        node = NodeB(tmp_path, store or MemoryStore())
        await node.server.start()
        try:
            await node.call("hello")  # the worker uses the runtime: the record says so
            await node.records.publish(NodeState.RUNNING, 1)
            return await scenario(node)
        finally:
            await node.server.close()

    return asyncio.run(go())


# -- the worker link ops ---------------------------------------------------------------------------


def test_the_fault_record_and_mark_are_in_etcd_when_the_suspect_gets_its_reply(tmp_path: Path) -> None:
    store = MemoryStore()

    async def scenario(node: NodeB) -> None:
        reply = await node.call("sdc_suspected", rank=1, step=40, sentence=SENTENCE, evidence=EVIDENCE)
        # The suspect exits non-zero right after this reply: by now etcd must say why.
        assert reply == {}
        record = store.record()
        assert record.fault == SENTENCE and record.state is NodeState.RUNNING, "the loop records it failed next"
        mark = decode(SuspectMark, store.kvs[KEYS.suspect("b")].value, "mark")
        assert mark == SuspectMark(node_id="b", generation=1, rank=1, step=40, fault=SENTENCE, at=7.0)
        assert node.faults.sentence == SENTENCE and node.faults.suspected and node.woken >= 1
        kinds = [e for e in node.events if e[0] == "sdc_suspected"]
        assert kinds == [("sdc_suspected", 1, {"local_rank": 0, "rank": 1, "step": 40, "sentence": SENTENCE,
                                               "evidence": EVIDENCE})]  # fmt: skip

    run(tmp_path, scenario, store)


def test_a_second_report_is_an_event_but_not_a_second_fault_or_mark(tmp_path: Path) -> None:
    store = MemoryStore()

    async def scenario(node: NodeB) -> None:
        await node.call("sdc_suspected", rank=1, step=40, sentence=SENTENCE, evidence=EVIDENCE)
        first_mark = store.kvs[KEYS.suspect("b")].mod_revision
        await node.call("sdc_suspected", rank=1, step=40, sentence=SENTENCE, evidence=EVIDENCE)
        assert node.faults.sentence == SENTENCE
        assert store.kvs[KEYS.suspect("b")].mod_revision == first_mark
        assert sum(e[0] == "sdc_suspected" for e in node.events) == 2

    run(tmp_path, scenario, store)


def test_a_malformed_report_still_takes_the_node_out_and_answers_with_the_bad_field(tmp_path: Path) -> None:
    store = MemoryStore()

    async def scenario(node: NodeB) -> None:
        with pytest.raises(AgentLinkError, match="lacks the field 'sentence'"):
            await node.call("sdc_suspected", rank=1, step=40, evidence=EVIDENCE)
        fault = store.record().fault
        assert fault.startswith("silent data corruption suspected on rank 1; its report was malformed"), fault
        assert KEYS.suspect("b") in store.kvs

    run(tmp_path, scenario, store)


def test_an_etcd_that_does_not_answer_keeps_the_fault_and_the_loop_sends_it_later(tmp_path: Path) -> None:
    store = MemoryStore()

    async def scenario(node: NodeB) -> None:
        store.down = True
        await node.call("sdc_suspected", rank=1, step=40, sentence=SENTENCE, evidence=EVIDENCE)
        assert node.faults.sentence == SENTENCE, "known to the agent at once, whatever etcd does"
        assert store.record().fault == "" and KEYS.suspect("b") not in store.kvs
        store.down = False
        await node.records.resend()  # what the agent's loop does every round
        await node.faults.resend()
        assert store.record().fault == SENTENCE and KEYS.suspect("b") in store.kvs

    run(tmp_path, scenario, store)


def test_moves_reports_are_kept_per_local_rank_and_bad_ones_refused(tmp_path: Path) -> None:
    async def scenario(node: NodeB) -> None:
        await node.call("moves", drain=True, replace=False, reason="no replica holds rank 1's shard", rank=1)
        assert node.link.state.moves == {0: MovesReport(1, True, False, "no replica holds rank 1's shard")}
        await node.call("moves", drain=True, replace=True, reason="", rank=1)
        assert node.link.state.moves == {0: MovesReport(1, True, True, "")}, "the latest report counts"
        with pytest.raises(AgentLinkError, match="drain='yes', which is not a bool"):
            await node.call("moves", drain="yes", replace=True, reason="", rank=1)
        assert node.link.state.moves == {0: MovesReport(1, True, True, "")}
        node.link.reset("active", None)
        assert node.link.state.moves == {}, "new workers report anew"

    run(tmp_path, scenario)


# -- the race with the suspect's exit ----------------------------------------------------------------


def test_the_suspects_exit_is_a_fault_never_an_ordinary_failure(tmp_path: Path) -> None:
    """The worker exits 3 right after its report; the agent sees the exit before its next look."""
    store = MemoryStore()

    async def scenario(node: NodeB) -> NodeRecord:
        await node.call("sdc_suspected", rank=1, step=40, sentence=SENTENCE, evidence=EVIDENCE)
        d = decide(
            Node(AgentState.ACTIVE, worker_gen=1, acked_gen=1), WorkersExited((3,), 1, fault=node.faults.sentence)
        )
        (pub,) = [a for a in d.actions if isinstance(a, Publish)]
        assert pub.failure == ("fault", SENTENCE), "its failure is the fault, not exit code 3"
        assert pub.exit_codes is not None
        await node.records.publish(pub.state, pub.generation, dict(pub.exit_codes), pub.failure)
        return store.record()

    published = run(tmp_path, scenario, store)
    assert (published.state, published.fault, published.exit_codes) == (NodeState.FAILED, SENTENCE, {"0": 3})
    a = rt(rec("a", NodeState.RUNNING, generation=1))
    g1 = gen(1, {"a": 0, "b": 1})
    # With a ready standby: a live replacement by c, counted as no restart.
    new, reason = plan(NOW, view(a, published, rt(rec("c", NodeState.STANDBY)), generation=g1), CFG)
    assert new is not None and new.kind == "replace" and new.joiners == ["c"] and new.assignment == {"a": 0, "c": 1}
    assert f"b (fault: {SENTENCE}) replaced by c" in reason and new.restart_count == 0
    # The same exit without the fault on the record is an ordinary failure: b would restart in place.
    ordinary = dataclasses.replace(published, fault="", failure="exit")
    again, _ = plan(NOW, view(a, ordinary, generation=g1), CFG)
    assert again is not None and again.joiners == ["b"], "why the fault must be on the record before the exit"


def test_without_a_standby_the_job_waits_restarts_without_the_suspect_or_fails_naming_it() -> None:
    a = rt(rec("a", NodeState.RUNNING, generation=1))
    suspect = dataclasses.replace(rt(rec("b", NodeState.FAILED, generation=1)), fault=SENTENCE, failure="fault")
    g1 = gen(1, {"a": 0, "b": 1})
    waiting, reason = plan(NOW, view(a, suspect, generation=g1), CFG)
    assert waiting is not None and waiting.number == 1 and waiting.deadline == NOW + CFG.standby_wait
    assert SENTENCE in reason and "no standby is ready" in reason, "the survivors wait in recovery"
    fallback, reason = plan(waiting.deadline, view(a, suspect, generation=waiting), CFG)
    assert fallback is not None and fallback.status is GenerationStatus.WAITING and "b" not in fallback.assignment
    assert SENTENCE in reason
    d = rt(rec("d", NodeState.WAITING))
    restarted, _ = plan(waiting.deadline + 1, view(a, suspect, d, generation=fallback), CFG)
    assert restarted is not None and restarted.assignment == {"a": 0, "d": 1}, "a new node, never the suspect"
    failed, reason = plan(fallback.deadline, view(a, suspect, generation=fallback), CFG)
    assert failed is not None and failed.status is GenerationStatus.FAILED
    assert reason == (f"no node came to take node rank(s) [1] within 60 s; b may not take one: {SENTENCE}; "
                      "the job failed")  # fmt: skip


def rt(record: NodeRecord) -> NodeRecord:
    return dataclasses.replace(record, runtime=True)


# -- a restarted agent of the suspect --------------------------------------------------------------


def test_an_agent_restarted_on_a_suspect_node_is_refused_with_the_fault() -> None:
    store = MemoryStore(delay=0)
    mark = SuspectMark(node_id="b", generation=1, rank=1, step=40, fault=SENTENCE, at=7.0)
    job = spec()

    async def go() -> None:
        await store.put(KEYS.spec, encode(dataclasses.replace(job, job_id="sdc")))
        await store.put(KEYS.node("a"), encode(rec("a", NodeState.RUNNING, generation=1)))
        await store.put(KEYS.suspect("b"), encode(mark))
        record = rec("b")
        await join_job(store, KEYS, dataclasses.replace(job, job_id="sdc"), record, 0, 5.0, asyncio.sleep)  # type: ignore[arg-type]

    with pytest.raises(JoinError) as info:
        asyncio.run(go())
    message = str(info.value)
    assert "Node 'b' was taken out of job 'sdc' because silent data corruption was suspected" in message
    assert SENTENCE in message and "another --rdzv-id" in message


def test_sdc_reports_are_validated_records() -> None:
    req = {"local_rank": 0, "rank": 1, "step": 40, "sentence": f" {SENTENCE} ", "evidence": EVIDENCE}
    assert SdcReport.from_request(req) == SdcReport(1, 40, SENTENCE, EVIDENCE)
    with pytest.raises(ReportError, match="evidence=\\[1\\], which is not a dict"):
        SdcReport.from_request({**req, "evidence": [1]})
    with pytest.raises(ReportError, match="empty sentence"):
        SdcReport.from_request({**req, "sentence": "  "})
    assert SdcReport.malformed({"local_rank": 2, "rank": "x"}, "why").sentence == (
        "silent data corruption suspected on local rank 2; its report was malformed (why)"
    )


class SlowFirstStore(MemoryStore):
    """The first write takes longer than the ones after it (two requests in flight)."""

    async def put(self, key: str, value: bytes, lease: int = 0) -> None:
        self.delay, first = 0.0, self.delay
        await asyncio.sleep(first)
        await super().put(key, value, lease)


def test_two_publishes_in_flight_leave_the_latest_record_in_etcd(tmp_path: Path) -> None:
    """The loop and a worker's report publish concurrently; etcd must end with the record made last."""
    store = SlowFirstStore(delay=0.05)

    async def go() -> tuple[NodeRecord, NodeRecord]:
        node = NodeB(tmp_path, store)
        node.faults.sentence = SENTENCE
        first = asyncio.ensure_future(node.records.publish(NodeState.RUNNING, 1))
        await asyncio.sleep(0)  # its put is in flight
        await node.records.publish(NodeState.FAILED, 1, {"0": 3}, ("fault", SENTENCE))
        await first
        landed = store.record()
        await node.records.republish()
        return landed, store.record()

    landed, latest = asyncio.run(go())
    assert landed.state is NodeState.FAILED, "the older record's slow put must not land last"
    assert (latest.state, latest.exit_codes, latest.failure, latest.fault) == (
        NodeState.FAILED, {"0": 3}, "fault", SENTENCE,
    ), "republish keeps the exit codes and the failure"  # fmt: skip
