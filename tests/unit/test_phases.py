"""The phase breakdown of a planned move, from every rank's marks (rlaunch.runtime.phases)."""

from __future__ import annotations

from typing import Any

import pytest

from rlaunch.runtime.phases import MovePhases, Phase, breakdown


def _report(role: str, rank: int, nbytes: int = 0, **marks: float) -> dict[str, Any]:
    return {"generation": 3, "role": role, "rank": rank, "marks": marks, "bytes": nbytes}


def test_the_breakdown_times_each_phase_from_the_earliest_boundary() -> None:
    t = 1000.0
    reports = [
        _report("leaver", 1, 400_000_000, plan_seen=t, prepared=t + 0.05, ready_voted=t + 0.3, boundary=t + 1.0,
                transfer_start=t + 1.01, transfer_end=t + 1.21),
        _report("survivor", 0, plan_seen=t + 0.002, prepared=t + 0.08, ready_voted=t + 0.3, boundary=t + 1.004,
                groups_swapped=t + 1.02, first_step_start=t + 1.02, work_start=t + 1.02, work_done=t + 1.52,
                voted=t + 1.6, first_step_end=t + 1.72),
        _report("joiner", 1, plan_seen=t + 0.001, prepared=t + 0.1, groups_swapped=t + 0.1, transfer_start=t + 0.1,
                params_landed=t + 1.08, first_step_start=t + 1.09, work_start=t + 1.09, transfer_end=t + 1.23,
                work_done=t + 1.45, verified=t + 1.5, voted=t + 1.62, first_step_end=t + 1.74),
    ]  # fmt: skip
    got = breakdown(reports, median_step=0.5)
    assert got == {
        "prepare_s": 0.1, "vote_wait_s": 0.9, "to_transfer_s": 0.01, "transfer_s": 0.22,
        "transfer_bytes": 400_000_000, "transfer_gbps": 1.818, "params_s": 0.07, "verified_s": 0.5, "swap_s": 0.02,
        "to_first_step_s": 0.09, "snapshot_s": None, "first_step_s": 0.7, "joiner_work_s": 0.36,
        "joiner_vote_s": 0.17, "survivor_work_s": 0.5, "survivor_vote_s": 0.08, "switch_to_trained_s": 0.74,
        "downtime_s": 0.24,
        "boundary_at": t + 1.0, "trained_at": t + 1.74,
    }  # fmt: skip


def test_the_snapshot_after_a_move_is_the_longest_wait_for_it_inside_a_first_step() -> None:
    """A layout with no replica: each rank copies the snapshot that covers the new generation at its
    first step's start, the joiner once its optimizer state landed."""
    reports = [
        _report("survivor", 0, boundary=5.0, groups_swapped=5.01, first_step_start=5.01, snapshot_taken=5.04,
                work_start=5.04, work_done=5.74, voted=5.8, first_step_end=5.9),
        _report("joiner", 1, params_landed=5.1, first_step_start=5.1, transfer_end=5.15, verified=5.2,
                snapshot_taken=5.22, work_start=5.22, work_done=5.72, voted=5.8, first_step_end=5.95),
    ]  # fmt: skip
    got = breakdown(reports, median_step=0.6)
    assert got["snapshot_s"] == 0.12 and got["first_step_s"] == 0.89 and got["downtime_s"] == 0.35
    # the step's own work is timed from the end of what the runtime did at its start (the snapshot)
    assert got["joiner_work_s"] == 0.5 and got["survivor_work_s"] == 0.7


def test_a_phase_no_rank_reported_is_none_and_downtime_is_never_negative() -> None:
    got = breakdown([_report("survivor", 0, boundary=5.0, first_step_start=5.0, first_step_end=5.1)], median_step=0.3)
    assert got["transfer_s"] is None and got["transfer_gbps"] is None and got["prepare_s"] is None
    assert got["downtime_s"] == 0.0 and got["switch_to_trained_s"] == 0.1
    assert got["joiner_work_s"] is None and got["survivor_vote_s"] is None


def test_each_roles_part_is_the_longest_over_its_ranks_and_a_step_that_went_to_recovery_has_no_vote() -> None:
    reports = [
        _report("survivor", 0, work_start=1.0, work_done=1.5, voted=1.6),
        _report("survivor", 2, work_start=1.0, work_done=1.7),  # its step went to recovery: no vote passed
        _report("survivor", 3, work_start=1.1, work_done=1.4, voted=1.65),
    ]
    got = breakdown(reports, median_step=0.5)
    assert got["survivor_work_s"] == 0.7 and got["survivor_vote_s"] == 0.25 and got["joiner_work_s"] is None


def test_a_phase_is_marked_once_at_its_first_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 11.0])
    monkeypatch.setattr("rlaunch.runtime.phases.time.time", lambda: next(clock))
    phases = MovePhases(4, "survivor")
    phases.mark(Phase.READY_VOTED)
    phases.mark(Phase.READY_VOTED)  # every later vote says ready again: the first one counts
    assert phases.report() == {"generation": 4, "role": "survivor", "marks": {"ready_voted": 10.0}, "bytes": 0}
