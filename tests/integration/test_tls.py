"""TLS and auth toward etcd, against a real etcd started here with client TLS and ``auth enable``.

The certificates are made in the test: a CA that signs etcd's server certificate and a client
certificate, and a second, unrelated CA with its own client certificate (the wrong ones). etcd
asks for a client certificate (``--client-cert-auth``) and has authentication on, with a root
user whose password the test knows. The client certificate's common name is no etcd user, so
the password is what authenticates. A job runs over TLS+auth end to end; each wrong setting
ends the command with a sentence naming the problem, a non-zero exit and no traceback.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlaunch.store.certs import CertificateAuthority, write_private
from rlaunch.store.client import Store, parse_endpoints
from rlaunch.store.embedded import find_etcd_binary, free_port
from rlaunch.store.security import resolve_security
from tests.cluster import TAG_VAR, AgentProc, kill_leftovers, wait_for

pytestmark = pytest.mark.timeout(240)

PASSWORD = "s3cret-" + uuid.uuid4().hex[:8]


class SecureEtcd:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        ca, other = CertificateAuthority("test etcd CA"), CertificateAuthority("some other CA")
        self.ca, self.other_ca = tmp / "ca.pem", tmp / "other-ca.pem"
        write_private(self.ca, ca.pem)
        write_private(self.other_ca, other.pem)
        self.files: dict[str, Path] = {}
        for name, issued in (
            ("server", ca.issue("etcd", ["127.0.0.1", "localhost"], server=True)),
            ("client", ca.issue("rlaunch-client", server=False)),
            ("stranger", other.issue("rlaunch-client", server=False)),
        ):
            self.files[name] = tmp / f"{name}.pem"
            self.files[name + "-key"] = tmp / f"{name}-key.pem"
            write_private(self.files[name], issued.cert)
            write_private(self.files[name + "-key"], issued.key)
        self.port, peer = free_port(), free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        binary = find_etcd_binary()
        self.etcdctl = str(Path(binary).parent / "etcdctl")
        assert os.access(self.etcdctl, os.X_OK), f"no etcdctl next to {binary}"
        self.log = (tmp / "etcd.log").open("wb")
        self.cmd = [
                binary, "--name", "tls", "--data-dir", str(tmp / "data"),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"tls=http://127.0.0.1:{peer}",
                "--cert-file", str(self.files["server"]), "--key-file", str(self.files["server-key"]),
                "--trusted-ca-file", str(self.ca), "--client-cert-auth", "--log-level", "error",
        ]  # fmt: skip
        self.proc = self._start()
        wait_for(lambda: self.ctl("endpoint", "health").returncode == 0, 60, "the TLS etcd to be healthy")
        for args in (("user", "add", "root", "--new-user-password", PASSWORD), ("auth", "enable")):
            out = self.ctl(*args)
            assert out.returncode == 0, out.stderr

    def _start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def restart(self) -> None:
        """Stop etcd and start it again on the same port and data: it forgets every auth token."""
        self.proc.terminate()
        self.proc.wait(10)
        self.proc = self._start()
        wait_for(lambda: self.ctl("endpoint", "health").returncode == 0, 60, "the TLS etcd to be back")

    def flags(self) -> list[str]:
        return ["--cacert", str(self.ca), "--cert", str(self.files["client"]), "--key", str(self.files["client-key"])]

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [self.etcdctl, "--endpoints", self.url, *self.flags(), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    server = SecureEtcd(tmp_path_factory.mktemp("tls"))
    yield server
    server.stop()


@pytest.fixture
def tag() -> Iterator[str]:
    tag = uuid.uuid4().hex
    yield tag
    left = kill_leftovers(tag)
    assert not left, f"processes left running after the test: {left}"


def env(tag: str, **extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ETCDCTL_", "PET_"))}
    return {**base, TAG_VAR: tag, **extra}


def cli(tag: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlaunch", *args], env=env(tag, **extra), capture_output=True, text=True, timeout=90
    )


def status_json(etcd: SecureEtcd, tag: str, job: str) -> subprocess.CompletedProcess[str]:
    return cli(tag, "status", "--rdzv-endpoint", etcd.url, "--rdzv-id", job, "--json", *etcd.flags(),
               ETCDCTL_USER=f"root:{PASSWORD}")  # fmt: skip


def test_a_job_runs_over_tls_and_auth_end_to_end(etcd: SecureEtcd, tag: str, tmp_path: Path) -> None:
    job = "tls-" + uuid.uuid4().hex[:8]
    flag = tmp_path / "go"
    script = tmp_path / "tiny.py"
    script.write_text(
        "import os, time\n"
        f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.1)\n"
        "print('tiny done rank', os.environ['RANK'], flush=True)\n"
    )
    argv = [
        sys.executable, "-m", "rlaunch", "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-endpoint", etcd.url, "--rdzv-id", job, "--node-id", "tls-node", "--lease-ttl", "3",
        "--user", f"root:{PASSWORD}", *etcd.flags(), str(script),
    ]  # fmt: skip
    agent = AgentProc("tls-node", argv, env(tag), tmp_path / "agent.log")
    try:
        import json

        def running() -> bool:
            out = status_json(etcd, tag, job)
            return out.returncode == 0 and any(n["state"] == "running" for n in json.loads(out.stdout)["nodes"])

        wait_for(running, 120, "the job to run over TLS with auth")
        events = cli(tag, "events", "--rdzv-id", job, ETCDCTL_ENDPOINTS=etcd.url, ETCDCTL_CACERT=str(etcd.ca),
                     ETCDCTL_CERT=str(etcd.files["client"]), ETCDCTL_KEY=str(etcd.files["client-key"]),
                     ETCDCTL_USER="root", ETCDCTL_PASSWORD=PASSWORD)  # fmt: skip
        assert events.returncode == 0, events.stderr
        assert "node_joined" in events.stdout
        page = tmp_path / "report.html"
        report = cli(tag, "report", "--rdzv-id", job, "-o", str(page), ETCDCTL_ENDPOINTS=etcd.url,
                     ETCDCTL_CACERT=str(etcd.ca), ETCDCTL_CERT=str(etcd.files["client"]),
                     ETCDCTL_KEY=str(etcd.files["client-key"]), ETCDCTL_USER="root",
                     ETCDCTL_PASSWORD=PASSWORD)  # fmt: skip
        assert report.returncode == 0, report.stderr
        assert page.is_file() and job in page.read_text()
        flag.touch()
        assert agent.wait(120) == 0, agent.output()[-3000:]
        assert agent.output().count("tiny done rank") == 2
        # What etcd holds was written through TLS+auth: etcdctl, as root, sees the job's spec.
        spec = etcd.ctl("--user", f"root:{PASSWORD}", "get", f"/rlaunch/{job}/spec", "--print-value-only")
        assert "tiny.py" in spec.stdout
    finally:
        agent.close()


def check_refused(out: subprocess.CompletedProcess[str], *phrases: str) -> None:
    assert out.returncode != 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    for phrase in phrases:
        assert phrase in out.stderr, out.stderr


def test_a_wrong_ca_is_named(etcd: SecureEtcd, tag: str) -> None:
    flags = [
        "--cacert",
        str(etcd.other_ca),
        "--cert",
        str(etcd.files["client"]),
        "--key",
        str(etcd.files["client-key"]),
    ]
    out = cli(tag, "status", "--rdzv-endpoint", etcd.url, *flags, "--user", f"root:{PASSWORD}")
    check_refused(out, f"etcd at 127.0.0.1:{etcd.port} presented a TLS certificate", str(etcd.other_ca))


def test_https_without_a_ca_uses_the_system_roots_and_says_so(etcd: SecureEtcd, tag: str) -> None:
    out = cli(tag, "status", "--rdzv-endpoint", etcd.url, "--user", f"root:{PASSWORD}")
    check_refused(out, "the system's root certificates cannot verify")


def test_a_client_certificate_etcd_does_not_trust_is_named(etcd: SecureEtcd, tag: str) -> None:
    flags = ["--cacert", str(etcd.ca), "--cert", str(etcd.files["stranger"]), "--key", str(etcd.files["stranger-key"])]
    out = cli(tag, "status", "--rdzv-endpoint", etcd.url, *flags, "--user", f"root:{PASSWORD}")
    check_refused(out, "rejected this client's TLS certificate", str(etcd.files["stranger"]))


def test_a_missing_client_certificate_is_named(etcd: SecureEtcd, tag: str) -> None:
    out = cli(tag, "status", "--rdzv-endpoint", etcd.url, "--cacert", str(etcd.ca), "--user", f"root:{PASSWORD}")
    check_refused(out, "requires a TLS client certificate")


def test_a_wrong_password_is_named_by_the_agent_and_the_cli(etcd: SecureEtcd, tag: str, tmp_path: Path) -> None:
    out = cli(tag, "status", "--rdzv-endpoint", etcd.url, *etcd.flags(), "--user", "root:wrong")
    check_refused(out, "rejected the user name or password of user 'root'")
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('the script must not start')\n")
    run = cli(tag, "--nnodes", "1", "--rdzv-endpoint", etcd.url, "--rdzv-id", "tls-wrong", *etcd.flags(),
              str(script), ETCDCTL_USER="root", ETCDCTL_PASSWORD="wrong")  # fmt: skip
    check_refused(run, "rejected the user name or password of user 'root'")
    assert "must not start" not in run.stdout + run.stderr


def test_no_user_on_an_etcd_with_auth_is_named(etcd: SecureEtcd, tag: str) -> None:
    out = cli(tag, "status", "--rdzv-endpoint", etcd.url, *etcd.flags())
    check_refused(out, "has authentication enabled", "pass --user USER:PASSWORD")


def test_plaintext_toward_a_tls_etcd_is_named(etcd: SecureEtcd, tag: str) -> None:
    out = cli(tag, "status", "--rdzv-endpoint", f"127.0.0.1:{etcd.port}", "--timeout", "30")
    check_refused(out, "serves TLS, but this client was set up for plaintext", f"https://127.0.0.1:{etcd.port}")


def test_http_with_tls_flags_is_refused(etcd: SecureEtcd, tag: str) -> None:
    out = cli(tag, "status", "--rdzv-endpoint", f"http://127.0.0.1:{etcd.port}", *etcd.flags())
    check_refused(out, "are http:// (plaintext), but --cacert and --cert and --key asks for TLS")
    assert out.returncode == 2


def test_the_client_logs_in_again_after_etcd_restarts(etcd: SecureEtcd) -> None:
    """etcd keeps auth tokens in memory: after a restart the store must renew its token by itself,
    for a request and for a watch made before any request renewed it (etcd refuses a watch stream
    opened with a forgotten token as "permission denied"; taken as a watch, or as the user's lack of
    access, an agent would have followed nothing)."""
    endpoints = parse_endpoints(etcd.url)
    security = resolve_security(
        endpoints, cacert=str(etcd.ca), cert=str(etcd.files["client"]), key=str(etcd.files["client-key"]),
        user=f"root:{PASSWORD}", environ={},
    )  # fmt: skip
    key = f"/rlaunch/tls-restart-{uuid.uuid4().hex}"

    async def go() -> None:
        store = Store(endpoints, timeout=2.0, security=security)
        try:
            await store.connect(30)
            await store.put(key, b"1")
            etcd.restart()
            seen: list[bytes] = []

            async def follow() -> None:
                async for ev in store.watch_prefix(key + "/w", exact=True):
                    seen.append(ev.value)

            watching = asyncio.create_task(follow())
            await asyncio.sleep(3.0)  # made (or refused) before the next request renews the token
            assert not watching.done(), watching
            await store.connect(30)
            kv = await store.get(key)
            assert kv is not None and kv.value == b"1"
            await store.put(key, b"2")
            await store.put(key + "/w", b"seen")
            for _ in range(50):
                if seen:
                    break
                await asyncio.sleep(0.1)
            assert seen == [b"seen"], "the watch made right after the restart must deliver"
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
        finally:
            await store.close()

    asyncio.run(go())
