"""``rt.steps()`` for a loop the script does not own: a framework's, begun and redone from its hooks.

A script on the runtime's loop writes ``for step in rt.steps(n)``: between two iterations the
runtime ends a step, switches to a new generation (a leaver hands its state over there and
exits, the others swap their groups), redoes a step after a fault, and a standby joins. A
framework (Lightning, Accelerate) owns its loop, so its integration drives the same generator
from the framework's hooks instead: :meth:`DrivenSteps.begin` where the framework is about to
read a step's first batch, :meth:`DrivenSteps.redo` where ``rt.optimizer_step`` discarded the
step, :meth:`DrivenSteps.end` when the framework's loop ends. Everything the runtime does between
two steps happens inside those calls, with the same guarantees as in a ``for`` loop.

Such a loop can redo the step it is in (the integration keeps that step's batches) but not the
steps before it, so :meth:`rlaunch.runtime.runtime.Runtime.drive` turns host snapshots off: where
no replica can serve a lost rank, the replacement is refused and the job restarts.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from rlaunch.runtime.vote import RefusedError

if TYPE_CHECKING:
    from rlaunch.runtime.runtime import Runtime


class DrivenSteps:
    """One runtime step loop, driven by calls instead of iteration (see the module docstring)."""

    def __init__(self, runtime: Runtime) -> None:
        self._rt = runtime
        self._steps = runtime.steps(sys.maxsize)
        #: the step under way (None before the first)
        self.step: int | None = None

    def begin(self) -> bool:
        """End the step under way and begin the next; True when this call made a standby join.

        Inside it, a leaver sends its state and ends the worker with ``SystemExit(0)``, and a
        standby runs its sandbox steps (one per call) and then blocks until it is given ranks and
        has received its state: the framework's own position must then be taken from what was
        received.
        """
        was_standby = self._rt.standby
        self.step = next(self._steps)
        return was_standby and not self._rt.standby

    def redo(self) -> None:
        """After ``rt.optimizer_step()`` returned False: the step's start is put back (module buffers,
        RNG states, every tracked object's state), replicas are sent to a replacement, and the same
        step begins again, for the framework to redo inside the call that discarded it."""
        discarded = self.step
        self.step = next(self._steps)
        if self.step != discarded:
            raise RefusedError(
                f"rank {self._rt.rank}: the runtime asked to go on at step {self.step} after discarding step "
                f"{discarded}; a framework's loop can redo only the step it is in, so this worker stops and the "
                "job restarts from your checkpoint."
            )

    def end(self) -> None:
        """The framework's loop ended: the runtime is done stepping (no more moves; teardown is no hang)."""
        self._steps.close()
