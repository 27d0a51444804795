"""What ``rlaunch drain`` prints of a move (``rlaunch.cli.drain._switch_stats``), read from a real etcd:
only the events since the request, each once, though the survivor's ``switched`` comes later than
the leaver's ``state_sent`` and a host's clock may lag the command's."""

from __future__ import annotations

import asyncio
import uuid

from rlaunch.cli.drain import CLOCK_MARGIN_S, _switch_stats
from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Event, encode


def test_a_drain_reads_its_own_events_once_each(endpoint: str) -> None:
    keys = JobKeys(f"job-{uuid.uuid4().hex[:8]}")
    requested = 1_800_000_000.0

    async def put(store: Store, at: float, node: str, kind: str, generation: int, **data: object) -> None:
        event = Event(time=at, node_id=node, kind=kind, generation=generation, data=data)
        await store.put(keys.event(int(at * 1e9), node), encode(event))

    async def run() -> dict[str, object]:
        store = Store(parse_endpoints(endpoint), timeout=5.0)
        await store.connect(10.0)
        try:
            # long before the request (given the same generation, so that only the time can leave them out)
            await put(store, requested - CLOCK_MARGIN_S - 5, "b", "state_sent", 3, bytes=999, seconds=9.0)
            await put(store, requested - CLOCK_MARGIN_S - 4, "a", "switched", 3, downtime_ms=999.0)
            await put(store, requested + 1.0, "b", "state_sent", 3, bytes=100, seconds=0.5)
            await put(store, requested + 1.2, "c", "state_sent", 3, bytes=50, seconds=0.25)

            async def late_switch() -> None:  # after a few polls, from a host whose clock lags by 2 s
                await asyncio.sleep(0.7)
                await put(store, requested - 1.0, "a", "switched", 3, downtime_ms=420.0)

            switched = asyncio.ensure_future(late_switch())
            out = await _switch_stats(store, keys, 3, requested)
            await switched
            return out
        finally:
            await store.delete_prefix(keys.events_prefix)
            await store.close()

    out = asyncio.run(run())
    assert out == {"state_bytes": 150, "transfer_s": 0.5, "downtime_ms": 420.0}, out
