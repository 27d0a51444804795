"""The one error hierarchy of rlaunch.

Every failure that reaches a user is an :class:`RlaunchError` whose message is a whole
sentence naming the value at fault and what to do. Client-library exceptions are translated
at the store boundary (``raise StoreError(...) from exc``) so nothing above it sees aetcd or grpc.
"""

from __future__ import annotations


class RlaunchError(Exception):
    """Base of every error rlaunch reports on purpose.

    ``exit_code`` is what the CLI exits with when the error reaches it.
    """

    exit_code = 1


class UsageError(RlaunchError):
    """A flag, argument or environment variable has a value rlaunch cannot use."""

    exit_code = 2


class StoreError(RlaunchError):
    """etcd could not be reached or answered with an error."""


class StoreUnavailableError(StoreError):
    """No etcd endpoint answered within the allowed time."""


class StoreAccessError(StoreError):
    """etcd refused this client: a TLS handshake failed, or the user or its rights were refused.

    Retrying cannot help, so nobody retries it.
    """


class RecordError(StoreError):
    """A value read from etcd is not a valid record of the expected type."""


class LeaseError(StoreError):
    """The node's lease could not be granted or kept alive."""


class FencingError(StoreError):
    """A guarded write lost its race: someone else changed the key first."""


class JoinError(RlaunchError):
    """The agent may not join the job (conflicting spec, duplicate node id, ...)."""


class PlanError(RlaunchError):
    """The controller cannot produce a valid plan."""


class MessageError(RlaunchError):
    """A message between an agent and its workers (a plan, a hello answer) is malformed or unknown."""


class TransferBrokenError(RlaunchError):
    """A joiner's state transfer broke off: its sender went away before every tensor arrived."""


class EmbeddedEtcdError(RlaunchError):
    """The embedded etcd server could not be found or started."""


class JobFailedError(RlaunchError):
    """The job ended in failure (restarts exhausted, or no replacement node in time)."""


class SandboxError(RlaunchError):
    """A standby's sandbox was asked for what it cannot serve without peers (point-to-point traffic)."""
