"""One slow etcd call must not close the client that every task of an agent shares.

A real etcd is stopped (SIGSTOP) while a watch runs on the same :class:`Store`: a call made then
times out, and once etcd resumes the watch must still deliver events (it was not torn down by the
timeout) and the same store must answer again, without being reopened.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path

import pytest

from rlaunch.errors import StoreUnavailableError
from rlaunch.store.client import Store, WatchEvent, parse_endpoints
from rlaunch.store.embedded import EmbeddedEtcd
from tests.cluster import wait_for

pytestmark = pytest.mark.timeout(120)


def stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (kill returns before they all are)."""
    tasks = Path(f"/proc/{pid}/task")
    return all((t / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t") for t in tasks.iterdir())


def test_a_timed_out_call_leaves_the_shared_watch_and_connection_alone() -> None:
    server = EmbeddedEtcd().start()
    assert server.proc is not None
    pid = server.proc.pid
    prefix = f"/test/{uuid.uuid4().hex}/"

    async def go() -> None:
        store = Store(parse_endpoints(server.endpoint), timeout=1.0)
        other = Store(parse_endpoints(server.endpoint), timeout=5.0)
        seen: list[WatchEvent] = []
        got = asyncio.Event()

        async def watch(revision: int) -> None:
            async for ev in store.watch_prefix(prefix, start_revision=revision + 1):
                seen.append(ev)
                got.set()

        try:
            await store.connect(10)
            _, revision = await store.get_prefix(prefix)
            task = asyncio.create_task(watch(revision))
            await store.put(prefix + "before", b"0")
            await asyncio.wait_for(got.wait(), 20)
            got.clear()
            os.kill(pid, signal.SIGSTOP)
            wait_for(lambda: stopped(pid), 10, "etcd to stop")
            try:
                with pytest.raises(StoreUnavailableError, match="did not answer in time"):
                    await store.get(prefix + "x")
            finally:
                os.kill(pid, signal.SIGCONT)
            await other.put(prefix + "after", b"1")
            try:
                await asyncio.wait_for(got.wait(), 20)
            except asyncio.TimeoutError:
                raise AssertionError("the watch delivered nothing after etcd resumed: the timeout broke it") from None
            assert not task.done(), "the watch ended when another call timed out"
            assert [e.key for e in seen] == [prefix + "before", prefix + "after"]
            assert (await store.get(prefix + "after")) is not None
            task.cancel()
        finally:
            await store.close()
            await other.close()

    try:
        asyncio.run(go())
    finally:
        os.kill(pid, signal.SIGCONT)
        server.stop()


def test_after_etcd_restarts_the_same_store_answers_and_watches_again(tmp_path) -> None:  # type: ignore[no-untyped-def]
    data = str(tmp_path / "data")
    server = EmbeddedEtcd(data_dir=data).start()
    port = server.port
    prefix = f"/test/{uuid.uuid4().hex}/"

    async def go() -> None:
        nonlocal server
        store = Store(parse_endpoints(server.endpoint), timeout=1.0)
        try:
            await store.put(prefix + "a", b"1")
            _, revision = await store.get_prefix(prefix)
            watch = store.watch_prefix(prefix, start_revision=revision + 1)
            first = asyncio.ensure_future(watch.__anext__())
            await asyncio.sleep(0.5)
            server.stop()
            with pytest.raises(StoreUnavailableError):
                await asyncio.wait_for(first, 30)
            server = EmbeddedEtcd(port=port, data_dir=data).start()
            await store.connect(30)
            assert (await store.get(prefix + "a")) is not None
            _, revision = await store.get_prefix(prefix)
            events = store.watch_prefix(prefix, start_revision=revision + 1)
            nxt = asyncio.ensure_future(events.__anext__())
            await asyncio.sleep(0.5)
            await store.put(prefix + "b", b"2")
            ev = await asyncio.wait_for(nxt, 20)
            assert ev.key == prefix + "b"
            await events.aclose()
        finally:
            await store.close()

    try:
        asyncio.run(go())
    finally:
        server.stop()
