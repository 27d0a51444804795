"""A drain's handover of host snapshots: the leaver gives its joiner the two copies it held.

After a drain the ranks keep their numbers, so every survivor's own copy and the copy it holds
for its source stay what they were: the committed snapshot S (see :mod:`rlaunch.runtime.snapshots`).
Only the joiner has none, and the leaver holds exactly the two it needs: its own copy of the rank
(sealed, with its digests) and its copy of that rank's source. So, where every rank held S whole at
the vote that agreed on the drain, the job keeps S across the move instead of taking a new snapshot
in the joiner's first step, and the leaver sends the joiner both copies over the state transfer's
channel, after the state itself (:func:`send`; the joiner's :class:`Receiving`).

The leaver sends on its main thread, after it left its groups and before it tells its agent it
left (the agent stops it right after that: a thread of its own would die with it); a timer cuts
the channel if the joiner takes longer than :data:`WAIT_S`, and a handover that fails is logged,
never raised: the leaver leaves as before. The joiner receives on a thread of its own, once its
state landed whole (gloo matches the operations of a channel in the order they were posted: the
landing's last receive is done by then) and its first step ended: the first step is the move's
critical path (every survivor waits for the joiner in its first collective), so nothing the step
does not need runs beside it, and no step waits for the copies. The receive, and gloo's threads
of the channel that read the copies, run at the lowest priority. Until both copies landed the
joiner holds no snapshot, and its vote says so: if a fault came then that needs the joiner's
copies, the survivors refuse the rollback and the job restarts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rlaunch.runtime import backend as backends
from rlaunch.runtime import hostcopy
from rlaunch.runtime.groups import retire
from rlaunch.runtime.hostcopy import HostCopy
from rlaunch.runtime.priority import yield_thread
from rlaunch.runtime.transfer import TransferError

log = logging.getLogger(__name__)

#: the knowledge key of the transfer header that names the snapshot the leaver hands over (absent: none)
KEY = "snapshot_handover"
#: how long the leaver waits for its joiner to take both copies before it cuts the channel and leaves,
#: besides their bytes at :data:`SLOWEST_BYTES_PER_S` (the joiner begins once its first step ended,
#: or half this after its state landed, whichever comes first)
WAIT_S = 30.0
#: the slowest handover the leaver waits for (bytes per second): a slower one is cut, and the job
#: takes a new snapshot instead
SLOWEST_BYTES_PER_S = 100e6


def send(channel: Any, own: HostCopy, held: HostCopy, rank: int) -> None:
    """(the leaver, main thread) Send ``own`` then ``held`` to the joiner on ``channel``; never raises."""
    timer = threading.Timer(WAIT_S + (own.nbytes + held.nbytes) / SLOWEST_BYTES_PER_S, backends.cut, (id(channel),))
    timer.daemon = True
    timer.start()
    began = time.perf_counter()
    try:
        sent = hostcopy.send(channel, own) + hostcopy.send(channel, held)
    except Exception as exc:  # noqa: BLE001 - the joiner went away or was too slow: the leaver still leaves
        log.warning(
            "rank %d: the host snapshot of step %d was not handed to the joiner (%s); the job takes a new one",
            rank, own.step, (str(exc) or type(exc).__name__).splitlines()[0],
        )  # fmt: skip
        return
    finally:
        timer.cancel()
    log.info("rank %d: handed the host snapshot of step %d to the joiner (%d bytes, %.3f s)",
             rank, own.step, sent, time.perf_counter() - began)  # fmt: skip


class Receiving:
    """(the joiner) The two copies of snapshot ``step``, arriving from the leaver once :meth:`start`ed.

    The receive begins once both :meth:`start` (the channel) and :meth:`go` (the joiner's first step
    ended) came, in either order, or half :data:`WAIT_S` after :meth:`start` without :meth:`go`.
    ``landed(own, held, seconds)`` is called on the receiving thread once both copies landed whole;
    a handover that fails or is cut leaves :attr:`failed` saying why, and calls nothing.
    """

    def __init__(self, step: int, rank: int, landed: Callable[[HostCopy, HostCopy, float], None]) -> None:
        self.step = step
        self.failed = ""
        self._channel: Any = None  # while the receive may use it: retired (and let go of) after
        self._ended = False  # cut: a receive not yet started never starts
        self._lock = threading.Lock()  # start and cut, each whole
        self._rank = rank
        self._landed = landed
        self._go = threading.Event()  # the first step ended (or the handover was cut: it fails at once)
        self.thread = threading.Thread(target=self._receive, name="rlaunch-snapshot-handover", daemon=True)

    def start(self, channel: Any) -> bool:
        """Receive on ``channel`` (the move's, once the state landed), on :attr:`thread`; False (and the
        channel retired) where the handover was cut before it began."""
        with self._lock:
            if not self._ended:
                self._channel = channel
                self.thread.start()
                return True
        self.failed = self.failed or "it was cut before it began"
        retire(channel)
        return False

    def go(self) -> None:
        """The joiner's first step ended: the receive may begin (at once, if the channel came)."""
        self._go.set()

    def cut(self) -> None:
        """Make the receive fail now, or never start (a fault, a new snapshot, the process's end)."""
        with self._lock:
            self._ended = True
            channel = self._channel
        if channel is not None:
            backends.cut(id(channel))
        self._go.set()

    def _receive(self) -> None:
        yield_thread()
        channel = self._channel
        # A first step longer than half the leaver's wait (an evaluation, a checkpoint in it): the
        # copies come beside it rather than not at all.
        self._go.wait(WAIT_S / 2)
        backends.yield_cpu(channel)  # gloo's threads of the channel read the copies: beside training too
        began = time.perf_counter()
        try:
            if self._ended:
                raise TransferError("it was cut (a fault, a new snapshot, or the process's end)")
            own = hostcopy.receive(channel)
            held = hostcopy.receive(channel)
            if own.step != self.step or held.step != self.step:
                raise TransferError(
                    f"the leaver handed over copies of steps {own.step} and {held.step}, not of step {self.step}"
                )
        except Exception as exc:  # noqa: BLE001 - a leaver gone, a cut channel: this rank holds no copy
            self.failed = (str(exc) or type(exc).__name__).splitlines()[0]
            log.warning(
                "rank %d: the host snapshot of step %d did not arrive from the drained rank (%s); the job takes a "
                "new one", self._rank, self.step, self.failed,
            )  # fmt: skip
            return
        finally:
            with self._lock:
                self._channel = None
            retire(channel)  # one use only, as every transfer channel
        self._landed(own, held, time.perf_counter() - began)
