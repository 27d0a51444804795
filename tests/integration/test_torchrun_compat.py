"""torchrun's own launcher tests, run against rlaunch.

The cases, flags (in the underscore spellings those tests use), scripts and expectations come
from PyTorch's ``test/distributed/launcher/run_test.py``: each worker touches a file named
after its global rank, so the set of files says which ranks ran. Cases are grouped into a few
tests to keep the suite short. Where rlaunch differs on purpose, the test says so:
``--nnodes 1:2`` (an elastic range) is refused, since nodes beyond ``--nnodes`` are standbys.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import uuid
from pathlib import Path

from tests.cluster import SCRIPTS, AgentProc, Cluster, wait_for

SCRIPT = str(SCRIPTS / "launcher_script.py")
BASH = str(SCRIPTS / "launcher_script.sh")


def launch(
    cluster: Cluster, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """One ``rlaunch`` run to its end, with torchrun's test sentinel in the environment."""
    proc = start(cluster, *args, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)  # its etcd's janitor may hold the pipes a few seconds
        raise AssertionError(f"rlaunch {' '.join(args)} did not end in 120 s; its log ends:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start(
    cluster: Cluster, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[str]:
    full = cluster.env({"TEST_SENTINEL_PARENT": "FOOBAR", **(env or {})})
    for name in [n for n in full if n.startswith("PET_") and n not in (env or {})]:
        del full[name]  # as torchrun's setUp: no stray PET_* variable
    return subprocess.Popen(
        [sys.executable, "-m", "rlaunch", *args], env=full, cwd=cwd, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def two_free_ports() -> int:
    """A free port P with P+1 also free (the static rendezvous' etcd takes the port after MASTER_PORT).

    Below the kernel's ephemeral range: the port goes into torchrun's flags and a worker binds it
    seconds later, while agents, etcds and gloo take ephemeral ports that could be this one."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(1000):
        port = random.randrange(1024, low - 1)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no two free ports in a row below {low} after 1000 tries")


def test_torchrun_launcher_cases_run_every_rank(cluster: Cluster, tmp_path: Path) -> None:
    etcd = ("--rdzv_backend=etcd", f"--rdzv_endpoint={cluster.endpoint}", "--monitor_interval=1")
    port = two_free_ports()
    cases: dict[str, tuple[tuple[str, ...], int, dict[str, str]]] = {
        # test_launch_user_script_python
        "python": ((*etcd, "--nnodes=1", "--nproc_per_node=4", "--start_method=spawn", SCRIPT), 4, {}),
        # test_launch_user_script_python_caffe2_bc: the static rendezvous on one node
        "caffe2_bc": (
            (
                "--nnodes=1",
                "--nproc_per_node=4",
                "--monitor_interval=1",
                "--start_method=spawn",
                "--master_addr=localhost",
                f"--master_port={port}",
                "--node_rank=0",
                SCRIPT,
            ),
            4,
            {},
        ),  # fmt: skip
        # test_launch_user_script_bash
        "bash": ((*etcd, "--nnodes=1", "--nproc_per_node=4", "--no_python", BASH), 4, {}),
        # test_launch_user_script_default_nproc
        "default_nproc": ((*etcd, "--nnodes=1", "--no_python", BASH), 1, {}),
        # test_launch_with_env_vars
        "env_vars": (
            (BASH,),
            4,
            {
                "PET_NNODES": "1",
                "PET_NPROC_PER_NODE": "4",
                "PET_RDZV_BACKEND": "etcd",
                "PET_RDZV_ENDPOINT": cluster.endpoint,
                "PET_MONITOR_INTERVAL": "1",
                "PET_START_METHOD": "spawn",
                "PET_NO_PYTHON": "1",
                "PET_MODULE": "0",
            },
        ),  # fmt: skip
        # test_nproc_launch_auto_configurations (no GPU here: one worker per CPU)
        "nproc_auto": ((*etcd, "--nnodes=1", "--nproc_per_node=auto", "--no_python", BASH), os.cpu_count() or 1, {}),
        # test_launch_standalone
        "standalone": (("--nnodes=1", "--nproc_per_node=4", "--standalone", "--monitor_interval=1", SCRIPT), 4, {}),
        # test_launch_run_path
        "run_path": (("--run_path", "--nnodes=1", "--nproc_per_node=4", "--monitor_interval=1", SCRIPT), 4, {}),
        # -m: the script as a module (python -m launcher_script, found in the working directory)
        "module": ((*etcd, "--nproc_per_node=2", "-m", "launcher_script"), 2, {}),
    }
    # The runs are independent (own job id, own ports): run them side by side to keep the test short.
    running = {}
    for name, (args, _, env) in cases.items():
        out = tmp_path / name
        out.mkdir()
        script_args = [str(out)] if BASH in args else [f"--touch_file_dir={out}"]
        if name == "env_vars":
            env = {**env, "PET_RDZV_ID": uuid.uuid4().hex}
        elif "--standalone" not in args:
            args = (f"--rdzv_id={uuid.uuid4().hex}", *args)
        running[name] = start(cluster, *args, *script_args, env=env, cwd=SCRIPTS if name == "module" else None)
    try:
        for name, proc in running.items():
            args, world_size, _ = cases[name]
            stdout, stderr = proc.communicate(timeout=180)
            assert proc.returncode == 0, (name, stdout[-2000:], stderr[-3000:])
            assert sorted(os.listdir(tmp_path / name), key=int) == [str(r) for r in range(world_size)], name
            if BASH not in args:
                for line in ("TEST_SENTINEL_PARENT = FOOBAR", f"WORLD_SIZE = {world_size}", "ROLE_NAME = default"):
                    assert line in stdout, (name, line, stdout[-2000:])
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.terminate()
                proc.communicate(timeout=60)


def test_torchrun_init_method_tcp_on_the_master_port(cluster: Cluster, tmp_path: Path) -> None:
    """test_init_method_tcp_with_torchelastic and test_is_torchelastic_launched: the script
    rendezvouses on ``tcp://localhost:<--master_port>`` itself, so that port must be free for it."""
    port = two_free_ports()
    res = launch(
        cluster, "--run_path", "--nnodes=1", "--nproc_per_node=2", "--master_addr=localhost",
        f"--master_port={port}", "--monitor_interval=1", str(SCRIPTS / "init_method.py"),
        f"--init_method=tcp://localhost:{port}", f"--out_dir={tmp_path}",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"0": "True", "1": "True"}


def test_torchrun_refusals_and_failures_exit_as_torchrun_does(cluster: Cluster, tmp_path: Path) -> None:
    etcd = ("--rdzv_backend=etcd", f"--rdzv_endpoint={cluster.endpoint}", f"--rdzv_id={uuid.uuid4().hex}")
    usage = {
        # test_launch_user_script_bash: --no_python cannot be used with --module
        ("--no_python", "--module", BASH): "cannot be used together",
        # test_nproc_launch_unknown_configurations
        ("--nproc_per_node=unknown", SCRIPT): "--nproc-per-node 'unknown' is not valid",
        ("--start_method=thread", SCRIPT): "--start-method 'thread' is not valid",
        ("--rdzv_backend=zookeeper", SCRIPT): "--rdzv-backend 'zookeeper' is not valid",
        ("--nnodes=2", "--node_rank=2", SCRIPT): "--node-rank 2 is not valid",
        # an elastic range is refused on purpose: nodes beyond --nnodes join as warm standbys
        ("--nnodes=1:2", SCRIPT): "nodes that join beyond it become warm standbys",
    }
    for args, message in usage.items():
        res = launch(cluster, *etcd, *args, str(tmp_path))
        assert res.returncode == 2, (args, res.stderr)
        assert message in " ".join(res.stderr.replace("│", " ").split()), (args, res.stderr)
    # test_launch_with_env_vars: PET_NO_PYTHON and PET_MODULE together
    res = launch(cluster, *etcd, BASH, str(tmp_path), env={"PET_NO_PYTHON": "1", "PET_MODULE": "1"})
    assert res.returncode == 2 and "cannot be used together" in res.stderr, res.stderr
    # two agents both node rank 0 (the default): the second finds etcd's port taken and says why
    port = two_free_ports()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        res = launch(cluster, "--nnodes=2", f"--master_port={port}", SCRIPT)
    assert res.returncode == 1 and "is another node rank 0 running?" in res.stderr, res.stderr
    # test_launch_elastic_worker_raise_exception: the worker raises, no restart is left, exit 1
    res = launch(cluster, *etcd, "--nproc_per_node=2", "--max_restarts=0", SCRIPT, "--fail")
    assert res.returncode == 1, res.stderr[-3000:]
    assert "RuntimeError: raising exception since --fail flag was set" in res.stderr
    assert "all 0 restarts are used; the job failed" in res.stderr
    assert not list(tmp_path.iterdir()), "no worker may have touched its file"


def test_static_rendezvous_keeps_given_node_ranks(cluster: Cluster, tmp_path: Path) -> None:
    """torchrun --nnodes 2 --node_rank R --master_addr A --master_port P, node rank 1 started first."""
    port = two_free_ports()
    dump = tmp_path / "dump"
    dump.mkdir()
    template = "${role_name}:${rank}:${local_rank}> "

    def start(rank: int | None) -> AgentProc:
        where = [f"--node_rank={rank}"] if rank is not None else ["--standby", "--node-id=spare"]
        argv = [
            sys.executable, "-m", "rlaunch", "--nnodes=2", "--nproc_per_node=2", *where,
            "--master_addr=127.0.0.1", f"--master_port={port}", "--role=trainer", "--lease_ttl=3",
            f"--log_line_prefix_template={template}", "--rdzv_timeout=60", str(SCRIPTS / "env_dump.py"),
        ]  # fmt: skip
        agent = AgentProc(f"rank{rank}", argv, cluster.env({"DUMP_DIR": str(dump)}), tmp_path / f"rank{rank}.log")
        cluster.agents[agent.name] = agent
        return agent

    spare = start(None)  # a standby joins at once, and takes no node rank
    one = start(1)
    wait_for(lambda: "waiting for node rank 0" in one.output(), 60, "node rank 1 to wait for node rank 0's etcd")
    zero = start(0)
    assert zero.wait(120) == 0, zero.output()[-3000:]
    assert one.wait(60) == 0, one.output()[-3000:]
    assert spare.wait(60) == 0, spare.output()[-3000:]
    assert "dumped its environment" not in spare.output()
    envs = {int(p.stem): json.loads(p.read_text()) for p in dump.glob("*.json")}
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, env in envs.items():
        assert env["GROUP_RANK"] == str(rank // 2), "the node rank given, not the join order"
        assert env["RLAUNCH_NODE_ID"] == f"node{rank // 2}"
        assert env["LOCAL_RANK"] == str(rank % 2) and env["WORLD_SIZE"] == "4"
        assert env["ROLE_NAME"] == "trainer"
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", str(port)), "torchrun's MASTER_*"
        assert env["allreduce"] == 4.0
    assert f"runs the job's etcd on 127.0.0.1:{port + 1}" in zero.output()
    assert "trainer:2:0> " in one.output() and "trainer:0:0> " in zero.output(), "the prefix template"
