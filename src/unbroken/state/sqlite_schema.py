"""The SQLite store's schema (``state/sqlite.py``), and how a file of an older version is brought up to
this one in the transaction that opens it: the CREATE statements are idempotent, v2 files are
converted, and columns added since v3 are added where missing."""

from __future__ import annotations

import sqlite3

SCHEMA_VERSION = 7

SCHEMA = """
CREATE TABLE IF NOT EXISTS cluster (
    id INTEGER PRIMARY KEY CHECK (id = 1), name TEXT NOT NULL, config_json TEXT NOT NULL,
    status TEXT NOT NULL, created_at REAL NOT NULL, controller_metrics TEXT
);
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY, "group" TEXT NOT NULL, instance_type TEXT NOT NULL,
    state TEXT NOT NULL, deep_health TEXT NOT NULL, address TEXT NOT NULL,
    fault_type TEXT, fault_reason TEXT, agent_pid INTEGER,
    registered_at REAL, state_changed_at REAL NOT NULL, reboots INTEGER NOT NULL,
    replaced_by TEXT, recovery_requested INTEGER NOT NULL, metrics_address TEXT, version INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS leases (node TEXT PRIMARY KEY, renewed_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    name TEXT PRIMARY KEY, spec_json TEXT NOT NULL, phase TEXT NOT NULL,
    attempt INTEGER NOT NULL, reason TEXT, created_at REAL NOT NULL,
    started_at REAL, ended_at REAL, phase_changed_at REAL NOT NULL,
    cancel_requested INTEGER NOT NULL, nodes TEXT NOT NULL DEFAULT '[]', resizes INTEGER NOT NULL DEFAULT 0,
    version INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS workers (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL REFERENCES jobs(name),
    attempt INTEGER NOT NULL, node TEXT NOT NULL, node_rank INTEGER NOT NULL,
    desired TEXT NOT NULL, phase TEXT NOT NULL, rdzv_endpoint TEXT NOT NULL,
    pid INTEGER, created_at REAL NOT NULL, started_at REAL, ended_at REAL,
    exit_code INTEGER, message TEXT, log_dir TEXT,
    first_step INTEGER, first_progress_at REAL, last_step INTEGER, last_progress_at REAL,
    restored_step INTEGER, ranks TEXT NOT NULL, checkpoint_stall_s REAL, saved_step INTEGER, step_timing TEXT, divergence TEXT,
    finished_at REAL,
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
CREATE TABLE IF NOT EXISTS shard_servers (node TEXT PRIMARY KEY, address TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS progress_samples (
    job TEXT NOT NULL, attempt INTEGER NOT NULL, second INTEGER NOT NULL, ts REAL NOT NULL, step INTEGER NOT NULL,
    PRIMARY KEY (job, attempt, second)
);
"""

# v2 kept the cluster, its status and the shard servers in a key-value table, heartbeats on
# the node rows, and no versions. Moving a v2 file forward keeps every row.
FROM_V2 = """
INSERT OR IGNORE INTO cluster (id, name, config_json, status, created_at)
    SELECT 1, json_extract(c.value, '$.ClusterName'), c.value,
           CASE (SELECT value FROM meta WHERE key = 'status') WHEN 'up' THEN 'Up' ELSE 'Down' END, 0
    FROM meta c WHERE c.key = 'cluster';
INSERT OR IGNORE INTO shard_servers (node, address)
    SELECT substr(key, length('ckpt-endpoint/') + 1), value FROM meta WHERE key LIKE 'ckpt-endpoint/%';
INSERT OR IGNORE INTO leases (node, renewed_at) SELECT name, heartbeat_at FROM nodes WHERE heartbeat_at IS NOT NULL;
ALTER TABLE nodes DROP COLUMN heartbeat_at;
DROP TABLE meta;
"""
NEW_IN_V3 = (
    ("nodes", "version", "INTEGER NOT NULL DEFAULT 0"),
    ("jobs", "nodes", "TEXT NOT NULL DEFAULT '[]'"),
    ("jobs", "version", "INTEGER NOT NULL DEFAULT 0"),
    ("workers", "checkpoint_stall_s", "REAL"),
    ("nodes", "metrics_address", "TEXT"),
)
NEW_IN_V4 = (
    ("jobs", "resizes", "INTEGER NOT NULL DEFAULT 0"),
    ("workers", "saved_step", "INTEGER"),
)
NEW_IN_V5 = (
    ("workers", "step_timing", "TEXT"),
)
NEW_IN_V6 = (
    ("workers", "divergence", "TEXT"),
)
NEW_IN_V7 = (
    ("workers", "finished_at", "REAL"),
)


def upgrade(conn: sqlite3.Connection, version: int) -> None:
    """Bring a file at ``version`` (0: a new one) to ``SCHEMA_VERSION``, inside the caller's transaction."""
    for statement in statements(SCHEMA):
        conn.execute(statement)
    if version == 2:
        for statement in statements(FROM_V2):
            conn.execute(statement)
    if version in (2, 3, 4, 5):  # a column the file already has is skipped
        for table, column, declaration in (*NEW_IN_V3, *NEW_IN_V4, *NEW_IN_V5, *NEW_IN_V6, *NEW_IN_V7):
            if column not in {row["name"] for row in conn.execute(f"PRAGMA table_info({table})")}:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def statements(script: str) -> list[str]:
    return [s for s in (part.strip() for part in script.split(";")) if s]
