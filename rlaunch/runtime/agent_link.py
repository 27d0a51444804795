"""A worker's connection to its own agent: length-prefixed JSON frames over the agent's Unix socket.

One connection per thread, so a thread blocked in a long wait (a store ``get``, the wait for a
plan) never holds up another. Workers talk only to their agent, never to etcd. The frame format
(a 4-byte big-endian length, then JSON) is :mod:`rlaunch.agent.control`'s; a frame has no size
limit that a store value comes near.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from typing import Any

#: The frame header: the payload's length in bytes (as :data:`rlaunch.agent.control.HEADER`).
_HEADER = struct.Struct(">I")


class AgentLinkError(RuntimeError):
    """The agent refused a request or could not be reached."""


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``; fewer only if the agent closed the connection."""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class AgentLink:
    def __init__(self, path: str, local_rank: int) -> None:
        self.path = path
        self.local_rank = local_rank
        self._local = threading.local()

    def _conn(self) -> socket.socket:
        sock = getattr(self._local, "conn", None)
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise AgentLinkError(
                    f"This worker cannot reach its rlaunch agent at {self.path} ({exc}); was it started by rlaunch?"
                ) from exc
            self._local.conn = sock
        return sock  # type: ignore[no-any-return]

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        sock = self._conn()
        payload = json.dumps({"op": op, "local_rank": self.local_rank, **fields}).encode()
        sock.sendall(_HEADER.pack(len(payload)) + payload)
        header = _read_exactly(sock, _HEADER.size)
        body = _read_exactly(sock, _HEADER.unpack(header)[0]) if len(header) == _HEADER.size else b""
        if len(header) < _HEADER.size or len(body) < _HEADER.unpack(header)[0]:
            self._local.conn = None
            sock.close()
            raise AgentLinkError(f"The rlaunch agent at {self.path} closed the connection during {op!r}.")
        reply: dict[str, Any] = json.loads(body)
        if "error" in reply:
            raise AgentLinkError(reply["error"])
        return reply
