"""The local backend's own parts with real processes and a real store, no running cluster:
the provisioning fence, an agent refusing a cluster that is going down, ranks found in a
process tree, idempotent launches."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from unbroken.plumbing import procs
from unbroken.backends.local.backend import LocalBackend
from unbroken.config.cluster import ClusterConfig
from unbroken.errors import BackendError
from unbroken.plumbing.layout import ClusterLayout
from unbroken.runtime import Runtime, create_local
from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState, WorkerPhase
from unbroken.state.records import ClusterStatus, Desired, Job, Node, Worker
from unbroken.plumbing.waiting import wait_until


@pytest.fixture
def runtime(tmp_path: Path) -> Runtime:
    return create_local(ClusterLayout.at(tmp_path / "cluster"), ClusterConfig.with_nodes(1))


def backend_of(runtime: Runtime) -> LocalBackend:
    return runtime.local_backend("test")


def test_no_node_is_provisioned_once_the_cluster_is_going_down(runtime: Runtime) -> None:
    runtime.cluster.set_cluster_status(ClusterStatus.STOPPING)
    with pytest.raises(BackendError, match="is Stopping: not starting nodes"):
        backend_of(runtime).provision_node("workers")
    assert runtime.cluster.list_nodes() == []
    assert procs.cluster_processes(runtime.layout.root) == []


def test_an_agent_started_as_the_cluster_goes_down_exits_without_registering(runtime: Runtime) -> None:
    runtime.cluster.add_node(Node(name="node-1", group="workers", instance_type="cpu-dev", state=NodeState.JOINING,
                                  deep_health=DeepHealthStatus.IN_PROGRESS))
    runtime.cluster.set_cluster_status(ClusterStatus.STOPPING)
    result = subprocess.run([sys.executable, "-m", "unbroken.agent", "--dir", str(runtime.layout.root), "--node", "node-1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "cluster is not up; agent exits" in result.stdout
    node = runtime.cluster.get_node("node-1")
    assert node.agent_pid is None and node.heartbeat_at is None, "it did not register"


TREE = textwrap.dedent("""
    import os, subprocess, sys, time
    # plays torchrun: two ranks, and rank 1 starts a data-loader worker that inherits its RANK
    loader = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    for rank, code in ((0, "import time; time.sleep(60)"), (1, loader)):
        subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "RANK": str(rank + 2), "LOCAL_RANK": str(rank)})
    time.sleep(60)
""")


def test_ranks_are_found_in_a_workers_process_tree_whatever_the_script(runtime: Runtime, tmp_path: Path) -> None:
    parent = subprocess.Popen([sys.executable, "-c", TREE])
    try:
        worker = Worker(job="j", attempt=0, node="node-1", node_rank=1, desired=Desired.RUN, phase=WorkerPhase.RUNNING,
                        rdzv_endpoint="x:1", pid=parent.pid)
        wait_until(lambda: len(procs.tree(parent.pid)) >= 4, 30, "the fake torchrun's tree")
        found = backend_of(runtime).rank_processes(worker)
        assert [(r.rank, r.local_rank) for r in found] == [(2, 0), (3, 1)]
        children = {p.pid for p in procs.tree(parent.pid)[1:] if p.ppid() == parent.pid}
        assert {r.pid for r in found} == children, "the ranks themselves, not the data-loader worker"
    finally:
        procs.kill_now(procs.tree(parent.pid))
        parent.wait()


def test_launching_an_attempt_twice_launches_it_once(runtime: Runtime) -> None:
    runtime.cluster.add_job(Job(name="j", spec_json="{}", phase=JobPhase.RUNNING, created_at=time.time()))
    nodes = [Node(name=f"node-{i}", group="workers", instance_type="cpu-dev", state=NodeState.SCHEDULABLE,
                  deep_health=DeepHealthStatus.PASSED) for i in (1, 2)]
    job = runtime.cluster.get_job("j")
    first = runtime.backend.launch_attempt(job, 0, nodes)
    again = runtime.backend.launch_attempt(job, 0, nodes)
    assert first == again and first.startswith("127.0.0.1:")
    workers = runtime.backend.observe_attempt("j", 0)
    assert [(w.node, w.node_rank) for w in workers] == [("node-1", 0), ("node-2", 1)]
    runtime.backend.stop_attempt("j", 0)
    runtime.backend.stop_attempt("j", 0)
    assert all(w.desired is Desired.STOP for w in runtime.backend.observe_attempt("j", 0))
