"""The node's lease: kept alive, and judged lost only on etcd's own word.

"I cannot reach etcd" is not evidence that "my lease is gone". While no etcd member answers,
etcd revokes nothing and nobody can plan a replacement, and workers need no etcd per step, so
training goes on untouched; etcd extends every lease when a leader is elected again. A node
stops its workers only on evidence that the job went on without it:

- etcd answers that its lease is gone (a keepalive answered with TTL 0, confirmed by a lease
  lookup answered with -1), which :class:`LeaseKeeper` reports here;
- or its peers moved to a generation that gives it no ranks, which the agent sees in the
  generation key (their collectives stop reaching it anyway: the old communicators are cut).

:func:`judge` is the pure decision; :class:`LeaseKeeper` is the loop that feeds it.

States of a kept lease (:class:`LeaseState`):

- ``HELD`` → ``UNREACHABLE`` when a keepalive gets no answer; → ``LOST`` when etcd answers
  that the lease is gone.
- ``UNREACHABLE`` → ``HELD`` when a keepalive is answered again; → ``LOST`` likewise.
- ``LOST`` is final.

A held lease is renewed every TTL/3, but the first wait (after the renewal at the keeper's start,
and after the one etcd answered when it came back) is a random part of it (:func:`first_pause`):
agents that a scheduler started together, or that etcd answered together when it came back, would
otherwise renew together for as long as the job runs, N keepalives in one burst every TTL/3, which a
plan written then waits behind.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import random
import time
from collections.abc import Awaitable, Callable

from rlaunch.errors import StoreError
from rlaunch.store.client import Store

log = logging.getLogger(__name__)

#: While etcd is unreachable, say so again at most this often (the first failure is always said).
OUTAGE_LOG_EVERY_S = 30.0
#: While etcd is unreachable, try again this often (at most; TTL/3 when that is shorter): when etcd
#: comes back, its new leader extends every lease by only TTL + the election timeout, so the
#: first renewal must not wait a whole round.
OUTAGE_RETRY_S = 1.0
#: Each keepalive request's timeout. A healthy etcd renews a lease in milliseconds (no raft
#: round), and a slow answer costs nothing now that silence never fences: it is just retried.
KEEPALIVE_TIMEOUT_S = 1.0


class LeaseState(str, enum.Enum):
    HELD = "held"
    UNREACHABLE = "unreachable"
    LOST = "lost"


@dataclasses.dataclass(frozen=True)
class Renewal:
    """What one keepalive round learned: etcd's remaining TTL (-1: no such lease), or the error."""

    remaining: int | None = None
    error: str = ""


def first_pause(ttl: float, draw: Callable[[], float] = random.random) -> float:
    """Seconds from a held lease's first renewal to its second: a part of TTL/3 that ``draw()`` (in [0, 1))
    picks, never 0 (the renewals of leases taken together then fall anywhere in the period, and stay apart)."""
    return ttl / 3 * (1.0 - draw())


def keepalive_store(shared: Store) -> Store:
    """A client of its own for the lease keepalives (``shared``'s etcd), with a short request timeout."""
    return shared.sibling(KEEPALIVE_TIMEOUT_S)


def judge(state: LeaseState, renewal: Renewal) -> LeaseState:
    """The lease's next state after one keepalive round.

    Only an answer from etcd can make a lease ``LOST``; a missing answer, however long it lasts,
    leaves it ``UNREACHABLE``.
    """
    if state is LeaseState.LOST:
        return state
    if renewal.remaining is None:
        return LeaseState.UNREACHABLE
    if renewal.remaining < 0:
        return LeaseState.LOST
    # 0: the lease exists but expires this very second; the next round (TTL/3 later) decides.
    return LeaseState.HELD if renewal.remaining > 0 else state


class LeaseKeeper:
    """Renews one lease at once, then every TTL/3 (the first wait, and the first after an outage, shorter:
    :func:`first_pause`) until it is lost or ``sleep`` says stop.

    ``store`` should be the keeper's own client (see :func:`keepalive_store`): a channel shared
    with watches and the controller is closed and reopened by their failures, and a keepalive in
    flight on it would fail with them.

    ``on_back(unreachable_s, remaining)`` is called when etcd answers again after an outage.
    :meth:`run` returns a sentence saying why the lease is lost, or ``None`` once stopped.
    """

    def __init__(
        self,
        store: Store,
        lease_id: int,
        ttl: int,
        node_id: str,
        *,
        sleep: Callable[[float], Awaitable[bool]],
        on_back: Callable[[float, int], None] = lambda _s, _r: None,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self._store = store
        self.lease_id = lease_id
        self.ttl = ttl
        self._node_id = node_id
        self._sleep = sleep
        self._on_back = on_back
        self._clock = clock
        self._draw = draw
        self.state = LeaseState.HELD
        self._unreachable_since = 0.0
        self._said_at = 0.0
        self._unexpected = ""  # the unexpected error of the renewals since the last answer, if any

    def unreachable_s(self) -> float:
        """How long etcd has not answered (0 while it does)."""
        return self._clock() - self._unreachable_since if self.state is LeaseState.UNREACHABLE else 0.0

    async def renew(self) -> Renewal:
        """One keepalive round. A keepalive's TTL of 0 is checked with a lease lookup before it counts."""
        try:
            remaining = await self._store.refresh_lease(self.lease_id)
            self._unexpected = ""
            if remaining > 0:
                return Renewal(remaining)
            # etcd answers a keepalive of an unknown lease with TTL 0; ask again, by another
            # request, so that only an explicit "not found" (-1) can fence the node.
            _, left = await self._store.lease_ttl(self.lease_id)
            return Renewal(left)
        except StoreError as exc:
            return Renewal(error=str(exc))
        except Exception as exc:
            # A client state it did not expect (a finished keepalive stream raised InvalidStateError
            # once): no answer from etcd, which never fences, said with its traceback when it first
            # comes (then the outage's own warnings say it). Raised on, it would end the renewals until
            # the task started again, and forget the outage it measures.
            error = f"{type(exc).__name__}: {exc}"
            if error != self._unexpected:
                log.error("[%s] renewing lease %x failed by an unexpected error; counted as no answer from etcd",
                          self._node_id, self.lease_id, exc_info=exc)  # fmt: skip
            self._unexpected = error
            return Renewal(error=error)

    async def run(self) -> str | None:
        """Keep the lease until it is lost (return why) or the ``sleep`` callable says stop."""
        spread = True  # the next wait of a held lease is first_pause(): at the start, and after an outage
        while True:
            renewal = await self.renew()
            before, self.state = self.state, judge(self.state, renewal)
            now = self._clock()
            if self.state is LeaseState.LOST:
                return (
                    f"etcd answered that its lease {self.lease_id:x} is gone (TTL {self.ttl} s), so the job "
                    "has dropped this node and may have given its ranks to another"
                )
            if self.state is LeaseState.UNREACHABLE:
                if before is LeaseState.HELD:
                    self._unreachable_since = self._said_at = now
                    log.warning(
                        "[%s] etcd is unreachable (%s); the workers go on: without etcd nobody can replace "
                        "this node, and only etcd's answer that lease %x is gone stops them",
                        self._node_id, renewal.error, self.lease_id,
                    )  # fmt: skip
                elif now - self._said_at >= OUTAGE_LOG_EVERY_S:
                    self._said_at = now
                    log.warning(
                        "[%s] etcd has been unreachable for %.0f s; the workers go on (%s)",
                        self._node_id, now - self._unreachable_since, renewal.error,
                    )  # fmt: skip
            elif before is LeaseState.UNREACHABLE:
                gone_s = now - self._unreachable_since
                remaining = renewal.remaining or 0
                log.warning(
                    "[%s] etcd answers again after %.1f s; lease %x is still held (%d s left)",
                    self._node_id, gone_s, self.lease_id, remaining,
                )  # fmt: skip
                self._on_back(gone_s, remaining)
            if self.state is not LeaseState.HELD:
                pause, spread = min(self.ttl / 3, OUTAGE_RETRY_S), True
            elif spread:
                pause, spread = first_pause(self.ttl, self._draw), False
            else:
                pause = self.ttl / 3
            if await self._sleep(pause):
                return None
