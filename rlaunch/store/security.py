"""How rlaunch authenticates to etcd: TLS files and a user, under etcdctl's flag names and variables.

:func:`resolve_security` turns ``--cacert``/``--cert``/``--key``/``--user`` (or ``ETCDCTL_CACERT``,
``ETCDCTL_CERT``, ``ETCDCTL_KEY``, ``ETCDCTL_USER``, ``ETCDCTL_PASSWORD``) and the endpoints'
schemes into one frozen :class:`EtcdSecurity`, or a :class:`~rlaunch.errors.UsageError` whose
sentence names the value at fault. A plaintext fallback is never silent: ``http://`` with TLS
files is refused, as are endpoints mixing ``http://`` and ``https://``; ``https://`` without
``--cacert`` verifies the server against the system's root certificates, and says so.
"""

from __future__ import annotations

import dataclasses
import os
import ssl
from collections.abc import Mapping, Sequence
from typing import Protocol

from rlaunch.errors import UsageError


class _HasScheme(Protocol):
    @property
    def scheme(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class EtcdSecurity:
    """TLS and credentials toward etcd. The default is plaintext without a user."""

    tls: bool = False
    #: CA bundle that signs etcd's server certificate (None: the system's root certificates)
    cacert: str | None = None
    #: client certificate and key, for an etcd started with --client-cert-auth
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def flags(self) -> list[str]:
        """The command-line flags that give another process this security (never the password)."""
        out = []
        for flag, value in (("--cacert", self.cacert), ("--cert", self.cert), ("--key", self.key)):
            if value:
                out += [flag, value]
        return out

    def describe(self) -> str:
        """One phrase for logs and errors: how this client talks to etcd."""
        if not self.tls:
            how = "plaintext"
        else:
            how = f"TLS with CA {self.cacert}" if self.cacert else "TLS with the system's root certificates"
            if self.cert:
                how += f" and client certificate {self.cert}"
        return how + (f", as user {self.user!r}" if self.user else "")


def resolve_security(
    endpoints: Sequence[_HasScheme],
    *,
    cacert: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    user: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> EtcdSecurity:
    """Check the flags against each other and the endpoints' schemes; read the files' headers.

    ``user`` is ``USER:PASSWORD``, or ``USER`` with the password in ``ETCDCTL_PASSWORD``.
    """
    env = os.environ if environ is None else environ
    cacert, cert, key, user = (v or None for v in (cacert, cert, key, user))
    schemes = {e.scheme for e in endpoints if e.scheme}
    if len(schemes) > 1:
        raise UsageError(
            "The etcd endpoints mix http:// and https://; give every endpoint the same scheme (https:// for TLS)."
        )
    tls_flags = [f for f, v in (("--cacert", cacert), ("--cert", cert), ("--key", key)) if v]
    if schemes == {"http"} and tls_flags:
        raise UsageError(
            f"The etcd endpoints are http:// (plaintext), but {' and '.join(tls_flags)} asks for TLS; "
            "write the endpoints as https://HOST:PORT to use TLS, or drop the TLS flags."
        )
    if bool(cert) != bool(key):
        given, missing = ("--cert", "--key") if cert else ("--key", "--cert")
        raise UsageError(f"{given} was given without {missing}: a client certificate needs both its file and its key.")
    for flag, path in (("--cacert", cacert), ("--cert", cert), ("--key", key)):
        if path is not None and not (os.path.isfile(path) and os.access(path, os.R_OK)):
            raise UsageError(f"The {flag} file {path!r} does not exist or cannot be read; check the path.")
    if cacert is not None:
        try:
            ssl.create_default_context(cafile=cacert)
        except (ssl.SSLError, ValueError) as exc:
            raise UsageError(f"The --cacert file {cacert!r} holds no usable PEM certificate ({exc}).") from exc
    if cert is not None and key is not None:
        try:
            ssl.create_default_context().load_cert_chain(cert, key)
        except (ssl.SSLError, ValueError) as exc:
            raise UsageError(
                f"The client certificate {cert!r} and key {key!r} could not be loaded together ({exc}); "
                "check that both are PEM files and that the key belongs to the certificate."
            ) from exc
    name, password = None, None
    if user is not None:
        name, sep, password_part = user.partition(":")
        password = password_part if sep else env.get("ETCDCTL_PASSWORD") or None
        if not name:
            raise UsageError("--user has no user name: give it as USER:PASSWORD.")
        if password is None:
            raise UsageError(f"--user {name!r} has no password: give --user {name}:PASSWORD, or set ETCDCTL_PASSWORD.")
    return EtcdSecurity(
        tls=bool(tls_flags) or schemes == {"https"},
        cacert=cacert,
        cert=cert,
        key=key,
        user=name,
        password=password,
    )
