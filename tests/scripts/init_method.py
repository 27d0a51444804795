"""torchrun's init-method test (PyTorch's bin/test_script_init_method.py and
bin/test_script_is_torchelastic_launched.py), for rlaunch: join a gloo group through
``--init_method``, check an all-reduce, and write ``is_torchelastic_launched()`` to ``<out_dir>/<RANK>``.
"""

import argparse
import os

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init_method", type=str, required=True)
    parser.add_argument("--out_dir", type=str, required=True)
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=args.init_method, rank=rank, world_size=world_size)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) / 2, t
    dist.destroy_process_group()
    with open(os.path.join(args.out_dir, str(rank)), "w") as f:
        f.write(str(dist.is_torchelastic_launched()))


if __name__ == "__main__":
    main()
