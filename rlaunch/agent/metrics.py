"""The agent's Prometheus metrics (``--metrics-port``): what its node and its ranks are doing.

Every series is built with ``prometheus_client`` on a registry of this agent's own, so the page
holds only ``rlaunch_*`` names. Values come from three places, none of them new channels:

- the workers' heartbeats (about one a second per rank, over the agent's control socket): step
  time, steps completed, the last applied step (for goodput);
- the agent's structured events (:class:`~rlaunch.events.EventLog` calls :meth:`AgentMetrics.on_event`
  for each): migrations, recoveries, restarts, detector findings, downtime as the runtime measured it;
- the etcd client, which times every request (``rlaunch.store.client.REQUEST_SECONDS``).

Goodput is the time in applied steps over wall time. :class:`Goodput` keeps it per rank: each
step applied beyond the highest one this rank had reached counts for one median step time
(redone steps and steps replayed after a restart are not useful), and wall time runs from the
rank's first heartbeat on this node. It is capped at 1 (a median can overstate the mean a little).

Updates happen on the agent's event loop; the HTTP server reads on its own thread
(``prometheus_client`` metrics are thread-safe; callbacks only read floats and ``len``).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, start_http_server

from rlaunch import __version__
from rlaunch.errors import UsageError
from rlaunch.store import client
from rlaunch.store.records import Event, Generation, LiveMoves, NodeState

log = logging.getLogger(__name__)

#: Downtime buckets, in seconds: from a fast switch (tens of ms) to a full restart (minutes).
DOWNTIME_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
#: Event kinds of detector findings, and the ``detector`` label each one counts under.
FINDINGS = {
    "worker_hung": "hang", "gpu_fault": "gpu_fault", "straggler": "straggler", "node_dead": "node_loss",
    "sdc_suspected": "sdc",
}  # fmt: skip


class Goodput:
    """One rank's useful time against wall time (pure: the clock is passed in).

    The ratio covers the time from the first report to the latest one, so it does not sag
    between reports; it is NaN (unknown) until a second report came.
    """

    def __init__(self, now: float, applied: int) -> None:
        self.began = self.latest = now
        self.highest = applied  # the highest step applied so far (-1: none)
        self.useful_s = 0.0

    def progress(self, now: float, applied: int, step_s: float) -> None:
        """At ``now`` the rank's last applied step is ``applied``; its median step takes ``step_s``."""
        self.latest = max(self.latest, now)
        if applied > self.highest:
            self.useful_s += (applied - self.highest) * step_s
            self.highest = applied

    def ratio(self) -> float:
        wall = self.latest - self.began
        return min(1.0, self.useful_s / wall) if wall > 0 else math.nan


class _Rank:
    """What the agent knows of one rank it holds (from its heartbeats)."""

    def __init__(self, now: float, applied: int) -> None:
        self.goodput = Goodput(now, applied)
        self.steps = 0  # the worker process's own count (it restarts at 0 with a new process)
        self.step_s = 0.0


class AgentMetrics:
    def __init__(self, node_id: str, nproc: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.node_id = node_id
        self._nproc = nproc
        self._clock = clock
        self.registry = CollectorRegistry()
        self._server: Any = None
        self._ranks: dict[int, _Rank] = {}
        self._gen: Generation | None = None
        self._offered: dict[int, str] = {}  # generation -> plan kind this node took part in
        self._pending: dict[tuple[str, int], dict[int, float]] = {}  # (kind, generation) -> rank -> downtime
        self._down_since: float | None = None  # this node's workers stopped (a restart may follow)
        self._restarting: tuple[int, float, set[int]] | None = None  # (generation, since, ranks yet to step)
        self._started = False
        r, node = self.registry, ("node",)
        rank = ("node", "rank")
        self.step_seconds = Gauge("rlaunch_rank_step_seconds", "Median step time of a rank.", rank, registry=r)
        self.compute_seconds = Gauge(
            "rlaunch_rank_compute_seconds", "Median compute time per step of a rank (without waiting on peers).",
            rank, registry=r,
        )  # fmt: skip
        self.steps = Counter("rlaunch_rank_steps_completed", "Steps a rank completed (redone ones too).", rank,
                             registry=r)  # fmt: skip
        self.applied = Gauge("rlaunch_rank_applied_step", "The last step a rank applied.", rank, registry=r)
        self.goodput = Gauge(
            "rlaunch_rank_goodput_ratio", "Time in applied steps over wall time, for a rank on this node.", rank,
            registry=r,
        )  # fmt: skip
        self.rank_downtime = Histogram(
            "rlaunch_rank_downtime_seconds", "Downtime of a rank in a migration, replacement or restart.",
            ("node", "rank", "kind"), buckets=DOWNTIME_BUCKETS, registry=r,
        )  # fmt: skip
        self.node_step_seconds = Gauge("rlaunch_node_step_seconds", "Median step time of the node's ranks.", node,
                                       registry=r)  # fmt: skip
        self.node_steps = Counter("rlaunch_node_steps_completed", "Steps the node's ranks completed.", node,
                                  registry=r)  # fmt: skip
        self.node_goodput = Gauge("rlaunch_node_goodput_ratio", "Mean goodput of the node's ranks.", node,
                                  registry=r)  # fmt: skip
        self.node_downtime = Histogram(
            "rlaunch_node_downtime_seconds", "Downtime of the node in an event: the longest of its ranks'.",
            ("node", "kind"), buckets=DOWNTIME_BUCKETS, registry=r,
        )  # fmt: skip
        self.migrations = Counter("rlaunch_migrations", "Live migrations this node took part in.", ("node", "role"),
                                  registry=r)  # fmt: skip
        self.recoveries = Counter(
            "rlaunch_recoveries", "Live replacements of failed ranks this node took part in.", ("node", "role"),
            registry=r,
        )  # fmt: skip
        self.restarts = Counter("rlaunch_restarts", "Restarts of this node's workers.", node, registry=r)
        self.findings = Counter(
            "rlaunch_detector_findings", "Findings of the detectors this node runs.", ("node", "detector"),
            registry=r,
        )  # fmt: skip
        self.stragglers_watched = Gauge(
            "rlaunch_stragglers_watched", "Slow nodes the controller on this node is watching (0: none).", node,
            registry=r,
        )  # fmt: skip
        self.leading = Gauge("rlaunch_controller_leading", "1 while this node's agent is the controller.", node,
                             registry=r)  # fmt: skip
        self.generation = Gauge("rlaunch_generation", "The newest generation this node has seen.", node, registry=r)
        self.state = Enum("rlaunch_node_state", "This node's state.", node, states=[s.value for s in NodeState],
                          registry=r)  # fmt: skip
        self.sdc_suspected = Counter(
            "rlaunch_sdc_suspected", "Ranks of this node whose replica check suspected silent data corruption.",
            node, registry=r,
        )  # fmt: skip
        self.live_moves = Enum(
            "rlaunch_live_moves", "Which live moves this node's ranks allow, as its workers reported.", node,
            states=[m.value for m in LiveMoves], registry=r,
        )  # fmt: skip
        self.snapshot_bytes = Gauge(
            "rlaunch_rank_snapshot_bytes", "Bytes of a rank's last committed host snapshot (its own copy).", rank,
            registry=r,
        )  # fmt: skip
        self.snapshot_seconds = Gauge(
            "rlaunch_rank_snapshot_seconds",
            "What a rank's last committed host snapshot took: its copy on the training thread, or its exchange "
            "with the buddy in the background.", ("node", "rank", "phase"), registry=r,
        )  # fmt: skip
        self.snapshot_committed = Gauge(
            "rlaunch_rank_snapshot_committed_timestamp_seconds",
            "When a rank's last host snapshot was committed (its age: time() minus this).", rank, registry=r,
        )  # fmt: skip
        self.snapshot_step = Gauge("rlaunch_rank_snapshot_step", "The step of a rank's last committed host snapshot.",
                                   rank, registry=r)  # fmt: skip
        Info("rlaunch_agent", "This agent.", node, registry=r).labels(node_id).info({"version": __version__})
        r.register(client.REQUEST_SECONDS)
        self.node_goodput.labels(node_id).set_function(self._node_goodput)
        self.node_step_seconds.labels(node_id).set_function(self._node_step_s)
        for detector in FINDINGS.values():
            self.findings.labels(node_id, detector)  # present at 0 from the start, so rate() sees the first
        self.restarts.labels(node_id)
        self.sdc_suspected.labels(node_id)
        self.live_moves.labels(node_id).state(LiveMoves.UNKNOWN.value)

    # -- serving ------------------------------------------------------------------------------

    def serve(self, addr: str, port: int) -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread."""
        try:
            self._server, _ = start_http_server(port, addr, self.registry)
        except OSError as exc:
            raise UsageError(
                f"The metrics endpoint cannot listen on {addr}:{port} ({exc.strerror or exc}); "
                "give --metrics-port a free port, or --local-addr an address of this machine."
            ) from exc
        log.info("[%s] Prometheus metrics at http://%s:%d/metrics", self.node_id, addr, port)

    def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.shutdown()
            server.server_close()

    def watch_controller(self, leading: Callable[[], bool], stragglers: Callable[[], int]) -> None:
        self.leading.labels(self.node_id).set_function(lambda: float(leading()))
        self.stragglers_watched.labels(self.node_id).set_function(lambda: float(stragglers()))

    # -- heartbeats ---------------------------------------------------------------------------

    def heartbeat(self, rank: int, steps: int, applied: int, step_s: float, compute_s: float) -> None:
        """A worker holding ``rank`` reported: ``steps`` completed by its process, ``applied`` its last step.

        Never raises: a failed heartbeat reply would stop the worker's heartbeats (and look like a hang).
        """
        try:
            self._heartbeat(rank, steps, applied, step_s, compute_s)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("[%s] a heartbeat of rank %d could not be counted in the metrics: %r", self.node_id, rank, exc)

    def _heartbeat(self, rank: int, steps: int, applied: int, step_s: float, compute_s: float) -> None:
        now = self._clock()
        held = self._ranks.get(rank)
        if held is None:
            held = self._ranks[rank] = _Rank(now, applied)
            labels = (self.node_id, str(rank))
            self.goodput.labels(*labels).set_function(held.goodput.ratio)
            self.steps.labels(*labels)
        done = steps - held.steps if steps >= held.steps else steps  # fewer: a new process
        held.steps, held.step_s = steps, step_s
        labels = (self.node_id, str(rank))
        if done > 0:
            self.steps.labels(*labels).inc(done)
            self.node_steps.labels(self.node_id).inc(done)
        if step_s > 0:
            held.goodput.progress(now, applied, step_s)
            self.step_seconds.labels(*labels).set(step_s)
        if compute_s > 0:
            self.compute_seconds.labels(*labels).set(compute_s)
        self.applied.labels(*labels).set(applied)
        if self._restarting is not None and steps > 0 and rank in self._restarting[2]:
            gen, since, waiting = self._restarting
            waiting.discard(rank)
            self._downtime("restart", gen, rank, now - since)
            if not waiting:
                self._restarting = None

    def _node_goodput(self) -> float:
        ratios = [r.goodput.ratio() for r in list(self._ranks.values())]
        known = [r for r in ratios if not math.isnan(r)]
        return statistics.fmean(known) if known else math.nan

    def _node_step_s(self) -> float:
        times = [r.step_s for r in list(self._ranks.values()) if r.step_s > 0]
        return statistics.median(times) if times else 0.0

    # -- generations and events ---------------------------------------------------------------

    def on_generation(self, gen: Generation) -> None:
        """The agent took generation ``gen``: forget the ranks this node no longer holds."""
        self._gen = gen
        self.generation.labels(self.node_id).set(gen.number)
        if self.node_id in gen.leavers and gen.kind == "migrate":
            return  # a leaver trains on until the switch point
        mine = set(gen.ranks_of(self.node_id))
        for rank in [r for r in self._ranks if r not in mine]:
            del self._ranks[rank]
            for metric in (self.step_seconds, self.compute_seconds, self.steps, self.applied, self.goodput,
                           self.snapshot_bytes, self.snapshot_committed, self.snapshot_step):  # fmt: skip
                try:
                    metric.remove(self.node_id, str(rank))
                except KeyError:
                    pass
            for phase in ("copy", "exchange"):
                try:
                    self.snapshot_seconds.remove(self.node_id, str(rank), phase)
                except KeyError:
                    pass

    def on_event(self, event: Event) -> None:
        """Count what an event says (called for every event this agent emits; never raises)."""
        try:
            self._on_event(event.kind, event.generation, event.data)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("[%s] event %s could not be counted in the metrics: %r", self.node_id, event.kind, exc)

    def _on_event(self, kind: str, gen: int, data: dict[str, Any]) -> None:
        node = self.node_id
        if kind in FINDINGS:
            self.findings.labels(node, FINDINGS[kind]).inc()
            if kind == "sdc_suspected":
                self.sdc_suspected.labels(node).inc()
        elif kind == "live_moves":
            self.live_moves.labels(node).state(str(data["moves"]))
        elif kind == "node_state":
            self.state.labels(node).state(str(data["state"]))
        elif kind == "migration_offered":
            self._offered[gen] = "migrate"
            self.migrations.labels(node, str(data["role"])).inc()
        elif kind == "replacement_offered":
            self._offered[gen] = "replace"
            self.recoveries.labels(node, str(data["role"])).inc()
        elif kind == "switched":
            self._downtime("migrate", gen, int(data["rank"]), float(data["downtime_ms"]) / 1000)
        elif kind == "recovered":
            self._downtime("replace", gen, int(data["rank"]), float(data["seconds"]))
        elif kind == "snapshot_committed":
            rank = str(data["rank"])
            self.snapshot_bytes.labels(node, rank).set(float(data["bytes"]))
            self.snapshot_seconds.labels(node, rank, "copy").set(float(data["copy_s"]))
            self.snapshot_seconds.labels(node, rank, "exchange").set(float(data["exchange_s"]))
            self.snapshot_step.labels(node, rank).set(float(data["step"]))
            self.snapshot_committed.labels(node, rank).set(time.time())  # wall clock: Prometheus computes the age
        elif kind == "snapshot_handed_over":  # a drain's joiner holds the kept snapshot (committed before it joined)
            self.snapshot_step.labels(node, str(data["rank"])).set(float(data["step"]))
        elif kind == "joined" and self._offered.get(gen) == "replace":
            # The joiner's rank was down from its own workers' failure (restarted in place), or
            # else (a standby) from the plan until it had its state.
            ranks = self._gen.ranks_of(node) if self._gen is not None and self._gen.number == gen else []
            local = int(data["local_rank"])
            since = self._down_since
            seconds = self._clock() - since if since is not None else float(data["seconds"])
            if local < len(ranks):
                self._downtime("replace", gen, ranks[local], seconds)
            if ("replace", gen) not in self._pending:
                self._down_since = None  # every local rank joined (the node's downtime was observed)
        elif kind in ("workers_stopped", "workers_failed"):
            if self._down_since is None:
                self._down_since = self._clock()
        elif kind == "workers_started":
            if int(data["restart_count"]) > 0 and self._started:
                self.restarts.labels(node).inc()
                since = self._down_since if self._down_since is not None else self._clock()
                self._restarting = (gen, since, {int(r) for r in data["ranks"]})
            self._started = True
            self._down_since = None

    def _downtime(self, kind: str, gen: int, rank: int, seconds: float) -> None:
        """Observe a rank's downtime; the node's is observed once all its ranks reported the event."""
        self.rank_downtime.labels(self.node_id, str(rank), kind).observe(seconds)
        reported = self._pending.setdefault((kind, gen), {})
        reported[rank] = seconds
        if len(reported) >= self._nproc:
            del self._pending[(kind, gen)]
            self.node_downtime.labels(self.node_id, kind).observe(max(reported.values()))
