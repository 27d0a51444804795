#!/usr/bin/env python3
"""The floor of a drain's downtime on this machine: the same move with nothing but its own work.

issue 17 asks a drain (DDP and FSDP2, warm standby) to cost at most the transfer bound plus a quarter
step.
This measures what the move's unavoidable work costs here when nothing else is done: three
processes of the benchmarks' model (``bench_train.make_model``: 25M parameters, AdamW, 1 thread
each) in one gloo world, two active and one standby, every group built before training (what
rlaunch's phase 1 does in the background), the boundary known in advance (no plan, no vote, no
agent, no etcd, no verification). At each event the leaver ends its step, sends its parameters
and AdamW's state to the standby (gloo send/recv, tensor by tensor, into the standby's tensors),
and the standby, warmed by two steps of its own, takes the next step with the survivor. Two ways,
a run each: ``survivor_computes``, the survivor goes straight on (its forward and backward run
while the transfer does, as a survivor's do under rlaunch; on 2 shared cores they take CPU from
the transfer); ``survivor_waits``, it starts its step once the joiner holds the state (a message
from the joiner). The leaver becomes the standby for the next event. Steady steps are timed the
same way, so the downtime is set against them. Two layouts (``--layouts``, a JSON key each), both
without torch's wrappers, whose groups cannot change under them without rlaunch's swap:

- ``ddp``: every rank holds the whole model; gradients are averaged by one all-reduce of a flat
  buffer after the backward pass;
- ``fsdp``: the FSDP2 layout of ``bench_train.py --layout fsdp`` (its 8-output model), each
  parameter's rows split in two (:class:`ShardedRank`): an all-gather of each parameter's halves
  before the forward pass and a reduce-scatter of its gradient after the backward one, the
  collectives FSDP2 runs on gloo (it runs one of each per layer, and prefetches; this gathers
  nothing again for the backward pass);
  a move sends the leaver's halves and their AdamW state, half of DDP's bytes.

Reported for each way (medians over the events, with their runs, least and most): ``downtime_s``,
the time from the boundary (the end of the step before the event) to the end of the first step
after it on the last of the two ranks, less the survivor's median period in the same run away
from the events (``median_step_s`` there; how rlaunch's phases count a drain's downtime);
``transfer_s``, the send's wall time inside the event; ``transfer_alone_s``, the same bytes sent
while the third process idles (best of 3: the bound's measure); ``first_step_s``, the joiner's
first step from the end of its receive. ``floor_s`` is the lower of the two medians, set against
issue 17's target (``target_below_floor``; its step: the run without events' median period), and
each rank's final parameters' digests are compared with that run's (the moves must not change a
bit; under DDP, both ranks' with each other too). The
floor moves the whole state before the joiner's first step; rlaunch's joiner starts once the
parameters landed, while the optimizer state goes on landing. What this cannot show: a GPU's copy
engines and NVLink, where the transfer would not share the cores with the steps. Prints one JSON
object, keyed by layout.
Usage: scripts/bench_floor.py [--events 5] [--steady 12] [--every 6] [--width 2048] [--layouts ddp,fsdp]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from rlaunch.store.embedded import free_port  # noqa: E402
from scripts.bench_train import batch, digest, make_model  # noqa: E402
from scripts.ending import die_with_parent, end_on_sigterm  # noqa: E402
from scripts.migration_figures import spread  # noqa: E402

DEPTH, BATCH = 6, 64  # bench_train.py's defaults (its width: --width)
WARM = 2  # a standby's own steps before it is needed (rlaunch's default sandbox is 3)
#: the layouts it can move: DDP's replicas, or FSDP2's halves (:class:`ShardedRank`)
LAYOUTS = ("ddp", "fsdp")
#: the moved runs: whether the survivor waits for the transfer's end before its step
VARIANTS = {"survivor_computes": False, "survivor_waits": True}


class Rank:
    """One process's model, optimizer and steps."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.model = make_model(0, width, DEPTH)
        self.params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)

    def step(self, step: int, data_rank: int, group: Any) -> None:
        """One step on ``data_rank``'s batch, gradients averaged over ``group`` (None: alone)."""
        x, y = batch(0, step, data_rank, BATCH, self.width)
        loss = nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if group is not None:
            flat = torch.cat([p.grad.reshape(-1) for p in self.params])  # type: ignore[union-attr]
            dist.all_reduce(flat, group=group)
            flat /= 2
            torch.nn.utils.vector_to_parameters(flat, [p.grad for p in self.params])  # type: ignore[misc]
        self.opt.step()

    def state(self) -> list[torch.Tensor]:
        """What a move sends: the parameters, then each one's AdamW step and moments (made by a step)."""
        return moved_state(self.params, self.opt)


class ShardedRank:
    """One process's half of the FSDP2 layout's model (``bench_train.py --layout fsdp``: the same
    model with 8 outputs, each parameter's rows split in two), its AdamW and its steps, with
    FSDP2's collectives written out instead of ``fully_shard`` (whose communicators cannot change
    under it without rlaunch's swap): each full parameter is all-gathered from the two halves before
    the forward pass and its gradient reduce-scattered back to the halves after the backward one."""

    def __init__(self, width: int, shard: int) -> None:
        self.width = width
        full = list(make_model(0, width, DEPTH, out=8).parameters())
        self.shapes = [p.shape for p in full]
        self.params = [p.detach().chunk(2)[shard].clone().requires_grad_() for p in full]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)

    def step(self, step: int, data_rank: int, group: Any) -> None:
        """One step on ``data_rank``'s batch over ``group`` (None, a standby alone: its own half stands
        in for the other's, as in rlaunch's sandbox)."""
        fulls = []
        for half, shape in zip(self.params, self.shapes, strict=True):
            if group is None:
                full = torch.cat([half.detach()] * 2)
            else:
                full = torch.empty(shape)
                dist.all_gather_into_tensor(full, half.detach(), group=group)
            fulls.append(full.requires_grad_())
        x, y = batch(0, step, data_rank, BATCH, self.width)
        h = x
        for i in range(0, len(fulls) - 2, 2):
            h = torch.tanh(nn.functional.linear(h, fulls[i], fulls[i + 1]))
        pred = nn.functional.linear(h, fulls[-2], fulls[-1])
        loss = nn.functional.mse_loss(pred, y.expand_as(pred))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        for half, full in zip(self.params, fulls, strict=True):
            grad = torch.empty_like(half)
            if group is None:  # this half stood in for both: the sum over both places, as a reduce-scatter's
                torch.add(*full.grad.chunk(2), out=grad)  # type: ignore[union-attr]
            else:
                dist.reduce_scatter_tensor(grad, full.grad, group=group)
            half.grad = grad.div_(2)
        self.opt.step()

    def state(self) -> list[torch.Tensor]:
        """What a move sends: this rank's halves, then each one's AdamW step and moments."""
        return moved_state(self.params, self.opt)


def moved_state(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters, then each one's AdamW step and moments (made by a step)."""
    out = [p.data for p in params]
    for p in params:
        s = opt.state[p]
        out += [s["step"], s["exp_avg"], s["exp_avg_sq"]]
    return out


def worker(rank: int, port: int, layout: str, width: int, steps: int, events: list[int], waits: bool,
           out: str) -> None:  # fmt: skip
    """Rank 0 is always active; the other active rank starts as 1, and the standby as 2 (under FSDP2
    both hold the second half). ``waits``: the survivor starts its step after the joiner received the
    state (else at once)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    pairs = {frozenset(p): dist.new_group(list(p)) for p in ((0, 1), (0, 2), (1, 2))}
    me = Rank(width) if layout == "ddp" else ShardedRank(width, min(rank, 1))
    if rank == 2:  # the standby warms up on steps of its own (its optimizer's state then exists, for a receive)
        for s in range(WARM):
            me.step(s, rank, None)
    record: dict[str, Any] = {"steps": {}, "events": []}
    probe = [torch.zeros_like(p) for p in me.params for _ in range(3)]  # parameters and two moments
    record["state_bytes"] = sum(t.numel() * t.element_size() for t in probe)
    transfer_alone = []
    for _ in range(3):  # the bound: as many bytes from 1 to 2 while 0 idles
        dist.barrier()
        began = time.time()
        if rank in (1, 2):
            for t in probe:
                (dist.send if rank == 1 else dist.recv)(t, 3 - rank, group=pairs[frozenset((1, 2))])
        dist.barrier()
        transfer_alone.append(time.time() - began)
    record["transfer_alone_s"] = min(transfer_alone)
    del probe
    dist.barrier()
    active, standby = 1, 2
    for step in range(steps):
        if step in events:  # the boundary: the active rank leaves, the standby joins
            leaver, joiner = active, standby
            if rank in (leaver, joiner):
                began = time.time()
                for t in me.state():
                    if rank == leaver:
                        dist.send(t, joiner, group=pairs[frozenset((leaver, joiner))])
                    else:
                        dist.recv(t, leaver, group=pairs[frozenset((leaver, joiner))])
                role = "sent" if rank == leaver else "received"
                record["events"].append({"step": step, "role": role, "from": began, "to": time.time()})
            if waits and rank in (0, joiner):  # the joiner tells the survivor it holds the state
                (dist.recv if rank == 0 else dist.send)(torch.zeros(1), joiner if rank == 0 else 0,
                                                        group=pairs[frozenset((0, joiner))])  # fmt: skip
            active, standby = joiner, leaver
        if rank in (0, active):
            began = time.time()
            me.step(step, 0 if rank == 0 else 1, pairs[frozenset((0, active))])
            record["steps"][step] = (began, time.time())
    if rank in (0, active):
        record["digest"] = [min(rank, 1), digest(me.params)]  # which rank's parameters, and their digest
    Path(out).write_text(json.dumps(record))
    dist.destroy_process_group()


def run(layout: str, width: int, steps: int, events: list[int], waits: bool, tmp: Path) -> list[dict[str, Any]]:
    """The three processes' records of one run (``waits``: see :func:`worker`)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = [tmp / f"{layout}-rank{r}-{len(events)}-{waits}.json" for r in range(3)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(r),
                "--port",
                str(port),
                "--layout",
                layout,
                "--width",
                str(width),
                "--steps",
                str(steps),
                *(["--survivor-waits"] if waits else []),
                "--at",
                ",".join(map(str, events)),
                "--out",
                str(outs[r]),
            ],
            env=env,
            preexec_fn=die_with_parent,
        )  # fmt: skip
        for r in range(3)
    ]
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            p.kill()
    if codes != [0, 0, 0]:
        raise RuntimeError(f"the floor run's processes exited with {codes}")
    return [json.loads(o.read_text()) for o in outs]


def median_period(run: list[dict[str, Any]], events: list[int]) -> float:
    """The survivor's median period (from one step's end to the next's) in ``run``, after its first
    two steps, leaving out the periods of an event's step and the one after it: the reference of the
    same run (the machine's speed drifts between runs by more than the effect measured)."""
    ends = dict(sorted((int(k), b) for k, (_, b) in run[0]["steps"].items()))
    skip = {e + d for e in events for d in (0, 1)}
    return statistics.median(ends[k] - ends[k - 1] for k in ends if k >= 3 and k not in skip and k - 1 in ends)


def events_report(moved: list[dict[str, Any]], events: list[int]) -> dict[str, Any]:
    """Each event's downtime (as the module docstring says), transfer and joiner's first step."""
    period = median_period(moved, events)
    downtime, transfer, first = [], [], []
    for step in events:
        key = str(step)
        sent = next(e for r in moved for e in r["events"] if e["step"] == step and e["role"] == "sent")
        got = next(e for r in moved for e in r["events"] if e["step"] == step and e["role"] == "received")
        joiner = next(r for r in moved if got in r["events"])
        boundary = max(r["steps"][str(step - 1)][1] for r in moved if str(step - 1) in r["steps"])
        downtime.append(max(r["steps"][key][1] for r in moved if key in r["steps"]) - boundary - period)
        transfer.append(got["to"] - sent["from"])
        first.append(joiner["steps"][key][1] - got["to"])
    return {
        "median_step_s": round(period, 4),
        "downtime_s": spread(downtime, 4),
        "transfer_s": spread(transfer, 4),
        "first_step_s": spread(first, 4),
    }


def report(layout: str, steady: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]],
           events: list[int]) -> dict[str, Any]:  # fmt: skip
    period = median_period(steady, [])
    bound = min(r["transfer_alone_s"] for moved in runs.values() for r in moved)
    out: dict[str, Any] = {
        "state_bytes": steady[0]["state_bytes"],
        "median_step_s": round(period, 4),
        "transfer_alone_s": round(bound, 4),
        "bound_plus_quarter_step_s": round(bound + 0.25 * period, 4),
    }
    for name, moved in runs.items():
        out[name] = events_report(moved, events)
    out["floor_s"] = min(out[name]["downtime_s"]["median"] for name in runs)
    out["target_below_floor"] = out["bound_plus_quarter_step_s"] < out["floor_s"]
    # one digest for each rank's parameters over every run; under DDP, one for both ranks
    digests = {tuple(r["digest"]) for moved in (steady, *runs.values()) for r in moved if "digest" in r}
    alike = layout != "ddp" or len({d for _, d in digests}) == 1
    out["bit_identical_to_no_event"] = alike and len(digests) == len({rank for rank, _ in digests})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--events", type=int, default=5)
    ap.add_argument("--every", type=int, default=6, help="steps between events")
    ap.add_argument("--steady", type=int, default=12, help="steps before the first event")
    ap.add_argument("--width", type=int, default=2048, help="the model's width (bench_train.py's default)")
    ap.add_argument("--layouts", default="ddp,fsdp", help="comma-separated: ddp, fsdp (FSDP2's halves) or both")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="ddp", choices=LAYOUTS, help=argparse.SUPPRESS)
    ap.add_argument("--survivor-waits", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--at", default="", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        at = [int(s) for s in args.at.split(",") if s]
        worker(args.worker, args.port, args.layout, args.width, args.steps, at, args.survivor_waits, args.out)
        return
    if args.events < 1 or args.every < 2 or args.steady < 4:
        ap.error("--events must be at least 1, --every at least 2 and --steady at least 4.")
    layouts = [x for x in args.layouts.split(",") if x]
    if not layouts or any(x not in LAYOUTS for x in layouts):
        ap.error(f"--layouts {args.layouts!r} must name ddp, fsdp or both, separated by commas.")
    end_on_sigterm()
    events = [args.steady + i * args.every for i in range(args.events)]
    steps = events[-1] + args.every
    out = {}
    with tempfile.TemporaryDirectory(prefix="rlaunch-floor-") as tmp:
        for layout in layouts:
            steady = run(layout, args.width, steps, [], False, Path(tmp))
            runs = {name: run(layout, args.width, steps, events, waits, Path(tmp)) for name, waits in VARIANTS.items()}
            out[layout] = report(layout, steady, runs, events)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
