"""Reading one job's state out of etcd into typed records (shared by controller, agent, CLI)."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

from rlaunch.controller.feed import NodeFeed
from rlaunch.controller.planner import NodeView
from rlaunch.errors import RecordError
from rlaunch.store import generations
from rlaunch.store.client import KV, Store
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import DrainedMark, DrainRequest, Generation, JobSpec, NodeRecord, SuspectMark, decode

R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class JobSnapshot:
    spec: JobSpec | None
    generation: Generation | None
    #: mod revision of the generation key (0 when absent): the fencing token for the next write
    generation_revision: int
    leader: str | None
    #: create revision of the leader key (0 when absent): which election made the leader, so a
    #: stale controller and a restarted agent of the same node id are told apart
    leader_revision: int
    nodes: dict[str, NodeView]
    node_leases: dict[str, int]
    #: one sentence per malformed record found (they are skipped, never fatal)
    problems: list[str]
    #: the generation key exists but does not parse: nobody may plan over it blindly
    generation_malformed: bool = False
    drains: dict[str, DrainRequest] = dataclasses.field(default_factory=dict)
    drained: dict[str, DrainedMark] = dataclasses.field(default_factory=dict)
    #: nodes suspected of silent data corruption (they take no ranks again in this job)
    suspects: dict[str, SuspectMark] = dataclasses.field(default_factory=dict)
    #: nodes that acknowledged the generation (read only while it waits for acks: a restart's barrier)
    acked: frozenset[str] = frozenset()


class RecordCache:
    """Decoded records by key and mod revision, kept across reads by one reader (the controller).

    A tick reads every node record and the generation (whose rank map names every node); decoding
    and validating them all was most of a tick at a thousand nodes. A key whose mod revision is
    unchanged holds the same bytes, so its decoded record is reused; only changed ones are decoded,
    and a new generation's rank map is rebuilt from the one held (see rlaunch.store.generations).
    The records are frozen and never changed in place by their readers.
    """

    def __init__(self) -> None:
        self._views: dict[str, tuple[int, NodeView, int]] = {}
        #: the generation last read and its head's mod revision (its rank map is rebuilt from it)
        self.generation: tuple[int, Generation] | None = None

    def view(self, kv: KV, keys: JobKeys, problems: list[str]) -> tuple[NodeView, int] | None:
        """The node view and lease of ``kv`` (None, with a sentence in ``problems``, if malformed)."""
        held = self._views.get(kv.key)
        if held is not None and held[0] == kv.mod_revision:
            return held[1], held[2]
        try:
            record = decode(NodeRecord, kv.value, kv.key)
        except RecordError as exc:
            problems.append(str(exc))
            return None
        if record.node_id != keys.node_id_of(kv.key):
            problems.append(
                f"The record at {kv.key} names node {record.node_id!r}, not the node of its key; "
                "delete or rewrite that key."
            )
            return None
        view = NodeView(record=record, join_revision=kv.create_revision)
        self._views[kv.key] = (kv.mod_revision, view, kv.lease)
        return view, kv.lease

    def keep_only(self, present: set[str]) -> None:
        """Forget the records of keys no longer present (deleted nodes)."""
        for key in [k for k in self._views if k not in present]:
            del self._views[key]


async def read_snapshot(
    store: Store,
    keys: JobKeys,
    cache: RecordCache | None = None,
    *,
    suspects: bool = False,
    feed: NodeFeed | None = None,
    whole: bool = False,
) -> JobSnapshot:
    """The job's state as etcd holds it now; ``cache`` spares decoding unchanged node records again.

    ``suspects``: also read the suspect marks (``rlaunch status`` shows them; the controller needs
    none, since a suspect's agent never rejoins, so its ticks spare the read).
    ``feed``: the node records kept from the leader's watch, used while it follows etcd (else they
    are read whole, and the feed takes the read); ``whole``: read them whole all the same (when the
    feed may lag: after a write of the reader's own that changes them, such as a revoked lease,
    which the watch has not brought yet, or at a tick no change woke; see rlaunch.controller.feed).
    """
    cache = cache if cache is not None else RecordCache()
    problems: list[str] = []
    spec = None
    kv = await store.get(keys.spec)
    if kv is not None:
        try:
            spec = decode(JobSpec, kv.value, keys.spec)
        except RecordError as exc:
            problems.append(str(exc))
    generation, gen_rev, gen_bad = None, 0, False
    try:
        gen_rev, generation = await generations.read(store, keys, cache.generation)
    except RecordError as exc:
        problems.append(str(exc))
        gen_bad = True
    if not gen_bad:
        cache.generation = (gen_rev, generation) if generation is not None else None
    acked: frozenset[str] = frozenset()
    if generation is not None and generation.waits_for_acks:
        prefix = keys.acks_prefix(generation.number)
        acked = frozenset(key[len(prefix) :] for key in await store.keys_under(prefix))
    kv = await store.get(keys.leader)
    leader = kv.value.decode(errors="replace") if kv is not None else None
    leader_rev = kv.create_revision if kv is not None else 0
    nodes: dict[str, NodeView] = {}
    leases: dict[str, int] = {}
    kvs = await _node_records(store, keys, feed, whole)
    for kv in kvs:
        found = cache.view(kv, keys, problems)
        if found is not None:
            nodes[found[0].record.node_id], leases[found[0].record.node_id] = found
    cache.keep_only({kv.key for kv in kvs})
    drains = {r.node_id: r for r in await _records(store, keys.drains_prefix, DrainRequest, problems)}
    drained = {m.node_id: m for m in await _records(store, keys.drained_prefix, DrainedMark, problems)}
    marks = await _records(store, keys.suspects_prefix, SuspectMark, problems) if suspects else []
    return JobSnapshot(
        spec, generation, gen_rev, leader, leader_rev, nodes, leases, problems, gen_bad, drains, drained,
        {m.node_id: m for m in marks}, acked,
    )  # fmt: skip


async def _node_records(store: Store, keys: JobKeys, feed: NodeFeed | None, whole: bool) -> list[KV]:
    """Every node record: from ``feed`` while it follows etcd (and ``whole`` is false), else read."""
    held = feed.records() if feed is not None and not whole else None
    if held is not None:
        return held
    if feed is None:
        kvs, _ = await store.get_prefix(keys.nodes_prefix)
        return kvs
    read = feed.begin_read()
    try:
        kvs, revision = await store.get_prefix(keys.nodes_prefix)
    except BaseException:
        feed.abandon(read)
        raise
    feed.read_whole(read, kvs, revision)
    return kvs


async def _records(store: Store, prefix: str, cls: type[R], problems: list[str]) -> list[R]:
    out = []
    kvs, _ = await store.get_prefix(prefix)
    for kv in kvs:
        try:
            out.append(decode(cls, kv.value, kv.key))
        except RecordError as exc:
            problems.append(str(exc))
    return out
