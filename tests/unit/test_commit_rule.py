"""The commit rule survivors apply after a fault (rlaunch.runtime.runtime.commit_point), and its refusal
when a framework drives the loop."""

from __future__ import annotations

import pytest

from rlaunch.runtime.recovery import driven_refusal
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
