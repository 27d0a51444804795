"""The agent's local control socket: how workers reach their own agent (never etcd).

A Unix socket in a private temporary directory. Each message, either way, is one frame: a 4-byte
big-endian length, then that many bytes of JSON (an object). Frames have no size limit below
:data:`MAX_FRAME` (a line protocol on asyncio's ``readline`` stops at 64 KiB, which a large
group's store values can pass). Workers find the socket in ``RLAUNCH_AGENT_ADDR``. Requests are
``{"op": NAME, ...}``; the agent registers one handler per op. An unknown op or a handler error
answers ``{"error": sentence}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

#: The frame header: the payload's length in bytes.
HEADER = struct.Struct(">I")
#: The largest frame either side accepts (a sanity bound against a corrupt header, not a limit
#: any store value comes near).
MAX_FRAME = 1 << 30


def frame(message: dict[str, Any]) -> bytes:
    """One message as a frame: its length, then its JSON."""
    payload = json.dumps(message).encode()
    return HEADER.pack(len(payload)) + payload


def frame_length(header: bytes) -> int:
    """The payload length a frame header announces; refuses one past :data:`MAX_FRAME`."""
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise ValueError(f"A control frame announced {length} bytes, more than the {MAX_FRAME} allowed.")
    return int(length)


class ControlServer:
    """The socket and its handlers. Its directory is made when it starts and removed when it closes,
    so an agent that ends before it serves (a refused rendezvous, a port taken) leaves nothing behind."""

    def __init__(self) -> None:
        self._dir: str | None = None
        self._handlers: dict[str, Handler] = {}
        self._server: asyncio.base_events.Server | None = None

    @property
    def path(self) -> str:
        """The socket's path (workers get it in ``RLAUNCH_AGENT_ADDR``); there is none before :meth:`start`."""
        if self._dir is None:
            raise RuntimeError("The agent's control socket has no path before the server starts.")
        return os.path.join(self._dir, "control.sock")

    def register(self, op: str, handler: Handler) -> None:
        self._handlers[op] = handler

    async def start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="rlaunch-agent-")
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    header = await reader.readexactly(HEADER.size)
                except asyncio.IncompleteReadError:
                    break  # the worker closed its connection between requests
                payload = await reader.readexactly(frame_length(header))
                try:
                    request = json.loads(payload)
                    handler = self._handlers.get(request.get("op", ""))
                    if handler is None:
                        reply = {"error": f"The agent does not know the request {request.get('op')!r}."}
                    else:
                        reply = await handler(request)
                except Exception as exc:  # noqa: BLE001 - a bad request must not kill the agent
                    reply = {"error": f"The request {payload[:200]!r} failed: {exc}."}
                writer.write(frame(reply))
                await writer.drain()
        except (ConnectionError, ValueError, asyncio.IncompleteReadError, asyncio.CancelledError) as exc:
            if isinstance(exc, ValueError):
                log.warning("closing a worker's control connection: %s", exc)
            # otherwise the worker went away, or the agent is shutting down
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
