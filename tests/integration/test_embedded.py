"""The embedded etcd: private to the job's user, and gone with its agent, even a SIGKILLed one.

A real ``rlaunch --standalone`` agent starts its etcd; the test checks that the etcd serves
mutual TLS with certificates kept in a 0700 directory (a client without them is refused, one with
the flags the agent prints gets in), then SIGKILLs the agent alone and waits for the etcd process,
its data directory and its certificates to be gone.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from rlaunch.store.embedded import EmbeddedEtcd
from tests.cluster import TAG_VAR, AgentProc, kill_leftovers, reap_zombies, wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def tag() -> Iterator[str]:
    tag = uuid.uuid4().hex
    yield tag
    reap_zombies()
    left = kill_leftovers(tag)
    assert not left, f"processes left running after the test: {left}"


def env(tag: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ETCDCTL_", "PET_"))}
    return {**base, TAG_VAR: tag}


def gone(pid: int) -> bool:
    reap_zombies()
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def cli(tag: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "rlaunch", *args]
    return subprocess.run(cmd, env=env(tag), capture_output=True, text=True, timeout=60)


def test_a_sigkilled_agent_takes_its_private_etcd_and_its_files_along(tag: str, tmp_path: Path) -> None:
    job = "emb-" + uuid.uuid4().hex[:8]
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('sleeper ready', flush=True)\ntime.sleep(600)\n")
    argv = [sys.executable, "-m", "rlaunch", "--standalone", "--rdzv-id", job, "--node-id", "solo", str(script)]
    # The agent's own TMPDIR, removed at the end: its control socket's directory is its to remove, which
    # the SIGKILL prevents (the janitor removes the etcd's). In /tmp: a socket's path fits in 108 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="rlaunch-test-", dir="/tmp"))
    agent = AgentProc("solo", argv, {**env(tag), "TMPDIR": str(scratch)}, tmp_path / "agent.log")
    try:
        join = wait_for(lambda: re.search(r"join with (.*) --rdzv-id", agent.output()), 60, "the embedded etcd")
        flags = shlex.split(join.group(1))
        url = flags[flags.index("--rdzv-endpoint") + 1]
        assert url.startswith("https://127.0.0.1:")
        etcd = wait_for(
            lambda: [c for c in psutil.Process(agent.pid).children() if c.name() == "etcd"], 30, "the etcd child"
        )[0]
        cmdline = etcd.cmdline()
        data_dir = Path(cmdline[cmdline.index("--data-dir") + 1])
        private = data_dir.parent
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        for pem in (private / "pki").iterdir():
            assert stat.S_IMODE(pem.stat().st_mode) == 0o600, pem
        assert "--client-cert-auth" in cmdline and "--peer-client-cert-auth" in cmdline

        # Only a holder of the job's client certificate gets in.
        wait_for(lambda: "sleeper ready" in agent.output(), 60, "the worker to start")
        ok = cli(tag, "status", "--rdzv-id", job, "--json", *flags)
        assert ok.returncode == 0 and '"solo"' in ok.stdout, ok.stderr
        plain = cli(tag, "status", "--rdzv-id", job, "--rdzv-endpoint", url.removeprefix("https://"))
        assert plain.returncode != 0 and "serves TLS" in plain.stderr, plain.stderr
        no_cert = cli(tag, "status", "--rdzv-id", job, "--rdzv-endpoint", url, "--cacert", str(private / "pki/ca.pem"))
        assert no_cert.returncode != 0 and "requires a TLS client certificate" in no_cert.stderr, no_cert.stderr

        workers = agent.workers()
        assert workers
        agent.signal(signal.SIGKILL)
        agent.proc.wait(10)
        wait_for(lambda: gone(etcd.pid), 30, "the embedded etcd to die with its agent")
        wait_for(lambda: not private.exists(), 30, "the janitor to remove the etcd's directory")
        for w in workers:
            wait_for(lambda w=w: gone(w.pid), 30, f"worker {w.pid} to die with its agent")
    finally:
        agent.close()
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_clean_stop_removes_the_files_and_ends_the_janitor(tag: str) -> None:
    server = EmbeddedEtcd(secure=True).start()
    private = Path(server.private_dir)
    assert (private / "pki" / "client-key.pem").exists()
    janitor = server._janitor
    assert janitor is not None and janitor.poll() is None
    server.stop()
    assert not private.exists()
    assert janitor.poll() == 0


def test_rlaunch_etcd_is_private_and_prints_how_to_reach_it(tag: str, tmp_path: Path) -> None:
    log = tmp_path / "etcd.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "rlaunch", "etcd"], env=env(tag), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        line = wait_for(lambda: re.search(r"^export (.*)$", log.read_text(), re.M), 60, "rlaunch etcd to start")
        variables = dict(part.split("=", 1) for part in shlex.split(line.group(1)))
        assert variables["ETCDCTL_ENDPOINTS"].startswith("https://127.0.0.1:")
        private = Path(variables["ETCDCTL_KEY"]).parent.parent
        job = "etcd-" + uuid.uuid4().hex[:8]
        cmd = [sys.executable, "-m", "rlaunch", "status", "--rdzv-id", job]
        with_vars = subprocess.run(cmd, env={**env(tag), **variables}, capture_output=True, text=True, timeout=60)
        assert with_vars.returncode == 1 and f"no job {job!r} exists" in with_vars.stderr, with_vars.stderr
        no_cert = {k: v for k, v in variables.items() if k not in ("ETCDCTL_CERT", "ETCDCTL_KEY")}
        refused = subprocess.run(cmd, env={**env(tag), **no_cert}, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and "requires a TLS client certificate" in refused.stderr, refused.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    wait_for(lambda: not private.exists(), 30, "rlaunch etcd to remove its files")
