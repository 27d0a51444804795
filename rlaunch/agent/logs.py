"""Routing of worker output: console lines prefixed ``[node_id/rank]``, per-rank log files.

As in torchrun, ``--redirects`` sends a stream to its file only, ``--tee`` to both the file and
the console, and ``--local-ranks-filter`` limits which local ranks reach the console. Files go to
``<log_dir>/<job_id>/<node_id>/attempt_<generation>/<local_rank>/{stdout,stderr}.log``.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from pathlib import Path
from string import Template
from typing import IO

from rlaunch.agent.config import Std


@dataclasses.dataclass(frozen=True)
class LogPolicy:
    node_id: str
    redirects: dict[int, Std]
    tee: dict[int, Std]
    local_ranks_filter: frozenset[int] | None
    #: None: no files
    attempt_dir: Path | None
    #: torchrun's --log-line-prefix-template (${role_name} ${rank} ${local_rank}); None: [node/rank]
    prefix_template: str | None = None
    role: str = "default"

    def prefix(self, label: int | str, local_rank: int) -> str:
        """The console prefix of a worker's lines; ``label`` is its rank, or ``s<i>`` on a standby."""
        if self.prefix_template is None:
            return f"[{self.node_id}/{label}] "
        return Template(self.prefix_template).safe_substitute(role_name=self.role, rank=label, local_rank=local_rank)

    def targets(self, local_rank: int, stream: Std) -> tuple[bool, Path | None]:
        """``(to_console, file_path)`` for one stream of one local rank."""
        redirected = bool(self.redirects.get(local_rank, Std.NONE) & stream)
        teed = bool(self.tee.get(local_rank, Std.NONE) & stream)
        shown = self.local_ranks_filter is None or local_rank in self.local_ranks_filter
        name = "stdout.log" if stream is Std.OUT else "stderr.log"
        path = None
        if (redirected or teed) and self.attempt_dir is not None:
            path = self.attempt_dir / str(local_rank) / name
        return (not redirected) and shown, path


_console_lock = threading.Lock()


class StreamPump:
    """A thread copying one worker pipe, line by line, to the console and/or a file."""

    def __init__(self, pipe: IO[bytes], prefix: str, console: IO[bytes] | None, path: Path | None) -> None:
        self._pipe = pipe
        #: read for every line, so a standby's workers can be relabelled when they take ranks
        self.prefix = prefix.encode()
        self._console = console
        self._file: IO[bytes] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("ab")
        self._thread = threading.Thread(target=self._run, name=f"pump{prefix}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for line in iter(self._pipe.readline, b""):
                if self._file is not None:
                    self._file.write(line)
                    self._file.flush()
                if self._console is not None:
                    with _console_lock:
                        self._console.write(self.prefix + line)
                        self._console.flush()
        except (OSError, ValueError):
            pass  # the pipe or the console went away while shutting down
        finally:
            self._pipe.close()
            if self._file is not None:
                self._file.close()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def console_streams() -> tuple[IO[bytes], IO[bytes]]:
    return sys.stdout.buffer, sys.stderr.buffer
