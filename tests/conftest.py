"""Fixtures: one real etcd server per session, a cluster harness per test, leftover checks."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from rlaunch.store.embedded import EmbeddedEtcd
from tests.cluster import TRAIN, Cluster, checksums, kill_leftovers, reap_zombies

# Orphans of the processes tests start are reparented to pytest, which reaps them: a zombie
# left after a test is then a defect of rlaunch, not of the container's init.
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"pytest got {signal.Signals(signum).name}")


# SIGTERM (timeout(1), a CI runner cancelling the job) and SIGHUP end the run as Ctrl-C does: pytest
# then tears down the running test's fixtures, so the agents, etcd members and network namespaces
# they started end with it (by default the signal killed pytest alone and left them running).
for _sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, _interrupt)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    log = tmp_path_factory.mktemp("etcd") / "etcd.log"
    server = EmbeddedEtcd(log_path=str(log)).start()
    yield server
    server.stop()


@pytest.fixture
def endpoint(etcd_server: EmbeddedEtcd) -> str:
    return etcd_server.endpoint


@pytest.fixture
def cluster(endpoint: str, tmp_path: Path) -> Iterator[Cluster]:
    """A job of its own on the test etcd; asserts at the end that nothing it started survives."""
    c = Cluster(endpoint, tmp_path, tag=uuid.uuid4().hex)
    yield c
    c.close()
    reap_zombies()
    left = kill_leftovers(c.tag)
    assert not left, f"processes left running after the test: {left}"


@pytest.fixture(scope="session")
def reference_checksum(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Final weights of an uninterrupted 2-rank run of the example (24 steps, seed 0)."""
    out = subprocess.run(
        [sys.executable, "-m", "rlaunch", "--standalone", "--nproc-per-node", "2", str(TRAIN), "--steps", "24"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    sums = checksums(out.stdout)
    assert len(sums) == 1, out.stdout
    return sums.pop()
