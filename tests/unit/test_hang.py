"""Unit tests of the hang detector: heartbeats fed by hand, with a hand-held clock."""

from __future__ import annotations

from rlaunch.detectors.hang import STEP_FACTOR, HangDetector


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
