"""The commit rule survivors apply after a fault (rlaunch.runtime.runtime.commit_point), and its refusal
when a framework drives the loop."""

from __future__ import annotations

import pytest

from rlaunch.runtime.recovery import after_vote_refusal, driven_refusal, first_refusal, generation_split
from rlaunch.runtime.runtime import commit_point


def test_nobody_applied_the_step_so_everyone_discards_it() -> None:
    assert commit_point(mine=41, step=42, applied=[41, 41, 41]) == (41, False)


def test_one_survivor_applied_the_step_so_the_others_roll_forward() -> None:
    assert commit_point(mine=41, step=42, applied=[42, 41, 41]) == (42, True)


def test_a_rank_one_step_ahead_discards_only_its_unfinished_step() -> None:
    # this rank applied 42 and failed in 43; another survivor is still in 42 and rolls forward
    assert commit_point(mine=42, step=43, applied=[42, 41]) == (42, False)


@pytest.mark.parametrize(("mine", "step", "applied"), [(40, 41, [43, 40]), (41, 42, [40, 39]), (42, 42, [43, 42])])
def test_impossible_reports_stop_the_worker_loudly(mine: int, step: int, applied: list[int]) -> None:
    with pytest.raises(RuntimeError, match="inconsistent"):
        commit_point(mine, step, applied)


def test_a_loop_a_framework_drives_refuses_a_roll_forward_on_every_survivor_alike() -> None:
    """Lightning issues collectives between a vote and the next step: a rank rolled forward would issue
    them while the others redo the next step (rlaunch.runtime.recovery.driven_refusal)."""
    assert driven_refusal([3], agreed=41, applied=[41, 41, 41]) == "", "everyone discards step 42: all redo it"
    assert driven_refusal([3], agreed=42, applied=[42, 42]) == "", "everyone applied step 42"
    why = driven_refusal([3, 5], agreed=42, applied=[42, 41, 41])
    assert "ranks [3, 5]" in why and "step 42's vote" in why and "redo step 43" in why
    assert driven_refusal([3, 5], agreed=42, applied=[41, 42]) == why, "any survivor behind refuses, the same"


def test_collectives_that_gave_own_values_after_a_vote_refuse_a_replica_and_say_how_to_avoid_it() -> None:
    """rt.steps(): what a script runs after rt.optimizer_step is not run again by a redone step, so a
    fault there that handed its collectives this rank's own inputs refuses the replicas' state."""
    assert after_vote_refusal(44, 0) == "", "no collective after the vote was served with own inputs"
    one, two = after_vote_refusal(44, 1), after_vote_refusal(44, 2)
    assert one.startswith("a collective issued after step 44's vote") and two.startswith("2 collectives issued")
    assert "before rt.optimizer_step" in one and "rt.alike()" in one


def test_parameters_written_before_the_vote_refuse_a_replica_only_where_the_step_is_redone() -> None:
    """A survivor wrote parameters before its step's vote (an average updated at the top of the step):
    where the commit rule discards that step every survivor refuses alike; where it rolls that survivor
    forward, the step is applied as on every rank, and nothing is refused."""
    wrote = "1 parameter changed in step 8 before its vote"
    redone = [
        {"rank": 0, "applied": 7, "refused": "", "touched": wrote},
        {"rank": 2, "applied": 7, "refused": "", "touched": ""},
    ]
    assert first_refusal(redone, commit_point(7, 8, [7, 7])[0]) == wrote
    rolled = [
        {"rank": 0, "applied": 7, "refused": "", "touched": wrote},
        {"rank": 2, "applied": 8, "refused": "", "touched": ""},
    ]
    assert first_refusal(rolled, commit_point(7, 8, [7, 8])[0]) == ""
    first = [{"rank": 0, "applied": 7, "refused": "per rank", "touched": wrote}]
    assert first_refusal(first, 7) == "per rank", "the first refusal stands"


def test_survivors_in_different_generations_refuse_a_replica_alike() -> None:
    """A drain's switch crossed the fault: rank 0 switched to the drain's groups (generation 2), rank 2
    did not (its vote saw the plan first): their kept groups would not match, so every survivor refuses
    alike, naming where each stands; survivors in one generation recover."""
    split = [{"rank": 0, "generation": 2}, {"rank": 2, "generation": 1}]
    why = generation_split(split, 3)
    assert why.startswith(
        "the survivors of generation 3 stand in different generations (rank: generation {0: 2, 2: 1})"
    )
    assert generation_split([{"rank": 0, "generation": 2}, {"rank": 2, "generation": 2}], 3) == ""
