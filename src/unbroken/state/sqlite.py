"""SQLite implementation of the Store, safe for many processes at once.

WAL mode lets readers (CLI, agents) run while the controller writes; every
write is one ``BEGIN IMMEDIATE`` transaction so two writers never interleave
half-updates. ``synchronous=NORMAL`` in WAL mode survives any process being
killed (the chaos we inject); only an OS crash can lose the last commits.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from unbroken.errors import ConflictError, NotFoundError, StoreError
from unbroken.state.phases import (
    JOB_TRANSITIONS,
    NODE_TRANSITIONS,
    WORKER_TRANSITIONS,
    JobPhase,
    NodeState,
    WorkerPhase,
    check_transition,
)
from unbroken.state.records import (
    CheckpointStep,
    CheckpointTier,
    Event,
    EventType,
    Job,
    Node,
    RankInfo,
    ShardCopy,
    Worker,
)
from unbroken.state.store import StaleUpdate

__all__ = ["SCHEMA_VERSION", "SqliteStore", "StaleUpdate"]

SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY, "group" TEXT NOT NULL, instance_type TEXT NOT NULL,
    state TEXT NOT NULL, deep_health TEXT NOT NULL, address TEXT NOT NULL,
    fault_type TEXT, fault_reason TEXT, agent_pid INTEGER, heartbeat_at REAL,
    registered_at REAL, state_changed_at REAL NOT NULL, reboots INTEGER NOT NULL,
    replaced_by TEXT, recovery_requested INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY, spec_json TEXT NOT NULL, phase TEXT NOT NULL,
    attempt INTEGER NOT NULL, reason TEXT, created_at REAL NOT NULL,
    started_at REAL, ended_at REAL, phase_changed_at REAL NOT NULL,
    cancel_requested INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS workers (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL REFERENCES jobs(name),
    attempt INTEGER NOT NULL, node TEXT NOT NULL, node_rank INTEGER NOT NULL,
    desired TEXT NOT NULL, phase TEXT NOT NULL, rdzv_endpoint TEXT NOT NULL,
    pid INTEGER, created_at REAL NOT NULL, started_at REAL, ended_at REAL,
    exit_code INTEGER, message TEXT, log_dir TEXT,
    first_step INTEGER, first_progress_at REAL, last_step INTEGER, last_progress_at REAL,
    restored_step INTEGER, ranks TEXT NOT NULL,
    UNIQUE (job, attempt, node)
);
CREATE INDEX IF NOT EXISTS workers_by_node ON workers(node, phase);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, object_kind TEXT NOT NULL,
    object_name TEXT NOT NULL, type TEXT NOT NULL, reason TEXT NOT NULL, message TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_object ON events(object_kind, object_name, id);
CREATE TABLE IF NOT EXISTS shard_copies (
    job TEXT NOT NULL, step INTEGER NOT NULL, rank INTEGER NOT NULL, tier TEXT NOT NULL,
    node TEXT NOT NULL, attempt INTEGER NOT NULL, world_size INTEGER NOT NULL,
    size INTEGER NOT NULL, checksum TEXT NOT NULL, info_json TEXT NOT NULL, created_at REAL NOT NULL,
    PRIMARY KEY (job, step, rank, tier, node)
);
CREATE TABLE IF NOT EXISTS checkpoint_steps (
    job TEXT NOT NULL, step INTEGER NOT NULL, tier TEXT NOT NULL, attempt INTEGER NOT NULL,
    world_size INTEGER NOT NULL, status TEXT NOT NULL, size INTEGER NOT NULL,
    updated_at REAL NOT NULL, committed_at REAL, message TEXT,
    PRIMARY KEY (job, step, tier)
);
"""

R = TypeVar("R")


class SqliteStore:
    """The local backend's store: ``<cluster dir>/state.db``."""

    def __init__(self, path: Path, *, create: bool = False) -> None:
        self.path = path
        if not create and not path.exists():
            raise StoreError(f"no cluster at {path.parent} (no {path.name}); start one with 'unbroken cluster up'")
        self._local = threading.local()
        conn = self._conn()
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version < SCHEMA_VERSION:
            # Every statement is CREATE ... IF NOT EXISTS, so running the schema on an
            # older database adds what is new (v2: the checkpoint tables) and keeps the rest.
            with self.transaction():
                for statement in filter(str.strip, _SCHEMA.split(";")):
                    conn.execute(statement)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        elif version > SCHEMA_VERSION:
            raise StoreError(f"{path}: schema version {version} is newer than this unbroken ({SCHEMA_VERSION}); upgrade unbroken")

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
            self._local.depth = 0
        return conn

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One atomic unit of writes; nests (inner blocks join the outer transaction)."""
        conn = self._conn()
        if self._local.depth:
            self._local.depth += 1
            try:
                yield
            finally:
                self._local.depth -= 1
            return
        conn.execute("BEGIN IMMEDIATE")
        self._local.depth = 1
        try:
            yield
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        else:
            conn.execute("COMMIT")
        finally:
            self._local.depth = 0

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    # -- cluster --------------------------------------------------------------------

    def save_cluster(self, config_json: str) -> None:
        with self.transaction():
            self._conn().execute("INSERT OR REPLACE INTO meta VALUES ('cluster', ?)", (config_json,))

    def cluster_json(self) -> str:
        row = self._conn().execute("SELECT value FROM meta WHERE key='cluster'").fetchone()
        if row is None:
            raise StoreError(f"{self.path}: holds no cluster configuration")
        return row[0]

    def get_meta(self, key: str) -> str | None:
        row = self._conn().execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_meta(self, key: str, value: str) -> None:
        with self.transaction():
            self._conn().execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def allocate_node_index(self) -> int:
        with self.transaction():
            conn = self._conn()
            row = conn.execute("SELECT value FROM meta WHERE key='next_node_index'").fetchone()
            index = int(row[0]) if row else 1
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('next_node_index', ?)", (str(index + 1),))
            return index

    # -- nodes ----------------------------------------------------------------------

    def add_node(self, node: Node) -> None:
        self._insert("nodes", node, conflict=f"node {node.name} already exists")

    def get_node(self, name: str) -> Node:
        return self._get("nodes", Node, name, "node")

    def list_nodes(self) -> list[Node]:
        rows = self._conn().execute("SELECT * FROM nodes ORDER BY length(name), name").fetchall()
        return [_decode(Node, r) for r in rows]

    def update_node(self, name: str, *, expect_state: NodeState | None = None, **changes: Any) -> Node:
        with self.transaction():
            current = self.get_node(name)
            if expect_state is not None and current.state != expect_state:
                raise StaleUpdate(f"node {name} is {current.state.value}, expected {expect_state.value}")
            if "state" in changes:
                check_transition(f"node {name}", NODE_TRANSITIONS, current.state, changes["state"])
                if changes["state"] != current.state:
                    changes.setdefault("state_changed_at", time.time())
            return self._update("nodes", Node, "name", name, changes)

    # -- jobs -----------------------------------------------------------------------

    def add_job(self, job: Job) -> None:
        self._insert("jobs", job, conflict=f"job {job.name} already exists")

    def get_job(self, name: str) -> Job:
        return self._get("jobs", Job, name, "job")

    def list_jobs(self) -> list[Job]:
        rows = self._conn().execute("SELECT * FROM jobs ORDER BY created_at").fetchall()
        return [_decode(Job, r) for r in rows]

    def update_job(self, name: str, *, expect_phase: JobPhase | None = None, **changes: Any) -> Job:
        with self.transaction():
            current = self.get_job(name)
            if expect_phase is not None and current.phase != expect_phase:
                raise StaleUpdate(f"job {name} is {current.phase.value}, expected {expect_phase.value}")
            if "phase" in changes:
                check_transition(f"job {name}", JOB_TRANSITIONS, current.phase, changes["phase"])
                if changes["phase"] != current.phase:
                    changes.setdefault("phase_changed_at", time.time())
            return self._update("jobs", Job, "name", name, changes)

    # -- workers --------------------------------------------------------------------

    def add_worker(self, worker: Worker) -> Worker:
        with self.transaction():
            row = _encode(dataclasses.replace(worker, created_at=worker.created_at or time.time()))
            row.pop("id")
            cur = self._conn().execute(
                f"INSERT INTO workers ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})",
                tuple(row.values()),
            )
            return self._get_worker(int(cur.lastrowid or 0))

    def list_workers(
        self, *, job: str | None = None, node: str | None = None, attempt: int | None = None, active: bool = False
    ) -> list[Worker]:
        clauses: list[str] = []
        params: list[Any] = []
        for column, value in (("job", job), ("node", node), ("attempt", attempt)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        if active:
            live = [p.value for p in WorkerPhase if not p.is_terminal]
            clauses.append(f"phase IN ({', '.join('?' for _ in live)})")
            params.extend(live)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._conn().execute(f"SELECT * FROM workers {where} ORDER BY id", params).fetchall()
        return [_decode(Worker, r) for r in rows]

    def update_worker(self, worker_id: int, **changes: Any) -> Worker:
        with self.transaction():
            current = self._get_worker(worker_id)
            if "phase" in changes:
                check_transition(f"worker {worker_id}", WORKER_TRANSITIONS, current.phase, changes["phase"])
            return self._update("workers", Worker, "id", worker_id, changes)

    def _get_worker(self, worker_id: int) -> Worker:
        return self._get("workers", Worker, worker_id, "worker", key="id")

    # -- events ---------------------------------------------------------------------

    def add_event(
        self, object_kind: str, object_name: str, reason: str, message: str, *, type: EventType = EventType.NORMAL
    ) -> Event:
        event = Event(ts=time.time(), object_kind=object_kind, object_name=object_name, type=type, reason=reason, message=message)
        with self.transaction():
            row = _encode(event)
            row.pop("id")
            cur = self._conn().execute(
                f"INSERT INTO events ({', '.join(row)}) VALUES ({', '.join('?' for _ in row)})", tuple(row.values())
            )
        return dataclasses.replace(event, id=int(cur.lastrowid or 0))

    def list_events(
        self, *, object_kind: str | None = None, object_name: str | None = None, reason: str | None = None
    ) -> list[Event]:
        clauses, params = [], []
        for column, value in (("object_kind", object_kind), ("object_name", object_name), ("reason", reason)):
            if value is not None:
                clauses.append(f"{column} = ?")
                params.append(value)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._conn().execute(f"SELECT * FROM events {where} ORDER BY id", params).fetchall()
        return [_decode(Event, r) for r in rows]

    # -- checkpoints ----------------------------------------------------------------

    def put_shard_copy(self, copy: ShardCopy) -> None:
        row = _encode(copy)
        with self.transaction():
            self._conn().execute(
                f'INSERT OR REPLACE INTO shard_copies ({", ".join(_quote(c) for c in row)}) VALUES ({", ".join("?" for _ in row)})',
                tuple(row.values()),
            )

    def list_shard_copies(self, job: str, *, step: int | None = None, tier: CheckpointTier | None = None) -> list[ShardCopy]:
        where, params = _where(job=job, step=step, tier=tier)
        rows = self._conn().execute(f"SELECT * FROM shard_copies WHERE {where} ORDER BY step DESC, rank, tier, node", params).fetchall()
        return [_decode(ShardCopy, r) for r in rows]

    def delete_shard_copies(self, job: str, step: int, *, tier: CheckpointTier | None = None, node: str | None = None) -> None:
        where, params = _where(job=job, step=step, tier=tier, node=node)
        with self.transaction():
            self._conn().execute(f"DELETE FROM shard_copies WHERE {where}", params)

    def put_checkpoint_step(self, record: CheckpointStep, *, only_if_absent: bool = False) -> bool:
        """Write a step's row in one tier; with ``only_if_absent``, False if someone wrote it first."""
        row = _encode(record)
        verb = "INSERT OR IGNORE" if only_if_absent else "INSERT OR REPLACE"
        with self.transaction():
            cursor = self._conn().execute(
                f'{verb} INTO checkpoint_steps ({", ".join(_quote(c) for c in row)}) VALUES ({", ".join("?" for _ in row)})',
                tuple(row.values()),
            )
        return cursor.rowcount > 0

    def list_checkpoint_steps(self, job: str, *, tier: CheckpointTier | None = None) -> list[CheckpointStep]:
        """Newest first."""
        where, params = _where(job=job, tier=tier)
        rows = self._conn().execute(f"SELECT * FROM checkpoint_steps WHERE {where} ORDER BY step DESC, tier", params).fetchall()
        return [_decode(CheckpointStep, r) for r in rows]

    def delete_checkpoint_step(self, job: str, step: int, tier: CheckpointTier) -> None:
        with self.transaction():
            self._conn().execute("DELETE FROM checkpoint_steps WHERE job = ? AND step = ? AND tier = ?", (job, step, tier.value))

    # -- generic row plumbing -------------------------------------------------------

    def _insert(self, table: str, record: Any, *, conflict: str) -> None:
        row = _encode(record)
        try:
            with self.transaction():
                self._conn().execute(
                    f'INSERT INTO {table} ({", ".join(_quote(c) for c in row)}) VALUES ({", ".join("?" for _ in row)})',
                    tuple(row.values()),
                )
        except sqlite3.IntegrityError:
            raise ConflictError(conflict) from None

    def _get(self, table: str, cls: type[R], value: Any, what: str, *, key: str = "name") -> R:
        row = self._conn().execute(f"SELECT * FROM {table} WHERE {key} = ?", (value,)).fetchone()
        if row is None:
            raise NotFoundError(f"{what} {value} not found")
        return _decode(cls, row)

    def _update(self, table: str, cls: type[R], key: str, value: Any, changes: dict[str, Any]) -> R:
        if changes:
            names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
            unknown = set(changes) - names
            if unknown:
                raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
            encoded = {k: _encode_value(v) for k, v in changes.items()}
            assignments = ", ".join(f"{_quote(c)} = ?" for c in encoded)
            self._conn().execute(
                f"UPDATE {table} SET {assignments} WHERE {key} = ?", (*encoded.values(), value)
            )
        return self._get(table, cls, value, table[:-1], key=key)


def _where(**equal: Any) -> tuple[str, list[Any]]:
    """``col = ?`` for every argument that is not None, ANDed, with its parameters."""
    given = {k: _encode_value(v) for k, v in equal.items() if v is not None}
    return " AND ".join(f"{_quote(k)} = ?" for k in given), list(given.values())


def _quote(column: str) -> str:
    return f'"{column}"'


def _encode_value(value: Any) -> Any:
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, tuple) and all(isinstance(v, RankInfo) for v in value):
        return json.dumps([dataclasses.asdict(v) for v in value])
    return value


def _encode(record: Any) -> dict[str, Any]:
    return {f.name: _encode_value(getattr(record, f.name)) for f in dataclasses.fields(record)}


_HINTS: dict[type, dict[str, Any]] = {}


def _decode(cls: type[R], row: sqlite3.Row) -> R:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = get_type_hints(cls)
    values: dict[str, Any] = {}
    for name in row.keys():
        raw = row[name]
        hint = hints[name]
        if raw is None:
            values[name] = None
        elif isinstance(hint, type) and issubclass(hint, StrEnum):
            values[name] = hint(raw)
        elif hint is bool:
            values[name] = bool(raw)
        elif name == "ranks":
            values[name] = tuple(RankInfo(**r) for r in json.loads(raw))
        else:
            values[name] = raw
    return cls(**values)
