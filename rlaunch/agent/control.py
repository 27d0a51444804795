"""The agent's local control socket: how workers reach their own agent (never etcd).

A Unix socket in a private temporary directory, speaking one JSON object per line each way.
Workers find it in ``RLAUNCH_AGENT_ADDR``. Requests are ``{"op": NAME, ...}``; the agent
registers one handler per op. An unknown op or a handler error answers ``{"error": sentence}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlServer:
    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="rlaunch-agent-")
        self.path = os.path.join(self._dir, "control.sock")
        self._handlers: dict[str, Handler] = {}
        self._server: asyncio.base_events.Server | None = None

    def register(self, op: str, handler: Handler) -> None:
        self._handlers[op] = handler

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    request = json.loads(line)
                    handler = self._handlers.get(request.get("op", ""))
                    if handler is None:
                        reply = {"error": f"The agent does not know the request {request.get('op')!r}."}
                    else:
                        reply = await handler(request)
                except Exception as exc:  # noqa: BLE001 - a bad request must not kill the agent
                    reply = {"error": f"The request {line[:200]!r} failed: {exc}."}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the worker went away, or the agent is shutting down
        finally:
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        shutil.rmtree(self._dir, ignore_errors=True)
