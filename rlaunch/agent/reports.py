"""What a worker's runtime reports to its agent about its rank's state: typed, validated records.

Two reports come over the control socket (:mod:`rlaunch.agent.worker_link`), each a JSON request
whose fields are checked here, so a runtime that sends a wrong field gets a sentence naming it:

- ``moves`` (:class:`MovesReport`): whether a drain can move the rank live and whether a live
  replacement can serve it, and if not why (summed up by :mod:`rlaunch.agent.moves`);
- ``sdc_suspected`` (:class:`SdcReport`): the replica check found that this rank's copy of the
  parameters or optimizer state differs from its replicas' (silent data corruption); the agent
  takes the node out of the job as for a GPU fault.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rlaunch.errors import RlaunchError


class ReportError(RlaunchError):
    """A worker's report lacks a field or has one of the wrong type (a bug in the runtime that sent it)."""


def require(req: Mapping[str, Any], op: str, name: str, kind: type[Any]) -> Any:
    """``req[name]`` checked to be a ``kind`` (a bool is no int here), else a :class:`ReportError`."""
    if name not in req:
        raise ReportError(f"The {op!r} report lacks the field {name!r}; the worker's runtime must send it.")
    value = req[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ReportError(
            f"The {op!r} report has {name}={value!r}, which is not a {kind.__name__}; the worker's runtime must "
            f"send a {kind.__name__}."
        )
    return value


@dataclasses.dataclass(frozen=True)
class MovesReport:
    """One rank's answer: can a drain move it live, can a replacement serve it, and if not why (or how)."""

    rank: int
    drain: bool
    replace: bool
    reason: str = ""

    @classmethod
    def from_request(cls, req: Mapping[str, Any]) -> MovesReport:
        """The report in a ``moves`` request (raises :class:`ReportError` naming a bad field)."""
        return cls(
            rank=require(req, "moves", "rank", int),
            drain=require(req, "moves", "drain", bool),
            replace=require(req, "moves", "replace", bool),
            reason=require(req, "moves", "reason", str).strip(),
        )

    def why_not(self) -> str:
        """Why not both: the rank's own sentence, or one saying it gave none (when both: its note on
        how, such as a rollback to host snapshots, or "")."""
        if self.drain and self.replace:
            return self.reason
        if self.reason:
            return self.reason
        if not self.drain and not self.replace:
            what = "neither a drain nor a live replacement can move it"
        elif not self.drain:
            what = "a drain cannot move it live"
        else:
            what = "a live replacement cannot serve it"
        return f"rank {self.rank} reported that {what}, without saying why"


@dataclasses.dataclass(frozen=True)
class SdcReport:
    """The replica check's verdict on this rank: its copy differs from its replicas' at ``step``.

    ``sentence`` says so for people (it becomes the node's fault); ``evidence`` is what the check
    saw, as JSON values (the object, the digests, the replicas compared, the method), for the event.
    """

    rank: int
    step: int
    sentence: str
    evidence: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_request(cls, req: Mapping[str, Any]) -> SdcReport:
        """The report in an ``sdc_suspected`` request (raises :class:`ReportError` naming a bad field)."""
        sentence = require(req, "sdc_suspected", "sentence", str).strip()
        if not sentence:
            raise ReportError("The 'sdc_suspected' report has an empty sentence; the runtime must say what differs.")
        return cls(
            rank=require(req, "sdc_suspected", "rank", int),
            step=require(req, "sdc_suspected", "step", int),
            sentence=sentence,
            evidence=dict(require(req, "sdc_suspected", "evidence", dict)),
        )

    @classmethod
    def malformed(cls, req: Mapping[str, Any], why: str) -> SdcReport:
        """What is known of a report that did not validate: the worker still suspects its own copy."""
        rank, step = req.get("rank"), req.get("step")
        rank = rank if isinstance(rank, int) and not isinstance(rank, bool) else -1
        step = step if isinstance(step, int) and not isinstance(step, bool) else -1
        who = f"rank {rank}" if rank >= 0 else f"local rank {req.get('local_rank')}"
        sentence = f"silent data corruption suspected on {who}; its report was malformed ({why})"
        return cls(rank=rank, step=step, sentence=sentence, evidence={})
