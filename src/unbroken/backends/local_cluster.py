"""Bring a local cluster up and down (what ``unbroken cluster up/down`` do)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable

from unbroken.backends import netns_launch
from unbroken.backends.base import provision_node
from unbroken.checkpoint import shm
from unbroken.checkpoint.peer import create_token
from unbroken.backends.local import LocalBackend
from unbroken.config.cluster import ClusterConfig
from unbroken.errors import BackendError, ConflictError
from unbroken.layout import ClusterLayout
from unbroken.state.phases import NodeState
from unbroken.state.sqlite import SqliteStore

_STATUS_KEY = "status"


def up(layout: ClusterLayout, config: ClusterConfig) -> tuple[SqliteStore, bool]:
    """Start ``config`` in ``layout``; returns (store, resumed).

    In a directory whose cluster is still up but whose controller died, only
    the controller is started again (``resumed``): nothing else is lost. A
    directory whose cluster was shut down is wiped and started afresh.
    """
    backend = LocalBackend(layout)
    if layout.state_db.exists():
        pid = backend.controller_pid()
        if pid is not None:
            raise ConflictError(f"a cluster is already up in {layout.root} (controller pid {pid}); run 'unbroken cluster down' first")
        store = SqliteStore(layout.state_db)
        if _status(store) == "up":
            backend.start_controller()
            return store, True
        store.close()
        _wipe(layout)
    layout.root.mkdir(parents=True, exist_ok=True)
    create_token(layout.cluster_token)
    store = SqliteStore(layout.state_db, create=True)
    store.save_cluster(config.model_dump_json())
    _set_status(store, "up")
    backend.start_controller()
    for group in config.InstanceGroups:
        for _ in range(group.InstanceCount):
            provision_node(store, backend, config, group.InstanceGroupName)
    return store, False


def wait_ready(store: SqliteStore, timeout: float, on_tick: Callable[[dict[str, int]], None] | None = None) -> None:
    """Poll until no node is Joining; raise if that takes longer than ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = [n for n in store.list_nodes() if n.state is not NodeState.RETIRED]
        counts: dict[str, int] = {}
        for node in nodes:
            counts[node.state.value] = counts.get(node.state.value, 0) + 1
        if on_tick:
            on_tick(counts)
        if nodes and not any(n.state in (NodeState.JOINING, NodeState.REBOOTING) for n in nodes):
            return
        if time.monotonic() > deadline:
            raise BackendError(f"nodes still joining after {timeout:g} s: {counts}; see the agent logs under nodes/*/agent.log")
        time.sleep(0.1)


def down(layout: ClusterLayout) -> list[int]:
    """Stop every process of the cluster and free its memory tier. Returns pids that survived.

    Shared memory is the one thing not kept for a post-mortem: it is RAM. Steps
    drained to a persistent tier stay there.
    """
    left = LocalBackend(layout).stop_cluster()
    shutil.rmtree(shm.cluster_root(layout.root), ignore_errors=True)
    if layout.state_db.exists():
        store = SqliteStore(layout.state_db)
        _set_status(store, "down")
        netns_launch.teardown(layout, store)
    return left


def is_up(store: SqliteStore) -> bool:
    return _status(store) == "up"


def _status(store: SqliteStore) -> str | None:
    return store.get_meta(_STATUS_KEY)


def _set_status(store: SqliteStore, status: str) -> None:
    store.set_meta(_STATUS_KEY, status)


def _wipe(layout: ClusterLayout) -> None:
    for name in ("state.db", "state.db-wal", "state.db-shm", "cluster.token"):
        (layout.root / name).unlink(missing_ok=True)
    for folder in ("nodes", "logs", "checkpoints"):
        shutil.rmtree(layout.root / folder, ignore_errors=True)

