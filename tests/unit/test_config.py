"""Unit tests of flag parsing (build_config, parse_*), worker environments, key paths and endpoints."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest

from rlaunch.agent.config import (
    LaunchConfig,
    Std,
    build_config,
    parse_nnodes,
    parse_nproc,
    parse_ranks_filter,
    parse_rdzv_conf,
    parse_std,
    script_fingerprint,
)
from rlaunch.agent.env import standby_env, worker_env
from rlaunch.errors import UsageError
from rlaunch.store.client import Endpoint, parse_endpoints
from rlaunch.store.keys import JobKeys
from rlaunch.store.records import Generation, GenerationStatus


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return path


def config(script: Path | str, **overrides: Any) -> LaunchConfig:
    """build_config with the CLI's defaults, a few of them overridden."""
    kw: dict[str, Any] = dict(
        script=str(script),
        script_args=["--lr", "0.1"],
        nnodes="1",
        nproc_per_node="2",
        rdzv_endpoint="",
        rdzv_id="job",
        rdzv_conf="",
        standalone=False,
        max_restarts=0,
        monitor_interval=0.1,
        log_dir=None,
        redirects="0",
        tee="0",
        local_ranks_filter="",
        module=False,
        no_python=False,
        master_port=None,
        node_id="node-a",
        standby=False,
        lease_ttl=10,
        rdzv_timeout=900.0,
        local_addr=None,
    )
    kw.update(overrides)
    return build_config(**kw)


# --- valid values -------------------------------------------------------------------------------


def test_defaults(script: Path) -> None:
    cfg = config(script)
    assert cfg.entrypoint == str(script)
    assert cfg.args == ["--lr", "0.1"]
    assert cfg.nnodes == 1
    assert cfg.nproc_per_node == 2
    assert cfg.endpoints is None
    assert cfg.job_id == "job"
    assert cfg.rdzv_conf == {}
    assert cfg.redirects == {0: Std.NONE, 1: Std.NONE}
    assert cfg.tee == {0: Std.NONE, 1: Std.NONE}
    assert cfg.local_ranks_filter is None
    assert cfg.master_port == 0
    assert cfg.node_id == "node-a"
    assert cfg.log_dir is None
    assert cfg.rdzv_timeout == 900.0


def test_node_id_defaults_to_the_host_name_and_log_dir_is_a_path(script: Path, tmp_path: Path) -> None:
    cfg = config(script, node_id=None, log_dir=str(tmp_path / "logs"), master_port=29501)
    assert cfg.node_id == socket.gethostname()
    assert cfg.log_dir == tmp_path / "logs"
    assert cfg.master_port == 29501


@pytest.mark.parametrize(("text", "expected"), [("2", 2), ("2:2", 2), ("16", 16)])
def test_nnodes(script: Path, text: str, expected: int) -> None:
    assert parse_nnodes(text) == expected
    assert config(script, nnodes=text).nnodes == expected


def test_nproc_number(script: Path) -> None:
    assert parse_nproc("3") == 3
    assert config(script, nproc_per_node="3").nproc_per_node == 3


def test_nproc_cpu_uses_the_cpu_count(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    assert parse_nproc("cpu") == 7
    cfg = config(script, nproc_per_node="cpu")
    assert cfg.nproc_per_node == 7
    assert sorted(cfg.redirects) == list(range(7))


def test_redirects_one_value_for_every_local_rank(script: Path) -> None:
    cfg = config(script, nproc_per_node="3", redirects="3", tee="1")
    assert cfg.redirects == {0: Std.ALL, 1: Std.ALL, 2: Std.ALL}
    assert cfg.tee == {0: Std.OUT, 1: Std.OUT, 2: Std.OUT}


def test_redirects_per_local_rank(script: Path) -> None:
    cfg = config(script, nproc_per_node="3", redirects="0:1,1:2")
    assert cfg.redirects == {0: Std.OUT, 1: Std.ERR, 2: Std.NONE}
    assert parse_std("--tee", "2:3", 3) == {0: Std.NONE, 1: Std.NONE, 2: Std.ALL}


def test_local_ranks_filter(script: Path) -> None:
    assert config(script, local_ranks_filter="0,2").local_ranks_filter == frozenset({0, 2})
    assert parse_ranks_filter("1") == frozenset({1})
    assert parse_ranks_filter("") is None


def test_rdzv_conf_pairs() -> None:
    assert parse_rdzv_conf("a=1, b=two ,c=") == {"a": "1", "b": "two", "c": ""}
    assert parse_rdzv_conf("") == {}


def test_rdzv_conf_join_timeout_overrides_rdzv_timeout(script: Path) -> None:
    cfg = config(script, rdzv_conf="join_timeout=30,other=x", rdzv_timeout=900.0)
    assert cfg.rdzv_timeout == 30.0
    assert cfg.rdzv_conf == {"join_timeout": "30", "other": "x"}


def test_rdzv_conf_without_join_timeout_keeps_rdzv_timeout(script: Path) -> None:
    assert config(script, rdzv_conf="other=x", rdzv_timeout=45.0).rdzv_timeout == 45.0


def test_endpoints_are_parsed(script: Path) -> None:
    cfg = config(script, rdzv_endpoint="10.0.0.1:2379,http://etcd-b:2380, http://[::1]:2381")
    assert cfg.endpoints == [Endpoint("10.0.0.1", 2379), Endpoint("etcd-b", 2380), Endpoint("::1", 2381)]
    assert [str(e) for e in cfg.endpoints] == ["10.0.0.1:2379", "etcd-b:2380", "[::1]:2381"]
    assert [e.scheme for e in cfg.endpoints] == ["", "http", "http"]
    assert not cfg.etcd_security.tls


def test_https_endpoints_turn_tls_on(script: Path) -> None:
    cfg = config(script, rdzv_endpoint="https://etcd-a:2379,https://etcd-b:2379")
    assert cfg.etcd_security.tls and cfg.etcd_security.cacert is None


def test_standalone_ignores_the_endpoint(script: Path) -> None:
    assert config(script, rdzv_endpoint="10.0.0.1:2379", standalone=True).endpoints is None


def test_parse_endpoints_single() -> None:
    assert parse_endpoints("localhost:2379") == [Endpoint("localhost", 2379)]


# --- invalid values -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "shown"),
    [
        ({"nnodes": "0"}, "'0'"),
        ({"nnodes": "x"}, "'x'"),
        ({"nnodes": "2:x"}, "'2:x'"),
        ({"nnodes": "0:0"}, "'0:0'"),
        ({"nproc_per_node": "0"}, "'0'"),
        ({"nproc_per_node": "abc"}, "'abc'"),
        ({"nproc_per_node": "-1"}, "'-1'"),
        ({"redirects": "a:b"}, "'a:b'"),
        ({"redirects": "x"}, "'x'"),
        ({"tee": "0:1,1"}, "'0:1,1'"),
        ({"local_ranks_filter": "0,x"}, "'0,x'"),
        ({"local_ranks_filter": "0,,1"}, "'0,,1'"),
        ({"rdzv_conf": "novalue"}, "'novalue'"),
        ({"rdzv_conf": "a=1,=2"}, "'a=1,=2'"),
        ({"rdzv_conf": "join_timeout=soon"}, "'soon'"),
        ({"rdzv_endpoint": "nohost"}, "'nohost'"),
        ({"rdzv_endpoint": "h:99999"}, "'h:99999'"),
        ({"max_restarts": -1}, "--max-restarts -1 "),
        ({"lease_ttl": 1}, "--lease-ttl 1 "),
        ({"monitor_interval": 0}, "--monitor-interval 0 "),
        ({"rdzv_timeout": 0.0}, "--rdzv-timeout 0.0 "),
        ({"master_port": 70000}, "--master-port 70000 "),
        ({"master_port": -5}, "--master-port -5 "),
    ],
)
def test_invalid_value_is_a_usage_error_naming_it(script: Path, overrides: dict[str, Any], shown: str) -> None:
    with pytest.raises(UsageError) as info:
        config(script, **overrides)
    assert shown in str(info.value)


def test_elastic_nnodes_range_says_extra_nodes_become_standbys() -> None:
    with pytest.raises(UsageError) as info:
        parse_nnodes("1:2")
    message = str(info.value)
    assert "'1:2'" in message
    assert "--nnodes 2" in message
    assert "standbys" in message


@pytest.mark.parametrize("text", ["nohost", "h:99999", "h:0", ":2379", "h:", "h:abc", "a:1,", "http://"])
def test_invalid_endpoint(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_endpoints(text)
    assert repr(text) in str(info.value)


def test_missing_script_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.py"
    with pytest.raises(UsageError) as info:
        config(missing)
    assert str(missing) in str(info.value)


def test_script_that_is_a_directory_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="is a directory"):
        config(tmp_path)


def test_module_and_no_python_together_are_rejected(script: Path) -> None:
    with pytest.raises(UsageError) as info:
        config(script, module=True, no_python=True)
    assert "--module" in str(info.value)
    assert "--no-python" in str(info.value)


@pytest.mark.parametrize("text", ["9", "4", "-1", "0:7", "5:1"])
def test_redirects_out_of_range_is_a_usage_error(script: Path, text: str) -> None:
    with pytest.raises(UsageError) as info:
        config(script, redirects=text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("value", ["0", "-5", "nan"])
def test_rdzv_conf_join_timeout_must_be_positive(script: Path, value: str) -> None:
    with pytest.raises(UsageError) as info:
        config(script, rdzv_conf=f"join_timeout={value}")
    assert value in str(info.value)


# --- the worker command and the job spec --------------------------------------------------------


def test_command_for_a_script(script: Path) -> None:
    assert config(script).command("/usr/bin/python3") == ["/usr/bin/python3", "-u", str(script), "--lr", "0.1"]


def test_command_for_a_module_needs_no_file() -> None:
    cfg = config("pkg.train", module=True)
    assert cfg.command("py") == ["py", "-u", "-m", "pkg.train", "--lr", "0.1"]


def test_command_without_python_needs_no_file() -> None:
    cfg = config("/opt/bin/trainer", no_python=True)
    assert cfg.command("py") == ["/opt/bin/trainer", "--lr", "0.1"]


def test_spec_carries_the_job_and_a_fingerprint_of_the_script(script: Path) -> None:
    cfg = config(script, nnodes="3", nproc_per_node="4", max_restarts=2)
    spec = cfg.spec()
    assert (spec.job_id, spec.nnodes, spec.nproc_per_node, spec.max_restarts) == ("job", 3, 4, 2)
    assert spec.entrypoint == str(script)
    assert spec.args == ["--lr", "0.1"]
    before = spec.fingerprint
    assert len(before) == 16
    script.write_text("print('changed')\n")
    assert cfg.spec().fingerprint != before


def test_fingerprint_of_a_module_depends_on_its_name_and_kind() -> None:
    assert script_fingerprint("a.b", True, False) == script_fingerprint("a.b", True, False)
    assert script_fingerprint("a.b", True, False) != script_fingerprint("a.c", True, False)
    assert script_fingerprint("a.b", True, False) != script_fingerprint("a.b", False, True)


# --- worker_env ---------------------------------------------------------------------------------


def generation() -> Generation:
    return Generation(
        number=6,
        status=GenerationStatus.RUNNING,
        assignment={"a": 0, "b": 1},
        nnodes=2,
        nproc_per_node=2,
        master_addr="10.0.0.1",
        master_port=29511,
        restart_count=2,
        reason="",
        controller="a",
        created_at=0.0,
    )


def env_for(base: dict[str, str], local_rank: int = 1) -> dict[str, str]:
    return worker_env(
        base,
        generation(),
        node_id="b",
        local_rank=local_rank,
        job_id="job-7",
        max_restarts=5,
        agent_addr="/tmp/agent.sock",
        host_addr="10.0.0.2",
    )


def test_worker_env_for_node_rank_one() -> None:
    env = env_for({"PATH": "/bin", "RANK": "stale"})
    expected = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "4",
        "ROLE_NAME": "default",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29511",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "5",
        "TORCHELASTIC_RUN_ID": "job-7",
        "RLAUNCH_AGENT_ADDR": "/tmp/agent.sock",
        "RLAUNCH_NODE_ID": "b",
        "RLAUNCH_GENERATION": "6",
        "RLAUNCH_JOB_ID": "job-7",
        "PATH": "/bin",
    }
    assert {k: env.get(k) for k in expected} == expected


def test_worker_env_local_rank_zero_of_node_rank_one() -> None:
    env = env_for({}, local_rank=0)
    assert env["RANK"] == "2"
    assert env["LOCAL_RANK"] == "0"


def test_worker_env_does_not_change_the_base() -> None:
    base = {"PATH": "/bin"}
    env_for(base)
    assert base == {"PATH": "/bin"}


def test_omp_num_threads_defaults_to_one_but_a_base_value_is_kept() -> None:
    assert env_for({})["OMP_NUM_THREADS"] == "1"
    assert env_for({"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"


# --- key paths ----------------------------------------------------------------------------------


def test_key_paths_live_under_the_job() -> None:
    keys = JobKeys("job-1")
    assert keys.prefix == "/rlaunch/job-1/"
    assert keys.spec == "/rlaunch/job-1/spec"
    assert keys.leader == "/rlaunch/job-1/leader"
    assert keys.generation == "/rlaunch/job-1/generation"
    assert keys.nodes_prefix == "/rlaunch/job-1/nodes/"
    assert keys.node("n1") == "/rlaunch/job-1/nodes/n1"
    assert keys.node_id_of(keys.node("n1")) == "n1"
    assert keys.acks_prefix(3) == "/rlaunch/job-1/acks/3/"
    assert keys.ack(3, "n1") == "/rlaunch/job-1/acks/3/n1"
    assert keys.all_acks_prefix == "/rlaunch/job-1/acks/"
    assert keys.events_prefix == "/rlaunch/job-1/events/"
    assert keys.event(5, "n1") == "/rlaunch/job-1/events/00000000000000000005-n1"


def test_event_keys_sort_in_time_order() -> None:
    keys = JobKeys("j")
    times = [5, 40, 300, 1_700_000_000_000_000_000]
    assert sorted(keys.event(t, "n") for t in reversed(times)) == [keys.event(t, "n") for t in times]


def test_keys_of_different_jobs_do_not_overlap() -> None:
    assert not JobKeys("job-10").spec.startswith(JobKeys("job-1").prefix)


@pytest.mark.parametrize("job_id", ["", "a/b", "/", " job", "job "])
def test_bad_job_id_is_rejected(job_id: str) -> None:
    with pytest.raises(UsageError) as info:
        JobKeys(job_id)
    assert repr(job_id) in str(info.value)


@pytest.mark.parametrize("node_id", ["", "x/y"])
def test_bad_node_id_is_rejected(node_id: str) -> None:
    keys = JobKeys("job")
    with pytest.raises(UsageError):
        keys.node(node_id)
    with pytest.raises(UsageError):
        keys.ack(1, node_id)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("standby_wait", -1.0), ("standby_wait", float("nan")), ("hang_timeout", 0.0), ("hang_timeout", -5.0)],
)
def test_bad_fault_timeouts_are_rejected_naming_the_flag_and_value(script: Path, flag: str, value: float) -> None:
    with pytest.raises(UsageError) as info:
        config(script, **{flag: value})
    assert f"--{flag.replace('_', '-')} {value}" in str(info.value)


def test_fault_timeouts_default_and_pass_through(script: Path) -> None:
    assert (config(script).standby_wait, config(script).hang_timeout) == (30.0, 300.0)
    cfg = config(script, standby_wait=0.0, hang_timeout=2.5)
    assert (cfg.standby_wait, cfg.hang_timeout) == (0.0, 2.5)


# --- --verify-every -----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [("auto", None), ("AUTO", None), (" auto ", None), ("0", 0),
                                                ("1", 1), ("250", 250)])  # fmt: skip
def test_verify_every_takes_auto_zero_or_a_number_of_steps(script: Path, text: str, expected: int | None) -> None:
    assert config(script).verify_every is None, "auto is the default"
    assert config(script, verify_every=text).verify_every == expected


@pytest.mark.parametrize("text", ["-1", "1.5", "", "x", "auto5", "1e3", "٣", "+4"])
def test_a_bad_verify_every_is_a_usage_error_naming_the_value_and_the_choices(script: Path, text: str) -> None:
    with pytest.raises(UsageError) as info:
        config(script, verify_every=text)
    message = str(info.value)
    assert f"--verify-every {text!r} is not valid" in message
    assert "auto" in message and "0 (off)" in message


@pytest.mark.parametrize(("value", "shown"), [(None, "auto"), (0, "0"), (40, "40")])
def test_verify_every_reaches_active_and_standby_workers(value: int | None, shown: str) -> None:
    common: dict[str, Any] = dict(
        node_id="b", local_rank=0, job_id="j", agent_addr="/s", host_addr="10.0.0.2", verify_every=value
    )
    assert worker_env({}, generation(), max_restarts=0, **common)["RLAUNCH_VERIFY_EVERY"] == shown
    assert standby_env({"RLAUNCH_VERIFY_EVERY": "stale"}, generation(), **common)["RLAUNCH_VERIFY_EVERY"] == shown


def test_a_bad_verify_every_on_the_command_line_exits_non_zero_with_a_sentence(script: Path) -> None:
    from typer.testing import CliRunner

    from rlaunch.cli import app

    res = CliRunner().invoke(app, ["run", "--verify-every", "often", str(script)])
    assert res.exit_code == 2, res.output
    assert "rlaunch: error: --verify-every 'often' is not valid" in res.output
    assert "Traceback" not in res.output and isinstance(res.exception, SystemExit)


def test_workers_never_inherit_the_agents_etcd_credentials() -> None:
    base = {"ETCDCTL_USER": "root:hunter2", "ETCDCTL_PASSWORD": "hunter2", "ETCDCTL_KEY": "/etc/k.pem", "PATH": "/bin"}
    common = {
        "node_id": "b",
        "local_rank": 0,
        "job_id": "job-7",
        "agent_addr": "/tmp/agent.sock",
        "host_addr": "10.0.0.2",
    }
    for env in (env_for(base), standby_env(base, generation(), **common)):
        assert env["PATH"] == "/bin" and not {"ETCDCTL_USER", "ETCDCTL_PASSWORD", "ETCDCTL_KEY"} & env.keys()
    assert base["ETCDCTL_PASSWORD"] == "hunter2", "the agent's own environment is untouched"
