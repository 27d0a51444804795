"""A lease's renewals on one LeaseKeepAlive stream of its own, as etcd's own clients send them.

aetcd's ``refresh_lease`` opens a gRPC stream for each renewal and drops it after the answer: at
etcd and in the agent, every renewal set a stream up and tore it down (4,096 agents renewing every
TTL/3 of a 30 s lease: 410 streams a second; in a fault's window they shared the two cores with
the plan's delivery). Here a lease's renewals go on one stream, opened at its first renewal and
kept while it answers: a renewal is one request written and its answer read.

Renewals of one stream take turns (a lock), and a renewal that fails or is given up on (its
timeout, a cancel) ends its stream: its answer may still come, and no later renewal may take it
for its own. So does an answer that the lease is gone or expiring (TTL 0), and so has a stream
that gRPC finished meanwhile (etcd restarted, the connection broke). The next renewal opens a new
stream, on the client's channel of the time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd.exceptions
import aetcd.rpc
import grpc

from rlaunch.store.watches import raise_translated


class StreamEnded(Exception):
    """The stream had ended before this renewal sent anything: renew on a new one."""


class KeepAliveStream:
    """One open LeaseKeepAlive stream of one lease, on ``channel`` (the one ``stub`` calls on)."""

    def __init__(self, stub: Any, channel: Any, lease_id: int, metadata: Any, timeout: float) -> None:
        self.channel = channel
        self.lease_id = lease_id
        self._call = stub.LeaseKeepAlive(metadata=metadata)  # no deadline: the stream lives on
        self._timeout = timeout
        self._turn = asyncio.Lock()
        self._ended = False

    @property
    def ended(self) -> bool:
        """Ended here, or finished by gRPC (etcd or the connection ended it)."""
        return self._ended or self._call.done()

    async def renew(self) -> int:
        """Renew the lease once; its remaining TTL as etcd answers it (0: etcd knows no such lease).

        Raises :class:`StreamEnded` when the stream had ended before; aetcd's
        :class:`~aetcd.exceptions.ClientError` when it fails now (a write or read on a call gRPC
        just finished, which raises no status, as ``ConnectionFailedError``); and
        :class:`asyncio.TimeoutError` when no answer came within the timeout. Each ends the stream.
        """
        async with self._turn:
            if self.ended:
                self.end()
                raise StreamEnded
            try:
                await self._call.write(aetcd.rpc.LeaseKeepAliveRequest(ID=self.lease_id))
                reply = await asyncio.wait_for(self._call.read(), self._timeout)
            except (aetcd.rpc.AioRpcError, asyncio.CancelledError, asyncio.TimeoutError) as exc:
                self.end()
                raise_translated(exc)
            except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:  # gRPC's: the call is finished
                self.end()
                raise aetcd.exceptions.ConnectionFailedError(f"the lease's keepalive stream failed: {exc!r}") from exc
            if reply is grpc.aio.EOF:
                self.end()
                raise aetcd.exceptions.ConnectionFailedError("etcd ended the lease's keepalive stream")
            if reply.TTL <= 0:
                self.end()  # the lease is gone (or goes this second): no stream stays open for it
            return int(reply.TTL)

    def end(self) -> None:
        """Cancel the stream (once); a renewal after it raises :class:`StreamEnded`."""
        if not self._ended:
            self._ended = True
            self._call.cancel()
