"""The environment a worker process starts with: torchrun's variables plus ``RLAUNCH_*``."""

from __future__ import annotations

from collections.abc import Mapping

from rlaunch.store.records import Generation

#: torchrun's default ROLE_NAME (``--role`` changes it)
ROLE_NAME = "default"


def worker_env(
    base: Mapping[str, str],
    gen: Generation,
    *,
    node_id: str,
    local_rank: int,
    job_id: str,
    max_restarts: int,
    agent_addr: str,
    role: str = ROLE_NAME,
) -> dict[str, str]:
    node_rank = gen.assignment[node_id]
    nproc = gen.nproc_per_node
    rank = node_rank * nproc + local_rank
    env = dict(base)
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
        RLAUNCH_NODE_ID=node_id,
        RLAUNCH_ROLE="active",
        RLAUNCH_GENERATION=str(gen.number),
        RLAUNCH_JOB_ID=job_id,
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def standby_env(
    base: Mapping[str, str],
    gen: Generation,
    *,
    node_id: str,
    local_rank: int,
    job_id: str,
    agent_addr: str,
    role: str = ROLE_NAME,
) -> dict[str, str]:
    """A standby's sandbox worker: no rank yet (the runtime learns it when given one)."""
    env = {k: v for k, v in base.items() if k not in ("RANK", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(gen.world_size),
        LOCAL_WORLD_SIZE=str(gen.nproc_per_node),
        GROUP_WORLD_SIZE=str(gen.nnodes),
        ROLE_WORLD_SIZE=str(gen.world_size),
        ROLE_NAME=role,
        TORCHELASTIC_RUN_ID=job_id,
        RLAUNCH_AGENT_ADDR=agent_addr,
        RLAUNCH_NODE_ID=node_id,
        RLAUNCH_ROLE="standby",
        RLAUNCH_JOB_ID=job_id,
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
