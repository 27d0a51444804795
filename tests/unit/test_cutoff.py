"""Unit tests of the network-cut verdict: probe reports built by hand, whom the cut takes out."""

from __future__ import annotations

from rlaunch.controller.cutoff import REPORTS_WAIT_S, decide

MEMBERS = ["a", "b", "c"]  # node ranks 0, 1, 2


def test_a_node_cut_from_every_peer_is_taken_out_whoever_reported_it() -> None:
    v = decide(MEMBERS, {"a": ["b"], "b": ["a", "c"], "c": ["b"]}, ["d"], 0.0)
    assert v.out == ("b",) and not v.waiting and not v.unreachable_standbys
    assert "node b and ['a', 'c'] cannot reach each other (as probed by ['a', 'b', 'c'])" in v.reason


def test_of_two_nodes_cut_from_each_other_alone_the_higher_node_rank_leaves() -> None:
    # a one-way drop breaks TCP both ways, but only one side may have probed in time
    assert decide(MEMBERS, {"a": ["c"], "b": [], "c": []}, [], 0.0).out == ("c",)
    assert decide(MEMBERS, {"a": [], "b": ["a"], "c": []}, [], 0.0).out == ("b",)


def test_between_two_nodes_the_one_cut_from_the_standbys_too_leaves_whatever_its_rank() -> None:
    # a (node rank 0) is cut from everyone, b and the standbys s1, s2 alike; b reaches the standbys
    v = decide(["a", "b"], {"a": ["b", "s1", "s2"], "b": ["a"]}, ["s1", "s2"], 0.0)
    assert v.out == ("a",) and v.unreachable_standbys == frozenset()


def test_the_verdict_waits_for_every_members_report_then_goes_on_without_the_silent_ones() -> None:
    # a alone reports b: were a the one cut off, b and c would report a; so wait for them
    waiting = decide(MEMBERS, {"a": ["b", "c"]}, [], 1.0)
    assert waiting.waiting and waiting.out == () and "['b', 'c']" in waiting.reason
    late = decide(MEMBERS, {"a": ["b", "c"]}, [], REPORTS_WAIT_S)
    assert late.out == ("a",) and "no probe report from ['b', 'c']" in late.reason


def test_a_split_into_halves_takes_out_the_fewest_nodes() -> None:
    members = ["a", "b", "c", "d", "e"]
    cut = {"a": ["d", "e"], "b": ["d", "e"], "c": ["d", "e"], "d": ["a", "b", "c"], "e": ["a", "b", "c"]}
    assert sorted(decide(members, cut, [], 0.0).out) == ["d", "e"]


def test_no_cut_among_members_decides_nothing_but_names_standbys_nobody_staying_reaches() -> None:
    v = decide(MEMBERS, {"a": ["s1"], "b": [], "c": []}, ["s1", "s2"], 0.0)
    assert v.out == () and not v.waiting and v.unreachable_standbys == {"s1"}
    # a node that leaves does not make a standby unusable
    v = decide(MEMBERS, {"a": ["c"], "b": [], "c": ["a", "s2"]}, ["s1", "s2"], 0.0)
    assert v.out == ("c",) and v.unreachable_standbys == frozenset()


def test_reports_about_nodes_that_hold_no_ranks_any_more_are_ignored() -> None:
    # b was taken out and replaced by d: a's old report of b decides nothing
    assert decide(["a", "d"], {"a": ["b"]}, [], 0.0).out == ()
    assert decide(MEMBERS, {}, [], 100.0).out == ()
