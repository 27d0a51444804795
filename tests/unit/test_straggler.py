"""Unit tests of straggler detection and of the planner's move of a straggler."""

from __future__ import annotations

import dataclasses

from rlaunch.controller.planner import plan
from rlaunch.detectors.straggler import FACTOR, StragglerWatch, compute_times
from rlaunch.store.records import GenerationStatus, NodeState
from tests.unit.test_planner import CFG, NOW, gen, rec, view
from tests.unit.test_planner_replace import rt


def test_a_node_slow_for_the_whole_window_is_a_straggler() -> None:
    w = StragglerWatch(window_s=10.0)
    times = {"a": 0.1, "b": 0.1 * FACTOR * 1.5, "c": 0.11}
    assert w.update(0.0, times) == [] and w.pending
    assert w.update(9.0, times) == []
    assert w.update(10.0, times) == ["b"]


def test_a_node_that_recovers_in_the_window_starts_over() -> None:
    w = StragglerWatch(window_s=10.0)
    w.update(0.0, {"a": 0.1, "b": 0.5})
    w.update(5.0, {"a": 0.1, "b": 0.1})
    assert not w.pending
    assert w.update(12.0, {"a": 0.1, "b": 0.5}) == []
    assert w.update(22.0, {"a": 0.1, "b": 0.5}) == ["b"]


def test_within_the_factor_or_alone_or_off_nobody_is_a_straggler() -> None:
    assert StragglerWatch(1.0).update(5.0, {"a": 0.1, "b": 0.1 * FACTOR * 0.9}) == []
    w = StragglerWatch(1.0)
    w.update(0.0, {"a": 0.1})
    assert w.update(5.0, {"a": 0.1}) == [] and not w.pending
    off = StragglerWatch(0.0)
    off.update(0.0, {"a": 0.1, "b": 1.0})
    assert off.update(100.0, {"a": 0.1, "b": 1.0}) == []


def test_the_planner_moves_a_straggler_to_a_ready_standby_live() -> None:
    g1 = gen(1, {"a": 0, "b": 1})
    v = view(rt(rec("a", NodeState.RUNNING, generation=1)), rt(rec("b", NodeState.RUNNING, generation=1)),
             rt(rec("c", NodeState.STANDBY)), generation=g1)  # fmt: skip
    new, reason = plan(NOW, dataclasses.replace(v, stragglers=frozenset({"b"})), CFG)
    assert new is not None and new.kind == "migrate" and new.leavers == ["b"] and new.joiners == ["c"]
    assert reason.startswith("straggler b: c takes node rank 1 live")
    both = dataclasses.replace(v, stragglers=frozenset({"b"}), drains=frozenset({"a"}))
    new, reason = plan(NOW, both, CFG)
    assert new is not None and new.leavers == ["a"], "a requested drain goes first"


def test_the_watch_is_fed_the_nodes_running_this_generation_only() -> None:
    """A replacement's survivor recovering its workers still says running at the last generation, with
    the compute time it had before the fault: it is not counted until it runs this one."""
    g2 = gen(2, {"a": 0, "b": 1, "c": 2, "d": 3})
    records = {
        "a": dataclasses.replace(rec("a", NodeState.RUNNING, generation=2), compute_s=0.1),
        "b": dataclasses.replace(rec("b", NodeState.RUNNING, generation=1), compute_s=0.9),  # recovering
        "c": dataclasses.replace(rec("c", NodeState.RESTARTING, generation=2), compute_s=0.1),  # joining
        "d": rec("d", NodeState.RUNNING, generation=2),  # no compute time reported yet
    }
    assert compute_times(g2, records.get) == {"a": 0.1}
    records["b"] = dataclasses.replace(records["b"], generation=2)
    assert compute_times(g2, records.get) == {"a": 0.1, "b": 0.9}
    assert compute_times(dataclasses.replace(g2, status=GenerationStatus.WAITING), records.get) == {}
    assert compute_times(None, records.get) == {}
