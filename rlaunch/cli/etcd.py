"""``rlaunch etcd``: run a private etcd server in the foreground for a cluster of local agents."""

from __future__ import annotations

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
) -> None:
    """Run an etcd server until interrupted, printing its endpoint."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        with EmbeddedEtcd(host=host, port=port, data_dir=data_dir) as server:
            print(f"etcd listening on {server.endpoint}", flush=True)
            print(f"agents join with: rlaunch --rdzv-endpoint {server.endpoint} ...", flush=True)
            done.wait()
    except RlaunchError as exc:
        fail(exc)
