"""A worker's store wait through the agent (``WorkerLink``'s ``kv_get``) when etcd keeps breaking off:
it reads again after each break, and its timeout names the last one (the real etcd case, a member
lost mid-wait, is in tests/integration/test_outage.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rlaunch.agent.worker_link import WorkerLink
from rlaunch.errors import StoreError, StoreUnavailableError
from rlaunch.store.keys import JobKeys


class BrokenEtcd:
    """The store boundary with no etcd member answering: every read fails as the client says so."""

    def __init__(self) -> None:
        self.reads = 0

    async def get_at(self, key: str) -> tuple[Any, int]:
        self.reads += 1
        raise StoreUnavailableError(f"No etcd endpoint answered (read {self.reads}).")


def test_a_wait_that_etcd_broke_off_reads_again_and_its_timeout_names_the_break() -> None:
    store = BrokenEtcd()
    naps: list[float] = []

    async def nap(seconds: float) -> None:
        naps.append(seconds)
        await asyncio.sleep(0.01)

    link = WorkerLink(store, JobKeys("j"), lambda: 0, lambda *a, **k: None, lambda: None, sleep=nap)  # type: ignore[arg-type]
    with pytest.raises(StoreError) as got:
        asyncio.run(link._kv_get({"key": "g1/world/rank_1", "timeout": 1.0}))
    assert store.reads >= 3 and len(naps) >= 2, (store.reads, naps)
    text = str(got.value)
    assert text.startswith("The store key 'g1/world/rank_1' was not set within 1 s (etcd broke off "), text
    assert f"last: No etcd endpoint answered (read {store.reads}))." in text, text
