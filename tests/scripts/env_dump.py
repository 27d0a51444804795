"""Writes the torchrun variables it was started with to $DUMP_DIR/<RANK>.json, then trains a step."""

import json
import os
import sys

import torch
import torch.distributed as dist

NAMES = [
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS",
    "RLAUNCH_AGENT_ADDR", "RLAUNCH_NODE_ID", "RLAUNCH_ROLE",
]  # fmt: skip
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
env = {n: os.environ.get(n) for n in NAMES}
env["allreduce"] = t.item()
env["argv"] = sys.argv[1:]
with open(os.path.join(os.environ["DUMP_DIR"], f"{os.environ['RANK']}.json"), "w") as f:
    json.dump(env, f)
dist.destroy_process_group()
print(f"rank {env['RANK']} dumped its environment", flush=True)
