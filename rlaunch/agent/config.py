"""The launch configuration: torchrun's flags and rlaunch's own, parsed and validated.

Pure functions: the CLI hands raw flag values to :func:`build_config`, which returns a frozen
:class:`LaunchConfig` or raises :class:`~rlaunch.errors.UsageError` with a sentence naming the
bad value.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import ipaddress
import os
import socket
from pathlib import Path

from rlaunch import __version__
from rlaunch.addresses import host_port, is_ipv6
from rlaunch.agent.env import VERIFY_AUTO
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


#: torchrun's default --master-port (the workers' MASTER_PORT in the static rendezvous)
DEFAULT_MASTER_PORT = 29500
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2", "etcd-v3")
START_METHODS = ("spawn", "fork", "forkserver")


@dataclasses.dataclass(frozen=True)
class StaticRendezvous:
    """torchrun's static rendezvous: node rank 0 runs the job's etcd at ``master_addr:etcd_port``.

    The workers get torchrun's ``MASTER_PORT`` (``--master-port``), so etcd takes the port after
    it unless ``--rdzv-conf etcd_port=N`` says otherwise. ``node_rank`` is None for a
    ``--standby`` agent, which joins without a node rank. Node ranks are kept by joining in
    their order (see :mod:`rlaunch.cli.static`).
    """

    node_rank: int | None
    master_addr: str
    master_port: int
    etcd_port: int

    @property
    def endpoint(self) -> str:
        return host_port(self.master_addr, self.etcd_port)

    @property
    def hosts_etcd(self) -> bool:
        return self.node_rank == 0


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
    #: port of the Prometheus endpoint, served on the agent's address (0: no endpoint)
    metrics_port: int = 0
    #: torchrun's static rendezvous (--node-rank/--master-addr without --rdzv-endpoint); None: etcd
    static: StaticRendezvous | None = None
    #: ROLE_NAME of the workers (torchrun's --role)
    role: str = "default"
    #: console prefix of worker lines, with ${role_name} ${rank} ${local_rank}; None: ``[node/rank] ``
    log_line_prefix_template: str | None = None
    #: accepted for torchrun compatibility: every worker is a fresh ``python`` process anyway
    start_method: str = "spawn"
    #: steps between the runtime's replica fingerprint checks (silent data corruption): a positive
    #: number, 0 (off), or None for ``auto`` (the runtime keeps the check at most 0.5 % of step time)
    verify_every: int | None = None
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
            verify_every="auto" if self.verify_every is None else str(self.verify_every),
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


def parse_verify_every(text: str) -> int | None:
    """``--verify-every``: a number of steps (0: off), or ``auto`` (None: the runtime picks it)."""
    value = text.strip()
    if value.lower() == VERIFY_AUTO:
        return None
    if value.isascii() and value.isdigit():
        return int(value)
    raise UsageError(
        f"--verify-every {text!r} is not valid: give a number of steps between checks of the replicas' "
        "fingerprints (such as 100), auto (the default: the runtime keeps the check at most 0.5 % of the "
        "step time) or 0 (off)."
    )


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
    metrics_port: int = 0,
    node_rank: int | None = None,
    master_addr: str | None = None,
    rdzv_backend: str = "",
    role: str = "default",
    log_line_prefix_template: str | None = None,
    start_method: str = "spawn",
    run_path: bool = False,
    verify_every: str = VERIFY_AUTO,
    # -- security toward etcd --
    etcd_cacert: str | None = None,
    etcd_cert: str | None = None,
    etcd_key: str | None = None,
    etcd_user: str | None = None,
) -> LaunchConfig:
    if run_path:  # as in torchrun, --run-path runs the script with Python, over -m and --no-python
        module = no_python = False
    if module and no_python:
        raise UsageError("-m/--module and --no-python cannot be used together; pick one.")
    if not module and not no_python and Path(script).is_dir():
        raise UsageError(f"The training script {script!r} is a directory; give the path of the script file in it.")
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
    if not 0 <= metrics_port < 65536:
        raise UsageError(f"--metrics-port {metrics_port} is not valid: give a port between 1 and 65535, or 0 (off).")
    if master_port is not None and not 0 < master_port < 65536:
        raise UsageError(f"--master-port {master_port} is not valid: give a port between 1 and 65535.")
    n = parse_nnodes(nnodes)
    nproc = parse_nproc(nproc_per_node)
    verify = parse_verify_every(verify_every)
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
    static = static_rendezvous(n, rdzv_endpoint, rdzv_backend, standalone, standby, node_rank, master_addr, master_port)
    if static is not None:
        endpoints = parse_endpoints(static.endpoint)
        master_port = static.master_port  # MASTER_PORT, as torchrun gives it
        if "etcd_port" in conf:
            static = dataclasses.replace(static, etcd_port=parse_port("--rdzv-conf etcd_port", conf["etcd_port"]))
            endpoints = parse_endpoints(static.endpoint)
        if static.hosts_etcd and local_addr is None:
            local_addr = static.master_addr  # the address the other nodes know node rank 0 by
        if node_id is None and static.node_rank is not None:
            node_id = f"node{static.node_rank}"
    if start_method not in START_METHODS:
        raise UsageError(f"--start-method {start_method!r} is not valid: give {', '.join(START_METHODS)}.")
    if not role or role.strip() != role:
        raise UsageError(f"--role {role!r} is not valid: give a name without surrounding spaces.")
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
        metrics_port=metrics_port,
        static=static,
        role=role,
        log_line_prefix_template=log_line_prefix_template or None,
        start_method=start_method,
        verify_every=verify,
        etcd_security=security,
    )


def static_rendezvous(
    nnodes: int,
    rdzv_endpoint: str,
    rdzv_backend: str,
    standalone: bool,
    standby: bool,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
) -> StaticRendezvous | None:
    """torchrun's choice of rendezvous, made for rlaunch (None: etcd at the endpoint, or embedded).

    As in torchrun, the static rendezvous is the default without ``--rdzv-endpoint`` when there
    is more than one node, or when ``--node-rank``, ``--master-addr`` or ``--rdzv-backend static``
    is given; ``--rdzv-backend static`` with an endpoint takes the endpoint as the master.
    ``--standalone`` is one node with a private etcd. With an etcd endpoint, node ranks follow
    join order and ``--node-rank`` is not used (see :func:`launch_notes`).
    """
    if rdzv_backend and rdzv_backend not in RDZV_BACKENDS:
        raise UsageError(
            f"--rdzv-backend {rdzv_backend!r} is not valid: give one of {', '.join(RDZV_BACKENDS)}; "
            "rlaunch always keeps the job's state in etcd v3."
        )
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise UsageError(
            f"--node-rank {node_rank} is not valid: give a node rank from 0 to {nnodes - 1} (--nnodes {nnodes})."
        )
    if standalone:
        if node_rank:
            raise UsageError(f"--standalone runs a single node, so --node-rank {node_rank} cannot be used with it.")
        return None
    if rdzv_endpoint and rdzv_backend != "static":
        return None
    wanted = rdzv_backend == "static" or node_rank is not None or master_addr is not None
    if not rdzv_endpoint and not wanted and nnodes == 1:
        return None  # one node: an embedded etcd on a free port, as --standalone
    if standby and node_rank is not None:
        raise UsageError(
            f"--standby and --node-rank {node_rank} cannot be used together: a standby holds no node rank "
            "until it replaces a node."
        )
    if rdzv_endpoint:
        eps = parse_endpoints(rdzv_endpoint)
        if len(eps) != 1:
            raise UsageError(f"--rdzv-backend static takes one --rdzv-endpoint (the master), not {rdzv_endpoint!r}.")
        master_addr, master_port = eps[0].host, eps[0].port
    port = master_port or DEFAULT_MASTER_PORT
    return StaticRendezvous(
        node_rank=None if standby else (node_rank or 0),
        master_addr=master_addr or "127.0.0.1",
        master_port=port,
        etcd_port=port + 1 if port < 65535 else port - 1,
    )


def parse_port(flag: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise UsageError(f"{flag}={text!r} is not valid: give a port between 1 and 65535.")
    return int(text)


def launch_notes(rdzv_endpoint: str, rdzv_backend: str, node_rank: int | None, master_addr: str | None) -> list[str]:
    """Sentences about flags that were given but have no effect (torchrun warns about the same)."""
    notes = []
    static = rdzv_backend == "static"
    if rdzv_endpoint and not static and node_rank is not None:
        notes.append(
            f"--node-rank {node_rank} is not used with an etcd --rdzv-endpoint: node ranks follow the "
            "order in which nodes join (use --rdzv-backend static to keep given node ranks)."
        )
    if rdzv_endpoint and not static and master_addr is not None:
        notes.append(f"--master-addr {master_addr} is not used with an etcd --rdzv-endpoint.")
    return notes


def etcd_listen_host(master_addr: str) -> str:
    """Where node rank 0's etcd listens: a loopback master address as is, else every interface.

    A host name may resolve to a loopback address on its own machine (Debian maps it to
    127.0.1.1) and to another address elsewhere, so only a loopback literal is taken as is.
    """
    if master_addr == "localhost":
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(master_addr).is_loopback:
            return master_addr
    except ValueError:
        pass
    # the other nodes reach node rank 0's etcd, as torchrun's store
    return "::" if is_ipv6(master_addr) else "0.0.0.0"  # noqa: S104
