"""The rule for a fault seen after a step's vote in a Lightning fit (``rlaunch.lightning.aftervote``),
from readings built by hand."""

from __future__ import annotations

import pytest

pytest.importorskip("pytorch_lightning", reason="the Lightning integration's tests need 'rlaunch[lightning]'")

from rlaunch.lightning.aftervote import Reading, Stretch, refusal  # noqa: E402 - after the skip: it imports Lightning

AT_VOTE = Reading(step=5, epochs=1, validations=2, own_results=3)


def test_a_fault_after_the_vote_with_no_collective_served_its_own_inputs_moves_live() -> None:
    """Lightning's own stretch after a vote (its SIGTERM broadcast is issued inside rt.alike()), or
    collectives that completed before the fault: nothing went on from this rank's own values."""
    assert refusal(Stretch.AFTER_VOTE, AT_VOTE, AT_VOTE, fault=True) == ""


def test_a_collective_after_the_vote_that_gave_this_rank_its_own_inputs_refuses() -> None:
    now = Reading(step=5, epochs=1, validations=2, own_results=4)
    why = refusal(Stretch.AFTER_VOTE, AT_VOTE, now, fault=True)
    assert why.startswith("A fault was seen after step 5's vote, and a collective issued since (such as self.log(")
    assert "restarts from your checkpoint" in why and "sync such values in training_step" in why
    two = refusal(Stretch.AFTER_VOTE, AT_VOTE, Reading(5, 1, 2, 5), fault=True)
    assert two.startswith("A fault was seen after step 5's vote, and 2 collectives issued since")


def test_validation_and_an_epochs_end_refuse_whenever_a_fault_is_seen_after_them() -> None:
    validated = Reading(step=5, epochs=1, validations=3, own_results=3)
    assert refusal(Stretch.AFTER_VOTE, AT_VOTE, validated, fault=True).startswith(
        "A fault was seen after validation ran past step 5's vote"
    )
    ended = Reading(step=5, epochs=2, validations=3, own_results=9)  # an epoch's end is named first
    assert refusal(Stretch.AFTER_VOTE, AT_VOTE, ended, fault=True).startswith(
        "A fault was seen after an epoch's end ran past step 5's vote"
    )


def test_a_collective_served_its_own_inputs_refuses_before_the_fault_is_seen() -> None:
    """A replacement plan pauses every group before the runtime holds the plan: a collective issued then
    is handed its caller's inputs while step_failed still says no fault."""
    now = Reading(step=5, epochs=1, validations=2, own_results=4)
    assert refusal(Stretch.AFTER_VOTE, AT_VOTE, now, fault=False).startswith(
        "A fault was seen after step 5's vote, and a collective issued since"
    )


def test_no_fault_or_a_fault_inside_a_step_refuses_nothing() -> None:
    """Inside a step (from its first read to its vote) a fault is redone with the step; before the first
    step (the sanity check) its values are let go; without a fault nothing is refused."""
    after = Reading(step=5, epochs=2, validations=3, own_results=9)
    assert refusal(Stretch.AFTER_VOTE, AT_VOTE, Reading(5, 2, 3, 3), fault=False) == ""
    assert refusal(Stretch.STEPPING, AT_VOTE, after, fault=True) == ""
    assert refusal(Stretch.BEFORE_STEPS, None, after, fault=True) == ""


def test_an_unknown_stretch_or_a_missing_reading_is_a_defect() -> None:
    with pytest.raises(ValueError, match="unknown stretch"):
        refusal("elsewhere", AT_VOTE, AT_VOTE, fault=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no reading taken at that vote"):
        refusal(Stretch.AFTER_VOTE, None, AT_VOTE, fault=True)
