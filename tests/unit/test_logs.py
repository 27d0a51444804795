"""Unit tests of LogPolicy.targets: where each stream of each local rank goes."""

from __future__ import annotations

from pathlib import Path

from rlaunch.agent.config import Std
from rlaunch.agent.logs import LogPolicy

ATTEMPT = Path("/logs/job/node-a/attempt_3")


def policy(
    redirects: dict[int, Std] | None = None,
    tee: dict[int, Std] | None = None,
    ranks_filter: frozenset[int] | None = None,
    attempt_dir: Path | None = ATTEMPT,
) -> LogPolicy:
    return LogPolicy(
        node_id="node-a",
        redirects=redirects if redirects is not None else {0: Std.NONE, 1: Std.NONE},
        tee=tee if tee is not None else {0: Std.NONE, 1: Std.NONE},
        local_ranks_filter=ranks_filter,
        attempt_dir=attempt_dir,
    )


def test_no_redirect_no_tee_goes_to_console_only() -> None:
    p = policy()
    assert p.targets(0, Std.OUT) == (True, None)
    assert p.targets(1, Std.ERR) == (True, None)


def test_redirect_sends_the_stream_to_its_file_only() -> None:
    p = policy(redirects={0: Std.OUT, 1: Std.NONE})
    assert p.targets(0, Std.OUT) == (False, ATTEMPT / "0" / "stdout.log")
    # The other stream of the same rank and the same stream of another rank are untouched.
    assert p.targets(0, Std.ERR) == (True, None)
    assert p.targets(1, Std.OUT) == (True, None)


def test_redirect_all_covers_both_streams() -> None:
    p = policy(redirects={0: Std.ALL, 1: Std.ALL})
    assert p.targets(1, Std.OUT) == (False, ATTEMPT / "1" / "stdout.log")
    assert p.targets(1, Std.ERR) == (False, ATTEMPT / "1" / "stderr.log")


def test_tee_sends_the_stream_to_console_and_file() -> None:
    p = policy(tee={0: Std.NONE, 1: Std.ERR})
    assert p.targets(1, Std.ERR) == (True, ATTEMPT / "1" / "stderr.log")
    assert p.targets(1, Std.OUT) == (True, None)
    assert p.targets(0, Std.ERR) == (True, None)


def test_redirect_wins_over_tee_for_the_console() -> None:
    p = policy(redirects={0: Std.OUT}, tee={0: Std.OUT})
    assert p.targets(0, Std.OUT) == (False, ATTEMPT / "0" / "stdout.log")


def test_filter_hides_the_console_of_other_ranks() -> None:
    p = policy(ranks_filter=frozenset({1}))
    assert p.targets(0, Std.OUT) == (False, None)
    assert p.targets(0, Std.ERR) == (False, None)
    assert p.targets(1, Std.OUT) == (True, None)


def test_filter_does_not_hide_files() -> None:
    p = policy(tee={0: Std.ALL, 1: Std.ALL}, ranks_filter=frozenset({1}))
    assert p.targets(0, Std.OUT) == (False, ATTEMPT / "0" / "stdout.log")
    assert p.targets(1, Std.OUT) == (True, ATTEMPT / "1" / "stdout.log")


def test_no_attempt_dir_means_no_file() -> None:
    p = policy(redirects={0: Std.ERR}, tee={0: Std.NONE, 1: Std.ALL}, attempt_dir=None)
    assert p.targets(0, Std.ERR) == (False, None)
    assert p.targets(1, Std.OUT) == (True, None)


def test_ranks_missing_from_the_maps_count_as_none() -> None:
    p = policy(redirects={}, tee={})
    assert p.targets(5, Std.OUT) == (True, None)
