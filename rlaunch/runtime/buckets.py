"""DDP's one-time rebuild of its gradient buckets, which no move may straddle (pure: reads torch's objects).

DDP sorts its gradient buckets once, by the order gradients became ready in its first synced
backward: at its next forward (usually the second step) it rebuilds them and broadcasts the new
bucket layout from rank 0, a collective every rank of its group takes part in, once. A standby's
sandbox runs at least :data:`MIN_SANDBOX_ITERATIONS` steps, so a joiner's DDP has always rebuilt
its buckets: it must join ranks whose DDP has too. Ranks that still have the rebuild ahead of them
would wait in its broadcast while the joiner's backward waits in the gradient allreduce: the job
hangs. So the runtime does not vote ready for a drain until every tracked DDP module has rebuilt
(the drain waits a step or two), and a fault before that takes the restart path, with a sentence.
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

#: a DDP standby's sandbox runs at least this many steps: its second rebuilds the buckets, as the
#: active ranks' DDP did at theirs
MIN_SANDBOX_ITERATIONS = 2


def pending(tracked: dict[str, Any]) -> list[str]:
    """The names of the tracked DDP modules whose bucket rebuild (a collective) is still ahead."""
    return [name for name, obj in tracked.items() if isinstance(obj, DistributedDataParallel) and _ahead(obj)]


def _ahead(ddp: DistributedDataParallel) -> bool:
    # as torch's Reducer decides (should_rebuild_buckets): only with a static graph or without
    # find_unused_parameters, and only once; the Python reducer and delayed allreduce never rebuild
    if getattr(ddp, "_has_rebuilt_buckets", True):
        return False
    if getattr(ddp, "_use_python_reducer", False) or getattr(ddp, "_delay_all_reduce_all_params", False):
        return False
    return bool(getattr(ddp, "static_graph", False)) or not getattr(ddp, "find_unused_parameters", False)


def refusal(tracked: dict[str, Any]) -> str:
    """Why no rank may be moved into this job yet ("" when the rebuild is behind every tracked DDP)."""
    names = pending(tracked)
    if not names:
        return ""
    return (
        f"DDP has not rebuilt the gradient buckets of {', '.join(repr(n) for n in names)} yet (it does so once, with "
        "a collective, at its second step), and a joiner's DDP has, so the two would wait on different collectives"
    )
