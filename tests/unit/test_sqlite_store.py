"""The SQLite store behind the local backend: the ClusterStore, the CheckpointCatalog and the
WorkerTable on one file. Round trips, versions, typed updates, compare-and-swap, leases, the
schema and its migration, and real multi-process writers racing for the same rows."""

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
from unbroken.state.records import (
    CheckpointStep,
    CheckpointTier,
    ClusterStatus,
    Desired,
    Event,
    EventType,
    Job,
    Node,
    RankInfo,
    ShardCopy,
    StepStatus,
    Worker,
    WorkerProgress,
)
from unbroken.state.sqlite import SCHEMA_VERSION, SqliteStore, StaleUpdate
from unbroken.state.updates import UNSET, JobUpdate, NodeUpdate, WorkerUpdate


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "cluster" / "state.db"


@pytest.fixture
def store(db: Path):
    s = SqliteStore(db, create=True)
    s.create_cluster("test", '{"ClusterName": "test"}')
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


def a_step(step: int = 10, status: StepStatus = StepStatus.DRAINING, **fields) -> CheckpointStep:
    return CheckpointStep(**{"job": "train", "step": step, "tier": CheckpointTier.PERSISTENT, "attempt": 0, "world_size": 2,
                             "status": status, "size": 100, "updated_at": 1.0, **fields})


# -- the cluster object ------------------------------------------------------------------


def test_cluster_record_and_its_status(db):
    store = SqliteStore(db, create=True)
    with pytest.raises(StoreError, match="no cluster configuration"):
        store.cluster()
    created = store.create_cluster("dev", '{"ClusterName": "dev"}')
    assert store.cluster() == created and created.status is ClusterStatus.UP
    store.set_cluster_status(ClusterStatus.STOPPING)
    assert store.cluster().status is ClusterStatus.STOPPING
    assert store.cluster().config_json == '{"ClusterName": "dev"}'


# -- nodes ------------------------------------------------------------------------------


def test_node_round_trip_decodes_enums(store):
    node = a_node(address="10.0.0.7", agent_pid=1234, registered_at=11.0, state_changed_at=11.0)
    store.add_node(node)
    got = store.get_node("node-1")
    assert got == node
    assert type(got.state) is NodeState and type(got.deep_health) is DeepHealthStatus
    assert type(got.agent_pid) is int and got.fault_type is None and got.heartbeat_at is None


def test_list_nodes_orders_by_number(store):
    for name in ("node-10", "node-2", "node-1"):
        store.add_node(a_node(name))
    assert [n.name for n in store.list_nodes()] == ["node-1", "node-2", "node-10"]


def test_every_update_bumps_the_version_and_a_state_change_is_stamped(store):
    store.add_node(a_node(state_changed_at=1.0))
    got = store.update_node("node-1", NodeUpdate(state=NodeState.SCHEDULABLE, deep_health=DeepHealthStatus.PASSED))
    assert (got.state, got.deep_health, got.version) == (NodeState.SCHEDULABLE, DeepHealthStatus.PASSED, 1)
    assert got.state_changed_at > 1.0
    again = store.update_node("node-1", NodeUpdate(fault_reason="noted"))
    assert again.version == 2 and again.state_changed_at == got.state_changed_at, "no state change, no new stamp"


def test_a_conditional_write_of_a_stale_read_raises_and_writes_nothing(store):
    store.add_node(a_node())
    read = store.get_node("node-1")
    store.update_node("node-1", NodeUpdate(state=NodeState.SCHEDULABLE))  # someone else, after our read
    before = store.get_node("node-1")
    with pytest.raises(StaleUpdate, match="changed since it was read"):
        store.update_node("node-1", NodeUpdate(state=NodeState.PENDING_REBOOT, fault_type="X"), expect_version=read.version)
    assert store.get_node("node-1") == before
    assert issubclass(StaleUpdate, ConflictError)
    got = store.update_node("node-1", NodeUpdate(state=NodeState.PENDING_REBOOT, fault_type="X"), expect_version=before.version)
    assert (got.state, got.fault_type) == (NodeState.PENDING_REBOOT, "X")


def test_update_node_rejects_illegal_transition_and_writes_nothing(store):
    store.add_node(a_node())
    store.update_node("node-1", NodeUpdate(state=NodeState.PENDING_REPLACEMENT))
    store.update_node("node-1", NodeUpdate(state=NodeState.RETIRED))
    before = store.get_node("node-1")
    with pytest.raises(IllegalTransition, match="Retired -> Schedulable"):
        store.update_node("node-1", NodeUpdate(state=NodeState.SCHEDULABLE, fault_reason="should not be written"))
    assert store.get_node("node-1") == before


def test_updates_are_typed_and_say_what_they_set():
    with pytest.raises(TypeError, match="no_such_column"):
        NodeUpdate(no_such_column=1)  # type: ignore[call-arg]
    update = NodeUpdate(fault_type=None, reboots=2)
    assert update.changes() == {"fault_type": None, "reboots": 2}, "None is written, UNSET is not"
    assert update.state is UNSET and not NodeUpdate() and bool(update)


def test_add_node_twice_conflicts(store):
    store.add_node(a_node())
    with pytest.raises(ConflictError, match="node node-1 already exists"):
        store.add_node(a_node())


def test_unknown_node_is_not_found(store):
    with pytest.raises(NotFoundError, match="node node-9 not found"):
        store.get_node("node-9")
    with pytest.raises(NotFoundError):
        store.update_node("node-9", NodeUpdate(fault_reason="x"))


# -- leases -----------------------------------------------------------------------------


def test_a_lease_renewal_is_the_heartbeat_and_leaves_the_node_version_alone(store):
    store.add_node(a_node())
    read = store.get_node("node-1")
    store.renew_lease("node-1", at=123.5)
    got = store.get_node("node-1")
    assert got.heartbeat_at == 123.5 and got.version == read.version
    # so a controller's conditional write is not made stale by a busy node's heartbeats
    store.update_node("node-1", NodeUpdate(state=NodeState.SCHEDULABLE), expect_version=read.version)
    store.renew_lease("node-1", at=124.0)
    assert [n.heartbeat_at for n in store.list_nodes()] == [124.0]


def test_a_lease_renewal_carries_progress_into_the_nodes_active_workers_only(store):
    store.add_job(a_job())
    store.add_job(a_job("other"))
    running, ended, elsewhere = store.add_workers([a_worker(attempt=1), a_worker(attempt=0), a_worker("other")])
    store.update_worker(running.id, WorkerUpdate(phase=WorkerPhase.RUNNING))
    store.update_worker(ended.id, WorkerUpdate(phase=WorkerPhase.STOPPED))
    ranks = (RankInfo(rank=0, local_rank=0, pid=7),)
    store.renew_lease("node-1", at=50.0, progress=[
        WorkerProgress(job="train", attempt=1, ranks=ranks, first_step=1, first_progress_at=40.0, last_step=9, last_progress_at=49.0),
        WorkerProgress(job="train", attempt=0, ranks=ranks, last_step=99, last_progress_at=49.0),
    ])
    got = {w.id: w for w in store.list_workers()}
    assert (got[running.id].last_step, got[running.id].first_progress_at, got[running.id].ranks) == (9, 40.0, ranks)
    assert got[ended.id].last_step is None, "a worker that ended keeps its final report"
    assert got[elsewhere.id] == elsewhere
    store.renew_lease("node-1", at=51.0, progress=[WorkerProgress(job="train", attempt=1, ranks=ranks, restored_step=5)])
    after = {w.id: w for w in store.list_workers()}[running.id]
    assert (after.restored_step, after.last_step) == (5, 9), "what a report does not say is kept"


def test_progress_samples_keep_the_slowest_node_per_second_and_thin_out_a_long_life(store):
    store.add_job(a_job())
    workers = store.add_workers([a_worker(attempt=1), a_worker(attempt=1, node="node-2")])
    for worker in workers:
        store.update_worker(worker.id, WorkerUpdate(phase=WorkerPhase.RUNNING))
    ranks = (RankInfo(rank=0, local_rank=0, pid=7),)

    def report(node: str, at: float, step: int, attempt: int = 1) -> None:
        store.renew_lease(node, at=at, progress=[
            WorkerProgress(job="train", attempt=attempt, ranks=ranks, last_step=step, last_progress_at=at)])

    report("node-1", 100.2, 12)
    report("node-2", 100.7, 10)  # same second, behind: the job is where its slowest node is
    report("node-1", 100.9, 14)
    report("node-1", 101.1, 15)
    report("node-1", 101.5, 99, attempt=0)  # no live worker of attempt 0 here: not a sample
    assert store.progress_samples("train") == [(1, 100.7, 10), (1, 101.1, 15)]
    for second in range(102, 10_102):
        report("node-1", float(second), second)
    thinned = store.progress_samples("train", max_points=100)
    assert 90 <= len(thinned) <= 101 and thinned[-1] == (1, 10_101.0, 10_101)
    assert [s[1] for s in thinned] == sorted(s[1] for s in thinned)
    assert store.progress_samples("other") == []


# -- jobs -------------------------------------------------------------------------------


def test_job_round_trip_decodes_enums_bools_and_placement(store):
    job = a_job(reason="waiting", cancel_requested=True, phase_changed_at=2.0, nodes=("node-1", "node-3"))
    store.add_job(job)
    got = store.get_job("train")
    assert got == job
    assert type(got.phase) is JobPhase and got.cancel_requested is True and got.nodes == ("node-1", "node-3")
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
    running = store.update_job("train", JobUpdate(phase=JobPhase.RUNNING, started_at=5.0, attempt=0, nodes=("node-2",)))
    assert running.phase is JobPhase.RUNNING and running.phase_changed_at > 0 and running.nodes == ("node-2",)
    store.update_job("train", JobUpdate(phase=JobPhase.RESTARTING, attempt=1), expect_version=running.version)
    store.update_job("train", JobUpdate(phase=JobPhase.RUNNING))
    done = store.update_job("train", JobUpdate(phase=JobPhase.SUCCEEDED, ended_at=9.0))
    assert (done.phase, done.attempt, done.ended_at, done.version) == (JobPhase.SUCCEEDED, 1, 9.0, 4)
    assert store.update_job("train", JobUpdate(cancel_requested=True)).cancel_requested is True


def test_update_job_rejects_illegal_transition_and_writes_nothing(store):
    store.add_job(a_job())
    store.update_job("train", JobUpdate(phase=JobPhase.RUNNING))
    store.update_job("train", JobUpdate(phase=JobPhase.SUCCEEDED))
    before = store.get_job("train")
    with pytest.raises(IllegalTransition, match="Succeeded -> Running"):
        store.update_job("train", JobUpdate(phase=JobPhase.RUNNING, reason="should not be written"))
    assert store.get_job("train") == before


def test_a_cancel_between_read_and_decision_makes_the_decision_stale(store):
    store.add_job(a_job())
    read = store.get_job("train")
    store.update_job("train", JobUpdate(cancel_requested=True))
    with pytest.raises(StaleUpdate):
        store.update_job("train", JobUpdate(phase=JobPhase.RUNNING, attempt=0), expect_version=read.version)
    assert store.get_job("train").phase is JobPhase.PENDING


# -- workers ----------------------------------------------------------------------------


def test_worker_round_trip_with_ranks(store):
    store.add_job(a_job())
    ranks = (RankInfo(rank=0, local_rank=0, pid=101), RankInfo(rank=1, local_rank=1, pid=102))
    [added] = store.add_workers([a_worker(ranks=ranks, log_dir="/tmp/logs")])
    assert added.id > 0 and added.created_at > 0
    got = store.list_workers()[0]
    assert got == added
    assert got.ranks == ranks and all(type(r) is RankInfo for r in got.ranks)
    assert type(got.phase) is WorkerPhase and type(got.desired) is Desired


def test_an_attempts_workers_are_added_all_or_none(store):
    store.add_job(a_job())
    store.add_workers([a_worker(node="node-2")])
    with pytest.raises(sqlite3.IntegrityError):
        store.add_workers([a_worker(node="node-1"), a_worker(node="node-2")])  # node-2's row exists: the batch fails
    assert [w.node for w in store.list_workers()] == ["node-2"], "node-1's row of the failed batch was not kept"


def test_update_worker_ranks_and_progress(store):
    store.add_job(a_job())
    [w] = store.add_workers([a_worker()])
    assert w.ranks == ()
    ranks = (RankInfo(rank=2, local_rank=0, pid=7),)
    got = store.update_worker(w.id, WorkerUpdate(phase=WorkerPhase.RUNNING, pid=7, ranks=ranks, last_step=10, last_progress_at=3.5))
    assert got.ranks == ranks and got.phase is WorkerPhase.RUNNING
    assert store.update_worker(w.id, WorkerUpdate(desired=Desired.STOP)).desired is Desired.STOP
    assert store.list_workers()[0] == dataclasses.replace(got, desired=Desired.STOP)


def test_list_workers_filters(store):
    store.add_job(a_job("a"))
    store.add_job(a_job("b"))
    w1, w2, w3, w4 = store.add_workers([a_worker("a", "node-1", 0), a_worker("a", "node-2", 0), a_worker("a", "node-1", 1),
                                        a_worker("b", "node-1", 0)])
    assert [w.id for w in store.list_workers()] == [w1.id, w2.id, w3.id, w4.id]
    assert [w.id for w in store.list_workers(job="a")] == [w1.id, w2.id, w3.id]
    assert [w.id for w in store.list_workers(node="node-1")] == [w1.id, w3.id, w4.id]
    assert [w.id for w in store.list_workers(job="a", attempt=0)] == [w1.id, w2.id]
    assert [w.id for w in store.list_workers(job="a", attempt=0, node="node-2")] == [w2.id]
    assert store.list_workers(job="c") == []
    store.update_worker(w1.id, WorkerUpdate(phase=WorkerPhase.RUNNING))
    store.update_worker(w2.id, WorkerUpdate(phase=WorkerPhase.STOPPED))
    store.update_worker(w3.id, WorkerUpdate(phase=WorkerPhase.RUNNING))
    store.update_worker(w3.id, WorkerUpdate(phase=WorkerPhase.SUCCEEDED))
    assert [w.id for w in store.list_workers(active=True)] == [w1.id, w4.id]
    assert [w.id for w in store.list_workers(node="node-1", active=True)] == [w1.id, w4.id]


def test_update_worker_enforces_transitions(store):
    store.add_job(a_job())
    [w] = store.add_workers([a_worker()])
    store.update_worker(w.id, WorkerUpdate(phase=WorkerPhase.RUNNING))
    store.update_worker(w.id, WorkerUpdate(phase=WorkerPhase.SUCCEEDED, exit_code=0))
    with pytest.raises(IllegalTransition, match="Succeeded -> Running"):
        store.update_worker(w.id, WorkerUpdate(phase=WorkerPhase.RUNNING, exit_code=5))
    got = store.list_workers()[0]
    assert (got.phase, got.exit_code) == (WorkerPhase.SUCCEEDED, 0)


def test_unknown_worker_is_not_found(store):
    with pytest.raises(NotFoundError):
        store.update_worker(999, WorkerUpdate(phase=WorkerPhase.RUNNING))


# -- events ---------------------------------------------------------------------------


def test_events_round_trip_and_filter(store):
    e1 = store.add_event("job", "train", "JobCreated", "created")
    e2 = store.add_event("node", "node-1", "NodeFault", "Xid 79", type=EventType.WARNING)
    e3 = store.add_event("job", "train", "JobScheduled", "on node-1")
    e4 = store.add_event("job", "other", "JobCreated", "created")
    assert e1.id < e2.id < e3.id < e4.id
    assert store.list_events() == [e1, e2, e3, e4]
    assert store.list_events(object_kind="job", object_name="train") == [e1, e3]
    assert store.list_events(object_kind="node") == [e2]
    assert store.list_events(reason="JobCreated") == [e1, e4]
    got = store.list_events(object_name="node-1")[0]
    assert type(got.type) is EventType and got.type is EventType.WARNING
    assert isinstance(got, Event) and got.ts == e2.ts


# -- the checkpoint catalog -------------------------------------------------------------


def test_insert_if_absent_lets_exactly_one_writer_open_a_step(store):
    assert store.put_checkpoint_step(a_step(message="mine"), only_if_absent=True) is True
    assert store.put_checkpoint_step(a_step(message="theirs"), only_if_absent=True) is False
    assert [s.message for s in store.list_checkpoint_steps("train")] == ["mine"]


def test_compare_and_swap_writes_only_over_the_row_it_read(store):
    store.put_checkpoint_step(a_step())
    read = store.list_checkpoint_steps("train")[0]
    claimed = dataclasses.replace(read, message="committing: node-1", updated_at=2.0)
    assert store.replace_checkpoint_step(read, claimed) is True
    failed = dataclasses.replace(read, status=StepStatus.FAILED, message="disk full")
    assert store.replace_checkpoint_step(read, failed) is False, "the row changed since it was read"
    assert store.list_checkpoint_steps("train") == [claimed]
    assert store.replace_checkpoint_step(claimed, None) is True, "None deletes"
    assert store.list_checkpoint_steps("train") == []
    assert store.replace_checkpoint_step(claimed, read) is False, "nothing to swap"


def test_shard_copies_are_forgotten_per_rank_tier_and_node(store):
    def copy(rank: int, tier: CheckpointTier, node: str) -> ShardCopy:
        return ShardCopy(job="train", step=10, rank=rank, tier=tier, node=node, attempt=0, world_size=2, size=1,
                         checksum="c", info_json="{}", created_at=1.0)

    for c in (copy(0, CheckpointTier.MEMORY, "node-1"), copy(1, CheckpointTier.MEMORY, "node-1"), copy(0, CheckpointTier.REPLICA, "node-2")):
        store.put_shard_copy(c)
    store.delete_shard_copies("train", 10, tier=CheckpointTier.MEMORY, node="node-1", rank=0)
    assert [(c.rank, c.tier, c.node) for c in store.list_shard_copies("train")] == [
        (0, CheckpointTier.REPLICA, "node-2"), (1, CheckpointTier.MEMORY, "node-1")]


def test_shard_servers(store):
    store.set_shard_server("node-1", "127.0.0.1:4000")
    store.set_shard_server("node-1", "127.0.0.1:4001")
    store.set_shard_server("node-2", "127.0.0.1:5000")
    assert store.shard_servers() == {"node-1": "127.0.0.1:4001", "node-2": "127.0.0.1:5000"}


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


V2 = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE nodes (
    name TEXT PRIMARY KEY, "group" TEXT NOT NULL, instance_type TEXT NOT NULL,
    state TEXT NOT NULL, deep_health TEXT NOT NULL, address TEXT NOT NULL,
    fault_type TEXT, fault_reason TEXT, agent_pid INTEGER, heartbeat_at REAL,
    registered_at REAL, state_changed_at REAL NOT NULL, reboots INTEGER NOT NULL,
    replaced_by TEXT, recovery_requested INTEGER NOT NULL
);
CREATE TABLE jobs (
    name TEXT PRIMARY KEY, spec_json TEXT NOT NULL, phase TEXT NOT NULL,
    attempt INTEGER NOT NULL, reason TEXT, created_at REAL NOT NULL,
    started_at REAL, ended_at REAL, phase_changed_at REAL NOT NULL, cancel_requested INTEGER NOT NULL
);
INSERT INTO meta VALUES ('cluster', '{"ClusterName": "old"}'), ('status', 'up'), ('next_node_index', '3'),
                        ('ckpt-endpoint/node-1', '127.0.0.1:4000');
INSERT INTO nodes VALUES ('node-1', 'workers', 'cpu-dev', 'Schedulable', 'Passed', '127.0.0.1', NULL, NULL, 42, 77.5,
                          1.0, 1.0, 0, NULL, 0);
INSERT INTO jobs VALUES ('train', '{}', 'Running', 2, NULL, 1.0, 2.0, NULL, 2.0, 0);
PRAGMA user_version = 2;
"""


def test_a_version_2_file_moves_forward_keeping_every_row(db):
    db.parent.mkdir(parents=True)
    conn = sqlite3.connect(db)
    conn.executescript(V2)
    conn.close()
    store = SqliteStore(db)
    cluster = store.cluster()
    assert (cluster.name, cluster.status, cluster.config_json) == ("old", ClusterStatus.UP, '{"ClusterName": "old"}')
    node = store.get_node("node-1")
    assert (node.state, node.heartbeat_at, node.agent_pid, node.version) == (NodeState.SCHEDULABLE, 77.5, 42, 0)
    job = store.get_job("train")
    assert (job.phase, job.attempt, job.nodes, job.version) == (JobPhase.RUNNING, 2, (), 0)
    assert store.shard_servers() == {"node-1": "127.0.0.1:4000"}
    assert store.update_node("node-1", NodeUpdate(fault_reason="x"), expect_version=0).version == 1


# -- real concurrency -----------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from unbroken.state.sqlite import SqliteStore, StaleUpdate
    from unbroken.state.updates import NodeUpdate

    store = SqliteStore(Path(sys.argv[1]))
    me = sys.argv[2]
    print("ready", flush=True)
    sys.stdin.readline()  # the parent releases every writer at once
    stale = 0
    for i in range(100):
        while True:  # read, decide, write conditionally; a stale read is read again
            node = store.get_node("node-1")
            try:
                store.update_node("node-1", NodeUpdate(reboots=node.reboots + 1), expect_version=node.version)
                break
            except StaleUpdate:
                stale += 1
        if i % 2:
            store.add_event("node", me, "Tick", str(i))
            store.renew_lease(me, at=float(i))
    print(stale, flush=True)
    """
)


def test_concurrent_conditional_writers_lose_no_update_and_keep_every_event(db, store):
    store.add_node(a_node())
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
        stale = 0
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            stale += int(out.strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    node = store.get_node("node-1")
    assert node.reboots == 400, "every increment landed exactly once"
    assert node.version == 400
    assert stale > 0, "the writers really raced (else this test proves nothing)"
    events = store.list_events()
    assert len(events) == 200 and len({e.id for e in events}) == 200
    assert all(sum(e.object_name == f"writer-{n}" for e in events) == 50 for n in range(4))
