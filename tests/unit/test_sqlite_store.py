"""The SQLite store: round trips, guards, transactions, schema, and real multi-process writers."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from unbroken.errors import ConflictError, NotFoundError, StoreError
from unbroken.state.phases import DeepHealthStatus, IllegalTransition, JobPhase, NodeState, WorkerPhase
from unbroken.state.records import Desired, Event, EventType, Job, Node, RankInfo, Worker
from unbroken.state.sqlite import SCHEMA_VERSION, SqliteStore, StaleUpdate


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "cluster" / "state.db"


@pytest.fixture
def store(db: Path):
    s = SqliteStore(db, create=True)
    yield s
    s.close()


def a_node(name: str = "node-1", state: NodeState = NodeState.JOINING, **fields) -> Node:
    return Node(name=name, group="workers", instance_type="cpu-dev", state=state,
                deep_health=DeepHealthStatus.IN_PROGRESS, **fields)


def a_job(name: str = "train", phase: JobPhase = JobPhase.PENDING, **fields) -> Job:
    return Job(name=name, spec_json=json.dumps({"name": name}), phase=phase, **{"created_at": 1.0, **fields})


def a_worker(job: str = "train", node: str = "node-1", attempt: int = 0, **fields) -> Worker:
    return Worker(job=job, attempt=attempt, node=node, node_rank=0, desired=Desired.RUN,
                  phase=WorkerPhase.PENDING, rdzv_endpoint="127.0.0.1:29500", **fields)


# -- nodes ------------------------------------------------------------------------------


def test_node_round_trip_decodes_enums(store):
    node = a_node(address="10.0.0.7", agent_pid=1234, heartbeat_at=12.5, registered_at=11.0, state_changed_at=11.0)
    store.add_node(node)
    got = store.get_node("node-1")
    assert got == node
    assert type(got.state) is NodeState and type(got.deep_health) is DeepHealthStatus
    assert type(got.heartbeat_at) is float and type(got.agent_pid) is int and got.fault_type is None


def test_list_nodes_orders_by_number(store):
    for name in ("node-10", "node-2", "node-1"):
        store.add_node(a_node(name))
    assert [n.name for n in store.list_nodes()] == ["node-1", "node-2", "node-10"]


def test_update_node_changes_fields_and_stamps_state_change(store):
    store.add_node(a_node(state_changed_at=1.0))
    got = store.update_node("node-1", state=NodeState.SCHEDULABLE, deep_health=DeepHealthStatus.PASSED, heartbeat_at=99.0)
    assert got.state is NodeState.SCHEDULABLE and got.deep_health is DeepHealthStatus.PASSED
    assert got.heartbeat_at == 99.0
    assert got.state_changed_at > 1.0
    assert store.get_node("node-1") == got
    # a write without a state change keeps the stamp
    again = store.update_node("node-1", heartbeat_at=100.0)
    assert again.state_changed_at == got.state_changed_at


def test_update_node_explicit_state_changed_at_wins(store):
    store.add_node(a_node())
    assert store.update_node("node-1", state=NodeState.SCHEDULABLE, state_changed_at=42.0).state_changed_at == 42.0


def test_update_node_rejects_illegal_transition_and_writes_nothing(store):
    store.add_node(a_node())
    store.update_node("node-1", state=NodeState.PENDING_REPLACEMENT)
    store.update_node("node-1", state=NodeState.RETIRED)
    before = store.get_node("node-1")
    with pytest.raises(IllegalTransition, match="Retired -> Schedulable"):
        store.update_node("node-1", state=NodeState.SCHEDULABLE, fault_reason="should not be written")
    assert store.get_node("node-1") == before


def test_update_node_expect_state_guard(store):
    store.add_node(a_node())
    store.update_node("node-1", state=NodeState.SCHEDULABLE)
    before = store.get_node("node-1")
    with pytest.raises(StaleUpdate, match="Schedulable, expected Joining"):
        store.update_node("node-1", expect_state=NodeState.JOINING, state=NodeState.PENDING_REBOOT, fault_type="X")
    assert store.get_node("node-1") == before
    assert issubclass(StaleUpdate, ConflictError)
    # a guard that holds lets the write through
    got = store.update_node("node-1", expect_state=NodeState.SCHEDULABLE, state=NodeState.PENDING_REBOOT, fault_type="X")
    assert (got.state, got.fault_type) == (NodeState.PENDING_REBOOT, "X")


def test_update_unknown_field_is_a_type_error(store):
    store.add_node(a_node())
    with pytest.raises(TypeError, match="no_such_column"):
        store.update_node("node-1", no_such_column=1)


def test_add_node_twice_conflicts(store):
    store.add_node(a_node())
    with pytest.raises(ConflictError, match="node node-1 already exists"):
        store.add_node(a_node())


def test_unknown_node_is_not_found(store):
    with pytest.raises(NotFoundError, match="node node-9 not found"):
        store.get_node("node-9")
    with pytest.raises(NotFoundError):
        store.update_node("node-9", heartbeat_at=1.0)


# -- jobs -------------------------------------------------------------------------------


def test_job_round_trip_decodes_enums_and_bools(store):
    job = a_job(reason="waiting", cancel_requested=True, phase_changed_at=2.0)
    store.add_job(job)
    got = store.get_job("train")
    assert got == job
    assert type(got.phase) is JobPhase
    assert got.cancel_requested is True
    assert store.list_jobs() == [job]


def test_list_jobs_in_creation_order(store):
    store.add_job(a_job("b", created_at=2.0))
    store.add_job(a_job("a", created_at=3.0))
    store.add_job(a_job("c", created_at=1.0))
    assert [j.name for j in store.list_jobs()] == ["c", "b", "a"]


def test_add_job_twice_conflicts(store):
    store.add_job(a_job())
    with pytest.raises(ConflictError, match="job train already exists"):
        store.add_job(a_job(reason="second"))
    assert store.get_job("train").reason is None


def test_unknown_job_is_not_found(store):
    with pytest.raises(NotFoundError, match="job nope not found"):
        store.get_job("nope")


def test_update_job_follows_the_lifecycle(store):
    store.add_job(a_job())
    running = store.update_job("train", phase=JobPhase.RUNNING, started_at=5.0, attempt=0)
    assert running.phase is JobPhase.RUNNING and running.phase_changed_at > 0
    store.update_job("train", expect_phase=JobPhase.RUNNING, phase=JobPhase.RESTARTING, attempt=1)
    store.update_job("train", phase=JobPhase.RUNNING)
    done = store.update_job("train", phase=JobPhase.SUCCEEDED, ended_at=9.0)
    assert (done.phase, done.attempt, done.ended_at) == (JobPhase.SUCCEEDED, 1, 9.0)
    assert store.update_job("train", cancel_requested=True).cancel_requested is True


def test_update_job_rejects_illegal_transition_and_writes_nothing(store):
    store.add_job(a_job())
    store.update_job("train", phase=JobPhase.RUNNING)
    store.update_job("train", phase=JobPhase.SUCCEEDED)
    before = store.get_job("train")
    with pytest.raises(IllegalTransition, match="Succeeded -> Running"):
        store.update_job("train", phase=JobPhase.RUNNING, reason="should not be written")
    assert store.get_job("train") == before


def test_update_job_expect_phase_guard(store):
    store.add_job(a_job())
    before = store.get_job("train")
    with pytest.raises(StaleUpdate, match="Pending, expected Running"):
        store.update_job("train", expect_phase=JobPhase.RUNNING, phase=JobPhase.RESTARTING, attempt=1)
    assert store.get_job("train") == before


# -- workers ----------------------------------------------------------------------------


def test_worker_round_trip_with_ranks(store):
    store.add_job(a_job())
    ranks = (RankInfo(rank=0, local_rank=0, pid=101), RankInfo(rank=1, local_rank=1, pid=102))
    added = store.add_worker(a_worker(ranks=ranks, log_dir="/tmp/logs"))
    assert added.id > 0 and added.created_at > 0
    got = store.list_workers()[0]
    assert got == added
    assert got.ranks == ranks and all(type(r) is RankInfo for r in got.ranks)
    assert type(got.phase) is WorkerPhase and type(got.desired) is Desired


def test_update_worker_ranks_and_progress(store):
    store.add_job(a_job())
    w = store.add_worker(a_worker())
    assert w.ranks == ()
    ranks = (RankInfo(rank=2, local_rank=0, pid=7),)
    got = store.update_worker(w.id, phase=WorkerPhase.RUNNING, pid=7, ranks=ranks, last_step=10, last_progress_at=3.5)
    assert got.ranks == ranks and got.phase is WorkerPhase.RUNNING
    assert store.update_worker(w.id, desired=Desired.STOP).desired is Desired.STOP
    assert store.list_workers()[0] == dataclasses.replace(got, desired=Desired.STOP)


def test_list_workers_filters(store):
    store.add_job(a_job("a"))
    store.add_job(a_job("b"))
    w1 = store.add_worker(a_worker("a", "node-1", 0))
    w2 = store.add_worker(a_worker("a", "node-2", 0))
    w3 = store.add_worker(a_worker("a", "node-1", 1))
    w4 = store.add_worker(a_worker("b", "node-1", 0))
    assert [w.id for w in store.list_workers()] == [w1.id, w2.id, w3.id, w4.id]
    assert [w.id for w in store.list_workers(job="a")] == [w1.id, w2.id, w3.id]
    assert [w.id for w in store.list_workers(node="node-1")] == [w1.id, w3.id, w4.id]
    assert [w.id for w in store.list_workers(job="a", attempt=0)] == [w1.id, w2.id]
    assert [w.id for w in store.list_workers(job="a", attempt=0, node="node-2")] == [w2.id]
    assert store.list_workers(job="c") == []
    store.update_worker(w1.id, phase=WorkerPhase.RUNNING)
    store.update_worker(w2.id, phase=WorkerPhase.STOPPED)
    store.update_worker(w3.id, phase=WorkerPhase.RUNNING)
    store.update_worker(w3.id, phase=WorkerPhase.SUCCEEDED)
    assert [w.id for w in store.list_workers(active=True)] == [w1.id, w4.id]
    assert [w.id for w in store.list_workers(node="node-1", active=True)] == [w1.id, w4.id]


def test_update_worker_enforces_transitions(store):
    store.add_job(a_job())
    w = store.add_worker(a_worker())
    store.update_worker(w.id, phase=WorkerPhase.RUNNING)
    store.update_worker(w.id, phase=WorkerPhase.SUCCEEDED, exit_code=0)
    with pytest.raises(IllegalTransition, match="Succeeded -> Running"):
        store.update_worker(w.id, phase=WorkerPhase.RUNNING, exit_code=5)
    got = store.list_workers()[0]
    assert (got.phase, got.exit_code) == (WorkerPhase.SUCCEEDED, 0)


def test_unknown_worker_is_not_found(store):
    with pytest.raises(NotFoundError):
        store.update_worker(999, phase=WorkerPhase.RUNNING)


# -- events and meta ----------------------------------------------------------------------


def test_events_round_trip_and_filter(store):
    e1 = store.add_event("job", "train", "JobCreated", "created")
    e2 = store.add_event("node", "node-1", "NodeFault", "Xid 79", type=EventType.WARNING)
    e3 = store.add_event("job", "train", "JobScheduled", "on node-1")
    e4 = store.add_event("job", "other", "JobCreated", "created")
    assert e1.id < e2.id < e3.id < e4.id
    assert store.list_events() == [e1, e2, e3, e4]
    assert store.list_events(object_kind="job", object_name="train") == [e1, e3]
    assert store.list_events(object_kind="node") == [e2]
    got = store.list_events(object_name="node-1")[0]
    assert type(got.type) is EventType and got.type is EventType.WARNING
    assert isinstance(got, Event) and got.ts == e2.ts


def test_cluster_and_meta(store):
    with pytest.raises(StoreError, match="no cluster configuration"):
        store.cluster_json()
    store.save_cluster('{"ClusterName": "a"}')
    store.save_cluster('{"ClusterName": "b"}')
    assert store.cluster_json() == '{"ClusterName": "b"}'
    assert store.get_meta("x") is None
    store.set_meta("x", "1")
    store.set_meta("x", "2")
    assert store.get_meta("x") == "2"


def test_allocate_node_index_counts_from_one(store):
    assert [store.allocate_node_index() for _ in range(3)] == [1, 2, 3]


# -- transactions ---------------------------------------------------------------------


class Boom(Exception):
    pass


def test_transaction_rolls_back_every_write(store):
    store.add_node(a_node())
    with pytest.raises(Boom):
        with store.transaction():
            store.add_job(a_job())
            store.add_event("job", "train", "JobCreated", "created")
            store.update_node("node-1", state=NodeState.SCHEDULABLE)
            raise Boom
    with pytest.raises(NotFoundError):
        store.get_job("train")
    assert store.list_events() == []
    assert store.get_node("node-1").state is NodeState.JOINING
    # the store is usable afterwards
    store.add_job(a_job())
    assert store.get_job("train").phase is JobPhase.PENDING


def test_illegal_transition_inside_transaction_rolls_back_earlier_writes(store):
    store.add_job(a_job())
    with pytest.raises(IllegalTransition):
        with store.transaction():
            store.add_event("job", "train", "JobSucceeded", "done")
            store.update_job("train", phase=JobPhase.SUCCEEDED)  # Pending -> Succeeded is not allowed
    assert store.list_events() == []


def test_nested_transaction_joins_the_outer_one(db, store):
    other = SqliteStore(db)  # another connection, as another process would have
    try:
        with pytest.raises(Boom):
            with store.transaction():
                with store.transaction():
                    store.add_job(a_job())
                # the inner block ended but did not commit: nobody else sees the job yet
                with pytest.raises(NotFoundError):
                    other.get_job("train")
                store.add_event("job", "train", "JobCreated", "created")
                raise Boom
        with pytest.raises(NotFoundError):
            store.get_job("train")
        assert store.list_events() == []

        with store.transaction():
            with store.transaction():
                store.add_job(a_job())
            store.add_event("job", "train", "JobCreated", "created")
        assert other.get_job("train").phase is JobPhase.PENDING
        assert len(other.list_events()) == 1
    finally:
        other.close()


def test_exception_in_inner_transaction_rolls_back_the_outer(store):
    with pytest.raises(Boom):
        with store.transaction():
            store.add_job(a_job())
            with store.transaction():
                store.add_event("job", "train", "JobCreated", "created")
                raise Boom
    with pytest.raises(NotFoundError):
        store.get_job("train")
    assert store.list_events() == []


def test_conflict_inside_a_transaction_keeps_the_transaction(store):
    store.add_job(a_job())
    with store.transaction():
        with pytest.raises(ConflictError):
            store.add_job(a_job())
        store.add_event("job", "train", "Dup", "ignored duplicate")
    assert [e.reason for e in store.list_events()] == ["Dup"]


# -- schema and opening ---------------------------------------------------------------


def test_wal_mode_and_schema_version(db, store):
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        conn.close()


def test_reopen_keeps_data(db, store):
    store.add_job(a_job())
    store.close()
    again = SqliteStore(db)
    try:
        assert again.get_job("train") == a_job()
    finally:
        again.close()


def test_newer_schema_is_refused(db, store):
    store.close()
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match=rf"schema version {SCHEMA_VERSION + 1} is newer than this unbroken \({SCHEMA_VERSION}\)"):
        SqliteStore(db)


def test_missing_db_without_create(tmp_path):
    path = tmp_path / "nowhere" / "state.db"
    with pytest.raises(StoreError, match="cluster up"):
        SqliteStore(path)
    assert not path.exists() and not path.parent.exists()


# -- real concurrency -----------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from unbroken.state.sqlite import SqliteStore

    store = SqliteStore(Path(sys.argv[1]))
    me = sys.argv[2]
    print("ready", flush=True)
    sys.stdin.readline()  # the parent releases every writer at once
    indexes = []
    for i in range(200):
        indexes.append(store.allocate_node_index())
        if i % 2:
            store.add_event("node", me, "Tick", str(i))
    print(json.dumps(indexes), flush=True)
    """
)


def test_concurrent_processes_allocate_unique_indexes_and_keep_every_event(db, store):
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(db), f"writer-{n}"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for n in range(4)
    ]
    try:
        for p in procs:
            line = p.stdout.readline()
            assert line.strip() == "ready", p.stderr.read()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    everything = [i for r in results for i in r]
    assert len(everything) == 800
    assert sorted(everything) == list(range(1, 801))
    for r in results:
        assert r == sorted(r)  # each writer sees its own indexes increase
    events = store.list_events()
    assert len(events) == 400
    assert {e.object_name for e in events} == {f"writer-{n}" for n in range(4)}
    assert all(sum(e.object_name == f"writer-{n}" for e in events) == 100 for n in range(4))
    assert len({e.id for e in events}) == 400
    assert store.allocate_node_index() == 801
