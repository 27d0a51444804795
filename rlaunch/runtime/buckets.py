"""DDP's one-time rebuild of its gradient buckets, which no move may straddle (pure: reads torch's objects).

DDP sorts its gradient buckets once, by the order gradients became ready in a synced backward: at
a later forward (its second step's; its third's with ``static_graph=True``) it rebuilds them and
broadcasts the new bucket layout from rank 0, a collective every rank of its group takes part in,
once. A standby's sandbox runs enough steps (:func:`sandbox_iterations`) that a joiner's DDP has
rebuilt its buckets: it must join ranks whose DDP has too. Ranks that still have the rebuild ahead
of them would wait in its broadcast while the joiner's backward waits in the gradient allreduce:
the job hangs. So within their first :data:`VOTES` votes, while a tracked DDP's rebuild is still
ahead, the ranks do not vote ready for a drain (it waits a step or two), and a fault takes the
restart path, with a sentence. A rebuild still ahead after that waits on something else (a DDP
that never runs a synced backward: a teacher under ``no_grad``, a model always in ``no_sync()``),
and a joiner's sandbox, running the same code, did not rebuild it either.
"""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel

#: the votes within which DDP's rebuild is awaited (its third step's forward, with a static graph)
VOTES = 3


def sandbox_iterations(tracked: dict[str, Any], asked: int) -> int:
    """The sandbox steps a standby runs: ``asked``, but enough for each tracked DDP to rebuild."""
    ddps = [obj for obj in tracked.values() if isinstance(obj, DistributedDataParallel)]
    if not ddps:
        return asked
    return max(asked, 3 if any(getattr(d, "static_graph", False) for d in ddps) else 2)


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


def awaited(tracked: dict[str, Any], votes: int) -> list[str]:
    """The tracked DDP modules whose rebuild a move must wait for, this process having cast ``votes`` votes."""
    return pending(tracked) if votes <= VOTES else []


def refusal(tracked: dict[str, Any], votes: int) -> str:
    """Why no rank may be moved into this job yet ("" when no rebuild is awaited)."""
    names = awaited(tracked, votes)
    if not names:
        return ""
    return (
        f"DDP has not rebuilt the gradient buckets of {', '.join(repr(n) for n in names)} yet (it does so once, with "
        "a collective, in its first steps), and a joiner's DDP has, so the two would wait on different collectives"
    )
