"""The ``rlaunch`` command line: one typer command per verb, thin bodies over library code.

``rlaunch SCRIPT ...`` launches (as torchrun does); the first word picks a subcommand when it
names one, so a script called like a subcommand is launched with ``rlaunch run SCRIPT``. Every
flag takes its dash and its underscore spelling (``--nproc-per-node``, ``--nproc_per_node``), as
torchrun's do: the context normalizes ``_`` to ``-`` in option names before matching them.

A subcommand's module is imported only when that command is chosen (:class:`LazyGroup`): a
``rlaunch drain`` often runs on a machine that trains, and the CPU it would spend importing the
launcher's agent, the report's plotting and the status tables would be taken from the training.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperGroup

from rlaunch import __version__

if TYPE_CHECKING:  # typer carries its own copy of click, which TyperGroup's methods take and return
    from typer._click import Command, Context

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

#: Each subcommand, in the order ``rlaunch --help`` lists them: ``module:function``.
COMMANDS = {
    "run": "rlaunch.cli.launch:run",
    "status": "rlaunch.cli.status:status",
    "drain": "rlaunch.cli.drain:drain",
    "undrain": "rlaunch.cli.drain:undrain",
    "events": "rlaunch.cli.events:events",
    "etcd": "rlaunch.cli.etcd:etcd",
    "report": "rlaunch.cli.report:report",
    "slurm-watch": "rlaunch.cli.slurm:slurm_watch",
}
#: A subcommand's settings beyond its function's signature and docstring.
SETTINGS: dict[str, dict[str, Any]] = {
    "run": {
        "context_settings": {"allow_interspersed_args": False},
        "help": "Launch SCRIPT on this node as one agent of the job "
        "(the default when the first word is no subcommand).",
    },
}


def _dashes(token: str) -> str:
    """Option names are matched with ``_`` read as ``-``: ``--node_rank`` is ``--node-rank``."""
    return token.replace("_", "-")


CONTEXT = {"token_normalize_func": _dashes, "help_option_names": ["-h", "--help"]}


class LazyGroup(TyperGroup):
    """rlaunch's commands, each built from its module (:data:`COMMANDS`) the first time it is asked for."""

    def list_commands(self, ctx: Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Context, cmd_name: str) -> Command | None:
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            module, function = COMMANDS[cmd_name].split(":")
            one = typer.Typer(add_completion=False)
            one.command(cmd_name, **SETTINGS.get(cmd_name, {}))(getattr(importlib.import_module(module), function))
            self.commands[cmd_name] = typer.main.get_command(one)
        return self.commands.get(cmd_name)


app = typer.Typer(cls=LazyGroup, add_completion=False, no_args_is_help=True, help=HELP, context_settings=CONTEXT)


@app.callback()
def _group() -> None:
    # Typer builds a group (rather than one command) only for an app with a callback or with
    # commands registered up front; the commands here come from LazyGroup, so the group's body is empty.
    pass


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args in (["--version"], ["-V"]):
        print(f"rlaunch {__version__}")
        return
    if args and args[0] not in COMMANDS and args[0] not in ("--help", "-h"):
        args = ["run", *args]
    app(args=args, prog_name="rlaunch")
