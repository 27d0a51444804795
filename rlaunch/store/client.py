"""The etcd boundary: an asyncio client over aetcd that speaks rlaunch's errors.

Only this module imports aetcd. Every call carries a timeout (a server that accepts TCP but
never answers would otherwise hang for 20 s), tries the next endpoint when one is unreachable,
and translates client exceptions into :class:`~rlaunch.errors.StoreError` subclasses whose
messages name the endpoint.

The channel is TLS when :class:`~rlaunch.store.security.EtcdSecurity` says so (aetcd itself only
opens plaintext channels, hence :class:`_Client`), and user credentials are sent once per
connection; a token etcd no longer knows (it restarted) is renewed on the spot. A failed TLS
handshake or a refused user is a :class:`~rlaunch.errors.StoreAccessError` at once, with a
sentence naming the problem, not a retry until the deadline. A call that fails or times out
never closes the connection that the other calls and the watches share: gRPC reconnects on its
own (with short backoff, and keepalive pings that notice a dead peer).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

# gRPC logs an INFO line on every fork() while a channel is open (each worker spawn).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import aetcd  # noqa: E402
import aetcd.exceptions  # noqa: E402
import aetcd.rpc  # noqa: E402
import aetcd.utils  # noqa: E402
import aetcd.watcher  # noqa: E402
import grpc  # noqa: E402
from prometheus_client import Histogram  # noqa: E402

from rlaunch.addresses import host_port
from rlaunch.errors import StoreAccessError, StoreError, StoreUnavailableError, UsageError  # noqa: E402
from rlaunch.store.keepalive import KeepAliveStream, StreamEnded  # noqa: E402
from rlaunch.store.security import EtcdSecurity  # noqa: E402
from rlaunch.store.watches import WatchStream, WatchStreams  # noqa: E402
from rlaunch.waiting import wait_event  # noqa: E402

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Every request's latency, failed tries included; an agent's metrics page registers it.
REQUEST_SECONDS = Histogram(
    "rlaunch_etcd_request_seconds", "Latency of etcd requests (one try at one endpoint).", registry=None,
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)  # fmt: skip
#: gRPC options of every channel. Subchannels are shared process-wide by default, and with them
#: the reconnect backoff, which grows to 2 minutes while etcd is down: a reopened client would
#: then keep failing long after etcd is back, past the TTL + 1 s by which a new etcd leader
#: expects lease renewals. Each client gets its own subchannel, retried at least every second,
#: and an idle connection is pinged so that a peer gone silent is noticed. (Not
#: ``grpc.min_reconnect_backoff_ms``: gRPC takes it as the timeout of one connection attempt, and
#: at 200 ms a loaded machine failed handshakes with "timed out before receiving SETTINGS frame".)
CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.use_local_subchannel_pool": 1,
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}


@dataclasses.dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    #: "http", "https", or "" when the endpoint was written without a scheme
    scheme: str = dataclasses.field(default="", compare=False)

    def __str__(self) -> str:
        return host_port(self.host, self.port)


def parse_endpoints(text: str) -> list[Endpoint]:
    """Parse ``[scheme://]host:port[,...]``; the scheme (http or https) is kept on each endpoint."""
    out = []
    for part in text.split(","):
        part = part.strip()
        scheme = ""
        for name in ("http", "https"):
            if part.startswith(name + "://"):
                scheme, part = name, part[len(name) + 3 :]
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(
                f"The rendezvous endpoint {text!r} is not valid: write it as host:port, "
                "several separated by commas (for example 127.0.0.1:2379, or https://etcd-a:2379 for TLS)."
            )
        out.append(Endpoint(host.strip("[]"), int(port), scheme))
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
    """One change of a key: its value, or its deletion (``mod_revision`` is then the deletion's)."""

    key: str
    value: bytes
    deleted: bool
    mod_revision: int
    create_revision: int
    lease: int

    def kv(self) -> KV:
        """The key as a read would have returned it just after this change (a put)."""
        return KV(self.key, self.value, self.create_revision, self.mod_revision, self.lease)


def _kv(raw: Any) -> KV:
    return KV(
        key=raw.key.decode(),
        value=raw.value,
        create_revision=raw.create_revision,
        mod_revision=raw.mod_revision,
        lease=raw.lease,
    )


class _Client(aetcd.Client):  # type: ignore[misc]
    """aetcd's client, over a TLS channel when ``credentials`` are given, with token renewal."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: int,
        credentials: grpc.ChannelCredentials | None,
        username: str | None,
        password: str | None,
    ) -> None:
        super().__init__(
            host=host, port=port, username=username, password=password, timeout=timeout, options=CHANNEL_OPTIONS
        )
        self._credentials = credentials
        self._is_connecting: bool = False
        self._closed = False  # a closed client never connects again (its channel would never be closed)
        #: this client's watch streams (see rlaunch.store.watches; aetcd's own watch methods are not used)
        self.watches = WatchStreams(self._new_stream)
        #: per lease, the stream its renewals go on (see rlaunch.store.keepalive)
        self._keepalives: dict[int, KeepAliveStream] = {}

    async def connect(self) -> None:
        # aetcd's connect(), with the channel made secure when asked and auth errors translated.
        if self._connected.is_set():
            return
        if self._closed:
            raise aetcd.exceptions.ConnectionFailedError("the etcd client was closed")
        if self._is_connecting:
            if not await wait_event(self._connected, self._connect_wait_timeout):
                raise asyncio.TimeoutError(
                    f"no connection to etcd at {host_port(self._host, self._port)} within the wait"
                )
            return
        try:
            self._is_connecting = True
            target = host_port(self._host, self._port)
            options = list(self._options.items())
            if self._credentials is not None:
                self.channel = grpc.aio.secure_channel(target, self._credentials, options=options)
            else:
                self.channel = grpc.aio.insecure_channel(target, options=options)
            if self._username is not None:
                self.auth_stub = aetcd.rpc.AuthStub(self.channel)
                await self.authenticate()
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self.watches.renew()  # a new channel: watches made from now on go on a stream of it
            self._connected.set()
        except BaseException:
            if self.channel is not None:
                await self.channel.close()
            self._init_channel_attrs()
            raise
        finally:
            self._is_connecting = False

    async def authenticate(self) -> None:
        """Get a fresh token for the user (etcd forgets tokens when it restarts)."""
        request = aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password)
        try:
            reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
        except aetcd.rpc.AioRpcError as exc:
            aetcd.exceptions._handle_exception(exc)
        self.metadata = (("token", reply.token),)
        self.watches.renew()  # a stream's token is the one it opened with: later watches on a new one

    async def close(self) -> None:
        self._closed = True
        for stream in self._keepalives.values():
            stream.end()
        try:
            await self.watches.close()
        finally:
            await super().close()

    async def renew_lease(self, lease_id: int) -> int:
        """Renew a lease on its keepalive stream (a new one if it has none open); its remaining TTL."""
        await self.connect()
        for _ in range(2):  # a stream that ended while this renewal waited for its turn is replaced once
            stream = self._keepalives.get(lease_id)
            if stream is None or stream.ended or stream.channel is not self.channel:
                if stream is not None:
                    stream.end()
                stream = KeepAliveStream(self.leasestub, self.channel, lease_id, self.metadata, self._timeout)
                self._keepalives[lease_id] = stream
            try:
                remaining = await stream.renew()
            except StreamEnded:
                continue
            if remaining <= 0:
                self.forget_lease(lease_id)  # gone: its (ended) stream is not kept
            return remaining
        raise aetcd.exceptions.ConnectionFailedError(
            f"the keepalive streams of lease {lease_id:x} at {host_port(self._host, self._port)} ended as each "
            "was opened"
        )

    def forget_lease(self, lease_id: int) -> None:
        """End the lease's keepalive stream, if it has one (the lease is being revoked)."""
        stream = self._keepalives.pop(lease_id, None)
        if stream is not None:
            stream.end()

    def _new_stream(self, on_end: Callable[[WatchStream], None]) -> WatchStream:
        """A watch stream on this client's channel (opened at its first watch)."""
        return WatchStream(aetcd.rpc.WatchStub(self.channel), self._timeout, self._stream_metadata(), on_end)

    def _stream_metadata(self) -> tuple[tuple[str, str], ...]:
        """A watch stream's gRPC metadata: the token, if any, and ``hasleader``, with which etcd ends
        the stream ("no leader") when its member has lost the leader (cut off from the others, it
        would keep the stream open and deliver nothing more)."""
        return (*(self.metadata or ()), ("hasleader", "true"))


def _credentials(security: EtcdSecurity) -> grpc.ChannelCredentials | None:
    if not security.tls:
        return None

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise UsageError(f"The TLS file {path!r} could not be read ({exc.strerror}); check the path.") from exc

    return grpc.ssl_channel_credentials(
        root_certificates=read(security.cacert), private_key=read(security.key), certificate_chain=read(security.cert)
    )


def access_problem(ep: Endpoint, security: EtcdSecurity, error: str) -> str | None:
    """The sentence for a client error that retrying cannot fix (TLS, credentials), else None."""
    low = error.lower()
    if "certificate_verify_failed" in low:
        roots = f"the CA in --cacert {security.cacert}" if security.cacert else "the system's root certificates"
        return (
            f"etcd at {ep} presented a TLS certificate that {roots} cannot verify; pass --cacert with the CA "
            "that signed etcd's certificate (etcd's --trusted-ca-file or the CA of its --cert-file)."
        )
    if "not in peer certificate" in low or "peer name" in low:
        return (
            f"etcd at {ep} presented a TLS certificate that is not valid for the host {ep.host!r}; "
            "connect to a name or address listed in the certificate."
        )
    if "alert_bad_certificate" in low or "alert_unknown_ca" in low or "certificate_required" in low:
        if security.cert:
            return (
                f"etcd at {ep} rejected this client's TLS certificate {security.cert}; give a --cert and --key "
                "signed by a CA that etcd trusts (its --trusted-ca-file)."
            )
        return (
            f"etcd at {ep} requires a TLS client certificate; pass --cert and --key (or ETCDCTL_CERT and ETCDCTL_KEY)."
        )
    if security.tls and "handshake" in low:
        return (
            f"etcd at {ep} did not complete a TLS handshake; it may serve plaintext: check the endpoint's "
            "scheme (http:// or https://) and etcd's --listen-client-urls."
        )
    if "authentication failed" in low:
        return (
            f"etcd at {ep} rejected the user name or password of user {security.user!r}; check --user "
            "USER:PASSWORD (or ETCDCTL_USER and ETCDCTL_PASSWORD)."
        )
    if "user name is empty" in low:
        return f"etcd at {ep} has authentication enabled; pass --user USER:PASSWORD (or set ETCDCTL_USER)."
    if "permission denied" in low and not security.user:
        return (
            f"etcd at {ep} refused this client access to rlaunch's keys: it has authentication enabled and "
            "no user was given (etcd then takes a client certificate's common name as the user); pass --user "
            "USER:PASSWORD (or set ETCDCTL_USER)."
        )
    if "permission denied" in low:
        who = f"user {security.user!r}"
        return (
            f"etcd at {ep} denied {who} access to rlaunch's keys; grant its role read and write on the "
            "prefix /rlaunch/ (etcdctl role grant-permission ROLE readwrite /rlaunch/ --prefix)."
        )
    if "authentication is not enabled" in low:
        return f"etcd at {ep} has authentication disabled, so --user {security.user!r} cannot be used; drop --user."
    return None


def _speaks_tls(ep: Endpoint, timeout: float) -> bool:
    """Whether ``ep`` answers a TLS client hello (asked only when a plaintext connection is closed on us)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((ep.host, ep.port), timeout) as raw, ctx.wrap_socket(raw) as tls:
            return tls.version() is not None
    except ssl.SSLError as exc:
        # A server that asks for a client certificate may end the handshake with an alert: still TLS.
        return "alert" in str(exc).lower()
    except OSError:
        return False


def _renews_token(exc: Exception) -> bool:
    text = str(exc).lower()
    return "invalid auth token" in text or "auth store is old" in text


class Store:
    """An etcd v3 client for one job's agent, CLI command or test.

    ``timeout`` bounds each request. Methods raise :class:`StoreError` (and subclasses);
    nothing from aetcd or grpc escapes.
    """

    def __init__(self, endpoints: list[Endpoint], timeout: float = 5.0, security: EtcdSecurity | None = None) -> None:
        if not endpoints:
            raise UsageError("At least one etcd endpoint is needed.")
        self.endpoints = endpoints
        self.timeout = timeout
        self.security = security or EtcdSecurity()
        if self.security.tls and any(e.scheme == "http" for e in endpoints):
            raise UsageError("TLS was asked for, but the etcd endpoints are http://; write them as https://.")
        if self.security.user and not self.security.tls:
            log.warning(
                "the password of etcd user %r goes to etcd at %s in plaintext; use https:// endpoints",
                self.security.user,
                self._describe(),
            )
        self._credentials = _credentials(self.security)
        self._index = 0
        self._clients: dict[int, _Client] = {}
        self._closed = False  # see close()

    def sibling(self, timeout: float) -> Store:
        """A client of its own to the same etcd (endpoints, and credentials where there are any)."""
        return Store(self.endpoints, timeout, security=self.security)

    @property
    def endpoint(self) -> Endpoint:
        return self.endpoints[self._index]

    def _describe(self) -> str:
        return ", ".join(str(e) for e in self.endpoints)

    async def connect(self, deadline_s: float, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """Wait until some endpoint answers a status request, for at most ``deadline_s``.

        A TLS or credentials problem ends the wait at once with :class:`StoreAccessError`.
        """
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline_s
        last: Exception | None = None
        probed = False
        while True:
            try:
                await self._call(lambda c: c.status())
                return
            except StoreAccessError:
                raise
            except StoreError as exc:
                last = exc
            if not self.security.tls and not probed and "socket closed" in str(last.__cause__).lower():
                probed = True
                ep = self.endpoint
                if await asyncio.to_thread(_speaks_tls, ep, min(2.0, self.timeout)):
                    raise StoreAccessError(
                        f"etcd at {ep} serves TLS, but this client was set up for plaintext; write the endpoint "
                        f"as https://{ep} and pass --cacert (and --cert and --key if etcd asks for a client "
                        "certificate)."
                    ) from last
            remaining = end - loop.time()
            if remaining <= 0:
                break
            log.warning("etcd at %s is not answering yet (%s); retrying", self._describe(), str(last).rstrip("."))
            await sleep(min(1.0, remaining))
        raise StoreUnavailableError(
            f"etcd at {self._describe()} did not answer within {deadline_s:.1f} s "
            f"({str(last).rstrip('.')}); "
            "check that etcd is running there and that --rdzv-endpoint is right."
        ) from last

    async def close(self) -> None:
        """Close every connection; a request made after (a task that outlived the store) fails with
        :class:`StoreError` instead of opening a connection nothing would close."""
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            try:
                await asyncio.wait_for(client.close(), self.timeout)
            except Exception:  # noqa: BLE001 - closing a broken channel is best effort
                log.debug("closing the etcd client failed", exc_info=True)

    def _open(self) -> _Client:
        if self._closed:
            raise self._closed_error()
        client = self._clients.get(self._index)
        if client is None:
            ep = self.endpoint
            # aetcd takes whole seconds for its per-request timeout.
            client = _Client(
                ep.host, ep.port, max(1, round(self.timeout)), self._credentials,
                self.security.user, self.security.password,
            )  # fmt: skip
            self._clients[self._index] = client
        return client

    def _closed_error(self) -> StoreError:
        return StoreError(f"The client of etcd at {self._describe()} was closed; nothing more is sent through it.")

    async def _log_in_again(self, client: _Client) -> None:
        """Renew ``client``'s token (etcd restarted and forgot it); a failure shows in the retry."""
        with contextlib.suppress(aetcd.exceptions.ClientError, asyncio.TimeoutError):
            await asyncio.wait_for(client.authenticate(), self.timeout)

    def _next_endpoint(self, ep: Endpoint, exc: Exception) -> None:
        if len(self.endpoints) > 1 and self.endpoint == ep:
            self._index = (self._index + 1) % len(self.endpoints)
            log.debug("etcd at %s failed (%r); trying the next endpoint", ep, exc)

    async def _call(self, fn: Callable[[_Client], Awaitable[T]]) -> T:
        """Run ``fn`` against the current endpoint, moving on to the next when unreachable.

        A failure never closes a client: other tasks' calls and watches share it.
        """
        last: BaseException | None = None
        renewed = False
        attempts = len(self.endpoints)
        while attempts > 0:
            attempts -= 1
            ep = self.endpoint
            client = self._open()
            try:
                with REQUEST_SECONDS.time():
                    return await asyncio.wait_for(fn(client), self.timeout + 1.0)
            except (
                aetcd.exceptions.ConnectionFailedError,
                aetcd.exceptions.ConnectionTimeoutError,
                asyncio.TimeoutError,
            ) as exc:
                problem = access_problem(ep, self.security, str(exc))
                if problem:
                    raise StoreAccessError(problem) from exc
                last = exc
                self._next_endpoint(ep, exc)
            except aetcd.exceptions.ClientError as exc:
                if not renewed and self.security.user and _renews_token(exc):
                    # etcd restarted and forgot the token: log in again and retry once.
                    renewed = True
                    attempts += 1
                    await self._log_in_again(client)
                    continue
                problem = access_problem(ep, self.security, str(exc))
                if problem:
                    raise StoreAccessError(problem) from exc
                raise StoreError(f"etcd at {ep} refused the request: {exc}.") from exc
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is None or getattr(task, "cancelling", lambda: 1)():
                    raise  # this task is being cancelled
                # gRPC cancels the calls of a channel that another task closed after its own
                # failure: this call did not fail, it is tried again on a fresh client.
                last = exc
                log.debug("a call to etcd at %s was cut by a closed channel; retrying", ep)
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

    async def get_after(self, start: str, prefix: str) -> list[KV]:
        """The keys under ``prefix`` from ``start`` on, in key order: the tail of keys that sort by
        time (events), read without the older ones."""
        end = aetcd.utils.prefix_range_end(prefix.encode())
        rng = await self._call(lambda c: c.get_range(start.encode(), end))
        return [_kv(kv) for kv in rng]

    async def get_at(self, key: str) -> tuple[KV | None, int]:
        """``key`` and the store revision it was read at (to start a watch right after).

        An exact read: the range ``[key, key + "\\0")`` holds ``key`` alone, so reading ``.../1``
        does not also transfer ``.../10`` and up (a prefix read would, making group setup O(N²)).
        """
        raw = key.encode()
        rng = await self._call(lambda c: c.get_range(raw, raw + b"\0"))
        revision = rng.header.revision if rng.header is not None else 0
        return next((_kv(kv) for kv in rng if kv.key == raw), None), revision

    async def keys_under(self, prefix: str) -> list[str]:
        """The keys under ``prefix`` (their values are not read)."""
        rng = await self._call(lambda c: c.get_prefix(prefix.encode(), keys_only=True))
        return [kv.key.decode() for kv in rng]

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        await self._call(lambda c: c.put(key.encode(), value, lease=lease))

    async def put_all(self, items: Sequence[tuple[str, bytes]], lease: int | None = None) -> None:
        """Put every ``(key, value)`` of ``items`` in one transaction (one request)."""

        async def txn(c: aetcd.Client) -> None:
            t = c.transactions
            await c.transaction(compare=[], success=[t.put(k.encode(), v, lease=lease) for k, v in items], failure=[])

        await self._call(txn)

    async def put_each(self, items: Sequence[tuple[str, bytes, int | None]]) -> None:
        """Put every ``(key, value, lease)`` of ``items`` in one transaction (one request)."""

        async def txn(c: aetcd.Client) -> None:
            t = c.transactions
            await c.transaction(compare=[], success=[t.put(k.encode(), v, lease=le) for k, v, le in items], failure=[])

        await self._call(txn)

    async def delete(self, key: str) -> None:
        await self._call(lambda c: c.delete(key.encode()))

    async def delete_prefix(self, prefix: str) -> None:
        await self._call(lambda c: c.delete_prefix(prefix.encode()))

    async def create(self, key: str, value: bytes, lease: int | None = None) -> int:
        """Create ``key`` only if it does not exist; return its create revision (0: not created).

        The revision names this one creation: a key deleted and created again, with the same value
        or not, has another (the controller's election term).
        """

        async def txn(c: aetcd.Client) -> bool:
            ok, _ = await c.transaction(
                compare=[c.transactions.version(key.encode()) == 0],
                success=[c.transactions.put(key.encode(), value, lease=lease)],
                failure=[],
            )
            return bool(ok)

        if not await self._call(txn):
            return 0
        kv = await self.get(key)
        # gone again (its lease expired meanwhile) or made by another lease: not this creation
        return kv.create_revision if kv is not None and kv.value == value and kv.lease == (lease or 0) else 0

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
        fence: tuple[str, int] | None = None,
        also: Sequence[tuple[str, bytes]] = (),
    ) -> bool:
        """Put ``key`` only if it is unchanged since ``mod_revision`` (0: absent).

        ``fence=(key2, create_revision)`` adds the condition that ``key2`` is still the one created
        at that revision (the controller's leadership, from :meth:`create`: a key
        re-created since, even with the same value, fails it). ``also``: more ``(key, value)`` puts
        in the same transaction (without a lease). Returns whether the write happened.
        """

        async def txn(c: aetcd.Client) -> bool:
            t = c.transactions
            compare = [t.mod(key.encode()) == mod_revision]
            if fence is not None:
                compare.append(t.create(fence[0].encode()) == fence[1])
            puts = [t.put(key.encode(), value, lease=lease), *(t.put(k.encode(), v) for k, v in also)]
            ok, _ = await c.transaction(compare=compare, success=puts, failure=[])
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
        """Keep a lease alive; return its remaining TTL (0 or less: it has expired). A lease's renewals
        go on one stream of their own (see rlaunch.store.keepalive)."""
        return await self._call(lambda c: self._renew_on(c, lease_id))

    async def _renew_on(self, client: _Client, lease_id: int) -> int:
        """Renew through ``client`` (the current endpoint's); the lease's streams to other endpoints end."""
        for other in self._clients.values():
            if other is not client:
                other.forget_lease(lease_id)
        return await client.renew_lease(lease_id)

    async def revoke_lease(self, lease_id: int) -> None:
        for client in self._clients.values():
            client.forget_lease(lease_id)
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
        :class:`StoreError` when the stream breaks.

        A broken stream gets a new one at the next watch; the connection itself stays open.
        """
        ep = self.endpoint
        client = self._open()
        raw = prefix.encode()
        renewed = False
        while True:
            try:
                await asyncio.wait_for(client.connect(), self.timeout)
                watch = await client.watches.open(
                    raw, None if exact else aetcd.utils.prefix_range_end(raw), start_revision, self.timeout
                )
                break
            except (aetcd.exceptions.ClientError, asyncio.TimeoutError) as exc:
                if not renewed and self.security.user and (_renews_token(exc) or "permission denied" in str(exc)):
                    # etcd restarted and forgot the token the stream opened with (a stream opened
                    # with a stale token is refused as "permission denied"): log in again, once.
                    renewed = True
                    await self._log_in_again(client)
                    continue
                self._watch_failed(ep, exc)
                raise StoreUnavailableError(f"etcd at {ep} refused a watch on {prefix}: {exc!r}.") from exc
        try:
            async for ev in watch.events():
                if (ev.kv.key != raw) if exact else (not ev.kv.key.startswith(raw)):
                    # Watches are made so that this cannot happen (rlaunch.store.watches); were it
                    # to, the watch ends (cancelling the id it holds) and is made again, not
                    # followed silently.
                    raise StoreUnavailableError(
                        f"The watch on {prefix} at etcd {ep} delivered a change of "
                        f"{ev.kv.key.decode(errors='replace')!r}, which it does not cover (the etcd client mixed "
                        "up two watches); watch again."
                    )
                yield WatchEvent(
                    key=ev.kv.key.decode(),
                    value=ev.kv.value,
                    deleted=ev.kind == "DELETE",
                    mod_revision=ev.kv.mod_revision,
                    create_revision=ev.kv.create_revision,
                    lease=ev.kv.lease,
                )
        except aetcd.exceptions.ClientError as exc:
            self._watch_failed(ep, exc)  # a broken stream retired itself (a compaction leaves it in use)
            raise StoreUnavailableError(f"The watch on etcd at {ep} broke: {exc!r}.") from exc
        finally:
            cancelling = watch.close()  # started now, even if this task is cancelled while it waits
            with contextlib.suppress(Exception):  # the stream may already be gone
                await asyncio.wait_for(asyncio.shield(cancelling), 1.0)

    def _watch_failed(self, ep: Endpoint, exc: BaseException) -> None:
        if self._closed:
            raise self._closed_error() from exc  # the store closed under it: no member failed
        problem = access_problem(ep, self.security, str(exc))
        if problem:
            raise StoreAccessError(problem) from exc
        unanswered = (aetcd.exceptions.ConnectionFailedError, aetcd.exceptions.WatchTimeoutError, asyncio.TimeoutError)
        if isinstance(exc, unanswered):
            self._next_endpoint(ep, exc)

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
