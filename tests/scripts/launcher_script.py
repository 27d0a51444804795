"""torchrun's launcher test script (PyTorch's test/distributed/launcher/bin/test_script.py), for rlaunch.

Prints the variables torchrun's agent sets (a missing one fails the worker), then touches
``<touch_file_dir>/<RANK>``; ``--fail`` raises instead. torchrun's version also reads
TORCHELASTIC_ERROR_FILE, which rlaunch does not set.
"""

import argparse
import os
from pathlib import Path

NAMES = [
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "TEST_SENTINEL_PARENT",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description="test script")
    parser.add_argument("--fail", default=False, action="store_true", help="raise a RuntimeError")
    parser.add_argument("--touch_file_dir", type=str, help="where to touch a file named after the global rank")
    args = parser.parse_args()
    print("Distributed env vars set by agent:")
    for name in NAMES:
        print(f"{name} = {os.environ[name]}")
    if args.fail:
        raise RuntimeError("raising exception since --fail flag was set")
    file = os.path.join(args.touch_file_dir, os.environ["RANK"])
    Path(file).touch()
    print(f"Success, created {file}")


if __name__ == "__main__":
    main()
