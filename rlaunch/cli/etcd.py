"""``rlaunch etcd``: run a private etcd server in the foreground for a cluster of local agents.

By default it serves mutual TLS with certificates made for it, readable by this user only, and
prints the flags (and the ``ETCDCTL_*`` variables) that agents and commands use to reach it.
"""

from __future__ import annotations

import shlex
import signal
import threading

import typer

from rlaunch.cli.options import fail
from rlaunch.errors import RlaunchError
from rlaunch.store.embedded import EmbeddedEtcd


def etcd(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(0, "--port", help="Client port; 0 picks a free one."),
    data_dir: str = typer.Option(None, "--data-dir", help="Data directory; default: a temporary one, removed on exit."),
    insecure: bool = typer.Option(
        False, "--insecure", help="Serve plaintext, to anyone who can reach the port (default: mutual TLS)."
    ),
) -> None:
    """Run an etcd server until interrupted, printing its endpoint and how to reach it."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        with EmbeddedEtcd(host=host, port=port, data_dir=data_dir, secure=not insecure) as server:
            print(f"etcd listening on {server.url}", flush=True)
            print(f"agents join with: rlaunch {server.join_flags()} ...", flush=True)
            sec = server.security
            if sec.tls:
                env = {"ETCDCTL_ENDPOINTS": server.url, "ETCDCTL_CACERT": sec.cacert,
                       "ETCDCTL_CERT": sec.cert, "ETCDCTL_KEY": sec.key}  # fmt: skip
                print("export " + " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items()), flush=True)
            done.wait()
    except RlaunchError as exc:
        fail(exc)
