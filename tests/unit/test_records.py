"""Unit tests of the typed records and their validating JSON codec."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from rlaunch.errors import RecordError, StoreError
from rlaunch.store.records import (
    Ack,
    Assignment,
    Event,
    Generation,
    GenerationHead,
    GenerationStatus,
    JobSpec,
    NodeRecord,
    NodeState,
    decode,
    encode,
)

WHERE = "/rlaunch/job/some-key"


def job_spec(**kw: Any) -> JobSpec:
    base: dict[str, Any] = dict(
        job_id="job",
        nnodes=2,
        nproc_per_node=4,
        max_restarts=3,
        entrypoint="train.py",
        args=["--lr", "0.1"],
        fingerprint="0123456789abcdef",
        rlaunch_version="0.1.0",
    )
    base.update(kw)
    return JobSpec(**base)


def node_record(**kw: Any) -> NodeRecord:
    base: dict[str, Any] = dict(
        node_id="n1",
        host="host1",
        addr="10.0.0.1",
        pid=4242,
        nproc=4,
        standby_only=True,
        state=NodeState.FAILED,
        generation=3,
        restarts=2,
        master_port=29500,
        updated_at=12.5,
        exit_codes={"0": 1, "1": -9},
        message="worker 1 was killed",
    )
    base.update(kw)
    return NodeRecord(**base)


def generation(**kw: Any) -> Generation:
    base: dict[str, Any] = dict(
        number=5,
        status=GenerationStatus.WAITING,
        assignment={"a": 0, "b": 1, "c": 2},
        nnodes=3,
        nproc_per_node=4,
        master_addr="10.0.0.1",
        master_port=29500,
        restart_count=1,
        reason="node(s) d lost",
        controller="a",
        created_at=100.25,
        deadline=160.25,
    )
    base.update(kw)
    return Generation(**base)


RECORDS: list[Any] = [
    job_spec(),
    node_record(),
    generation(),
    generation(kind="replace", leavers=["b"], joiners=["d"]).head(generation(number=4)),
    Assignment(number=5, nodes={"a": 0, "b": 1}),
    Ack(node_id="n1", generation=7),
    Event(time=1.5, node_id="n1", kind="workers_started", generation=2, data={"ranks": [0, 1], "x": {"y": None}}),
]


def as_obj(record: Any) -> dict[str, Any]:
    obj: dict[str, Any] = json.loads(encode(record))
    return obj


def raw(obj: Any) -> bytes:
    return json.dumps(obj).encode()


# --- round trips ----------------------------------------------------------------------------------


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_round_trip(record: Any) -> None:
    back = decode(type(record), encode(record), WHERE)
    assert back == record
    assert type(back) is type(record)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_encoding_takes_the_fields_as_asdict_would(record: Any) -> None:
    assert json.loads(encode(record)) == json.loads(json.dumps(dataclasses.asdict(record), default=lambda e: e.value))


def test_a_record_inside_an_events_data_is_encoded_as_its_fields() -> None:
    event = Event(time=1.0, node_id="n", kind="k", generation=1, data={"ack": Ack(node_id="n", generation=2)})
    assert json.loads(encode(event))["data"] == {"ack": {"node_id": "n", "generation": 2}}


@pytest.mark.parametrize("state", list(NodeState))
def test_node_state_round_trips_as_its_value(state: NodeState) -> None:
    data = encode(node_record(state=state))
    assert json.loads(data)["state"] == state.value
    assert decode(NodeRecord, data, WHERE).state is state


@pytest.mark.parametrize("status", list(GenerationStatus))
def test_generation_status_round_trips_as_its_value(status: GenerationStatus) -> None:
    data = encode(generation(status=status))
    assert json.loads(data)["status"] == status.value
    assert decode(Generation, data, WHERE).status is status


def test_float_field_accepts_a_json_integer() -> None:
    obj = as_obj(generation())
    obj["created_at"] = 100
    back = decode(Generation, raw(obj), WHERE)
    assert back.created_at == 100.0
    assert isinstance(back.created_at, float)


def test_unknown_fields_are_ignored() -> None:
    obj = as_obj(Ack(node_id="n1", generation=1))
    obj["future_field"] = "x"
    assert decode(Ack, raw(obj), WHERE) == Ack(node_id="n1", generation=1)


def test_optional_fields_may_be_omitted() -> None:
    node = as_obj(node_record())
    del node["exit_codes"], node["message"]
    back = decode(NodeRecord, raw(node), WHERE)
    assert back.exit_codes == {}
    assert back.message == ""

    gen = as_obj(generation())
    del gen["deadline"]
    assert decode(Generation, raw(gen), WHERE).deadline == 0.0

    event = as_obj(RECORDS[6])
    del event["data"]
    assert decode(Event, raw(event), WHERE).data == {}


# --- decode errors --------------------------------------------------------------------------------


def test_record_error_is_a_store_error() -> None:
    assert issubclass(RecordError, StoreError)


@pytest.mark.parametrize("data", [b"{not json", b"", b"\xff\xfe\x00garbage"])
def test_invalid_json_names_the_key(data: bytes) -> None:
    with pytest.raises(RecordError, match="not valid JSON") as info:
        decode(Ack, data, WHERE)
    assert WHERE in str(info.value)


@pytest.mark.parametrize("data", [b"[1, 2]", b"3", b'"text"', b"null"])
def test_non_object_json_names_the_key(data: bytes) -> None:
    with pytest.raises(RecordError, match="not a JSON object") as info:
        decode(Ack, data, WHERE)
    assert WHERE in str(info.value)


@pytest.mark.parametrize(
    ("cls", "record", "field"),
    [
        (JobSpec, job_spec(), "fingerprint"),
        (NodeRecord, node_record(), "state"),
        (Generation, generation(), "assignment"),
        (Ack, Ack(node_id="n", generation=1), "generation"),
        (Event, RECORDS[6], "kind"),
    ],
)
def test_missing_required_field_is_named(cls: type, record: Any, field: str) -> None:
    obj = as_obj(record)
    del obj[field]
    with pytest.raises(RecordError, match="lacks the field") as info:
        decode(cls, raw(obj), WHERE)
    assert WHERE in str(info.value)
    assert repr(field) in str(info.value)


@pytest.mark.parametrize(
    ("cls", "record", "field", "value"),
    [
        (NodeRecord, node_record(), "pid", "4242"),  # string for int
        (NodeRecord, node_record(), "pid", True),  # bool for int
        (NodeRecord, node_record(), "pid", 1.5),  # float for int
        (NodeRecord, node_record(), "standby_only", 1),  # int for bool
        (NodeRecord, node_record(), "state", "sleeping"),  # bad enum value
        (NodeRecord, node_record(), "state", ["waiting"]),  # unhashable for enum
        (NodeRecord, node_record(), "updated_at", "12.5"),  # string for float
        (NodeRecord, node_record(), "updated_at", False),  # bool for float
        (NodeRecord, node_record(), "exit_codes", {"0": "1"}),  # dict of wrong values
        (NodeRecord, node_record(), "exit_codes", [1, 2]),  # list for dict
        (NodeRecord, node_record(), "message", None),  # null for str
        (Generation, generation(), "status", "paused"),  # bad enum value
        (Generation, generation(), "assignment", {"a": "0"}),  # dict of wrong values
        (Generation, generation(), "assignment", {"a": 0, "b": True}),  # a bool among ints
        (Generation, generation(), "leavers", ["a", 1]),  # list of wrong items
        (JobSpec, job_spec(), "args", ["ok", 3]),  # list of wrong items
        (JobSpec, job_spec(), "args", "--lr 0.1"),  # string for list
        (JobSpec, job_spec(), "nnodes", "2"),  # string for int
        (Ack, Ack(node_id="n", generation=1), "node_id", 5),  # int for str
        (Event, RECORDS[6], "data", [1]),  # list for dict
        (GenerationHead, RECORDS[3], "given", {"d": 1.0}),  # dict of wrong values
        (GenerationHead, RECORDS[3], "taken", "b"),  # string for list
        (Assignment, RECORDS[4], "nodes", {"a": None}),  # dict of wrong values
    ],
)
def test_wrong_type_names_key_and_field(cls: type, record: Any, field: str, value: Any) -> None:
    obj = as_obj(record)
    obj[field] = value
    with pytest.raises(RecordError, match="not a valid") as info:
        decode(cls, raw(obj), WHERE)
    message = str(info.value)
    assert WHERE in message
    assert f"{field}=" in message


def test_wrong_type_message_shows_the_value_and_the_enum() -> None:
    obj = as_obj(node_record())
    obj["state"] = "sleeping"
    with pytest.raises(RecordError) as info:
        decode(NodeRecord, raw(obj), WHERE)
    assert "state='sleeping'" in str(info.value)
    assert "NodeState" in str(info.value)


# --- JobSpec.differences --------------------------------------------------------------------------


def test_equal_specs_have_no_differences() -> None:
    assert job_spec().differences(job_spec()) == []


def test_differences_name_each_differing_field() -> None:
    ours = job_spec()
    theirs = job_spec(nnodes=4, args=["--lr", "0.2"])
    lines = ours.differences(theirs)
    assert len(lines) == 2
    assert lines[0].startswith("nnodes:")
    assert "4 (job)" in lines[0]
    assert "2 (this agent)" in lines[0]
    assert lines[1].startswith("args:")
    assert "'0.2'" in lines[1]


def test_differences_cover_every_field() -> None:
    theirs = JobSpec(
        job_id="other",
        nnodes=9,
        nproc_per_node=9,
        max_restarts=9,
        entrypoint="other.py",
        args=["x"],
        fingerprint="ffffffffffffffff",
        rlaunch_version="9.9.9",
        verify_every="7",
    )
    names = [line.partition(":")[0] for line in job_spec().differences(theirs)]
    assert names == [f.name for f in dataclasses.fields(JobSpec)]


# --- Generation helpers ---------------------------------------------------------------------------


def test_generation_ranks_and_world_size() -> None:
    g = generation(assignment={"a": 0, "b": 1, "c": 2}, nnodes=3, nproc_per_node=4)
    assert g.world_size == 12
    assert g.node_rank("b") == 1
    assert g.node_rank("standby") is None
    assert g.ranks_of("a") == [0, 1, 2, 3]
    assert g.ranks_of("c") == [8, 9, 10, 11]
    assert g.ranks_of("standby") == []


def test_records_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Ack(node_id="n", generation=1).generation = 2  # type: ignore[misc]


# --- the generation's head: its rank map told as a change ----------------------------------------


def test_a_head_carries_the_change_of_the_rank_map_not_the_map() -> None:
    before = generation(number=4, assignment={"a": 0, "b": 1, "c": 2})
    after = generation(number=5, assignment={"a": 0, "d": 1, "c": 2}, kind="replace", leavers=["b"], joiners=["d"])
    head = after.head(before)
    assert (head.base, head.given, head.taken, head.assigned) == (4, {"d": 1}, ["b"], 3)
    assert not hasattr(head, "assignment") and head.reason == after.reason and head.joiners == ["d"]
    assert head.follow(before) == after, "rebuilt from the base"
    assert head.follow(after) == after, "the reader holds this generation already"
    assert head.follow(None) is None and head.follow(generation(number=3)) is None, "not the base: read the map"
    wrong = generation(number=4, assignment={"a": 0, "b": 1})  # a base that does not add up to 3 nodes
    assert head.follow(wrong) is None


def test_a_long_chain_of_replacements_rebuilds_each_map_and_leaves_the_held_one_as_it_was() -> None:
    """Each move takes one node and gives its rank to another: the maps rebuilt from the one held
    (copied with its holes) stay equal to the planned ones, and the one held is never changed."""
    held = generation(number=1, assignment={f"n{i}": i for i in range(64)})
    for number in range(2, 300):
        leaver = next(n for n, r in held.assignment.items() if r == number % 64)
        planned = {n: r for n, r in held.assignment.items() if n != leaver} | {f"j{number}": number % 64}
        after = generation(number=number, assignment=planned, kind="replace", leavers=[leaver],
                           joiners=[f"j{number}"])  # fmt: skip
        before = dict(held.assignment)
        rebuilt = after.head(held).follow(held)
        assert rebuilt == after, f"generation {number} rebuilt from {number - 1}"
        assert held.assignment == before and rebuilt is not None and rebuilt.assignment is not held.assignment
        held = rebuilt


def test_a_first_head_gives_the_whole_map_and_one_written_again_changes_nothing() -> None:
    first = generation(number=1)
    head = first.head(None)
    assert (head.base, head.given, head.taken) == (0, first.assignment, [])
    assert head.follow(None) == first and head.follow(generation(number=7)) == first
    done = dataclasses.replace(first, status=GenerationStatus.SUCCEEDED)
    again = done.head(first)
    assert (again.base, again.given, again.taken) == (1, {}, [])
    assert again.follow(first) == done and again.follow(None) is None


def test_a_head_has_every_field_of_its_generation_but_the_map() -> None:
    """A field added to Generation alone would be dropped by the head and reset by every reader that
    rebuilds the generation from it (GenerationHead.whole)."""
    names = {f.name for f in dataclasses.fields(Generation)} - {"assignment"}
    head_names = {f.name for f in dataclasses.fields(GenerationHead)} - {"base", "given", "taken", "assigned"}
    assert names == head_names
    unusual = generation(
        number=3, deadline=9.5, kind="migrate", leavers=["b"], joiners=["d"], all_acked=True, restart_count=2
    )  # every field away from its default
    rebuilt = unusual.head(None).whole(dict(unusual.assignment))
    assert rebuilt == unusual and rebuilt.leavers is not unusual.leavers
