"""Live moves: the workers' ``moves`` reports, the node's and the job's summaries, and the record fields
(``rlaunch status`` shows them: see test_cli_format)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from rlaunch.agent.moves import NodeMoves, combine, node_summary, sentence
from rlaunch.agent.reports import MovesReport, ReportError
from rlaunch.store.records import LiveMoves, NodeRecord, NodeState, decode, encode
from tests.unit.test_planner import rec

BOTH, DRAIN, REPL, NONE, UNKNOWN = (LiveMoves.BOTH, LiveMoves.DRAIN_ONLY, LiveMoves.REPLACEMENT_ONLY,
                                    LiveMoves.NONE, LiveMoves.UNKNOWN)  # fmt: skip
NO_REPLICA = "rank 3's optimizer state is sharded and no other rank holds its shard"


def report(rank: int, drain: bool = True, replace: bool = True, reason: str = "") -> MovesReport:
    return MovesReport(rank=rank, drain=drain, replace=replace, reason=reason)


# -- the report ------------------------------------------------------------------------------------


def test_a_moves_request_becomes_a_report() -> None:
    req = {"op": "moves", "local_rank": 1, "rank": 3, "drain": True, "replace": False, "reason": f" {NO_REPLICA} "}
    assert MovesReport.from_request(req) == report(3, replace=False, reason=NO_REPLICA)


@pytest.mark.parametrize(
    ("change", "shown"),
    [({"drain": 1}, "drain=1, which is not a bool"), ({"rank": True}, "rank=True, which is not a int"),
     ({"rank": "3"}, "rank='3', which is not a int"), ({"reason": None}, "reason=None, which is not a str")],
)  # fmt: skip
def test_a_bad_field_is_refused_naming_it(change: dict[str, Any], shown: str) -> None:
    req = {"local_rank": 0, "rank": 3, "drain": True, "replace": True, "reason": "", **change}
    with pytest.raises(ReportError, match=shown):
        MovesReport.from_request(req)


def test_a_missing_field_is_named() -> None:
    with pytest.raises(ReportError, match="lacks the field 'replace'"):
        MovesReport.from_request({"local_rank": 0, "rank": 3, "drain": True, "reason": ""})


def test_a_rank_that_gives_no_reason_gets_a_sentence_saying_so() -> None:
    assert report(2).why_not() == ""
    assert (
        report(2, replace=False).why_not()
        == "rank 2 reported that a live replacement cannot serve it, without saying why"
    )
    assert report(2, drain=False).why_not() == "rank 2 reported that a drain cannot move it live, without saying why"
    assert "neither a drain nor a live replacement" in report(2, False, False).why_not()
    assert report(2, replace=False, reason=NO_REPLICA).why_not() == NO_REPLICA


# -- summaries -------------------------------------------------------------------------------------


def test_a_node_is_unknown_until_every_local_rank_reported() -> None:
    assert node_summary({}, 2) == (UNKNOWN, "")
    assert node_summary({0: report(0)}, 2) == (UNKNOWN, "")
    assert node_summary({0: report(0), 1: report(1)}, 2) == (BOTH, "")


def test_a_node_moves_live_only_as_far_as_each_of_its_ranks() -> None:
    ranks = {0: report(2), 1: report(3, replace=False, reason=NO_REPLICA)}
    assert node_summary(ranks, 2) == (DRAIN, NO_REPLICA)
    ranks[0] = report(2, drain=False, reason="rank 2 is pipeline stage 0 of 1")
    assert node_summary(ranks, 2) == (NONE, "rank 2 is pipeline stage 0 of 1"), "the first reason, in local rank order"
    assert node_summary({0: report(2, drain=False, reason="x"), 1: report(3)}, 2) == (REPL, "x")


def test_the_job_takes_the_weakest_node_and_the_first_reason() -> None:
    assert combine([]) == (UNKNOWN, "")
    assert combine([(BOTH, ""), (BOTH, "")]) == (BOTH, "")
    assert combine([(BOTH, ""), (UNKNOWN, "")]) == (UNKNOWN, ""), "not known until every node reported"
    assert combine([(BOTH, ""), (DRAIN, "a"), (REPL, "b")]) == (NONE, "a")
    assert combine([(DRAIN, "a"), (DRAIN, "b")]) == (DRAIN, "a")
    rollback = "a fault rolls back to the last host snapshot (every 20 steps: up to 20 steps redone), since x"
    assert combine([(BOTH, ""), (BOTH, rollback)]) == (BOTH, rollback), "how a fault is recovered, where a rank said"
    assert combine([(BOTH, rollback), (DRAIN, "a")]) == (DRAIN, "a"), "what lacks comes first"


def test_the_summary_reads_as_a_sentence() -> None:
    assert sentence(UNKNOWN, "") == "not known yet"
    assert sentence(BOTH, "") == "drain and replacement"
    assert sentence(DRAIN, NO_REPLICA) == f"drain only: {NO_REPLICA}"
    assert sentence(NONE, "x") == "none: x"
    assert sentence(BOTH, "a fault rolls back") == "drain and replacement: a fault rolls back"


def test_the_node_publishes_a_summary_when_first_known_and_when_it_changes() -> None:
    moves = NodeMoves(2)
    assert moves.update({0: report(0)}) is None and moves.current == (UNKNOWN, ""), "one rank of two"
    assert moves.update({0: report(0), 1: report(1)}) is UNKNOWN and moves.current == (BOTH, "")
    assert moves.update({0: report(0), 1: report(1)}) is None, "the same again: nothing to publish"
    assert moves.update({0: report(0), 1: report(1, replace=False, reason="r")}) is BOTH
    assert moves.current == (DRAIN, "r")
    assert moves.update({}) is None and moves.current == (DRAIN, "r"), "new workers: the last summary stands"


# -- the node record -------------------------------------------------------------------------------


def test_the_record_fields_round_trip_and_default_for_records_that_lack_them() -> None:
    record = dataclasses.replace(rec("b", NodeState.RUNNING), live_moves=DRAIN, moves_reason=NO_REPLICA)
    raw = encode(record)
    assert json.loads(raw)["live_moves"] == "drain only" and json.loads(raw)["moves_reason"] == NO_REPLICA
    assert decode(NodeRecord, raw, "k") == record
    old = {k: v for k, v in json.loads(raw).items() if k not in ("live_moves", "moves_reason")}
    back = decode(NodeRecord, json.dumps(old).encode(), "k")
    assert (back.live_moves, back.moves_reason) == (UNKNOWN, ""), "an older agent's record"


def test_a_record_with_an_unknown_live_moves_value_is_refused_naming_it() -> None:
    obj = json.loads(encode(rec("b", NodeState.RUNNING)))
    obj["live_moves"] = "sometimes"
    with pytest.raises(Exception, match="live_moves='sometimes'"):
        decode(NodeRecord, json.dumps(obj).encode(), "k")
