"""What Slurm says about its nodes, read from ``scontrol show node -o``: pure parsing and decisions.

Slurm marks a node for maintenance by adding a flag to its state: ``DRAIN`` (``scontrol update
nodename=X state=drain reason=...``, also set by ``scontrol reboot ASAP``), ``FAIL`` (``state=fail``:
expected to fail soon) or ``MAINTENANCE`` (inside an active maintenance reservation). A running job
keeps such a node until it ends; rlaunch moves the node's ranks to a standby at once instead, and
:mod:`rlaunch.integrations.slurm_watch` asks for that drain. This module has no I/O: it turns the
text ``scontrol`` prints into typed records and says which nodes Slurm wants out.

One line of ``scontrol show node -o`` is a run of ``Key=value`` fields separated by spaces, where
some values hold spaces themselves (``OS=Linux 6.1.0 #1 SMP ...``) and ``Reason`` is free text
followed by ``[user@time]``; the parser reads the reason by that suffix, then splits the rest at
each `` Key=``.
"""

from __future__ import annotations

import dataclasses
import re

from rlaunch.errors import RlaunchError

#: State flags by which Slurm takes a node out of service: drain (also ``scontrol reboot ASAP``),
#: fail (expected to fail soon), an active maintenance reservation.
MAINTENANCE_FLAGS = frozenset({"DRAIN", "FAIL", "MAINTENANCE"})

_REASON = re.compile(r"(?:^|\s)Reason=(?P<text>.*?)\s\[(?P<user>[^\]@\s]+)@(?P<time>[^\]\s]+)\]")
_KEY = re.compile(r"(?:^|\s+)([A-Za-z][A-Za-z0-9_]*)=")


class SlurmError(RlaunchError):
    """Slurm could not be asked about its nodes, or answered with something unreadable."""


@dataclasses.dataclass(frozen=True)
class SlurmNode:
    """One node as ``scontrol show node`` describes it.

    ``state`` is the base state (``IDLE``, ``ALLOCATED``, ``MIXED``, ``DOWN``, ...) and ``flags``
    the ``+``-joined flags after it (``DRAIN``, ``FAIL``, ``MAINTENANCE``, ``NOT_RESPONDING``, ...).
    ``reason`` is the operator's text without the ``[user@time]`` suffix, which goes to
    ``reason_by`` and ``reason_at``.
    """

    name: str
    state: str
    flags: frozenset[str]
    addr: str | None = None
    reason: str | None = None
    reason_by: str | None = None
    reason_at: str | None = None

    @property
    def state_text(self) -> str:
        """The state as Slurm prints it, e.g. ``ALLOCATED+DRAIN``."""
        return "+".join([self.state, *sorted(self.flags)])


def parse_fields(line: str) -> dict[str, str]:
    """The ``Key=value`` fields of one ``scontrol -o`` line (``Reason`` read by its suffix)."""
    fields: dict[str, str] = {}
    reason = _REASON.search(line)
    if reason is not None:
        fields["Reason"] = reason.group("text")
        fields["ReasonUser"] = reason.group("user")
        fields["ReasonTime"] = reason.group("time")
        line = line[: reason.start()] + line[reason.end() :]
    keys = list(_KEY.finditer(line))
    for i, key in enumerate(keys):
        end = keys[i + 1].start() if i + 1 < len(keys) else len(line)
        fields.setdefault(key.group(1), line[key.end() : end].strip())
    return fields


def parse_node(line: str) -> SlurmNode:
    """One node from one line of ``scontrol show node -o``, or :class:`SlurmError` naming the line."""
    fields = parse_fields(line)
    name, state = fields.get("NodeName"), fields.get("State")
    if not name or not state:
        raise SlurmError(
            f"This line of `scontrol show node -o` has no NodeName or no State field: {line.strip()[:200]!r}."
        )
    base, *flags = state.split("+")
    return SlurmNode(
        name=name,
        state=base,
        flags=frozenset(flags),
        addr=fields.get("NodeAddr"),
        reason=fields.get("Reason") or None,
        reason_by=fields.get("ReasonUser"),
        reason_at=fields.get("ReasonTime"),
    )


def parse_nodes(text: str) -> dict[str, SlurmNode]:
    """Every node in the output of ``scontrol show node -o [NODES]``, by name."""
    nodes = [parse_node(line) for line in text.splitlines() if line.strip()]
    return {node.name: node for node in nodes}


def maintenance(node: SlurmNode) -> str | None:
    """A sentence saying why Slurm wants ``node`` out of service, or None when it is in service."""
    if not node.flags & MAINTENANCE_FLAGS:
        return None
    why = f" with reason {node.reason!r}" if node.reason else ""
    by = f" (set by {node.reason_by} at {node.reason_at})" if node.reason_by else ""
    return f"Slurm marks node {node.name} {node.state_text}{why}{by}."
