"""Unit tests of the hang detector: heartbeats fed by hand, with a hand-held clock."""

from __future__ import annotations

from rlaunch.detectors.hang import STALL_FLOOR_S, STALL_STEPS, STEP_FACTOR, HangDetector


def test_a_worker_is_watched_only_after_its_first_completed_step() -> None:
    d = HangDetector(5.0)
    assert d.hung(1000.0) == []
    d.heartbeat(0, 0.0, steps=0, step_s=0.0, waiting=False)
    assert d.hung(1000.0) == []
    d.heartbeat(0, 0.0, steps=1, step_s=0.0, waiting=False)
    assert d.hung(1000.0)


def test_steps_completed_keep_a_worker_alive() -> None:
    d = HangDetector(5.0)
    for t in range(0, 20):
        d.heartbeat(0, float(t), steps=t, step_s=0.1, waiting=False)
    assert d.hung(20.0) == []


def test_heartbeats_without_progress_past_the_floor_are_a_hang() -> None:
    d = HangDetector(5.0)
    for t in range(0, 7):
        d.heartbeat(0, float(t), steps=3, step_s=0.1, waiting=False)
    (hang,) = d.hung(6.0)
    assert hang.local_rank == 0 and not hang.frozen and hang.silent_s == 6.0 and hang.timeout_s == 5.0
    assert "completed no step for 6.0 s" in hang.sentence() and "--hang-timeout" in hang.sentence()


def test_a_worker_waiting_on_its_peers_is_not_hung_but_a_silent_one_is() -> None:
    d = HangDetector(5.0)
    for t in range(0, 30):
        d.heartbeat(0, float(t), steps=3, step_s=0.1, waiting=True)
    d.heartbeat(1, 0.0, steps=3, step_s=0.1, waiting=True)
    (hang,) = d.hung(29.0)
    assert hang.local_rank == 1 and hang.frozen and "sent no heartbeat" in hang.sentence()


def test_the_timeout_follows_the_jobs_own_step_time_above_the_floor() -> None:
    d = HangDetector(5.0)
    d.heartbeat(0, 0.0, steps=1, step_s=2.0, waiting=False)
    assert d.timeout() == STEP_FACTOR * 2.0
    assert d.hung(STEP_FACTOR * 2.0 - 1) == []
    assert d.hung(STEP_FACTOR * 2.0 + 1)


def test_the_end_of_a_wait_restarts_the_clock_and_reset_forgets_everyone() -> None:
    d = HangDetector(5.0)
    d.heartbeat(0, 0.0, steps=3, step_s=0.1, waiting=True)
    d.heartbeat(0, 9.0, steps=3, step_s=0.1, waiting=False)
    assert d.hung(10.0) == []
    d.reset()
    assert d.hung(100.0) == []


def test_waiting_on_peers_past_the_stall_limit_is_a_stall_and_a_completed_step_ends_it() -> None:
    d = HangDetector(300.0)
    d.heartbeat(0, 0.0, steps=3, step_s=4.0, waiting=False)
    assert d.stall_limit() == STALL_STEPS * 4.0 and d.stalled_s(100.0) == 0.0, "not waiting: no stall"
    d.heartbeat(0, 1.0, steps=3, step_s=4.0, waiting=True)
    assert d.stalled_s(20.0) == 20.0 > d.stall_limit(), "waiting, and no step since t=0"
    d.heartbeat(0, 21.0, steps=4, step_s=4.0, waiting=True)
    assert d.stalled_s(22.0) == 1.0
    fast = HangDetector(300.0)
    fast.heartbeat(0, 0.0, steps=1, step_s=0.01, waiting=True)
    assert fast.stall_limit() == STALL_FLOOR_S, "a few fast steps are no stall: the floor holds"
