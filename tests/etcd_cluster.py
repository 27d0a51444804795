"""Test harness: a real 3-member etcd cluster whose members tests kill and restart.

On loopback by default; on the hosts of a :class:`tests.netns.Hosts` when given ``places`` (each
member's address and the command prefix that runs a process there). There a member answers
clients on every address of its host, so on a second network too (a management network), while
it advertises, and talks to its peers on, the address it was given.

Each member is a real etcd process with its own data directory and free client and peer ports.
A killed member is restarted on the same ports and data (as an operator would), so it rejoins
the cluster with its log; killing all of them is a whole-etcd outage. Every member carries the
test's ``RLAUNCH_TEST_TAG`` in its environment, so the leftover check finds a forgotten one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path

from rlaunch.addresses import host_port
from rlaunch.store.embedded import find_etcd_binary, free_port

HOST = "127.0.0.1"


class Member:
    """One etcd member: its name, address, ports, data directory and (while it runs) its process."""

    def __init__(self, name: str, data_dir: Path, log_path: Path, host: str = HOST, prefix: Sequence[str] = ()) -> None:
        self.name = name
        self.host = host
        self.prefix = list(prefix)  # runs it where ``host`` is (empty: here)
        # a host of its own (a network namespace) has every port free
        self.client_port = free_port(HOST) if host == HOST else 2379
        self.peer_port = free_port(HOST) if host == HOST else 2380
        self.data_dir = data_dir
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return host_port(self.host, self.client_port)

    @property
    def peer_url(self) -> str:
        return f"http://{host_port(self.host, self.peer_port)}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _post(self, path: str, timeout: float = 1.0) -> dict[str, object]:
        req = urllib.request.Request(f"http://{self.endpoint}{path}", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback http only
            return dict(json.loads(resp.read()))

    def healthy(self) -> bool:
        """Whether this member answers and the cluster has a leader (etcd's own /health)."""
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1.0) as resp:  # noqa: S310
                return bool(json.loads(resp.read()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def is_leader(self) -> bool:
        try:
            status = self._post("/v3/maintenance/status")
        except (OSError, ValueError, urllib.error.URLError):
            return False
        header = status.get("header")
        return isinstance(header, dict) and header.get("member_id") == status.get("leader")


class EtcdCluster:
    """``size`` etcd members forming one cluster: on loopback, or at ``places`` (address, prefix) each."""

    def __init__(
        self,
        tmp: Path,
        tag: str,
        size: int = 3,
        tag_var: str = "RLAUNCH_TEST_TAG",
        places: Sequence[tuple[str, Sequence[str]]] = (),
    ) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rlaunch-etcd-cluster-", dir=tmp))
        where = list(places) or [(HOST, ())] * size
        self.members = [
            Member(f"m{i}", self.root / f"m{i}", self.root / f"m{i}.log", host, prefix)
            for i, (host, prefix) in enumerate(where)
        ]
        self.token = "rlaunch-test-" + uuid.uuid4().hex[:8]
        self._env = {**os.environ, tag_var: tag}
        self._binary = find_etcd_binary()

    @property
    def endpoints(self) -> str:
        """``host:port,host:port,...``, as ``--rdzv-endpoint`` takes it."""
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 60.0) -> EtcdCluster:
        for member in self.members:
            self._spawn(member)
        self.wait_healthy(self.members, timeout)
        return self

    def _spawn(self, member: Member) -> None:
        client = f"http://{member.endpoint}"
        # on a host of its own, every address of the host (a network added later reaches it too)
        listen = f"http://{host_port('::', member.client_port)}" if member.prefix else client
        cmd = [
            *member.prefix,
            self._binary,
            "--name", member.name,
            "--data-dir", str(member.data_dir),
            "--listen-client-urls", listen,
            "--advertise-client-urls", client,
            "--listen-peer-urls", member.peer_url,
            "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", ",".join(f"{m.name}={m.peer_url}" for m in self.members),
            "--initial-cluster-state", "new",  # ignored on a restart: the data directory says
            "--initial-cluster-token", self.token,
            "--log-level", "warn",
        ]  # fmt: skip
        with member.log_path.open("ab") as out:
            member.proc = subprocess.Popen(
                cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=self._env, start_new_session=True
            )

    def wait_healthy(self, members: list[Member], timeout: float = 60.0) -> None:
        """Wait until each of ``members`` answers with a leader elected; fail naming the laggards."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for m in members:
                if m.proc is not None and m.proc.poll() is not None:
                    raise AssertionError(f"etcd member {m.name} exited with {m.proc.returncode}: {self.log_tail(m)}")
            if all(m.healthy() for m in members):
                return
            time.sleep(0.2)
        bad = [m.name for m in members if not m.healthy()]
        raise AssertionError(f"etcd members {bad} were not healthy within {timeout:.0f} s")

    def leader(self, timeout: float = 30.0) -> Member:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for m in self.members:
                if m.running and m.is_leader():
                    return m
            time.sleep(0.2)
        raise AssertionError(f"no etcd member was leader within {timeout:.0f} s")

    def kill(self, member: Member) -> None:
        """SIGKILL one member (its data stays, as after a crash)."""
        if member.proc is not None and member.proc.poll() is None:
            member.proc.send_signal(signal.SIGKILL)
            member.proc.wait(10)
        member.proc = None

    def restart(self, member: Member) -> None:
        """Start a killed member again on its ports and data directory (without waiting)."""
        assert not member.running, f"etcd member {member.name} is still running"
        self._spawn(member)

    def log_tail(self, member: Member, size: int = 2000) -> str:
        try:
            return member.log_path.read_text(errors="replace")[-size:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop every member (SIGTERM, then SIGKILL) and remove the data."""
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.terminate()
        for m in self.members:
            if m.proc is not None:
                try:
                    m.proc.wait(10)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait(10)
                m.proc = None
        shutil.rmtree(self.root, ignore_errors=True)
