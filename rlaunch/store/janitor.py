"""The embedded etcd's janitor: ends etcd and removes its files when their owner dies, however it dies.

``python -m rlaunch.store.janitor PID STARTTIME DIR`` is started by
:class:`~rlaunch.store.embedded.EmbeddedEtcd` with a pipe on its standard input whose only writer
is the owner (the agent). A clean stop writes ``done`` before closing it; end of input without
it means the owner died (SIGKILL included), so the janitor SIGKILLs etcd (``PID``, checked
against its kernel start time ``STARTTIME`` so a reused pid is never hit), waits until it is
gone, and removes ``DIR`` (the data directory and the certificates). The etcd process also has
``PR_SET_PDEATHSIG``; the janitor covers the files, and etcd should the signal be missed.
Standard library only: it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

#: How long the janitor waits for etcd to end before it removes the files anyway.
WAIT_S = 10.0


def start_time(pid: int) -> str | None:
    """The kernel start time of ``pid`` (field 22 of /proc/PID/stat), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def clean(pid: int, started: str, directory: str) -> None:
    """SIGKILL ``pid`` if it is still the process started at ``started``, then remove ``directory``."""
    if start_time(pid) == started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        end = time.monotonic() + WAIT_S
        while _alive(pid) and start_time(pid) == started and time.monotonic() < end:
            time.sleep(0.05)
    shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str]) -> int:
    pid, started, directory = int(argv[0]), argv[1], argv[2]
    # Leave the owner's signals alone: a Ctrl-C for the agent must not end the janitor first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    message = sys.stdin.buffer.read()
    if message.strip() != b"done":
        clean(pid, started, directory)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
