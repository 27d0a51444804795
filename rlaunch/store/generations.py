"""The generation in etcd: a small head that every node watches, and the whole rank map apart.

A generation's rank map names every node, so a record holding it grows with the job. Written to
the one key every node watches, it made each of 4,096 nodes receive 65 KB per generation (265 MB
of watch events) and decode all of it to learn its own rank. So the controller writes two records
in one transaction, guarded by the head's revision and by its leadership (:func:`write`):

- the :class:`~rlaunch.store.records.GenerationHead` at ``generation``: the generation without
  its map, and how the map changed from the generation it replaces (one entry per node that was
  given or lost ranks), which every node watches;
- the :class:`~rlaunch.store.records.Assignment` at ``assignment``: the whole map.

A reader that acts on the generation a head changes (or on the head's own number) rebuilds the map
from the head alone (:func:`follow`). Any other (a fresh agent, a watch that restarted past a
write, the CLI, a new controller) reads the assignment too, and takes it only with the head of its
number: a number names one map, so no reader ever acts on a mix of two generations.
"""

from __future__ import annotations

from rlaunch.errors import PlanError, RecordError, StoreUnavailableError
from rlaunch.store.client import Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Assignment, Generation, GenerationHead, decode, encode

#: How often :func:`read` reads again when the generation changed between its two reads.
READ_TRIES = 5
#: What a head and a map that do not match mean, and what to do. Not "delete the keys": without a
#: generation, the controller would plan generation 1 under the running workers.
MISMATCH_ADVICE = (
    "rlaunch writes both in one transaction, so this is a bug in rlaunch, or something else wrote to the job's "
    "keys; stop the job (a new run clears its keys)."
)


async def write(
    store: Store,
    keys: JobKeys,
    new: Generation,
    previous: Generation | None,
    revision: int,
    fence: tuple[str, int] | None = None,
) -> bool:
    """Replace ``previous`` (read at the head's mod ``revision``; 0: none) with ``new``, only if
    the head is unchanged since and ``fence`` holds (see :meth:`Store.put_guarded`). The rank map
    goes with the head when the number changes; a generation written again keeps its number's map.
    Returns whether the write happened."""
    again = previous is not None and previous.number == new.number
    if again and previous is not None and previous.assignment != new.assignment:
        raise PlanError(
            f"Generation {new.number} was planned again with another rank map; a generation number names one "
            "map, so the controller does not write it (this is a bug in the planner)."
        )
    also = () if again else ((keys.assignment, encode(Assignment(number=new.number, nodes=new.assignment))),)
    return await store.put_guarded(keys.generation, encode(new.head(previous)), revision, fence=fence, also=also)


async def follow(store: Store, keys: JobKeys, raw: bytes, held: Generation | None) -> Generation | None:
    """The generation whose head is ``raw`` (the value of ``generation``), its map rebuilt from
    ``held`` or else read whole. ``None``: a newer generation replaced it meanwhile (a watch brings
    that one next). Raises :class:`RecordError` for a malformed head or map."""
    head = decode(GenerationHead, raw, keys.generation)
    gen = head.follow(held)
    if gen is not None:
        return gen
    kv = await store.get(keys.assignment)
    if kv is None:
        raise RecordError(
            f"The generation {head.number} at {keys.generation} has no rank map at {keys.assignment}; "
            + MISMATCH_ADVICE
        )
    whole = decode(Assignment, kv.value, kv.key)
    if whole.number > head.number:
        return None
    if whole.number < head.number or len(whole.nodes) != head.assigned:
        raise RecordError(
            f"The rank map at {keys.assignment} is generation {whole.number}'s with {len(whole.nodes)} node(s), "
            f"not that of generation {head.number} at {keys.generation} ({head.assigned} node(s)); " + MISMATCH_ADVICE
        )
    return head.whole(whole.nodes)


async def read(
    store: Store, keys: JobKeys, held: tuple[int, Generation] | None = None
) -> tuple[int, Generation | None]:
    """The current generation and its head's mod revision (the fencing token of the next write;
    ``(0, None)``: none yet). ``held``: a ``(mod revision, generation)`` read before, reused while
    the head is unchanged, and the map to rebuild from. Raises :class:`RecordError` for a malformed
    head or map; :class:`StoreUnavailableError` when the generation changed at each of its
    ``READ_TRIES`` reads, and any :class:`~rlaunch.errors.StoreError` of etcd's."""
    for _ in range(READ_TRIES):
        kv = await store.get(keys.generation)
        if kv is None:
            return 0, None
        if held is not None and held[0] == kv.mod_revision:
            return held
        gen = await follow(store, keys, kv.value, held[1] if held is not None else None)
        if gen is not None:
            return kv.mod_revision, gen
    raise StoreUnavailableError(
        f"The generation at {keys.generation} changed {READ_TRIES} times while it was read; try again."
    )
