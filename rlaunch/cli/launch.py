"""``rlaunch [OPTIONS] SCRIPT [ARGS...]``: the torchrun-compatible launch command."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import typer

from rlaunch.agent.agent import Agent
from rlaunch.agent.config import LaunchConfig, build_config, launch_notes
from rlaunch.cli.options import CACERT, CERT, KEY, USER, fail, setup_logging
from rlaunch.cli.static import launch_static
from rlaunch.errors import RlaunchError
from rlaunch.store.client import parse_endpoints
from rlaunch.store.embedded import EmbeddedEtcd

log = logging.getLogger(__name__)


def _opt(default: object, *names: str, help: str, env: bool | str = True) -> Any:  # noqa: A002
    """An option under torchrun's name and PET_* variable (``env``: also this variable, or none).

    The underscore spelling (``--nproc_per_node``) needs no alias: the app's context reads ``_``
    as ``-`` in every option name (see :mod:`rlaunch.cli`).
    """
    long = next(n for n in names if n.startswith("--"))
    pet = "PET_" + long[2:].replace("-", "_").upper()
    envvar: str | list[str] | None = ([pet, env] if isinstance(env, str) else pet) if env else None
    return typer.Option(default, *names, envvar=envvar, help=help)


def run(
    script: str = typer.Argument(..., help="The training script (or module with -m, program with --no-python)."),
    script_args: list[str] = typer.Argument(None, help="Arguments passed to the script."),
    nnodes: str = _opt("1", "--nnodes", help="Number of active nodes; nodes beyond it join as warm standbys."),
    nproc_per_node: str = _opt("1", "--nproc-per-node", help="Workers per node: a number, or cpu, gpu, auto."),
    rdzv_endpoint: str = _opt(
        "",
        "--rdzv-endpoint",
        env="ETCDCTL_ENDPOINTS",
        help="etcd endpoint(s) [https://]host:port[,...] (or ETCDCTL_ENDPOINTS); none: an embedded etcd.",
    ),  # fmt: skip
    rdzv_id: str = _opt("none", "--rdzv-id", help="The job id; every key of the job lives under it."),
    rdzv_conf: str = _opt("", "--rdzv-conf", help="key=value,...; join_timeout overrides --rdzv-timeout."),
    rdzv_backend: str = _opt(
        "",
        "--rdzv-backend",
        help="static: node rank 0 runs the job's etcd (the default without --rdzv-endpoint for more than one "
        "node); c10d, etcd, etcd-v2, etcd-v3: --rdzv-endpoint names an etcd server (v3 API), or none for an "
        "embedded one.",
    ),
    standalone: bool = _opt(False, "--standalone", help="Single node: start an embedded etcd on a free port."),
    max_restarts: int = _opt(0, "--max-restarts", help="Restarts of all workers allowed after worker failures."),
    monitor_interval: float = _opt(0.1, "--monitor-interval", help="Seconds between checks of the local workers."),
    log_dir: str = _opt(None, "--log-dir", help="Directory for per-rank log files and events.jsonl."),
    redirects: str = _opt(
        "0", "-r", "--redirects", help="Worker streams to files only: 0 none, 1 out, 2 err, 3 both; or 0:1,1:2."
    ),
    tee: str = _opt("0", "-t", "--tee", help="Worker streams to files and console, as --redirects."),
    local_ranks_filter: str = _opt(
        "", "--local-ranks-filter", help="Local ranks whose output reaches the console, e.g. 0,1."
    ),
    module: bool = _opt(False, "-m", "--module", help="Run SCRIPT as a Python module (python -m)."),
    no_python: bool = _opt(False, "--no-python", help="Run SCRIPT as a program, without the Python interpreter."),
    master_port: int = _opt(
        None,
        "--master-port",
        help="A fixed MASTER_PORT. Static rendezvous: default 29500, and node rank 0's etcd takes the next port "
        "(or --rdzv-conf etcd_port=N). Otherwise: default a free port on the node holding rank 0.",
    ),
    node_rank: int = _opt(
        None, "--node-rank", help="Static rendezvous: this node's rank, 0 to --nnodes minus 1 (default 0)."
    ),
    master_addr: str = _opt(
        None,
        "--master-addr",
        help="Static rendezvous: the address of node rank 0, where it runs the job's etcd (default 127.0.0.1).",
    ),
    role: str = _opt("default", "--role", help="The workers' ROLE_NAME."),
    log_line_prefix_template: str = _opt(
        None,
        "--log-line-prefix-template",
        help="Prefix of worker lines on the console, with ${role_name}, ${rank} and ${local_rank}; "
        "default: \\[node/rank].",
        env="TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
    ),
    start_method: str = _opt(
        "spawn",
        "--start-method",
        help="spawn, fork or forkserver. Accepted for torchrun compatibility: every worker is a new process.",
    ),
    run_path: bool = _opt(
        False, "--run-path", help="Run SCRIPT with Python, as a path (over -m and --no-python), as torchrun does."
    ),
    local_addr: str = _opt(
        None, "--local-addr", help="Address other nodes use to reach this one; default: the route to etcd."
    ),
    node_id: str = _opt(None, "--node-id", help="This node's id in the job; default: the hostname.", env=False),
    standby: bool = _opt(
        False, "--standby", help="Join only as a warm standby, never among the first --nnodes.", env=False
    ),
    lease_ttl: int = _opt(5, "--lease-ttl", help="Seconds after which a silent node counts as lost.", env=False),
    sandbox_steps: int = _opt(
        3,
        "--sandbox-steps",
        help="Warm-up iterations a standby runs in its sandbox (0: none; a DDP model needs and gets 2).",
        env=False,
    ),
    rdzv_timeout: float = _opt(
        600.0, "--rdzv-timeout", help="Longest wait, in seconds, for etcd and for the rendezvous.", env=False
    ),
    standby_wait: float = _opt(
        30.0,
        "--standby-wait",
        help="Seconds a live replacement of a lost node waits for a standby before restarting every worker.",
        env=False,
    ),
    straggler_window: float = _opt(
        60.0,
        "--straggler-window",
        help="Seconds a node must compute over twice the others' median per step before it moves to a standby "
        "(0: off).",
        env=False,
    ),
    hang_timeout: float = _opt(
        300.0,
        "--hang-timeout",
        help="Floor, in seconds, of the hang timeout: a worker without step progress for longer is killed.",
        env=False,
    ),
    metrics_port: int = _opt(
        0,
        "--metrics-port",
        help="Serve Prometheus metrics on this port, on the agent's address (--local-addr, or the route to etcd); "
        "0: off.",
        env=False,
    ),
    verify_every: str = _opt(
        "auto",
        "--verify-every",
        help="Steps between checks that data-parallel replicas hold the same parameters and optimizer state "
        "(silent data corruption): a number, auto (the runtime keeps the check at most 0.5 % of step time) or 0 (off).",
        env=False,
    ),
    cacert: str | None = CACERT,
    cert: str | None = CERT,
    key: str | None = KEY,
    user: str | None = USER,
) -> None:
    """Launch SCRIPT on this node as one agent of the job (torchrun's flags and semantics)."""
    setup_logging()
    try:
        cfg = build_config(
            script=script, script_args=script_args or [], nnodes=nnodes, nproc_per_node=nproc_per_node,
            rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, rdzv_conf=rdzv_conf, standalone=standalone,
            max_restarts=max_restarts, monitor_interval=monitor_interval, log_dir=log_dir,
            redirects=redirects, tee=tee, local_ranks_filter=local_ranks_filter, module=module,
            no_python=no_python, master_port=master_port, node_id=node_id, standby=standby,
            lease_ttl=lease_ttl, rdzv_timeout=rdzv_timeout, local_addr=local_addr, sandbox_steps=sandbox_steps,
            standby_wait=standby_wait, hang_timeout=hang_timeout, straggler_window=straggler_window,
            metrics_port=metrics_port, verify_every=verify_every,
            node_rank=node_rank, master_addr=master_addr, rdzv_backend=rdzv_backend, role=role,
            log_line_prefix_template=log_line_prefix_template, start_method=start_method, run_path=run_path,
            etcd_cacert=cacert, etcd_cert=cert, etcd_key=key, etcd_user=user,
        )  # fmt: skip
        for note in launch_notes(rdzv_endpoint, rdzv_backend, node_rank, master_addr):
            log.warning("%s", note)
        code = launch(cfg)
    except RlaunchError as exc:
        fail(exc)
    sys.exit(code)


def launch(cfg: LaunchConfig) -> int:
    """Run one agent, with an embedded etcd when no endpoint was given; return its exit code."""
    if cfg.static is not None:
        return launch_static(cfg)
    if cfg.endpoints is not None:
        return asyncio.run(Agent(cfg, cfg.endpoints).run())
    with EmbeddedEtcd(secure=True) as etcd:
        log.info(
            "started an embedded etcd at %s (mutual TLS: only this user can read its certificates); "
            "agents of this user on this machine join with %s --rdzv-id %s",
            etcd.url,
            etcd.join_flags(),
            cfg.job_id,
        )
        agent = Agent(cfg, parse_endpoints(etcd.url), keep_pids=etcd.pids, security=etcd.security)
        return asyncio.run(agent.run())
