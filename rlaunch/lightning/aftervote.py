"""The stretch after a step's vote, which no redone step runs again, and when a fault there refuses a live move.

The per-step vote is in Lightning's optimizer step. What Lightning runs after it, until the next
step's first batch is read, is not part of any step: the rest of the batch (the ``on_train_batch_end``
hooks, a ``self.log(..., sync_dist=True)`` there, a step-interval ``ReduceLROnPlateau``), validation,
the epoch's end (the checkpoint's and early stopping's decisions across ranks), and Lightning's
broadcast of its SIGTERM flag before each batch is read. A fault seen there is recovered in the
next step, which the survivors redo from its start; the work after the vote is not run again. If
a collective of that work handed this rank its own inputs instead of every rank's result (a failed
group does), a callback or a plateau scheduler may have taken that value, and a live move would go
on with ranks that disagree: :func:`refusal` says so, and the job restarts instead. Validation and
an epoch's end refuse whenever a fault is seen after them (their decisions may also stand on values
logged without ``sync_dist``); the rest of a batch refuses only when one of its collectives was
served with this rank's own inputs (``Runtime.own_results``), so a fault there that hit no
collective (the common case: ``self.log(..., sync_dist=True)`` in ``training_step`` syncs before
the vote, and the SIGTERM flag, 0 on every rank, is issued inside ``rt.alike()``) still moves live.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from rlaunch.lightning import checks


class Stretch(str, Enum):
    """Where the fit stands against the runtime's steps.

    Transitions: ``BEFORE_STEPS -> STEPPING`` (the first step begins, at its first read);
    ``STEPPING -> AFTER_VOTE`` (the vote applies the step); ``STEPPING -> STEPPING`` (the vote
    discards it: it is redone inside the same call); ``AFTER_VOTE -> STEPPING`` (the next step begins).
    """

    #: no step has begun (Lightning's sanity check): a fault is seen in the first step, whose values are let go
    BEFORE_STEPS = "before_steps"
    #: from a step's first read to its vote: a fault is redone with the step
    STEPPING = "stepping"
    #: the vote applied the step: what runs until the next step's first read is not run again
    AFTER_VOTE = "after_vote"


@dataclass(frozen=True)
class Reading:
    """Counts read where a step's vote applied it, and again where a fault may be seen."""

    step: int  # the step under way
    epochs: int  # epochs processed (their end's hooks ran)
    validations: int  # validation runs begun
    own_results: int  # collectives that handed this rank its own inputs (Runtime.own_results)


def refusal(stretch: Stretch, at_vote: Reading | None, now: Reading, fault: bool) -> str:
    """Why this rank must not move live, now that ``fault`` says whether a fault was seen ("" when it
    may): ``at_vote`` was read where the last vote applied its step (None before any), ``now`` here."""
    if stretch is Stretch.BEFORE_STEPS or stretch is Stretch.STEPPING:
        return ""
    if stretch is not Stretch.AFTER_VOTE:
        raise ValueError(f"unknown stretch {stretch!r}")
    if at_vote is None:
        raise ValueError("the stretch after a vote has no reading taken at that vote")
    # The count rises only when a group failed, was paused for a replacement plan or abandoned: a fault,
    # even where step_failed does not say so yet (a group only paused, before the plan reaches the runtime).
    own = now.own_results - at_vote.own_results
    if not fault and own <= 0:
        return ""
    if now.epochs != at_vote.epochs:
        return checks.validation_after_fault("an epoch's end", at_vote.step)
    if now.validations != at_vote.validations:
        return checks.validation_after_fault("validation", at_vote.step)
    if own > 0:
        return checks.collectives_after_fault(own, at_vote.step)
    return ""
