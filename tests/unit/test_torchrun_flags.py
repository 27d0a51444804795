"""torchrun's flags that rlaunch takes: spellings, the static rendezvous, and the worker-facing ones."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import typer.main
from typer.core import TyperGroup

from rlaunch.agent.config import (
    StaticRendezvous,
    Std,
    etcd_listen_host,
    launch_notes,
    static_rendezvous,
)
from rlaunch.agent.env import standby_env, worker_env
from rlaunch.agent.logs import LogPolicy
from rlaunch.cli import app
from rlaunch.cli.static import may_join
from rlaunch.errors import UsageError
from rlaunch.store.client import Endpoint
from rlaunch.store.records import Generation, GenerationStatus
from tests.unit.test_config import config, script  # noqa: F401 - the fixture

if TYPE_CHECKING:
    from typer._click import Command, Context

# --- every flag in both spellings ---------------------------------------------------------------


def _command(command: str) -> tuple[Command, Context]:
    """The subcommand as ``rlaunch`` builds it (its module imported on demand), and its parent context."""
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup)
    parent = group.make_context("rlaunch", [command, "--help"], resilient_parsing=True)
    sub = group.get_command(parent, command)
    assert sub is not None, command
    return sub, parent


def _parse(command: str, args: list[str]) -> dict[str, Any]:
    sub, parent = _command(command)
    return dict(sub.make_context(command, args, parent=parent).params)


POSITIONAL = {"run": ["train.py"], "drain": ["node-b"], "undrain": ["node-b"]}
NEEDS_ENDPOINT = {"status", "drain", "undrain", "events"}


@pytest.mark.parametrize("command", ["run", "status", "drain", "undrain", "events", "etcd"])
def test_every_flag_takes_its_underscore_spelling(command: str) -> None:
    checked = 0
    for param in _command(command)[0].params:
        for opt in (o for o in param.opts if o.startswith("--") and "-" in o[2:]):
            underscore = "--" + opt[2:].replace("-", "_")
            value = [] if param.is_flag else ["7"]
            extra = (
                ["--rdzv-endpoint", "127.0.0.1:1"]
                if command in NEEDS_ENDPOINT and param.name != "rdzv_endpoint"
                else []
            )
            parsed = _parse(command, [*extra, underscore, *value, *POSITIONAL.get(command, [])])
            assert parsed[param.name] in (True, 7, 7.0, "7"), (command, underscore, parsed[param.name])
            checked += 1
    assert checked or command == "etcd"


def test_underscore_spelling_with_equals_and_torchrun_names() -> None:
    parsed = _parse(
        "run",
        ["--nproc_per_node=4", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29500", "--rdzv_backend",
         "static", "--max_restarts=3", "--start_method=fork", "--run_path", "--log_line_prefix_template=[${rank}]",
         "train.py", "--some_script_flag=1"],
    )  # fmt: skip
    assert parsed["nproc_per_node"] == "4" and parsed["node_rank"] == 1 and parsed["master_addr"] == "10.0.0.1"
    assert parsed["master_port"] == 29500 and parsed["rdzv_backend"] == "static" and parsed["max_restarts"] == 3
    assert parsed["start_method"] == "fork" and parsed["run_path"] is True
    assert parsed["log_line_prefix_template"] == "[${rank}]"
    assert parsed["script_args"] == ["--some_script_flag=1"], "the script's own flags are left alone"


# --- the static rendezvous ----------------------------------------------------------------------


def static(nnodes: int = 2, **kw: Any) -> StaticRendezvous | None:
    args: dict[str, Any] = dict(
        rdzv_endpoint="", rdzv_backend="", standalone=False, standby=False, node_rank=None, master_addr=None,
        master_port=None,
    )  # fmt: skip
    args.update(kw)
    return static_rendezvous(nnodes, **args)


def test_more_than_one_node_without_endpoint_is_torchruns_static_rendezvous() -> None:
    assert static() == StaticRendezvous(node_rank=0, master_addr="127.0.0.1", master_port=29500, etcd_port=29501)
    assert static(node_rank=1, master_addr="head", master_port=4000) == StaticRendezvous(1, "head", 4000, 4001)


def test_one_node_is_static_only_when_asked() -> None:
    assert static(1) is None, "one node without flags: an embedded etcd on a free port"
    assert static(1, master_port=29511) is None, "--master-port alone fixes MASTER_PORT, as before"
    assert static(1, node_rank=0) is not None
    assert static(1, master_addr="localhost") is not None
    assert static(1, rdzv_backend="static") is not None


def test_an_etcd_endpoint_is_not_static_unless_the_backend_says_so() -> None:
    for backend in ("", "c10d", "etcd", "etcd-v2", "etcd-v3"):
        assert static(rdzv_endpoint="e:2379", rdzv_backend=backend, node_rank=1) is None
    assert static(rdzv_endpoint="head:4000", rdzv_backend="static", node_rank=1) == StaticRendezvous(
        1, "head", 4000, 4001
    )


def test_standalone_is_never_static() -> None:
    assert static(1, standalone=True, node_rank=0, master_addr="x") is None


def test_a_standby_joins_a_static_job_without_a_node_rank() -> None:
    assert static(standby=True) == StaticRendezvous(None, "127.0.0.1", 29500, 29501)


@pytest.mark.parametrize(
    ("kw", "shown"),
    [
        ({"node_rank": 2}, "--node-rank 2 is not valid: give a node rank from 0 to 1 (--nnodes 2)"),
        ({"node_rank": -1}, "--node-rank -1 is not valid"),
        ({"rdzv_backend": "zookeeper"}, "--rdzv-backend 'zookeeper' is not valid"),
        ({"standalone": True, "node_rank": 1}, "--standalone runs a single node"),
        ({"standby": True, "node_rank": 1}, "--standby and --node-rank 1 cannot be used together"),
        ({"rdzv_backend": "static", "rdzv_endpoint": "a:1,b:2"}, "takes one --rdzv-endpoint"),
    ],
)
def test_bad_static_flags_are_refused_naming_them(kw: dict[str, Any], shown: str) -> None:
    with pytest.raises(UsageError, match=None) as info:
        static(**kw)
    assert shown in str(info.value)


def test_build_config_for_a_static_node(script: Path) -> None:  # noqa: F811
    cfg = config(script, nnodes="2", node_id=None, node_rank=1, master_addr="head", master_port=4000)
    assert cfg.static == StaticRendezvous(1, "head", 4000, 4001)
    assert cfg.endpoints == [Endpoint("head", 4001)], "the other nodes join node rank 0's etcd"
    assert cfg.master_port == 4000, "MASTER_PORT is torchrun's --master-port"
    assert cfg.node_id == "node1"
    assert cfg.local_addr is None
    zero = config(script, nnodes="2", node_id=None, node_rank=0, master_addr="head", rdzv_conf="etcd_port=5000")
    assert zero.static is not None and zero.static.etcd_port == 5000 and zero.endpoints == [Endpoint("head", 5000)]
    assert zero.local_addr == "head", "node rank 0 is known to the others by --master-addr"
    assert zero.master_port == 29500 and zero.node_id == "node0"
    assert config(script, nnodes="2", node_rank=0).node_id == "node-a", "--node-id still wins"
    with pytest.raises(UsageError, match="etcd_port='x' is not valid"):
        config(script, nnodes="2", rdzv_conf="etcd_port=x")


def test_etcd_listens_on_a_loopback_master_or_on_every_interface() -> None:
    assert etcd_listen_host("127.0.0.1") == "127.0.0.1"
    assert etcd_listen_host("localhost") == "127.0.0.1"
    assert etcd_listen_host("127.0.0.5") == "127.0.0.5"
    assert etcd_listen_host("10.1.2.3") == "0.0.0.0"
    assert etcd_listen_host("head-node") == "0.0.0.0", "a name may resolve to 127.0.1.1 on its own host"
    assert etcd_listen_host("fd00::7") == "::" and etcd_listen_host("::1") == "::1"


def test_flags_without_effect_are_named() -> None:
    notes = launch_notes("e:2379", "c10d", 2, "head")
    assert any("--node-rank 2 is not used" in n for n in notes)
    assert any("--master-addr head is not used" in n for n in notes)
    assert launch_notes("e:2379", "static", 2, "head") == []
    assert launch_notes("", "", 1, "head") == []


def test_join_order_follows_node_rank() -> None:
    assert may_join(0, 0, started=False)
    assert not may_join(2, 1, started=False), "node rank 2 waits for node ranks 0 and 1"
    assert may_join(2, 2, started=False)
    assert may_join(2, 0, started=True), "a node rejoining a running job is placed by the controller"
    assert may_join(None, 0, started=False), "a standby joins at once"


# --- the other flags ----------------------------------------------------------------------------


def test_run_path_runs_the_script_with_python_over_module_and_no_python(script: Path) -> None:  # noqa: F811
    cfg = config(script, run_path=True, module=True, no_python=True)
    assert cfg.command("python") == ["python", "-u", str(script), "--lr", "0.1"]


def test_start_method_and_role(script: Path) -> None:  # noqa: F811
    assert config(script).start_method == "spawn" and config(script).role == "default"
    assert config(script, start_method="forkserver", role="trainer").role == "trainer"
    with pytest.raises(UsageError, match="--start-method 'thread' is not valid: give spawn, fork, forkserver"):
        config(script, start_method="thread")
    with pytest.raises(UsageError, match="--role ' x' is not valid"):
        config(script, role=" x")


def test_log_line_prefix_template() -> None:
    policy = LogPolicy("node-a", {0: Std.NONE}, {0: Std.NONE}, None, None)
    assert policy.prefix(5, 1) == "[node-a/5] "
    templated = LogPolicy("node-a", {}, {}, None, None, "[${role_name}${rank}:${local_rank}]:", "trainer")
    assert templated.prefix(5, 1) == "[trainer5:1]:"
    assert templated.prefix("s0", 0) == "[trainers0:0]:", "a standby's worker has no rank yet"
    assert LogPolicy("n", {}, {}, None, None, "${unknown} ${rank}|").prefix(3, 0) == "${unknown} 3|"


def test_role_name_reaches_the_workers() -> None:
    gen = Generation(
        number=1, status=GenerationStatus.RUNNING, assignment={"a": 0}, nnodes=1, nproc_per_node=1,
        master_addr="h", master_port=1, restart_count=0, reason="", controller="a", created_at=0.0,
    )  # fmt: skip
    common: dict[str, Any] = dict(node_id="a", local_rank=0, job_id="j", agent_addr="/s", host_addr="10.0.0.2")
    assert worker_env({}, gen, max_restarts=0, **common)["ROLE_NAME"] == "default"
    assert worker_env({}, gen, max_restarts=0, role="trainer", **common)["ROLE_NAME"] == "trainer"
    assert standby_env({}, gen, role="trainer", **common)["ROLE_NAME"] == "trainer"
