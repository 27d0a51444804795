"""The store-pruning decision: old generations' kv prefixes go only once the new one has settled."""

from __future__ import annotations

from rlaunch.controller.planner import NodeView
from rlaunch.controller.prune import prunable_below
from rlaunch.store.records import GenerationStatus, NodeState
from tests.unit.test_planner import gen, rec


def nodes(*records: object) -> dict[str, NodeView]:
    return {r.node_id: NodeView(record=r, join_revision=1) for r in records}  # type: ignore[attr-defined]


def test_everything_below_a_settled_generation_is_prunable() -> None:
    g = gen(5, {"a": 0, "b": 1})
    below, reason = prunable_below(g, nodes(rec("a", NodeState.RUNNING, generation=5),
                                            rec("b", NodeState.SUCCEEDED, generation=5)))  # fmt: skip
    assert below == 5 and "settled" in reason


def test_a_node_still_setting_up_keeps_old_prefixes() -> None:
    g = gen(5, {"a": 0, "b": 1})
    below, reason = prunable_below(g, nodes(rec("a", NodeState.RUNNING, generation=5),
                                            rec("b", NodeState.RESTARTING, generation=5)))  # fmt: skip
    assert below == 0 and "node b is restarting at generation 5" in reason


def test_a_record_of_an_older_generation_keeps_old_prefixes() -> None:
    # b's record still says running at 4: its workers may still be building generation 4's groups
    g = gen(5, {"a": 0, "b": 1})
    below, _ = prunable_below(g, nodes(rec("a", NodeState.RUNNING, generation=5),
                                       rec("b", NodeState.RUNNING, generation=4)))  # fmt: skip
    assert below == 0


def test_a_missing_node_or_a_waiting_generation_keeps_old_prefixes() -> None:
    g = gen(5, {"a": 0, "b": 1})
    assert prunable_below(g, nodes(rec("a", NodeState.RUNNING, generation=5)))[0] == 0
    waiting = gen(5, {"a": 0}, status=GenerationStatus.WAITING)
    assert prunable_below(waiting, nodes(rec("a", NodeState.RUNNING, generation=5)))[0] == 0
    assert prunable_below(None, {})[0] == 0
