"""The job reconciler against a real SQLite store (no processes): one pass, several jobs."""

from __future__ import annotations

import time
from pathlib import Path

from unbroken import jobs
from unbroken.config.job import JobSpec
from unbroken.controller.job_reconciler import JobReconciler
from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState
from unbroken.state.records import Node
from unbroken.state.sqlite import SqliteStore


def test_two_jobs_in_one_pass_never_get_the_same_nodes(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db", create=True)
    now = time.time()
    for name in ("node-1", "node-2", "node-3"):
        store.add_node(Node(name=name, group="g", instance_type="cpu-dev", state=NodeState.SCHEDULABLE,
                            deep_health=DeepHealthStatus.PASSED, heartbeat_at=now, state_changed_at=now))
    for name in ("first", "second"):
        jobs.submit(store, JobSpec.model_validate({"name": name, "nodes": 2, "command": ["-m", "x"]}))

    JobReconciler(store, silent_after=1.5).reconcile_all(now)

    first, second = store.get_job("first"), store.get_job("second")
    assert first.phase is JobPhase.RUNNING
    assert second.phase is JobPhase.PENDING and "needs 2" in (second.reason or "") and "1 available" in second.reason
    assert sorted(w.node for w in store.list_workers(job="first")) == ["node-1", "node-2"]
    assert store.list_workers(job="second") == []


def test_resumed_event_is_written_once_per_attempt(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db", create=True)
    now = time.time()
    for name in ("node-1", "node-2"):
        store.add_node(Node(name=name, group="g", instance_type="cpu-dev", state=NodeState.SCHEDULABLE,
                            deep_health=DeepHealthStatus.PASSED, heartbeat_at=now, state_changed_at=now))
    jobs.submit(store, JobSpec.model_validate({"name": "r", "nodes": 1, "command": ["-m", "x"]}))
    reconciler = JobReconciler(store, silent_after=1.5)
    reconciler.reconcile_all(now)
    [w0] = store.list_workers(job="r")
    store.update_worker(w0.id, phase=w0.phase.RUNNING, last_step=30, first_step=1, first_progress_at=now, last_progress_at=now)
    store.update_worker(w0.id, phase=w0.phase.FAILED, exit_code=-9, message="rank 0 exited with signal 9")
    store.update_job("r", spec_json=JobSpec.model_validate(
        {"name": "r", "nodes": 1, "command": ["-m", "x"], "resilience": {"auto_resume": True}}).model_dump_json())
    reconciler.reconcile_all(now)  # -> Restarting
    reconciler.reconcile_all(now)  # -> attempt 1 placed
    [w1] = store.list_workers(job="r", attempt=1)
    store.update_worker(w1.id, phase=w1.phase.RUNNING, restored_step=20, first_step=21, first_progress_at=now + 1,
                        last_step=21, last_progress_at=now + 1)
    for _ in range(3):
        reconciler.reconcile_all(now + 1)
    resumed = store.list_events(object_kind="Job", object_name="r", reason="JobResumed")
    assert [e.message for e in resumed] == ["attempt 1 resumed from step 20; 10 steps lost"]
