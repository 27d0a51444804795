"""A c10d ``Store`` kept in etcd, reached through the worker's agent.

Groups are built on it (each generation on a fresh key prefix), so no rendezvous store lives in
a worker or agent that may leave the job: draining the node of rank 0 is like draining any other.
"""

from __future__ import annotations

import base64
import datetime
from collections.abc import Sequence

from torch.distributed import Store

from rlaunch.runtime.agent_link import AgentLink


def _b64(value: bytes | str) -> str:
    raw = value.encode() if isinstance(value, str) else bytes(value)
    return base64.b64encode(raw).decode()


class AgentStore(Store):  # type: ignore[misc]
    def __init__(self, link: AgentLink, timeout: datetime.timedelta = datetime.timedelta(seconds=300)) -> None:
        super().__init__()
        self._link = link
        self._timeout = timeout

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout

    def _seconds(self, timeout: datetime.timedelta | None) -> float:
        t = timeout if timeout is not None and timeout.total_seconds() > 0 else self._timeout
        return t.total_seconds()

    def set(self, key: str, value: bytes | str) -> None:
        self._link.call("kv_set", key=key, value=_b64(value))

    def get(self, key: str) -> bytes:
        reply = self._link.call("kv_get", key=key, timeout=self._seconds(None))
        return base64.b64decode(reply["value"])

    def add(self, key: str, amount: int) -> int:
        return int(self._link.call("kv_add", key=key, amount=int(amount))["value"])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        reply = self._link.call("kv_compare_set", key=key, expected=_b64(expected), desired=_b64(desired))
        return base64.b64decode(reply["value"])

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._link.call("kv_check", keys=list(keys))["value"])

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        for key in keys:
            self._link.call("kv_get", key=key, timeout=self._seconds(timeout))

    def delete_key(self, key: str) -> bool:
        return bool(self._link.call("kv_delete", key=key)["value"])

    def num_keys(self) -> int:
        return int(self._link.call("kv_count")["value"])

    def gather(self, prefix: str, done: str, count: int, timeout: datetime.timedelta | None = None) -> list[bytes]:
        """Every value under ``prefix`` (in key order) once ``count`` keys are there.

        Not a c10d call: an exchange at O(1) store requests per caller (the agent publishes the
        whole list once, under ``done``), where reading every other caller's key would be O(N²).
        """
        reply = self._link.call("kv_gather", prefix=prefix, done=done, count=count, timeout=self._seconds(timeout))
        return [base64.b64decode(v) for v in reply["values"]]
