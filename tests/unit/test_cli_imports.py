"""A subcommand imports its own module only: ``rlaunch drain`` often runs on a machine that trains,
and what it imports costs CPU taken from the training (rlaunch.cli's LazyGroup)."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Each command, run to a fast user error, and the sentence that shows its own code ran.
COMMANDS = {
    "drain": (["drain", "n1", "--rdzv-endpoint", "127.0.0.1:1", "--timeout", "0"], "--timeout 0.0 is not valid"),
    "undrain": (["undrain", "n1", "--rdzv-endpoint", "a:b:c"], "endpoint 'a:b:c' is not valid"),
    "events": (["events", "--rdzv-endpoint", "a:b:c"], "endpoint 'a:b:c' is not valid"),
    "status": (["status", "--rdzv-endpoint", "a:b:c"], "endpoint 'a:b:c' is not valid"),
}
#: The module each command lives in.
MODULE = {"drain": "drain", "undrain": "drain", "events": "events", "status": "status"}


def imported_by(args: list[str]) -> tuple[str, set[str]]:
    """A fresh interpreter's stderr after ``rlaunch ARGS``, and the modules it had imported when it exited."""
    code = (
        "import atexit, sys; atexit.register(lambda: print(' '.join(sys.modules), file=sys.stderr)); "
        f"from rlaunch.cli import main; main({args!r})"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    *message, modules = res.stderr.strip().splitlines()
    return "\n".join(message), set(modules.split())


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_command_imports_neither_torch_nor_the_other_commands(command: str) -> None:
    args, sentence = COMMANDS[command]
    message, modules = imported_by(args)
    assert sentence in message, f"rlaunch {command} did not reach its own check: {message}"
    cli = {m for m in modules if m.startswith("rlaunch.cli.")}
    assert cli == {"rlaunch.cli.options", f"rlaunch.cli.{MODULE[command]}"}
    heavy = ("torch", "plotly", "psutil", "rlaunch.runtime", "rlaunch.agent.agent", "rlaunch.report")
    assert [m for m in modules if m == "torch" or m.startswith(heavy)] == []
