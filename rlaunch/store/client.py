"""The etcd boundary: an asyncio client over aetcd that speaks rlaunch's errors.

Only this module imports aetcd. Every call carries a timeout (a server that accepts TCP but
never answers would otherwise hang for 20 s), tries the next endpoint when one is unreachable,
and translates client exceptions into :class:`~rlaunch.errors.StoreError` subclasses whose
messages name the endpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

# gRPC logs an INFO line on every fork() while a channel is open (each worker spawn).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import aetcd  # noqa: E402
import aetcd.exceptions  # noqa: E402
from prometheus_client import Histogram  # noqa: E402

from rlaunch.errors import StoreError, StoreUnavailableError, UsageError

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Every request's latency, failed tries included; an agent's metrics page registers it.
REQUEST_SECONDS = Histogram(
    "rlaunch_etcd_request_seconds", "Latency of etcd requests (one try at one endpoint).", registry=None,
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str) -> list[Endpoint]:
    """Parse ``host:port[,host:port...]`` (an ``http://`` scheme is tolerated)."""
    out = []
    for part in text.split(","):
        part = part.strip()
        for scheme in ("http://", "https://"):
            if part.startswith(scheme):
                part = part[len(scheme) :]
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(
                f"The rendezvous endpoint {text!r} is not valid: write it as host:port, "
                "several separated by commas (for example 127.0.0.1:2379)."
            )
        out.append(Endpoint(host.strip("[]"), int(port)))
    return out


@dataclasses.dataclass(frozen=True)
class KV:
    """One key as read from etcd."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    key: str
    value: bytes
    deleted: bool
    mod_revision: int


def _kv(raw: Any) -> KV:
    return KV(
        key=raw.key.decode(),
        value=raw.value,
        create_revision=raw.create_revision,
        mod_revision=raw.mod_revision,
        lease=raw.lease,
    )


class Store:
    """An etcd v3 client for one job's agent, CLI command or test.

    ``timeout`` bounds each request. Methods raise :class:`StoreError` (and subclasses);
    nothing from aetcd or grpc escapes.
    """

    def __init__(self, endpoints: list[Endpoint], timeout: float = 5.0) -> None:
        if not endpoints:
            raise UsageError("At least one etcd endpoint is needed.")
        self.endpoints = endpoints
        self.timeout = timeout
        self._index = 0
        self._client: aetcd.Client | None = None

    @property
    def endpoint(self) -> Endpoint:
        return self.endpoints[self._index]

    def _describe(self) -> str:
        return ", ".join(str(e) for e in self.endpoints)

    async def connect(self, deadline_s: float, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """Wait until some endpoint answers a status request, for at most ``deadline_s``."""
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        last: Exception | None = None
        while True:
            try:
                await self._call(lambda c: c.status())
                return
            except StoreError as exc:
                last = exc
            remaining = end - loop.time()
            if remaining <= 0:
                break
            log.warning("etcd at %s is not answering yet (%s); retrying", self._describe(), last)
            await sleep(min(1.0, remaining))
        raise StoreUnavailableError(
            f"etcd at {self._describe()} did not answer within {deadline_s:.1f} s "
            f"({str(last).rstrip('.')}); "
            "check that etcd is running there and that --rdzv-endpoint is right."
        ) from last

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            try:
                await asyncio.wait_for(client.close(), self.timeout)
            except Exception:  # noqa: BLE001 - closing a broken channel is best effort
                log.debug("closing the etcd client failed", exc_info=True)

    def _open(self) -> aetcd.Client:
        if self._client is None:
            ep = self.endpoint
            # aetcd takes whole seconds for its per-request timeout.
            self._client = aetcd.Client(host=ep.host, port=ep.port, timeout=max(1, round(self.timeout)))
        return self._client

    async def _call(self, fn: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """Run ``fn`` against the current endpoint, moving on to the next when unreachable."""
        last: Exception | None = None
        for _ in range(len(self.endpoints)):
            ep = self.endpoint
            try:
                with REQUEST_SECONDS.time():
                    return await asyncio.wait_for(fn(self._open()), self.timeout + 1.0)
            except (
                aetcd.exceptions.ConnectionFailedError,
                aetcd.exceptions.ConnectionTimeoutError,
                asyncio.TimeoutError,
            ) as exc:
                last = exc
                await self.close()
                self._index = (self._index + 1) % len(self.endpoints)
                log.debug("etcd at %s failed (%r); trying the next endpoint", ep, exc)
            except aetcd.exceptions.ClientError as exc:
                raise StoreError(f"etcd at {ep} refused the request: {exc}.") from exc
        reason = (
            "did not answer in time"
            if isinstance(last, (asyncio.TimeoutError, aetcd.exceptions.ConnectionTimeoutError))
            else "is unreachable"
        )
        raise StoreUnavailableError(
            f"etcd at {self._describe()} {reason} (request timeout {self.timeout:.1f} s)."
        ) from last

    # -- keys ---------------------------------------------------------------------------------

    async def get(self, key: str) -> KV | None:
        raw = await self._call(lambda c: c.get(key.encode()))
        return _kv(raw) if raw is not None else None

    async def get_prefix(self, prefix: str) -> tuple[list[KV], int]:
        """All keys under ``prefix`` and the store revision they were read at."""
        rng = await self._call(lambda c: c.get_prefix(prefix.encode()))
        revision = rng.header.revision if rng.header is not None else 0
        return [_kv(kv) for kv in rng], revision

    async def get_at(self, key: str) -> tuple[KV | None, int]:
        """``key`` and the store revision it was read at (to start a watch right after).

        An exact read: the range ``[key, key + "\\0")`` holds ``key`` alone, so reading ``.../1``
        does not also transfer ``.../10`` and up (a prefix read would, making group setup O(N²)).
        """
        raw = key.encode()
        rng = await self._call(lambda c: c.get_range(raw, raw + b"\0"))
        revision = rng.header.revision if rng.header is not None else 0
        return next((_kv(kv) for kv in rng if kv.key == raw), None), revision

    async def count_prefix(self, prefix: str) -> int:
        """How many keys are under ``prefix`` (their keys alone are read, not their values)."""
        rng = await self._call(lambda c: c.get_prefix(prefix.encode(), keys_only=True))
        return sum(1 for _ in rng)

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        await self._call(lambda c: c.put(key.encode(), value, lease=lease))

    async def delete(self, key: str) -> None:
        await self._call(lambda c: c.delete(key.encode()))

    async def delete_prefix(self, prefix: str) -> None:
        await self._call(lambda c: c.delete_prefix(prefix.encode()))

    async def create(self, key: str, value: bytes, lease: int | None = None) -> bool:
        """Create ``key`` only if it does not exist; return whether it was created."""

        async def txn(c: aetcd.Client) -> bool:
            ok, _ = await c.transaction(
                compare=[c.transactions.version(key.encode()) == 0],
                success=[c.transactions.put(key.encode(), value, lease=lease)],
                failure=[],
            )
            return bool(ok)

        return await self._call(txn)

    async def create_all(
        self, items: list[tuple[str, bytes, int | None]], guard: tuple[str, int] | None = None
    ) -> bool:
        """Create every ``(key, value, lease)`` of ``items`` in one transaction, only if none exists.

        ``guard=(key, mod_revision)`` adds the condition that ``key`` is unchanged since then.
        """

        async def txn(c: aetcd.Client) -> bool:
            t = c.transactions
            compare = [t.version(k.encode()) == 0 for k, _, _ in items]
            if guard is not None:
                compare.append(t.mod(guard[0].encode()) == guard[1])
            ok, _ = await c.transaction(
                compare=compare, success=[t.put(k.encode(), v, lease=lease) for k, v, lease in items], failure=[]
            )
            return bool(ok)

        return await self._call(txn)

    async def put_guarded(
        self,
        key: str,
        value: bytes,
        mod_revision: int,
        lease: int | None = None,
        also: tuple[str, bytes] | None = None,
    ) -> bool:
        """Put ``key`` only if it is unchanged since ``mod_revision`` (0: absent).

        ``also=(key2, value2)`` adds the fencing condition that ``key2`` still holds ``value2``
        (the controller's leadership). Returns whether the write happened.
        """

        async def txn(c: aetcd.Client) -> bool:
            t = c.transactions
            compare = [t.mod(key.encode()) == mod_revision]
            if also is not None:
                compare.append(t.value(also[0].encode()) == also[1])
            ok, _ = await c.transaction(compare=compare, success=[t.put(key.encode(), value, lease=lease)], failure=[])
            return bool(ok)

        return await self._call(txn)

    async def delete_prefix_guarded(self, prefix: str, key: str, mod_revision: int) -> bool:
        """Delete everything under ``prefix`` only if ``key`` is unchanged since ``mod_revision``."""

        async def txn(c: aetcd.Client) -> bool:
            t = c.transactions
            ok, _ = await c.transaction(
                compare=[t.mod(key.encode()) == mod_revision],
                success=[t.delete(prefix.encode(), range_end=aetcd.utils.prefix_range_end(prefix.encode()))],
                failure=[],
            )
            return bool(ok)

        return await self._call(txn)

    # -- leases -------------------------------------------------------------------------------

    async def grant_lease(self, ttl: int) -> int:
        lease = await self._call(lambda c: c.lease(ttl))
        return int(lease.id)

    async def refresh_lease(self, lease_id: int) -> int:
        """Keep a lease alive; return its remaining TTL (0 or less: it has expired)."""
        reply = await self._call(lambda c: c.refresh_lease(lease_id))
        return int(reply.TTL) if reply is not None else 0

    async def revoke_lease(self, lease_id: int) -> None:
        await self._call(lambda c: c.revoke_lease(lease_id))

    async def lease_ttl(self, lease_id: int) -> tuple[int, int]:
        """``(granted, remaining)`` seconds of a lease; remaining is -1 once expired."""
        info = await self._call(lambda c: c.get_lease_info(lease_id, keys=False))
        return int(info.grantedTTL), int(info.TTL)

    # -- watches ------------------------------------------------------------------------------

    async def watch_prefix(
        self, prefix: str, start_revision: int | None = None, exact: bool = False
    ) -> AsyncIterator[WatchEvent]:
        """Yield changes under ``prefix`` (of the key ``prefix`` alone if ``exact``); raises
        :class:`StoreError` when the stream breaks."""
        try:
            client = self._open()
            raw = prefix.encode()
            opened = (
                client.watch(raw, start_revision=start_revision)
                if exact
                else client.watch_prefix(raw, start_revision=start_revision)
            )
            watch = await asyncio.wait_for(opened, self.timeout)
        except (aetcd.exceptions.ClientError, asyncio.TimeoutError) as exc:
            await self.close()
            raise StoreUnavailableError(f"etcd at {self.endpoint} refused a watch on {prefix}: {exc!r}.") from exc
        try:
            async for ev in watch:
                yield WatchEvent(
                    key=ev.kv.key.decode(),
                    value=ev.kv.value,
                    deleted=ev.kind == "DELETE",
                    mod_revision=ev.kv.mod_revision,
                )
        except aetcd.exceptions.ClientError as exc:
            await self.close()
            raise StoreUnavailableError(f"The watch on etcd at {self.endpoint} broke: {exc!r}.") from exc
        finally:
            try:
                await asyncio.wait_for(watch.cancel(), 1.0)
            except Exception:  # noqa: BLE001 - the stream may already be gone
                pass

    async def watch_many(
        self, ranges: Sequence[tuple[str, bool]], start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        """Yield changes of several ``(key_or_prefix, exact)`` ranges, merged, from ``start_revision``.

        One watch per range, so a reader follows just the keys it acts on instead of a whole job
        prefix. Raises :class:`StoreError` when any of them breaks. Close it (``aclosing``) to stop.
        """
        queue: asyncio.Queue[WatchEvent | BaseException] = asyncio.Queue()

        async def pump(key: str, exact: bool) -> None:
            try:
                async for ev in self.watch_prefix(key, start_revision=start_revision, exact=exact):
                    queue.put_nowait(ev)
            except BaseException as exc:  # noqa: BLE001 - handed to the reader below
                queue.put_nowait(exc)
                raise
            queue.put_nowait(StoreUnavailableError(f"The watch on {key} at etcd {self.endpoint} ended."))

        tasks = [asyncio.create_task(pump(key, exact)) for key, exact in ranges]
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    if isinstance(item, StoreError):
                        raise item
                    raise StoreUnavailableError(f"A watch on etcd at {self.endpoint} failed: {item!r}.") from item
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
