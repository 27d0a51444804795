"""Every etcd key path rlaunch uses, built in one place.

All keys of a job live under ``/rlaunch/<job_id>/``. No other module formats key strings.
"""

from __future__ import annotations

ROOT = "/rlaunch"


def _check_segment(kind: str, value: str) -> str:
    if not value or "/" in value or value.strip() != value:
        from rlaunch.errors import UsageError

        raise UsageError(f"The {kind} {value!r} is not valid: it must be non-empty, without '/' or surrounding spaces.")
    return value


class JobKeys:
    """Key paths of one job."""

    def __init__(self, job_id: str) -> None:
        self.job_id = _check_segment("job id", job_id)
        self.prefix = f"{ROOT}/{job_id}/"

    @property
    def spec(self) -> str:
        return self.prefix + "spec"

    @property
    def leader(self) -> str:
        return self.prefix + "leader"

    @property
    def generation(self) -> str:
        """The current generation's head, which every node watches (see rlaunch.store.generations)."""
        return self.prefix + "generation"

    @property
    def assignment(self) -> str:
        """The current generation's whole rank map, written with its head."""
        return self.prefix + "assignment"

    @property
    def nodes_prefix(self) -> str:
        return self.prefix + "nodes/"

    def node(self, node_id: str) -> str:
        return self.nodes_prefix + _check_segment("node id", node_id)

    def node_id_of(self, key: str) -> str:
        """The node id of a key under :attr:`nodes_prefix`."""
        return key[len(self.nodes_prefix) :]

    def acks_prefix(self, generation: int) -> str:
        return f"{self.prefix}acks/{generation}/"

    def ack(self, generation: int, node_id: str) -> str:
        return self.acks_prefix(generation) + _check_segment("node id", node_id)

    @property
    def all_acks_prefix(self) -> str:
        return self.prefix + "acks/"

    def kv(self, key: str) -> str:
        """A key of the c10d store that workers build their groups on."""
        return f"{self.prefix}kv/{key}"

    def kv_generation_prefix(self, generation: int) -> str:
        """The c10d store keys that workers build generation ``generation``'s groups on (``g<n>/``)."""
        return self.kv(f"g{generation}/")

    @property
    def drains_prefix(self) -> str:
        return self.prefix + "requests/drain/"

    def drain_request(self, node_id: str) -> str:
        return self.drains_prefix + _check_segment("node id", node_id)

    @property
    def drained_prefix(self) -> str:
        return self.prefix + "drained/"

    def drained(self, node_id: str) -> str:
        return self.drained_prefix + _check_segment("node id", node_id)

    @property
    def suspects_prefix(self) -> str:
        return self.prefix + "suspects/"

    def suspect(self, node_id: str) -> str:
        """A node suspected of silent data corruption (:class:`~rlaunch.store.records.SuspectMark`)."""
        return self.suspects_prefix + _check_segment("node id", node_id)

    @property
    def events_prefix(self) -> str:
        return self.prefix + "events/"

    def event(self, time_ns: int, node_id: str) -> str:
        # Zero-padded so that lexical order is time order.
        return f"{self.events_prefix}{time_ns:020d}-{node_id}"
