"""The agent's generation watch remembers a change of node records until a read of them succeeded."""

from __future__ import annotations

import asyncio

import pytest

from rlaunch.agent.generations import GenerationWatch
from rlaunch.errors import StoreUnavailableError
from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.keys import JobKeys


def watch() -> GenerationWatch:
    """A watch that is never run: these tests hand it the reads themselves."""
    store = Store(parse_endpoints("127.0.0.1:1"))
    return GenerationWatch(store, JobKeys("j"), "s", lambda: None, lambda: None, lambda _: None)


def test_a_read_that_fails_leaves_the_change_to_be_read_again() -> None:
    """A standby reads the records to learn whether the job uses the runtime (to warm up); a failed
    read that cleared the mark left it deciding without them, cold until a record changed again."""
    w = watch()
    assert w.nodes_changed

    async def fails() -> int:
        raise StoreUnavailableError("etcd did not answer")

    with pytest.raises(StoreUnavailableError):
        asyncio.run(w.read_changed_nodes(fails))
    assert w.nodes_changed, "the change was not read: the next look reads again"


def test_a_read_clears_the_change_unless_another_came_during_it() -> None:
    w = watch()

    async def read() -> str:
        return "records"

    assert asyncio.run(w.read_changed_nodes(read)) == "records"
    assert not w.nodes_changed

    async def read_while_one_changes() -> str:
        w.nodes_changed = True  # what the watch does when a record changes meanwhile
        return "records"

    asyncio.run(w.read_changed_nodes(read_while_one_changes))
    assert w.nodes_changed, "a change during the read is read again"
