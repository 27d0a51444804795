"""Options shared by several commands, and the one way the CLI reports errors."""

from __future__ import annotations

import logging
import sys
from typing import NoReturn

import typer

from rlaunch.errors import RlaunchError
from rlaunch.store.client import Endpoint, parse_endpoints
from rlaunch.store.security import EtcdSecurity, resolve_security

ENDPOINT = typer.Option(
    ...,
    "--rdzv-endpoint",
    envvar=["PET_RDZV_ENDPOINT", "ETCDCTL_ENDPOINTS"],
    help="etcd client endpoint(s), [https://]host:port[,...] (or ETCDCTL_ENDPOINTS).",
)
JOB_ID = typer.Option("none", "--rdzv-id", envvar="PET_RDZV_ID", help="The job id.")
TIMEOUT = typer.Option(10.0, "--timeout", help="Seconds to wait for etcd.")

# -- security toward etcd: etcdctl's flag names and environment variables --------------------------
CACERT = typer.Option(
    None, "--cacert", envvar="ETCDCTL_CACERT", help="CA bundle that verifies etcd's TLS certificate (turns TLS on)."
)
CERT = typer.Option(None, "--cert", envvar="ETCDCTL_CERT", help="TLS client certificate for etcd (with --key).")
KEY = typer.Option(None, "--key", envvar="ETCDCTL_KEY", help="Key of the TLS client certificate for etcd.")
USER = typer.Option(
    None,
    "--user",
    envvar="ETCDCTL_USER",
    help="etcd user as USER:PASSWORD (or USER, with ETCDCTL_PASSWORD); prefer the variable: flags are visible in ps.",
)


def connection(
    endpoint: str, cacert: str | None, cert: str | None, key: str | None, user: str | None
) -> tuple[list[Endpoint], EtcdSecurity]:
    """The endpoints and the security of a command's etcd client, from its flags (UsageError if they clash)."""
    endpoints = parse_endpoints(endpoint)
    return endpoints, resolve_security(endpoints, cacert=cacert, cert=cert, key=key, user=user)


def fail(exc: RlaunchError) -> NoReturn:
    print(f"rlaunch: error: {exc}", file=sys.stderr)
    sys.exit(exc.exit_code)


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="[rlaunch %(asctime)s %(levelname)s] %(message)s",
        datefmt="%H:%M:%S",
    )
