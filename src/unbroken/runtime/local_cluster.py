"""Bring a local cluster up and down (what ``unbroken cluster up/down`` do)."""

from __future__ import annotations

import shutil
from collections.abc import Callable

from unbroken.backends.local import netns_launch
from unbroken.checkpoint.node import credentials, shm
from unbroken.config.cluster import ClusterConfig
from unbroken.errors import BackendError, ConflictError, StoreError
from unbroken.plumbing.layout import ClusterLayout
from unbroken.runtime import Runtime, create_local, open_local
from unbroken.state.phases import NodeState
from unbroken.state.records import ClusterStatus
from unbroken.plumbing.waiting import WaitTimeout, wait_until


def up(layout: ClusterLayout, config: ClusterConfig) -> tuple[Runtime, bool]:
    """Start ``config`` in ``layout``; returns (runtime, resumed).

    In a directory whose cluster is still up but whose controller died, only
    the controller is started again (``resumed``): nothing else is lost. A
    directory whose cluster was shut down (or whose shutdown was interrupted)
    is swept of leftover processes, wiped and started afresh.
    """
    if layout.state_db.exists():
        try:
            runtime: Runtime | None = open_local(layout)
        except StoreError:
            runtime = None  # a state file this unbroken cannot read: start afresh
        if runtime is not None:
            backend = runtime.local_backend("cluster up")
            pid = backend.controller_pid()
            if pid is not None:
                raise ConflictError(f"a cluster is already up in {layout.root} (controller pid {pid}); run 'unbroken cluster down' first")
            if runtime.cluster.cluster().status is ClusterStatus.UP:
                backend.start_controller()
                return runtime, True
            down(layout)
        _wipe(layout)
    runtime = create_local(layout, config)
    backend = runtime.local_backend("cluster up")
    backend.start_controller()
    for group in config.InstanceGroups:
        for _ in range(group.InstanceCount):
            backend.provision_node(group.InstanceGroupName)
    return runtime, False


def wait_ready(runtime: Runtime, timeout: float, on_tick: Callable[[dict[str, int]], None] | None = None) -> None:
    """Poll until no node is Joining; raise if that takes longer than ``timeout``."""
    counts: dict[str, int] = {}

    def ready() -> bool:
        nodes = [n for n in runtime.cluster.list_nodes() if n.state is not NodeState.RETIRED]
        counts.clear()
        for node in nodes:
            counts[node.state.value] = counts.get(node.state.value, 0) + 1
        if on_tick:
            on_tick(dict(counts))
        return bool(nodes) and not any(n.state in (NodeState.JOINING, NodeState.REBOOTING) for n in nodes)

    try:
        wait_until(ready, timeout, "nodes to finish joining")
    except WaitTimeout:
        raise BackendError(f"nodes still joining after {timeout:g} s: {counts}; see the agent logs under nodes/*/agent.log") from None


def down(layout: ClusterLayout) -> list[int]:
    """Stop every process of the cluster and free its memory tier. Returns pids that survived.

    Order matters. The cluster is marked Stopping first: that fences provisioning
    (the backend refuses to start a node, an agent started a moment before refuses
    to register), so a replacement the controller decided just before cannot come
    up after the sweep. Then every process goes, controller first. Shared memory is
    the one thing not kept for a post-mortem: it is RAM. Steps drained to a
    persistent tier stay there.
    """
    runtime = open_local(layout)
    runtime.cluster.set_cluster_status(ClusterStatus.STOPPING)
    left = runtime.local_backend("cluster down").stop_cluster()
    shutil.rmtree(shm.cluster_root(layout.root), ignore_errors=True)
    netns_launch.teardown(layout, runtime.config, [n.name for n in runtime.cluster.list_nodes()])
    if not left:
        runtime.cluster.set_cluster_status(ClusterStatus.DOWN)
    return left


def _wipe(layout: ClusterLayout) -> None:
    for name in ("state.db", "state.db-wal", "state.db-shm", credentials.CA_FILE, credentials.CERT_FILE, credentials.KEY_FILE):
        (layout.root / name).unlink(missing_ok=True)
    for folder in ("nodes", "logs", "checkpoints"):
        shutil.rmtree(layout.root / folder, ignore_errors=True)
