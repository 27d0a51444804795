"""A worker's connection to its own agent: JSON lines over the agent's Unix socket.

One connection per thread, so a thread blocked in a long wait (a store ``get``, the wait for a
plan) never holds up another. Workers talk only to their agent, never to etcd.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any


class AgentLinkError(RuntimeError):
    """The agent refused a request or could not be reached."""


class AgentLink:
    def __init__(self, path: str, local_rank: int) -> None:
        self.path = path
        self.local_rank = local_rank
        self._local = threading.local()

    def _conn(self) -> tuple[socket.socket, Any]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
            except OSError as exc:
                raise AgentLinkError(
                    f"This worker cannot reach its rlaunch agent at {self.path} ({exc}); was it started by rlaunch?"
                ) from exc
            conn = (sock, sock.makefile("rb"))
            self._local.conn = conn
        return conn  # type: ignore[no-any-return]

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        sock, reader = self._conn()
        sock.sendall(json.dumps({"op": op, "local_rank": self.local_rank, **fields}).encode() + b"\n")
        line = reader.readline()
        if not line:
            self._local.conn = None
            raise AgentLinkError(f"The rlaunch agent at {self.path} closed the connection during {op!r}.")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise AgentLinkError(reply["error"])
        return reply
