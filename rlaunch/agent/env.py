"""The environment a worker process starts with: torchrun's variables plus ``RLAUNCH_*``, and the
NCCL settings under which a hang is the agent's hang detector's to find (:data:`NCCL_ENV`)."""

from __future__ import annotations

from collections.abc import Mapping

from rlaunch.store.records import Generation

#: torchrun's default ROLE_NAME (``--role`` changes it)
ROLE_NAME = "default"

#: ``RLAUNCH_VERIFY_EVERY`` for ``--verify-every auto`` (else the number of steps; ``0``: off)
VERIFY_AUTO = "auto"

#: ProcessGroupNCCL's watchdog settings for workers, each only where the user has not set it.
#: Torch's defaults end a worker whose collective hangs: its watchdog aborts the process when the
#: group's timeout passes (10 min for NCCL), and its monitor thread does when the watchdog itself
#: is stuck for TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (8 min). Under rlaunch a hung peer is found by the
#: agent's hang detector, which plans a replacement; the survivors then abort the communicators
#: that wait on it (``ProcessGroupNCCL.abort()``) and recover in place. So:
NCCL_ENV = {
    # on an NCCL error or timeout, abort the communicators but keep the process: the failed
    # operation's future carries the error, and the runtime recovers the step (2 = CleanUpOnly)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # no monitor thread killing the process when the watchdog is stuck: the agent decides
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # if a user turns the monitor back on, it waits well past the hang detector's timeouts
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1800",
    # a timeout must not first spend time dumping the flight recorder
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    # work.wait() does not block the host (the runtime waits on futures it can abandon)
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    # a non-blocking NCCL setup whose peer never comes ends after 5 min, as the runtime's switch
    # timeout does, not torch's 30: torch holds the communicator's lock while it waits, so until
    # then the communicator cannot be aborted (rlaunch.runtime.nccl)
    "TORCH_NCCL_NONBLOCKING_TIMEOUT": "300",
}

#: The agent's etcd credentials (``--user``, ``--key``): workers never talk to etcd, so they never
#: see them (a training script's environment is often logged, dumped or inherited by its tools).
AGENT_SECRETS = ("ETCDCTL_USER", "ETCDCTL_PASSWORD", "ETCDCTL_KEY")


def _inherited(base: Mapping[str, str], drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The agent's environment as a worker inherits it: without the agent's secrets and ``drop``."""
    return {k: v for k, v in base.items() if k not in AGENT_SECRETS and k not in drop}


def worker_env(
    base: Mapping[str, str],
    gen: Generation,
    *,
    node_id: str,
    local_rank: int,
    job_id: str,
    max_restarts: int,
    agent_addr: str,
    host_addr: str,
    role: str = ROLE_NAME,
    verify_every: int | None = None,
) -> dict[str, str]:
    node_rank = gen.assignment[node_id]
    nproc = gen.nproc_per_node
    rank = node_rank * nproc + local_rank
    env = _inherited(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(gen.world_size),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK=str(node_rank),
        GROUP_WORLD_SIZE=str(gen.nnodes),
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(gen.world_size),
        ROLE_NAME=role,
        MASTER_ADDR=gen.master_addr,
        MASTER_PORT=str(gen.master_port),
        TORCHELASTIC_RESTART_COUNT=str(gen.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(max_restarts),
        TORCHELASTIC_RUN_ID=job_id,
        TORCHELASTIC_USE_AGENT_STORE="False",
        RLAUNCH_AGENT_ADDR=agent_addr,
        RLAUNCH_HOST_ADDR=host_addr,
        RLAUNCH_NODE_ID=node_id,
        RLAUNCH_ROLE="active",
        RLAUNCH_GENERATION=str(gen.number),
        RLAUNCH_JOB_ID=job_id,
        RLAUNCH_VERIFY_EVERY=verify_value(verify_every),
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in NCCL_ENV.items():
        env.setdefault(key, value)
    return env


def standby_env(
    base: Mapping[str, str],
    gen: Generation,
    *,
    node_id: str,
    local_rank: int,
    job_id: str,
    agent_addr: str,
    host_addr: str,
    role: str = ROLE_NAME,
    verify_every: int | None = None,
) -> dict[str, str]:
    """A standby's sandbox worker: no rank yet (the runtime learns it when given one)."""
    env = _inherited(base, ("RANK", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT"))
    env.update(
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(gen.world_size),
        LOCAL_WORLD_SIZE=str(gen.nproc_per_node),
        GROUP_WORLD_SIZE=str(gen.nnodes),
        ROLE_WORLD_SIZE=str(gen.world_size),
        ROLE_NAME=role,
        TORCHELASTIC_RUN_ID=job_id,
        RLAUNCH_AGENT_ADDR=agent_addr,
        RLAUNCH_HOST_ADDR=host_addr,
        RLAUNCH_NODE_ID=node_id,
        RLAUNCH_ROLE="standby",
        RLAUNCH_JOB_ID=job_id,
        RLAUNCH_VERIFY_EVERY=verify_value(verify_every),
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in NCCL_ENV.items():
        env.setdefault(key, value)
    return env


def verify_value(verify_every: int | None) -> str:
    """``RLAUNCH_VERIFY_EVERY`` for ``--verify-every`` (None: ``auto``)."""
    return VERIFY_AUTO if verify_every is None else str(verify_every)
