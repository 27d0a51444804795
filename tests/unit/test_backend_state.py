"""State on GPUs without a GPU: how CUDA tensors cross a transfer channel, where CUDA random
states go on a joiner, and the NCCL watchdog settings a worker starts with."""

from __future__ import annotations

import random

import pytest
import torch

from rlaunch.agent.env import NCCL_ENV, standby_env, worker_env
from rlaunch.runtime import rng
from rlaunch.runtime.transfer import wire
from rlaunch.store.records import Generation, GenerationStatus


def test_cuda_tensors_go_direct_over_nccl_and_are_staged_through_the_cpu_over_gloo() -> None:
    assert wire("cuda", carried=True) == "direct"
    assert wire("cuda", carried=False) == "staged"
    assert wire("cpu", carried=False) == "direct"


def test_the_leavers_gpu_state_goes_to_the_joiners_gpu() -> None:
    # the leaver used GPU 2 of 4; the joiner uses GPU 0 of 4: GPU 0 gets state 2, the rest their own
    assert rng.cuda_targets(4, sender_device=2, my_device=0, my_count=4) == [(0, 2), (1, 1), (2, 2), (3, 3)]
    # a joiner with fewer GPUs gets what fits, and its own GPU the leaver's stream
    assert rng.cuda_targets(8, sender_device=7, my_device=1, my_count=2) == [(0, 0), (1, 7)]
    # states from an older sender (no device recorded): index to index, as set_rng_state_all
    assert rng.cuda_targets(2, sender_device=None, my_device=0, my_count=2) == [(0, 0), (1, 1)]


def test_cuda_states_on_a_joiner_without_a_gpu_are_refused_with_a_sentence() -> None:
    with pytest.raises(rng.RngError, match=r"cannot be restored here: this process sees no GPU"):
        rng.cuda_targets(1, sender_device=0, my_device=0, my_count=0)


def test_the_cuda_device_travels_in_the_json_header() -> None:
    state = rng.RngState(
        torch_cpu=torch.get_rng_state(), python=random.getstate(), numpy=None,
        cuda=(torch.arange(16, dtype=torch.uint8),), cuda_device=0,
    )  # fmt: skip
    back = rng.from_json(rng.to_json(state))
    assert back.cuda_device == 0
    assert back.cuda is not None and torch.equal(back.cuda[0], state.cuda[0])  # type: ignore[index]
    cpu_only = rng.from_json(rng.to_json(rng.capture()))
    assert cpu_only.cuda is None and cpu_only.cuda_device is None


def _gen() -> Generation:
    return Generation(
        number=1, status=GenerationStatus.RUNNING, assignment={"n0": 0}, nnodes=1, nproc_per_node=1,
        master_addr="127.0.0.1", master_port=1, restart_count=0, reason="", controller="n0", created_at=0.0,
    )  # fmt: skip


def test_workers_and_standbys_start_with_the_nccl_watchdog_settings_unless_the_user_set_them() -> None:
    common = {"node_id": "n0", "local_rank": 0, "job_id": "j", "agent_addr": "127.0.0.1:1", "host_addr": "10.0.0.2"}
    env = worker_env({}, _gen(), max_restarts=0, **common)
    assert {k: env[k] for k in NCCL_ENV} == NCCL_ENV
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    mine = standby_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, _gen(), **common)
    assert mine["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert mine["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


def test_the_cuda_fingerprint_is_the_ranks_own_gpus_stream() -> None:
    def state(gpu0: int, gpu1: int, own: int) -> rng.RngState:
        cuda = (torch.full((16,), gpu0, dtype=torch.uint8), torch.full((16,), gpu1, dtype=torch.uint8))
        return rng.RngState(torch.get_rng_state(), random.getstate(), None, cuda, own)

    # rank 0 drew on GPU 0 and rank 1 on GPU 1, as far: the same stream, other GPUs untouched
    assert rng.fingerprints(state(5, 0, own=0))["cuda"] == rng.fingerprints(state(0, 5, own=1))["cuda"]
    assert rng.fingerprints(state(5, 0, own=0))["cuda"] != rng.fingerprints(state(6, 0, own=0))["cuda"]
