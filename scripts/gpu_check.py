"""GPU checks of rlaunch's CUDA and NCCL path, for a machine with one GPU (run by gpu_check.sh).

Parts (``--parts``, default all), each printed as one JSON line and gathered in
``<out>/gpu_check.json``:

- ``env``: torch, CUDA, GPU name, NCCL version.
- ``gloo``: several ranks on the one GPU over gloo with CUDA tensors (``RLAUNCH_BACKEND=gloo``,
  ``tests/scripts/cuda_train.py --device cuda``): an uninterrupted run, a drain onto a warm
  standby and a live replacement after a worker's SIGKILL; the final weights and optimizer
  state of each must be bit-identical to the uninterrupted run's.
- ``transfer``: a state of ``--transfer-mb`` MiB (1024 on a GPU) moved by rlaunch's transfer
  (``send_state``/``recv_state``) from a leaver process to a joiner process over a gloo channel,
  CUDA tensors staged through pinned host memory; the leaver exits the moment its send returns,
  and the joiner must still land it whole (digests checked, and compared with the seeded
  original). Its rate is set against the slowest leg measured on the same pair: the loopback,
  and the pinned device-to-host and host-to-device copies.
- ``nccl``: NCCL with world size 1, through rlaunch's own layer (rlaunch.runtime.backend):
  blocking and non-blocking communicator init times, an allreduce on the GPU, abandoning a
  group with an operation pending on the GPU (its future must return), a non-blocking init
  whose peer never comes, aborted, and an NCCL error with no lost peer (a gradient allreduce
  queued behind ~10 s of GPU work passes its group's 3 s timeout): the pre-vote wait must find
  it, so the step is not applied. Each in a subprocess with a timeout: a hang is a result.
- ``nvml``: a health reading through rlaunch's detector (rlaunch.detectors.gpu.NvmlHealth).

``cases`` in the JSON sums it up: every case by name, with its pass/fail and seconds.

NCCL refuses two ranks of one communicator on one GPU, so NCCL with several ranks is not run:
no NCCL transfer, no NCCL drain or replacement, no error at a peer, no watchdog abort seen from a
second rank. Those run over gloo here (the ``gloo`` and ``transfer`` parts).

Without CUDA the script says so and exits 3, unless ``--device cpu`` is given: the ``gloo`` and
``transfer`` parts then run on the CPU (64 MiB), which checks the harness itself (how the tests use it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "tests" / "scripts" / "cuda_train.py"
FINAL = re.compile(r"rank (\d+) final: steps=\d+ params=(\w+) optim=(\w+) versions=\S+ devices=(\S+)")
NO_CUDA = 3
PARTS = ("env", "gloo", "transfer", "nccl", "nvml")


def emit(results: dict[str, Any], name: str, value: dict[str, Any]) -> None:
    results[name] = value
    print(json.dumps({name: value}, default=str), flush=True)


def env_part() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "python": sys.version.split()[0],
    }
    if out["cuda"]:
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpus"] = torch.cuda.device_count()
        out["cuda_runtime"] = torch.version.cuda
        try:
            out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out["nccl"] = f"unavailable: {exc}"
    return out


# --- gloo with CUDA tensors: drain and live replacement, bit-identical -------------------------------


def _finals(text: str) -> dict[int, tuple[str, str, str]]:
    return {int(m.group(1)): (m.group(2), m.group(3), m.group(4)) for m in FINAL.finditer(text)}


def gloo_part(device: str, steps: int, tmp: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from rlaunch.store.embedded import EmbeddedEtcd
    from tests.cluster import Cluster, wait_for

    env = {**os.environ, "RLAUNCH_BACKEND": "gloo", "OMP_NUM_THREADS": "1"}
    os.environ.update(RLAUNCH_BACKEND="gloo")  # the agents the harness starts inherit it
    args = ("--device", device, "--steps", str(steps), "--step-time", "0.05")
    began = time.perf_counter()
    ref = subprocess.run(
        [sys.executable, "-m", "rlaunch", "--standalone", "--nproc-per-node", "2", str(TRAIN), *args],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO,
    )  # fmt: skip
    reference = _finals(ref.stdout)
    out: dict[str, Any] = {"device": device, "reference_s": round(time.perf_counter() - began, 1)}
    if ref.returncode != 0 or sorted(reference) != [0, 1]:
        out.update(ok=False, error=f"the uninterrupted run failed (exit {ref.returncode})", tail=ref.stderr[-2000:])
        return out
    out["reference"] = {r: v[:2] for r, v in reference.items()}
    out["devices"] = sorted({v[2] for v in reference.values()})

    def warm(cluster: Cluster, node_id: str) -> bool:
        node = cluster.node(node_id)
        return bool(node and node["state"] == "standby" and node["runtime"])

    def scenario(kind: str, etcd: EmbeddedEtcd) -> dict[str, Any]:
        cluster = Cluster(etcd.endpoint, tmp / kind, tag=uuid.uuid4().hex)
        (tmp / kind).mkdir(parents=True, exist_ok=True)
        gate = tmp / kind / "gate"
        started = time.perf_counter()
        try:
            a, b, c = cluster.agents_in_order(
                ["a", "b", "c"], TRAIN, *args, "--gate", str(gate), flags=("--max-restarts", "1")
            )
            wait_for(lambda: warm(cluster, "c"), 180, "standby c to be warm")
            wait_for(lambda: "step 20/" in a.output(), 120, "training to reach the gate")
            if kind == "drain":  # planned while the ranks wait at the gate: it lands mid-run
                drain = subprocess.Popen(
                    [sys.executable, "-m", "rlaunch", "drain", "b", "--rdzv-endpoint", etcd.endpoint,
                     "--rdzv-id", cluster.job_id],
                    env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )  # fmt: skip
                wait_for(lambda: "migration_offered" in a.output(), 60, "the drain to be planned")
                gate.touch()
                stdout, stderr = drain.communicate(timeout=180)
                note = stdout.strip().splitlines()[-1:] if drain.returncode == 0 else [stderr[-1000:]]
            else:
                b.workers()[0].send_signal(signal.SIGKILL)
                gate.touch()
                note = ["worker of b killed at the gate"]
            codes = [a.wait(240), c.wait(240), b.wait(120)]
            got = _finals(a.output() + b.output() + c.output())
            same = {r: got.get(r, ("", "", ""))[:2] == reference[r][:2] for r in reference}
            return {
                "ok": all(same.values()) and codes[:2] == [0, 0], "exit_codes": codes, "identical": same,
                "note": note, "seconds": round(time.perf_counter() - started, 1),
                "devices": sorted({v[2] for v in got.values()}),
            }  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a failed scenario is a result
            logs = {n: ag.output()[-1500:] for n, ag in cluster.agents.items()}
            return {"ok": False, "error": str(exc)[:500], "logs": logs}
        finally:
            cluster.close()

    with EmbeddedEtcd(log_path=str(tmp / "etcd.log")) as etcd:
        out["drain"] = scenario("drain", etcd)
        out["replace"] = scenario("replace", etcd)
    out["ok"] = bool(out["drain"].get("ok") and out["replace"].get("ok"))
    return out


# --- one large state transfer: landed whole after the leaver exits, against the link's bound ---------

#: the largest tensor of the transfer's model (its parameters are cut into tensors of this size)
TRANSFER_PIECE_MB = 256


def _transfer_model(mb: int, device: str, seed: int | None) -> Any:
    """Parameters of ``mb`` MiB in all on ``device``: seeded normals, or zeros where ``seed`` is None."""
    import torch
    from torch import nn

    sizes = [TRANSFER_PIECE_MB] * (mb // TRANSFER_PIECE_MB) + (
        [mb % TRANSFER_PIECE_MB] if mb % TRANSFER_PIECE_MB else []
    )
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    params = []
    for size in sizes:
        n = size * (1 << 20) // 4
        t = torch.randn(n, generator=gen, device=device) if gen is not None else torch.zeros(n, device=device)
        params.append(nn.Parameter(t))
    return nn.ParameterList(params)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


def _copy_bounds(device: str, nbytes: int) -> dict[str, float]:
    """GB/s of a device-to-host and a host-to-device copy of ``nbytes`` through pinned memory."""
    import torch

    if device != "cuda":
        return {}
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, (dst, src) in {"d2h_gbps": (host, gpu), "h2d_gbps": (gpu, host)}.items():
        dst.copy_(src)  # warm
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        out[name] = _gbps(nbytes, time.perf_counter() - t0)
    return out


def transfer_role(role: str, device: str, mb: int, port: int) -> dict[str, Any]:
    """One end of the transfer, in this (child) process: ``send`` is the leaver, ``recv`` the joiner."""
    import torch
    from torch.distributed import TCPStore

    from rlaunch.runtime import backend as backends
    from rlaunch.runtime import rng
    from rlaunch.runtime.transfer import recv_state, send_state

    rank = 0 if role == "send" else 1
    if device == "cuda":
        torch.cuda.set_device(0)
    store = TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    channel = backends.build(store, "transfer/", rank, 2, datetime.timedelta(seconds=120), backends.Backend.GLOO)
    out: dict[str, Any] = {"role": role}
    # the loopback's own rate, measured on this channel before the transfer: one CPU tensor, its
    # pages touched first (a fresh tensor's page faults would be measured instead), best of 3
    probe, best = torch.zeros(min(mb, TRANSFER_PIECE_MB) << 20, dtype=torch.uint8), float("inf")
    for _ in range(3):
        channel.barrier().wait()
        t0 = time.perf_counter()
        (channel.send([probe], 1, 1) if rank == 0 else channel.recv([probe], 0, 1)).wait()
        channel.barrier().wait()
        best = min(best, time.perf_counter() - t0)
    out["loopback_gbps"] = _gbps(probe.numel(), best)
    out.update(_copy_bounds(device, probe.numel()))
    tracked = {"model": _transfer_model(mb, device, 1 if rank == 0 else None)}
    nbytes = sum(p.numel() * p.element_size() for p in tracked["model"].parameters())
    channel.barrier().wait()
    t0 = time.perf_counter()
    if rank == 0:
        out["bytes"] = send_state(channel, tracked, 7, rng.capture())
        out["sent_s"] = round(time.perf_counter() - t0, 3)
        print("RESULT " + json.dumps(out), flush=True)
        os._exit(0)  # the leaver exits the moment its send returns, as a drained worker does
    landed = recv_state(channel, tracked, rank=1)  # raises if a digest differs from the sender's
    seconds = time.perf_counter() - t0
    expected = _transfer_model(mb, device, 1)
    out.update(
        bytes=nbytes, step=landed.step, received_s=round(seconds, 3), gbps=_gbps(nbytes, seconds),
        identical=all(torch.equal(a, b) for a, b in zip(tracked["model"], expected, strict=True)),
        devices=sorted({str(p.device) for p in tracked["model"]}),
    )  # fmt: skip
    print("RESULT " + json.dumps(out), flush=True)
    return out


def transfer_part(device: str, mb: int, timeout: float) -> dict[str, Any]:
    """A state of ``mb`` MiB from a leaver process to a joiner process over a gloo channel (CUDA
    tensors staged through pinned host memory): it must land whole, digests checked, although
    the leaver exits as soon as its send returns."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--device", device, "--transfer-mb", str(mb),
           "--transfer-port", str(port), "--transfer-role"]  # fmt: skip
    t0 = time.perf_counter()
    ends = {r: subprocess.Popen([*cmd, r], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
            for r in ("send", "recv")}  # fmt: skip
    out: dict[str, Any] = {"device": device, "mb": mb}
    for role, proc in ends.items():
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            for p in ends.values():
                p.kill()
            proc.communicate()
            out.update(ok=False, error=f"the {role} end hung: no result within {timeout:.0f} s")
            return out
        found = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        out[role] = json.loads(found[-1][len("RESULT ") :]) if proc.returncode == 0 and found else {
            "error": f"exit {proc.returncode}", "tail": stderr[-1500:]}  # fmt: skip
    got, sent = out["recv"], out["send"]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if "gbps" in got:  # staged, the transfer can go no faster than its slowest leg: out of the GPU, the wire, in
        legs = [got["loopback_gbps"], sent.get("d2h_gbps"), got.get("h2d_gbps")]
        bound = min(v for v in legs if v)
        out.update(gbps=got["gbps"], bound_gbps=bound, fraction_of_bound=round(got["gbps"] / bound, 2))
    out["ok"] = bool(got.get("identical") and got.get("bytes", 0) == sent.get("bytes") and got["bytes"] >= mb << 20)
    return out


# --- NCCL with world size 1 -----------------------------------------------------------------------

NCCL_CASES = ("init", "abandon_pending", "abort_missing_peer", "error_without_lost_peer")


def nccl_case(case: str) -> dict[str, Any]:
    """One NCCL case, in this (child) process; prints its result as JSON."""
    import torch
    from torch.distributed import HashStore, PrefixStore

    from rlaunch.runtime import backend as backends
    from rlaunch.runtime import devicework
    from rlaunch.runtime.backend import Backend, Communicators
    from rlaunch.runtime.groups import SwitchableGroup
    from rlaunch.runtime.nccl import TorchNccl

    torch.cuda.set_device(0)
    gpu = torch.device("cuda", 0)
    timeout = datetime.timedelta(seconds=60)
    api = TorchNccl()
    comms = Communicators(api, device=lambda: gpu)
    out: dict[str, Any] = {}
    if case == "init":
        for blocking in (True, False):
            t0 = time.perf_counter()
            comm = api.create(PrefixStore(f"b{blocking}/", HashStore()), 0, 1, name=f"ws1.{blocking}", device=gpu,
                              timeout=timeout, blocking=blocking, ranks=[0])  # fmt: skip
            returned = time.perf_counter() - t0
            end = time.perf_counter() + 60
            while not api.ready(comm) and time.perf_counter() < end:  # non-blocking: the setup thread's outcome
                time.sleep(0.001)
            key = "blocking" if blocking else "non_blocking"
            out[key] = {"create_returned_ms": round(returned * 1000, 2), "ready": api.ready(comm),
                        "ready_ms": round((time.perf_counter() - t0) * 1000, 2),
                        "torch_initialized": bool(comm._is_initialized())}  # fmt: skip
            api.abort(comm)
        t0 = time.perf_counter()
        pg = comms.build(HashStore(), "g1/world/", 0, 1, timeout, Backend.NCCL)
        out["rlaunch_build_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        comms.wait_ready(pg, 60)
        out["rlaunch_ready_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        x = torch.full((1 << 20,), 3.0, device=gpu)
        pg.allreduce([x]).wait()
        torch.cuda.synchronize()
        cpu = torch.ones(4)
        pg.allreduce([cpu]).wait()
        out["allreduce_cuda_ok"] = bool((x == 3.0).all().item())
        out["allreduce_cpu_via_gloo_ok"] = cpu.tolist() == [1.0] * 4
        out["nccl_version"] = list(api.nccl_version)
        out["ok"] = bool(out["allreduce_cuda_ok"] and out["allreduce_cpu_via_gloo_ok"] and out["blocking"]["ready"]
                         and out["non_blocking"]["ready"])  # fmt: skip
        comms.cut(id(pg))
    elif case == "abandon_pending":
        backends.use(comms)
        pg = comms.build(HashStore(), "g1/world/", 0, 1, timeout, Backend.NCCL)
        comms.wait_ready(pg, 60)
        group = SwitchableGroup("world", [0], 0, pg, 1, guarded=True, backend=Backend.NCCL)
        torch.cuda._sleep(int(5e9))  # the GPU is busy for seconds: the allreduce queued behind it is pending
        y = torch.ones(1 << 20, device=gpu)
        work = group.allreduce([y])
        # NCCL's future completed when the allreduce was queued (group.busy is false): the GPU says it is pending
        out["pending_before_abandon"] = not torch.cuda.current_stream(gpu).query()
        t0 = time.perf_counter()
        group.abandon("the check abandons it")
        work.wait()
        out["future_returned_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        try:  # what the pre-vote wait sees after a plan aborted a kernel still queued
            torch.cuda.current_stream(gpu).synchronize()
            out["sync_after_abort"] = "ok"
        except RuntimeError as exc:
            out["sync_after_abort"] = str(exc).splitlines()[0]
        out["failed"] = group.failed
        out["ok"] = bool(out["pending_before_abandon"] and group.failed)
    elif case == "abort_missing_peer":
        os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] = "5"  # torch reads it once, at this first setup
        t0 = time.perf_counter()
        comm = api.create(PrefixStore("m/", HashStore()), 0, 2, name="ws2.missing", device=gpu, timeout=timeout,
                          blocking=False, ranks=[0, 1])  # fmt: skip
        out["create_returned_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        slept = time.perf_counter()
        time.sleep(1.0)  # the setup thread waits inside torch meanwhile: this thread must run on
        out["main_thread_free"] = time.perf_counter() - slept < 1.5
        out["ready_after_1s"] = api.ready(comm)
        t0 = time.perf_counter()
        api.abort(comm)
        out["abort_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        from rlaunch.runtime.nccl import NcclSetupError

        # the setup ends after TORCH_NCCL_NONBLOCKING_TIMEOUT; its thread then makes the abort
        end, out["setup_failed"] = time.perf_counter() + 30, ""
        while not out["setup_failed"] and time.perf_counter() < end:
            try:
                api.ready(comm)
                time.sleep(0.01)
            except NcclSetupError as exc:
                out["setup_failed"] = str(exc)
        out["ok"] = out["main_thread_free"] and not out["ready_after_1s"] and bool(out["setup_failed"])
    elif case == "error_without_lost_peer":
        backends.use(comms)
        pg = comms.build(HashStore(), "g1/world/", 0, 1, datetime.timedelta(seconds=3), Backend.NCCL)
        comms.wait_ready(pg, 60)
        group = SwitchableGroup("world", [0], 0, pg, 1, guarded=True, backend=Backend.NCCL)
        weight, grad = torch.ones(1 << 20, device=gpu), torch.ones(1 << 20, device=gpu)
        before = weight.clone()
        # the GPU is busy for ~10 s (as a rank is that spends minutes on a checkpoint while its peers
        # wait): the gradient allreduce queued behind it passes the group's 3 s timeout, every peer alive
        torch.cuda._sleep(int(2e10))
        group.allreduce([grad]).wait()  # completes at enqueue, as every NCCL future does
        t0 = time.perf_counter()
        found = devicework.finish([group])  # the runtime's pre-vote wait
        out["found_ms"] = round((time.perf_counter() - t0) * 1000, 2)
        out["wait"], out["errors"] = found.wait, [e for _, e in found.errors]
        if not found.wait and not found.errors:  # what the step would do next: apply the reduced gradient
            weight.sub_(grad)
        out["step_applied"] = not torch.equal(weight, before)
        out["ok"] = bool((found.errors or found.wait) and not out["step_applied"])
    print("RESULT " + json.dumps(out), flush=True)
    return out


def nccl_part(case_timeout: float) -> dict[str, Any]:
    from rlaunch.agent.env import NCCL_ENV

    env = {**NCCL_ENV, **os.environ}  # the watchdog settings rlaunch's workers start with
    out: dict[str, Any] = {"env": {k: env[k] for k in NCCL_ENV}}
    for case in NCCL_CASES:
        t0 = time.perf_counter()
        try:
            res = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--nccl-case", case],
                capture_output=True, text=True, timeout=case_timeout, cwd=REPO, env=env,
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            out[case] = {"ok": False, "error": f"hung: no result within {case_timeout:.0f} s",
                         "tail": str(exc.stderr or "")[-1500:]}  # fmt: skip
            continue
        found = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
        if res.returncode != 0 or not found:
            out[case] = {"ok": False, "error": f"exit {res.returncode}", "tail": res.stderr[-1500:]}
        else:
            out[case] = json.loads(found[-1][len("RESULT ") :])
        out[case]["seconds"] = round(time.perf_counter() - t0, 1)
    out["ok"] = all(out[c].get("ok") for c in NCCL_CASES)
    return out


def nvml_part() -> dict[str, Any]:
    import pynvml

    from rlaunch.detectors.gpu import NvmlHealth

    health = NvmlHealth(pynvml)
    off = health.start()
    if off is not None:
        return {"ok": False, "off": off}
    faults = health.check()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    name = pynvml.nvmlDeviceGetName(handle)
    return {
        "ok": True, "gpus": pynvml.nvmlDeviceGetCount(), "name": name if isinstance(name, str) else name.decode(),
        "faults": [f.sentence() for f in faults],
        "temperature_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
        "memory_used_mib": pynvml.nvmlDeviceGetMemoryInfo(handle).used // (1 << 20),
    }  # fmt: skip


def cases(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every case that ran, by name, with its pass/fail and seconds: the summary quoted on the issue."""
    out: dict[str, dict[str, Any]] = {}
    for part, value in results.items():
        if part in ("env", "verdict") or not isinstance(value, dict):
            continue
        inner = {k: v for k, v in value.items() if isinstance(v, dict) and "ok" in v}
        for name, case in inner.items() or [(part, value)]:
            key = f"{part}.{name}" if inner else part
            out[key] = {"ok": bool(case.get("ok")), "seconds": case.get("seconds", value.get("seconds"))}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for gpu_check.json (default: $OUT, else none)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the gloo part on the CPU")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--case-timeout", type=float, default=60.0)
    ap.add_argument("--transfer-mb", type=int, default=None, help="MiB of the transfer part (default: 1024 on a GPU)")
    ap.add_argument("--nccl-case", choices=NCCL_CASES, help=argparse.SUPPRESS)
    ap.add_argument("--transfer-role", choices=("send", "recv"), help=argparse.SUPPRESS)
    ap.add_argument("--transfer-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    mb = args.transfer_mb or (1024 if args.device == "cuda" else 64)
    if args.nccl_case:
        return 0 if nccl_case(args.nccl_case).get("ok") else 1
    if args.transfer_role:
        return 0 if transfer_role(args.transfer_role, args.device, mb, args.transfer_port) else 1
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"gpu_check: unknown parts {unknown}; choose among {list(PARTS)}.", file=sys.stderr)
        return 2
    results: dict[str, Any] = {}
    emit(results, "env", env_part())
    status = 0
    if not results["env"]["cuda"] and args.device == "cuda":
        results["verdict"] = (
            "No CUDA device is visible here (torch.cuda.is_available() is False), so no GPU check ran; "
            "run this script on the device machine, or pass --device cpu to check its gloo harness on the CPU."
        )
        print(results["verdict"], file=sys.stderr)
        status = NO_CUDA
    else:
        with tempfile.TemporaryDirectory(prefix="rlaunch-gpu-check-") as tmp:
            if "gloo" in parts:
                emit(results, "gloo", gloo_part(args.device, args.steps, Path(tmp)))
            if "transfer" in parts:
                emit(results, "transfer", transfer_part(args.device, mb, 240.0))
            if "nccl" in parts and args.device == "cuda":
                emit(results, "nccl", nccl_part(args.case_timeout))
            if "nvml" in parts and args.device == "cuda":
                emit(results, "nvml", nvml_part())
        results["cases"] = cases(results)
        failed = [p for p in parts if p in results and p != "env" and not results[p].get("ok")]
        results["verdict"] = "all checks passed" if not failed else f"failed: {', '.join(failed)}"
        status = 0 if not failed else 1
        print(f"gpu_check: {results['verdict']}", flush=True)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())
