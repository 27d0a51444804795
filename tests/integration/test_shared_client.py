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

import pytest

from rlaunch.errors import StoreUnavailableError
from rlaunch.store.client import Store, WatchEvent, parse_endpoints
from rlaunch.store.embedded import EmbeddedEtcd

pytestmark = pytest.mark.timeout(120)


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

        async def watch() -> None:
            _, revision = await store.get_prefix(prefix)
            async for ev in store.watch_prefix(prefix, start_revision=revision + 1):
                seen.append(ev)
                got.set()

        try:
            await store.connect(10)
            task = asyncio.create_task(watch())
            await store.put(prefix + "before", b"0")
            await asyncio.wait_for(got.wait(), 20)
            got.clear()
            os.kill(pid, signal.SIGSTOP)
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
