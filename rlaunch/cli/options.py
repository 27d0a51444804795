"""Options shared by several commands, and the one way the CLI reports errors."""

from __future__ import annotations

import logging
import sys
from typing import NoReturn

import typer

from rlaunch.errors import RlaunchError

ENDPOINT = typer.Option(
    ...,
    "--rdzv-endpoint",
    envvar="PET_RDZV_ENDPOINT",
    help="etcd client endpoint(s), host:port[,host:port...].",
)
JOB_ID = typer.Option("none", "--rdzv-id", envvar="PET_RDZV_ID", help="The job id.")
TIMEOUT = typer.Option(10.0, "--timeout", help="Seconds to wait for etcd.")


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
