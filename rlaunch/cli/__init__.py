"""The ``rlaunch`` command line: one typer command per verb, thin bodies over library code.

``rlaunch SCRIPT ...`` launches (as torchrun does); the first word picks a subcommand when it
names one, so a script called like a subcommand is launched with ``rlaunch run SCRIPT``. Every
flag takes its dash and its underscore spelling (``--nproc-per-node``, ``--nproc_per_node``), as
torchrun's do: the context normalizes ``_`` to ``-`` in option names before matching them.
"""

from __future__ import annotations

import sys

import typer

from rlaunch import __version__
from rlaunch.cli.drain import drain, undrain
from rlaunch.cli.etcd import etcd
from rlaunch.cli.events import events
from rlaunch.cli.launch import run
from rlaunch.cli.report import report
from rlaunch.cli.slurm import slurm_watch
from rlaunch.cli.status import status

#: What ``rlaunch --help`` tells a user about the tool.
HELP = (
    "Launch PyTorch distributed training as torchrun does, and keep it running through machine "
    "faults and maintenance.\n\n"
    "Start one rlaunch per machine, with torchrun's flags:\n"
    "  rlaunch --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:2379 train.py\n\n"
    "Machines that join beyond --nnodes wait as warm standbys. When a machine fails, or is drained "
    "with `rlaunch drain`, a standby takes its ranks. A script that calls rlaunch.init() moves live "
    "while the other ranks keep running; other scripts restart every worker, as under torchrun.\n\n"
    "Without --rdzv-endpoint, rlaunch starts its own etcd: with --standalone on one machine, or on "
    "node rank 0 at --master-addr:--master-port (torchrun's static rendezvous). Every flag takes "
    "its dash or underscore spelling. `rlaunch run --help` lists the launch flags."
)


def _dashes(token: str) -> str:
    """Option names are matched with ``_`` read as ``-``: ``--node_rank`` is ``--node-rank``."""
    return token.replace("_", "-")


CONTEXT = {"token_normalize_func": _dashes, "help_option_names": ["-h", "--help"]}

app = typer.Typer(add_completion=False, no_args_is_help=True, help=HELP, context_settings=CONTEXT)
app.command(
    "run", context_settings={"allow_interspersed_args": False},
    help="Launch SCRIPT on this node as one agent of the job (the default when the first word is no subcommand).",
)(run)  # fmt: skip
app.command("status")(status)
app.command("drain")(drain)
app.command("undrain")(undrain)
app.command("events")(events)
app.command("etcd")(etcd)
app.command("report")(report)
app.command("slurm-watch")(slurm_watch)

SUBCOMMANDS = ("run", "status", "drain", "undrain", "events", "etcd", "report", "slurm-watch")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args in (["--version"], ["-V"]):
        print(f"rlaunch {__version__}")
        return
    if args and args[0] not in SUBCOMMANDS and args[0] not in ("--help", "-h"):
        args = ["run", *args]
    app(args=args, prog_name="rlaunch")
