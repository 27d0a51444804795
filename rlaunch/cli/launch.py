"""``rlaunch [OPTIONS] SCRIPT [ARGS...]``: the torchrun-compatible launch command."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import typer

from rlaunch.agent.agent import Agent
from rlaunch.agent.config import LaunchConfig, build_config
from rlaunch.cli.options import CACERT, CERT, KEY, USER, fail, setup_logging
from rlaunch.errors import RlaunchError
from rlaunch.store.client import parse_endpoints
from rlaunch.store.embedded import EmbeddedEtcd

log = logging.getLogger(__name__)


def _opt(default: object, *names: str, help: str, env: bool = True, also_env: str = "") -> Any:  # noqa: A002
    """An option under torchrun's names (dash and underscore spellings) and PET_* variable (then ``also_env``)."""
    flags = list(names)
    long = next(n for n in names if n.startswith("--"))
    if "-" in long[2:]:
        flags.append("--" + long[2:].replace("-", "_"))
    envvar = ["PET_" + long[2:].replace("-", "_").upper()] if env else []
    envvar += [also_env] if also_env else []
    return typer.Option(default, *flags, envvar=envvar or None, help=help)


def run(
    script: str = typer.Argument(..., help="The training script (or module with -m, program with --no-python)."),
    script_args: list[str] = typer.Argument(None, help="Arguments passed to the script."),
    nnodes: str = _opt("1", "--nnodes", help="Number of active nodes; nodes beyond it join as warm standbys."),
    nproc_per_node: str = _opt("1", "--nproc-per-node", help="Workers per node: a number, or cpu, gpu, auto."),
    rdzv_endpoint: str = _opt(
        "",
        "--rdzv-endpoint",
        also_env="ETCDCTL_ENDPOINTS",
        help="etcd endpoint(s) [https://]host:port[,...] (or ETCDCTL_ENDPOINTS); none: an embedded etcd.",
    ),  # fmt: skip
    rdzv_id: str = _opt("none", "--rdzv-id", help="The job id; every key of the job lives under it."),
    rdzv_conf: str = _opt("", "--rdzv-conf", help="key=value,...; join_timeout overrides --rdzv-timeout."),
    rdzv_backend: str = _opt(
        "etcd-v3", "--rdzv-backend", help="Accepted for torchrun compatibility; rlaunch always uses etcd v3."
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
        None, "--master-port", help="Fixed MASTER_PORT; default: a free port on the node holding rank 0."
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
            etcd_cacert=cacert, etcd_cert=cert, etcd_key=key, etcd_user=user,
        )  # fmt: skip
        if rdzv_backend not in ("etcd-v3", "etcd", "c10d", "static"):
            log.warning("--rdzv-backend %s is ignored: rlaunch always rendezvouses through etcd v3", rdzv_backend)
        code = launch(cfg)
    except RlaunchError as exc:
        fail(exc)
    sys.exit(code)


def launch(cfg: LaunchConfig) -> int:
    """Run one agent, with an embedded etcd when no endpoint was given; return its exit code."""
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
