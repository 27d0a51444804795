"""The ``rlaunch`` command line: one typer command per verb, thin bodies over library code.

``rlaunch SCRIPT ...`` launches (as torchrun does); the first word picks a subcommand when it
names one, so a script called like a subcommand is launched with ``rlaunch run SCRIPT``.
"""

from __future__ import annotations

import sys

import typer

from rlaunch import __version__
from rlaunch.cli.drain import drain, undrain
from rlaunch.cli.etcd import etcd
from rlaunch.cli.events import events
from rlaunch.cli.launch import run
from rlaunch.cli.slurm import slurm_watch
from rlaunch.cli.status import status

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0] if __doc__ else None)
app.command(
    "run", context_settings={"allow_interspersed_args": False},
    help="Launch SCRIPT on this node (the default when the first word is no subcommand).",
)(run)  # fmt: skip
app.command("status")(status)
app.command("drain")(drain)
app.command("undrain")(undrain)
app.command("events")(events)
app.command("etcd")(etcd)
app.command("slurm-watch")(slurm_watch)

SUBCOMMANDS = ("run", "status", "drain", "undrain", "events", "etcd", "slurm-watch")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args in (["--version"], ["-V"]):
        print(f"rlaunch {__version__}")
        return
    if args and args[0] not in SUBCOMMANDS and args[0] not in ("--help", "-h"):
        args = ["run", *args]
    app(args=args, prog_name="rlaunch")
