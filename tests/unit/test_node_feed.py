"""The controller's node records kept from the leader's watch (rlaunch.controller.feed): when they
are vouched for, and that no change is lost between a whole read and the watch."""

from __future__ import annotations

from rlaunch.controller.feed import FeedState, NodeFeed
from rlaunch.store.client import KV, WatchEvent


def kv(name: str, revision: int, value: bytes = b"{}") -> KV:
    return KV(f"/job/nodes/{name}", value, create_revision=revision, mod_revision=revision, lease=7)


def put(name: str, revision: int, value: bytes = b"{}") -> WatchEvent:
    return WatchEvent(f"/job/nodes/{name}", value, False, revision, create_revision=revision, lease=7)


def gone(name: str, revision: int) -> WatchEvent:
    return WatchEvent(f"/job/nodes/{name}", b"", True, revision, create_revision=0, lease=0)


def held(feed: NodeFeed) -> dict[str, tuple[bytes, int]] | None:
    records = feed.records()
    return None if records is None else {r.key.rsplit("/", 1)[1]: (r.value, r.mod_revision) for r in records}


def following(records: list[KV], revision: int) -> NodeFeed:
    feed = NodeFeed()
    feed.watching()
    feed.read_whole(feed.begin_read(), records, revision)
    assert feed.state is FeedState.FOLLOWING
    return feed


def test_without_a_watch_nothing_is_vouched_for_and_no_read_is_taken() -> None:
    feed = NodeFeed()
    feed.saw(put("a", 3))
    feed.read_whole(feed.begin_read(), [kv("a", 3)], 3)
    assert feed.state is FeedState.BLIND and held(feed) is None


def test_a_watch_is_vouched_for_only_after_a_whole_read_begun_under_it() -> None:
    feed = NodeFeed()
    feed.watching()
    feed.saw(put("a", 4))  # before any read: the read, begun later, has it
    assert feed.state is FeedState.CATCHING_UP and held(feed) is None
    feed.read_whole(feed.begin_read(), [kv("a", 4), kv("b", 2)], 5)
    assert held(feed) == {"a": (b"{}", 4), "b": (b"{}", 2)}


def test_changes_after_the_read_are_applied_in_order_and_older_ones_are_not() -> None:
    feed = following([kv("a", 4), kv("b", 2)], 5)
    feed.saw(put("a", 5, b"old"))  # the read had it already (its revision is 5)
    feed.saw(put("c", 6, b"new"))
    feed.saw(gone("b", 7))
    feed.saw(put("a", 8, b"later"))
    assert held(feed) == {"a": (b"later", 8), "c": (b"new", 6)}
    assert {r.key: (r.create_revision, r.lease) for r in feed.records() or []}["/job/nodes/c"] == (6, 7)


def test_changes_that_come_while_the_read_is_in_flight_are_applied_after_it() -> None:
    """A read served at revision 10 whose answer comes after the watch delivered revisions 9 to 12:
    those after 10 would be lost if the read simply replaced what is held."""
    feed = NodeFeed()
    feed.watching()
    read = feed.begin_read()
    feed.saw(put("a", 9, b"in the read"))
    feed.saw(put("b", 11, b"after the read"))
    feed.saw(gone("a", 12))
    feed.read_whole(read, [kv("a", 9, b"in the read"), kv("c", 3)], 10)
    assert held(feed) == {"b": (b"after the read", 11), "c": (b"{}", 3)}


def test_a_whole_read_again_while_following_keeps_the_changes_received_meanwhile() -> None:
    feed = following([kv("a", 1)], 1)
    read = feed.begin_read()
    feed.saw(put("b", 3))
    feed.read_whole(read, [kv("a", 1)], 2)  # served before b was written
    assert held(feed) == {"a": (b"{}", 1), "b": (b"{}", 3)}


def test_two_reads_in_flight_each_keep_the_changes_since_they_began() -> None:
    feed = following([kv("a", 1)], 1)
    first = feed.begin_read()
    feed.saw(put("b", 3))
    second = feed.begin_read()
    feed.saw(put("c", 5))
    feed.read_whole(second, [kv("a", 1), kv("b", 3)], 4)
    feed.saw(put("d", 6))
    feed.read_whole(first, [kv("a", 1)], 2)  # the older answer comes last
    assert held(feed) == {"a": (b"{}", 1), "b": (b"{}", 3), "c": (b"{}", 5), "d": (b"{}", 6)}


def test_a_read_that_failed_keeps_no_changes_for_itself() -> None:
    """A failed read is abandoned: otherwise every later change would be kept for it, for good."""
    feed = following([kv("a", 1)], 1)
    read = feed.begin_read()
    feed.saw(put("b", 2))
    feed.abandon(read)
    feed.saw(put("c", 3))
    assert len(read.since) == 1 and held(feed) == {"a": (b"{}", 1), "b": (b"{}", 2), "c": (b"{}", 3)}


def test_a_read_begun_under_an_earlier_watch_is_refused() -> None:
    """The watch broke and another started while the read was in flight: the read may predate a
    change neither watch delivered."""
    feed = following([kv("a", 1)], 1)
    read = feed.begin_read()
    feed.blind()
    assert held(feed) is None
    feed.watching()
    feed.read_whole(read, [kv("a", 1)], 2)
    assert feed.state is FeedState.CATCHING_UP and held(feed) is None
    feed.read_whole(feed.begin_read(), [kv("a", 1), kv("b", 3)], 3)
    assert held(feed) == {"a": (b"{}", 1), "b": (b"{}", 3)}


def test_a_watch_that_ends_leaves_nothing_vouched_for() -> None:
    feed = following([kv("a", 1)], 1)
    feed.blind()
    feed.saw(put("b", 2))
    assert feed.state is FeedState.BLIND and held(feed) is None


def test_after_etcd_was_away_the_records_are_vouched_for_only_after_a_new_whole_read() -> None:
    """The watch may have been silent meanwhile (open on a member cut off from the others)."""
    feed = following([kv("a", 1)], 1)
    feed.resync()
    assert feed.state is FeedState.CATCHING_UP and held(feed) is None
    feed.saw(put("b", 3))  # the watch goes on: the next read has this one
    feed.read_whole(feed.begin_read(), [kv("a", 1), kv("b", 3), kv("c", 2)], 3)
    assert held(feed) == {"a": (b"{}", 1), "b": (b"{}", 3), "c": (b"{}", 2)}
    blind = NodeFeed()
    blind.resync()
    assert blind.state is FeedState.BLIND, "no watch runs: nothing to follow after a read"


def test_a_read_without_a_revision_is_not_followed_from() -> None:
    feed = NodeFeed()
    feed.watching()
    feed.read_whole(feed.begin_read(), [kv("a", 1)], 0)
    assert feed.state is FeedState.CATCHING_UP and held(feed) is None
