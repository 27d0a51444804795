"""The launch configuration: torchrun's flags and rlaunch's own, parsed and validated.

Pure functions: the CLI hands raw flag values to :func:`build_config`, which returns a frozen
:class:`LaunchConfig` or raises :class:`~rlaunch.errors.UsageError` with a sentence naming the
bad value. (:func:`route_addr` asks the kernel for a route to etcd; it sends no packet.)
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
import socket
from pathlib import Path

from rlaunch import __version__
from rlaunch.errors import UsageError
from rlaunch.store.client import Endpoint, parse_endpoints
from rlaunch.store.records import JobSpec
from rlaunch.store.security import EtcdSecurity, resolve_security


class Std(enum.IntFlag):
    """Which of a worker's streams go to files (torchrun's ``--redirects``/``--tee`` values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    entrypoint: str
    args: list[str]
    module: bool
    no_python: bool
    nnodes: int
    nproc_per_node: int
    #: None: start an embedded etcd
    endpoints: list[Endpoint] | None
    job_id: str
    rdzv_conf: dict[str, str]
    max_restarts: int
    monitor_interval: float
    log_dir: Path | None
    redirects: dict[int, Std]
    tee: dict[int, Std]
    local_ranks_filter: frozenset[int] | None
    master_port: int
    node_id: str
    standby: bool
    lease_ttl: int
    rdzv_timeout: float
    local_addr: str | None
    #: sandbox iterations a standby's workers run before they report ready (0: no warm-up)
    sandbox_steps: int = 3
    #: how long a live replacement of a lost node waits for a standby before a full restart
    standby_wait: float = 30.0
    #: floor of the hang timeout (the timeout grows with the job's own step time)
    hang_timeout: float = 300.0
    #: seconds a node must stay slow before it is moved to a standby (0: no straggler detection)
    straggler_window: float = 60.0
    # -- security toward etcd (--cacert, --cert, --key, --user; ETCDCTL_* variables) --
    #: TLS and credentials of the external etcd (the embedded one makes its own)
    etcd_security: EtcdSecurity = EtcdSecurity()

    def command(self, python: str) -> list[str]:
        """The worker command line, as torchrun builds it (``python -u`` unless --no-python)."""
        if self.no_python:
            return [self.entrypoint, *self.args]
        if self.module:
            return [python, "-u", "-m", self.entrypoint, *self.args]
        return [python, "-u", self.entrypoint, *self.args]

    def spec(self) -> JobSpec:
        return JobSpec(
            job_id=self.job_id,
            nnodes=self.nnodes,
            nproc_per_node=self.nproc_per_node,
            max_restarts=self.max_restarts,
            entrypoint=self.entrypoint,
            args=list(self.args),
            fingerprint=script_fingerprint(self.entrypoint, self.module, self.no_python),
            rlaunch_version=__version__,
        )


def script_fingerprint(entrypoint: str, module: bool, no_python: bool) -> str:
    """A short hash of the script's content (of its name where it is not a local file)."""
    h = hashlib.sha256()
    path = Path(entrypoint)
    if not module and not no_python and path.is_file():
        h.update(path.read_bytes())
    else:
        h.update(f"{'module' if module else 'program'}:{entrypoint}".encode())
    return h.hexdigest()[:16]


def parse_nnodes(text: str) -> int:
    lo, sep, hi = text.partition(":")
    try:
        low = int(lo)
        high = int(hi) if sep else low
    except ValueError:
        raise UsageError(f"--nnodes {text!r} is not valid: give a positive number of nodes, such as 2.") from None
    if low < 1 or high < 1:
        raise UsageError(f"--nnodes {text!r} is not valid: the number of nodes must be at least 1.")
    if low != high:
        raise UsageError(
            f"--nnodes {text!r} asks for an elastic range, which rlaunch does not use: give the number "
            f"of active nodes (--nnodes {high}); nodes that join beyond it become warm standbys."
        )
    return low


def parse_nproc(text: str) -> int:
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text == "cpu":
        return os.cpu_count() or 1
    if text in ("gpu", "auto"):
        import torch  # only here: the agent does not otherwise need torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        if text == "gpu":
            raise UsageError("--nproc-per-node gpu was given, but this machine has no CUDA device.")
        return os.cpu_count() or 1
    raise UsageError(f"--nproc-per-node {text!r} is not valid: give a positive number, or cpu, gpu or auto.")


def parse_std(flag: str, text: str, nproc: int) -> dict[int, Std]:
    """Parse torchrun's ``0..3`` or per-rank ``0:1,1:2`` into a value for each local rank."""
    bad = UsageError(
        f"{flag} {text!r} is not valid: give 0 (none), 1 (stdout), 2 (stderr) or 3 (both), "
        f"or per local rank (0 to {nproc - 1}) as 0:1,1:2."
    )

    def value(v: str) -> Std:
        if not v.strip().isdigit() or int(v) > 3:
            raise bad
        return Std(int(v))

    if ":" not in text:
        return dict.fromkeys(range(nproc), value(text))
    out = dict.fromkeys(range(nproc), Std.NONE)
    for part in text.split(","):
        rank, _, v = part.partition(":")
        if not rank.strip().isdigit() or int(rank) >= nproc:
            raise bad
        out[int(rank)] = value(v)
    return out


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    if not text:
        return None
    try:
        return frozenset(int(p) for p in text.split(","))
    except ValueError:
        raise UsageError(
            f"--local-ranks-filter {text!r} is not valid: give local ranks separated by commas, such as 0,1."
        ) from None


def parse_rdzv_conf(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise UsageError(f"--rdzv-conf {text!r} is not valid: write key=value pairs separated by commas.")
        out[key] = value
    return out


def build_config(
    *,
    script: str,
    script_args: list[str],
    nnodes: str,
    nproc_per_node: str,
    rdzv_endpoint: str,
    rdzv_id: str,
    rdzv_conf: str,
    standalone: bool,
    max_restarts: int,
    monitor_interval: float,
    log_dir: str | None,
    redirects: str,
    tee: str,
    local_ranks_filter: str,
    module: bool,
    no_python: bool,
    master_port: int | None,
    node_id: str | None,
    standby: bool,
    lease_ttl: int,
    rdzv_timeout: float,
    local_addr: str | None,
    sandbox_steps: int = 3,
    standby_wait: float = 30.0,
    hang_timeout: float = 300.0,
    straggler_window: float = 60.0,
    # -- security toward etcd --
    etcd_cacert: str | None = None,
    etcd_cert: str | None = None,
    etcd_key: str | None = None,
    etcd_user: str | None = None,
) -> LaunchConfig:
    if module and no_python:
        raise UsageError("-m/--module and --no-python cannot be used together; pick one.")
    if not module and not no_python and not Path(script).is_file():
        raise UsageError(f"The training script {script!r} does not exist; check the path.")
    if max_restarts < 0:
        raise UsageError(f"--max-restarts {max_restarts} is not valid: give 0 or more.")
    if monitor_interval <= 0:
        raise UsageError(f"--monitor-interval {monitor_interval} is not valid: give a positive number of seconds.")
    if lease_ttl < 2:
        raise UsageError(f"--lease-ttl {lease_ttl} is not valid: give at least 2 seconds.")
    if sandbox_steps < 0:
        raise UsageError(f"--sandbox-steps {sandbox_steps} is not valid: give 0 or more.")
    if not standby_wait >= 0:  # also rejects nan
        raise UsageError(f"--standby-wait {standby_wait} is not valid: give 0 or more seconds.")
    if not straggler_window >= 0:
        raise UsageError(f"--straggler-window {straggler_window} is not valid: give 0 (off) or more seconds.")
    if not hang_timeout > 0:
        raise UsageError(f"--hang-timeout {hang_timeout} is not valid: give a positive number of seconds.")
    if master_port is not None and not 0 < master_port < 65536:
        raise UsageError(f"--master-port {master_port} is not valid: give a port between 1 and 65535.")
    n = parse_nnodes(nnodes)
    nproc = parse_nproc(nproc_per_node)
    conf = parse_rdzv_conf(rdzv_conf)
    if "join_timeout" in conf:
        try:
            rdzv_timeout = float(conf["join_timeout"])
        except ValueError:
            raise UsageError(f"--rdzv-conf join_timeout={conf['join_timeout']!r} is not a number of seconds.") from None
        if not rdzv_timeout > 0:  # also rejects nan
            raise UsageError(
                f"--rdzv-conf join_timeout={conf['join_timeout']!r} is not valid: give a positive number of seconds."
            )
    if not rdzv_timeout > 0:
        raise UsageError(f"--rdzv-timeout {rdzv_timeout} is not valid: give a positive number of seconds.")
    endpoints = None if standalone or not rdzv_endpoint else parse_endpoints(rdzv_endpoint)
    security = (
        EtcdSecurity()
        if endpoints is None
        else resolve_security(endpoints, cacert=etcd_cacert, cert=etcd_cert, key=etcd_key, user=etcd_user)
    )
    return LaunchConfig(
        entrypoint=script,
        args=list(script_args),
        module=module,
        no_python=no_python,
        nnodes=n,
        nproc_per_node=nproc,
        endpoints=endpoints,
        job_id=rdzv_id,
        rdzv_conf=conf,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        log_dir=Path(log_dir) if log_dir else None,
        redirects=parse_std("--redirects", redirects, nproc),
        tee=parse_std("--tee", tee, nproc),
        local_ranks_filter=parse_ranks_filter(local_ranks_filter),
        master_port=master_port or 0,
        node_id=node_id or socket.gethostname(),
        standby=standby,
        lease_ttl=lease_ttl,
        rdzv_timeout=rdzv_timeout,
        local_addr=local_addr,
        sandbox_steps=sandbox_steps,
        standby_wait=standby_wait,
        hang_timeout=hang_timeout,
        straggler_window=straggler_window,
        etcd_security=security,
    )


def route_addr(ep: Endpoint) -> str:
    """The local address this machine uses to reach ``ep`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ep.host, ep.port))
            return str(s.getsockname()[0])
        except OSError:
            return socket.gethostbyname(socket.gethostname())
