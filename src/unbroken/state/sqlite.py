"""The local backend's state: one SQLite file that is the ClusterStore, the CheckpointCatalog
and the WorkerTable at once, safe for many processes.

WAL mode lets readers (CLI, agents) run while the controller writes; every
write is one ``BEGIN IMMEDIATE`` transaction so two writers never interleave
half-updates. ``synchronous=NORMAL`` in WAL mode survives any process being
killed (the chaos we inject); only an OS crash can lose the last commits.
Connections are per thread, so one ``SqliteStore`` serves every thread of a process.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time
import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from unbroken.state.catalog import CopyKey
from unbroken.errors import ConflictError, NotFoundError, StoreError, StoreUnavailable
from unbroken.state.phases import (
    JOB_TRANSITIONS,
    NODE_TRANSITIONS,
    WORKER_TRANSITIONS,
    WorkerPhase,
    check_transition,
)
from unbroken.state.records import (
    CheckpointStep,
    CheckpointTier,
    ClusterRecord,
    ClusterStatus,
    Event,
    EventType,
    Job,
    Node,
    ShardCopy,
    Worker,
    WorkerProgress,
)
from unbroken.state import sqlite_rows as sql
from unbroken.state.sqlite_schema import SCHEMA_VERSION, upgrade
from unbroken.state.store import StaleUpdate, check_version
from unbroken.state.updates import JobUpdate, NodeUpdate, WorkerUpdate

__all__ = ["SCHEMA_VERSION", "SqliteStore", "StaleUpdate"]

_NODES = "SELECT nodes.*, leases.renewed_at AS heartbeat_at FROM nodes LEFT JOIN leases ON leases.node = nodes.name"

R = TypeVar("R")
P = ParamSpec("P")


def _store_call(method: Callable[P, R]) -> Callable[P, R]:
    """SQLite's operational errors (a lock held past the timeout, an I/O error) become
    :class:`StoreUnavailable`, the retryable error every store raises for a hiccup."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except sqlite3.OperationalError as exc:
            raise StoreUnavailable(f"state store busy or unreadable: {exc}") from exc

    return call


class SqliteStore:
    """``<cluster dir>/state.db``."""

    copy_write_delay = 0.0
    forget_write_delay = 0.0
    replica_write_wait = 0.0
    """A local write is a transaction on this machine: every pass's copies go in at once."""

    def __init__(self, path: Path, *, create: bool = False) -> None:
        self.path = path
        if not create and not path.exists():
            raise StoreError(f"no cluster at {path.parent} (no {path.name}); start one with 'unbroken cluster up'")
        self._local = threading.local()
        conn = self._conn()
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(f"{path}: schema version {version} is newer than this unbroken ({SCHEMA_VERSION}); upgrade unbroken")
        if version < SCHEMA_VERSION:
            with self._transaction():
                upgrade(conn, version)

    # -- connection and transactions -------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            self._local.conn = conn
        return conn

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write: BEGIN IMMEDIATE takes the write lock up front, so a read-then-write
        inside it (a version check, an insert-if-absent) cannot interleave with another writer."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    # -- the cluster object -------------------------------------------------------------

    @_store_call
    def create_cluster(self, name: str, config_json: str) -> ClusterRecord:
        """The one cluster of this file (what ``cluster up`` writes first), status Up."""
        record = ClusterRecord(name=name, config_json=config_json, status=ClusterStatus.UP, created_at=time.time())
        with self._transaction() as conn:
            conn.execute("INSERT OR REPLACE INTO cluster VALUES (1, ?, ?, ?, ?, NULL)",
                         (record.name, record.config_json, record.status.value, record.created_at))
        return record

    @_store_call
    def cluster(self) -> ClusterRecord:
        row = self._conn().execute("SELECT name, config_json, status, created_at, controller_metrics FROM cluster WHERE id = 1").fetchone()
        if row is None:
            raise StoreError(f"{self.path}: holds no cluster configuration")
        return sql.decode(ClusterRecord, row)

    @_store_call
    def set_cluster_status(self, status: ClusterStatus) -> None:
        with self._transaction() as conn:
            conn.execute("UPDATE cluster SET status = ? WHERE id = 1", (status.value,))

    @_store_call
    def set_controller_metrics(self, address: str | None) -> None:
        with self._transaction() as conn:
            conn.execute("UPDATE cluster SET controller_metrics = ? WHERE id = 1", (address,))

    # -- nodes ----------------------------------------------------------------------

    @_store_call
    def add_node(self, node: Node) -> None:
        row = sql.encode(node)
        row.pop("heartbeat_at")
        self._insert("nodes", row, conflict=f"node {node.name} already exists")

    @_store_call
    def get_node(self, name: str) -> Node:
        row = self._conn().execute(f"{_NODES} WHERE nodes.name = ?", (name,)).fetchone()
        if row is None:
            raise NotFoundError(f"node {name} not found")
        return sql.decode(Node, row)

    @_store_call
    def list_nodes(self) -> list[Node]:
        rows = self._conn().execute(f"{_NODES} ORDER BY length(nodes.name), nodes.name").fetchall()
        return [sql.decode(Node, r) for r in rows]

    @_store_call
    def update_node(self, name: str, update: NodeUpdate, *, expect_version: int | None = None) -> Node:
        changes = update.changes()
        with self._transaction() as conn:
            current = self.get_node(name)
            check_version(f"node {name}", current.version, expect_version)
            if "state" in changes:
                check_transition(f"node {name}", NODE_TRANSITIONS, current.state, changes["state"])
                if changes["state"] != current.state:
                    changes["state_changed_at"] = time.time()
            sql.update(conn, "nodes", "name", name, {**changes, "version": current.version + 1})
        return self.get_node(name)

    @_store_call
    def renew_lease(self, node: str, *, at: float, progress: Sequence[WorkerProgress] = ()) -> None:
        live = [p.value for p in WorkerPhase if not p.is_terminal]
        with self._transaction() as conn:
            conn.execute("INSERT OR REPLACE INTO leases VALUES (?, ?)", (node, at))
            for report in progress:
                values = {k: v for k, v in sql.encode(report).items() if k not in ("job", "attempt") and v is not None}
                if not values:
                    continue
                assignments = ", ".join(f"{sql.quote(c)} = ?" for c in values)
                updated = conn.execute(
                    f"UPDATE workers SET {assignments} WHERE job = ? AND attempt = ? AND node = ? "
                    f"AND phase IN ({', '.join('?' for _ in live)})",
                    (*values.values(), report.job, report.attempt, node, *live),
                ).rowcount
                if updated and report.last_step is not None and report.last_progress_at is not None:
                    # One row per job, attempt and second, whatever the node count: the slowest node's step.
                    conn.execute(
                        "INSERT INTO progress_samples VALUES (?, ?, ?, ?, ?) ON CONFLICT (job, attempt, second) DO UPDATE "
                        "SET step = excluded.step, ts = excluded.ts WHERE excluded.step < progress_samples.step",
                        (report.job, report.attempt, int(report.last_progress_at), report.last_progress_at, report.last_step))

    @_store_call
    def progress_samples(self, job: str, max_points: int = 2000) -> list[tuple[int, float, int]]:
        """(attempt, time, step) of the job, oldest first: at most about ``max_points``, evenly
        spread over its life (a week-long job has 600k seconds; a plot needs a few hundred)."""
        conn = self._conn()
        span = conn.execute("SELECT MIN(second), MAX(second) FROM progress_samples WHERE job = ?", (job,)).fetchone()
        if span[0] is None:
            return []
        bucket = max(1, -(-(int(span[1]) - int(span[0]) + 1) // max_points))
        rows = conn.execute(
            "SELECT attempt, MAX(ts) AS ts, MAX(step) AS step FROM progress_samples WHERE job = ? "
            "GROUP BY attempt, second / ? ORDER BY ts", (job, bucket)).fetchall()
        return [(int(r["attempt"]), float(r["ts"]), int(r["step"])) for r in rows]

    # -- jobs -----------------------------------------------------------------------

    @_store_call
    def add_job(self, job: Job) -> None:
        self._insert("jobs", sql.encode(job), conflict=f"job {job.name} already exists")

    @_store_call
    def get_job(self, name: str) -> Job:
        return self._get("jobs", Job, name, "job")

    @_store_call
    def list_jobs(self) -> list[Job]:
        rows = self._conn().execute("SELECT * FROM jobs ORDER BY created_at").fetchall()
        return [sql.decode(Job, r) for r in rows]

    @_store_call
    def update_job(self, name: str, update: JobUpdate, *, expect_version: int | None = None) -> Job:
        changes = update.changes()
        with self._transaction() as conn:
            current = self.get_job(name)
            check_version(f"job {name}", current.version, expect_version)
            if "phase" in changes:
                check_transition(f"job {name}", JOB_TRANSITIONS, current.phase, changes["phase"])
                if changes["phase"] != current.phase:
                    changes["phase_changed_at"] = time.time()
            sql.update(conn, "jobs", "name", name, {**changes, "version": current.version + 1})
        return self.get_job(name)

    # -- workers (the local backend's) ----------------------------------------------

    @_store_call
    def add_workers(self, workers: Sequence[Worker]) -> list[Worker]:
        ids = []
        with self._transaction() as conn:
            for worker in workers:
                row = sql.encode(dataclasses.replace(worker, created_at=worker.created_at or time.time()))
                row.pop("id")
                cur = conn.execute(f"INSERT INTO workers ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})",
                                   tuple(row.values()))
                ids.append(int(cur.lastrowid or 0))
        return [self._get_worker(i) for i in ids]

    def list_workers(
        self, *, job: str | None = None, node: str | None = None, attempt: int | None = None, active: bool = False
    ) -> list[Worker]:
        where, params = sql.where(job=job, node=node, attempt=attempt)
        if active:
            live = [p.value for p in WorkerPhase if not p.is_terminal]
            where = " AND ".join(filter(None, [where, f"phase IN ({', '.join('?' for _ in live)})"]))
            params.extend(live)
        rows = self._conn().execute(f"SELECT * FROM workers {'WHERE ' + where if where else ''} ORDER BY id", params).fetchall()
        return [sql.decode(Worker, r) for r in rows]

    @_store_call
    def update_worker(self, worker_id: int, update: WorkerUpdate) -> Worker:
        changes = update.changes()
        with self._transaction() as conn:
            current = self._get_worker(worker_id)
            if "phase" in changes:
                check_transition(f"worker {worker_id}", WORKER_TRANSITIONS, current.phase, changes["phase"])
            sql.update(conn, "workers", "id", worker_id, changes)
        return self._get_worker(worker_id)

    def _get_worker(self, worker_id: int) -> Worker:
        return self._get("workers", Worker, worker_id, "worker", key="id")

    # -- events ---------------------------------------------------------------------

    def add_event(
        self, object_kind: str, object_name: str, reason: str, message: str, *, type: EventType = EventType.NORMAL
    ) -> Event:
        event = Event(ts=time.time(), object_kind=object_kind, object_name=object_name, type=type, reason=reason, message=message)
        row = sql.encode(event)
        row.pop("id")
        with self._transaction() as conn:
            cur = conn.execute(f"INSERT INTO events ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})", tuple(row.values()))
        return dataclasses.replace(event, id=int(cur.lastrowid or 0))

    def list_events(
        self, *, object_kind: str | None = None, object_name: str | None = None, reason: str | None = None
    ) -> list[Event]:
        where, params = sql.where(object_kind=object_kind, object_name=object_name, reason=reason)
        rows = self._conn().execute(f"SELECT * FROM events {'WHERE ' + where if where else ''} ORDER BY id", params).fetchall()
        return [sql.decode(Event, r) for r in rows]

    # -- the checkpoint catalog -----------------------------------------------------

    @_store_call
    def put_shard_copy(self, copy: ShardCopy) -> None:
        row = sql.encode(copy)
        with self._transaction() as conn:
            conn.execute(
                f'INSERT OR REPLACE INTO shard_copies ({", ".join(sql.quote(c) for c in row)}) VALUES ({", ".join("?" for _ in row)})',
                tuple(row.values()),
            )

    @_store_call
    def update_shard_copies(self, job: str, *, put: Sequence[ShardCopy] = (), forget: Sequence[CopyKey] = ()) -> None:
        with self._transaction() as conn:
            for key in forget:
                conn.execute("DELETE FROM shard_copies WHERE job = ? AND step = ? AND tier = ? AND node = ? AND rank = ?",
                             (job, key.step, key.tier.value, key.node, key.rank))
            for copy in put:
                row = sql.encode(copy)
                conn.execute(
                    f'INSERT OR REPLACE INTO shard_copies ({", ".join(sql.quote(c) for c in row)}) VALUES ({", ".join("?" for _ in row)})',
                    tuple(row.values()),
                )

    @_store_call
    def list_shard_copies(self, job: str, *, step: int | None = None, tier: CheckpointTier | None = None) -> list[ShardCopy]:
        where, params = sql.where(job=job, step=step, tier=tier)
        rows = self._conn().execute(f"SELECT * FROM shard_copies WHERE {where} ORDER BY step DESC, rank, tier, node", params).fetchall()
        return [sql.decode(ShardCopy, r) for r in rows]

    @_store_call
    def delete_shard_copies(self, job: str, step: int, *, tier: CheckpointTier | None = None, node: str | None = None,
                            rank: int | None = None) -> None:
        where, params = sql.where(job=job, step=step, tier=tier, node=node, rank=rank)
        with self._transaction() as conn:
            conn.execute(f"DELETE FROM shard_copies WHERE {where}", params)

    @_store_call
    def put_checkpoint_step(self, record: CheckpointStep, *, only_if_absent: bool = False) -> bool:
        row = sql.encode(record)
        verb = "INSERT OR IGNORE" if only_if_absent else "INSERT OR REPLACE"
        with self._transaction() as conn:
            cursor = conn.execute(
                f'{verb} INTO checkpoint_steps ({", ".join(sql.quote(c) for c in row)}) VALUES ({", ".join("?" for _ in row)})',
                tuple(row.values()),
            )
        return cursor.rowcount > 0

    @_store_call
    def replace_checkpoint_step(self, current: CheckpointStep, new: CheckpointStep | None) -> bool:
        with self._transaction() as conn:
            stored = conn.execute("SELECT * FROM checkpoint_steps WHERE job = ? AND step = ? AND tier = ?",
                                  (current.job, current.step, current.tier.value)).fetchone()
            if stored is None or sql.decode(CheckpointStep, stored) != current:
                return False
            conn.execute("DELETE FROM checkpoint_steps WHERE job = ? AND step = ? AND tier = ?",
                         (current.job, current.step, current.tier.value))
            if new is not None:
                row = sql.encode(new)
                conn.execute(f'INSERT INTO checkpoint_steps ({", ".join(sql.quote(c) for c in row)}) VALUES ({", ".join("?" for _ in row)})',
                             tuple(row.values()))
        return True

    @_store_call
    def list_checkpoint_steps(self, job: str, *, tier: CheckpointTier | None = None) -> list[CheckpointStep]:
        where, params = sql.where(job=job, tier=tier)
        rows = self._conn().execute(f"SELECT * FROM checkpoint_steps WHERE {where} ORDER BY step DESC, tier", params).fetchall()
        return [sql.decode(CheckpointStep, r) for r in rows]

    @_store_call
    def delete_checkpoint_step(self, job: str, step: int, tier: CheckpointTier) -> None:
        with self._transaction() as conn:
            conn.execute("DELETE FROM checkpoint_steps WHERE job = ? AND step = ? AND tier = ?", (job, step, tier.value))

    @_store_call
    def set_shard_server(self, node: str, address: str) -> None:
        with self._transaction() as conn:
            conn.execute("INSERT OR REPLACE INTO shard_servers VALUES (?, ?)", (node, address))

    @_store_call
    def shard_servers(self) -> dict[str, str]:
        return {row["node"]: row["address"] for row in self._conn().execute("SELECT node, address FROM shard_servers")}

    # -- generic row plumbing -------------------------------------------------------

    def _insert(self, table: str, row: dict[str, Any], *, conflict: str) -> None:
        try:
            with self._transaction() as conn:
                conn.execute(
                    f'INSERT INTO {table} ({", ".join(sql.quote(c) for c in row)}) VALUES ({", ".join("?" for _ in row)})',
                    tuple(row.values()),
                )
        except sqlite3.IntegrityError:
            raise ConflictError(conflict) from None

    def _get(self, table: str, cls: type[R], value: Any, what: str, *, key: str = "name") -> R:
        row = self._conn().execute(f"SELECT * FROM {table} WHERE {key} = ?", (value,)).fetchone()
        if row is None:
            raise NotFoundError(f"{what} {value} not found")
        return sql.decode(cls, row)


