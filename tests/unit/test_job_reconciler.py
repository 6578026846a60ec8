"""The job reconciler against a real local runtime (SQLite store, local backend) with no processes:
what one pass decides and writes, and that a controller killed between deciding and doing loses nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from unbroken.controller import jobs
from unbroken.config.cluster import ClusterConfig
from unbroken.config.job import JobSpec
from unbroken.controller.job_reconciler import JobReconciler
from unbroken.plumbing.layout import ClusterLayout
from unbroken.runtime import Runtime, create_local
from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState, WorkerPhase
from unbroken.state.records import Desired, Node, RankTiming, StepTiming, WorkerProgress
from unbroken.state.updates import JobUpdate, WorkerUpdate


@pytest.fixture
def runtime(tmp_path: Path) -> Runtime:
    return create_local(ClusterLayout.at(tmp_path / "cluster"), ClusterConfig.with_nodes(3))


def add_nodes(runtime: Runtime, *names: str, now: float) -> None:
    for name in names:
        runtime.cluster.add_node(Node(name=name, group="workers", instance_type="cpu-dev", state=NodeState.SCHEDULABLE,
                                      deep_health=DeepHealthStatus.PASSED, state_changed_at=now))
        runtime.cluster.renew_lease(name, at=now)


def reconciler(runtime: Runtime) -> JobReconciler:
    return JobReconciler(runtime.cluster, runtime.backend, silent_after=2.0)


def submit(runtime: Runtime, name: str, nodes: int, **resilience: object) -> None:
    jobs.submit(runtime.cluster, JobSpec.model_validate({"name": name, "nodes": nodes, "command": ["-m", "x"],
                                                         "resilience": resilience}))


def test_two_jobs_in_one_pass_never_get_the_same_nodes(runtime: Runtime) -> None:
    now = time.time()
    add_nodes(runtime, "node-1", "node-2", "node-3", now=now)
    submit(runtime, "first", 2)
    submit(runtime, "second", 2)

    reconciler(runtime).reconcile_all(now)

    first, second = runtime.cluster.get_job("first"), runtime.cluster.get_job("second")
    assert first.phase is JobPhase.RUNNING and first.nodes == ("node-1", "node-2")
    assert second.phase is JobPhase.PENDING and "needs 2" in (second.reason or "") and "1 available" in second.reason
    assert sorted(w.node for w in runtime.backend.observe_attempt("first", 0)) == ["node-1", "node-2"]
    assert runtime.backend.observe_attempt("second", 0) == []
    endpoints = {w.rdzv_endpoint for w in runtime.backend.observe_attempt("first", 0)}
    assert len(endpoints) == 1, "the backend gave the attempt one rendezvous endpoint"


def test_resumed_event_is_written_once_per_attempt(runtime: Runtime) -> None:
    table = runtime.worker_table
    assert table is not None
    now = time.time()
    add_nodes(runtime, "node-1", "node-2", now=now)
    submit(runtime, "r", 1, auto_resume=True)
    passes = reconciler(runtime)
    passes.reconcile_all(now)
    [w0] = runtime.backend.observe_attempt("r", 0)
    table.update_worker(w0.id, WorkerUpdate(phase=WorkerPhase.RUNNING, last_step=30, first_step=1, first_progress_at=now,
                                            last_progress_at=now))
    table.update_worker(w0.id, WorkerUpdate(phase=WorkerPhase.FAILED, exit_code=-9, message="rank 0 exited with signal 9"))
    passes.reconcile_all(now)  # -> Restarting
    passes.reconcile_all(now)  # -> attempt 1 placed
    [w1] = runtime.backend.observe_attempt("r", 1)
    table.update_worker(w1.id, WorkerUpdate(phase=WorkerPhase.RUNNING, restored_step=20, first_step=21, first_progress_at=now + 1,
                                            last_step=21, last_progress_at=now + 1))
    for _ in range(3):
        passes.reconcile_all(now + 1)
    resumed = runtime.cluster.list_events(object_kind="Job", object_name="r", reason="JobResumed")
    assert [e.message for e in resumed] == ["attempt 1 resumed from step 20; 10 steps lost"]


def test_a_placement_whose_launch_never_happened_is_launched_on_the_next_pass(runtime: Runtime) -> None:
    """The controller wrote "attempt 0 on node-2" and died before the backend launched it."""
    now = time.time()
    add_nodes(runtime, "node-1", "node-2", now=now)
    submit(runtime, "lost", 1)
    runtime.cluster.update_job("lost", JobUpdate(phase=JobPhase.RUNNING, attempt=0, nodes=("node-2",), started_at=now))
    assert runtime.backend.observe_attempt("lost", 0) == []

    reconciler(runtime).reconcile_all(now)

    [worker] = runtime.backend.observe_attempt("lost", 0)
    assert (worker.node, worker.desired, worker.phase) == ("node-2", Desired.RUN, WorkerPhase.PENDING)
    assert runtime.cluster.get_job("lost").phase is JobPhase.RUNNING


def test_a_stop_decided_but_never_applied_is_applied_on_the_next_pass(runtime: Runtime) -> None:
    """The controller wrote "Restarting" (or "Failed") and died before asking the backend to stop the workers."""
    now = time.time()
    add_nodes(runtime, "node-1", "node-2", now=now)
    submit(runtime, "failing", 1, auto_resume=False)
    submit(runtime, "restarting", 1, auto_resume=True)
    passes = reconciler(runtime)
    passes.reconcile_all(now)
    runtime.cluster.update_job("failing", JobUpdate(phase=JobPhase.FAILED, reason="decided", ended_at=now))
    runtime.cluster.update_job("restarting", JobUpdate(phase=JobPhase.RESTARTING, reason="decided"))

    passes.reconcile_all(now)

    for name in ("failing", "restarting"):
        [worker] = runtime.backend.observe_attempt(name, 0)
        assert worker.desired is Desired.STOP, f"{name}'s worker was not asked to stop"
    assert runtime.cluster.get_job("restarting").phase is JobPhase.RESTARTING, "it waits for its worker to stop"


def test_a_restart_decided_on_a_lost_peer_names_its_cause_once_that_reports(runtime: Runtime) -> None:
    table = runtime.worker_table
    assert table is not None
    now = time.time()
    add_nodes(runtime, "node-1", "node-2", now=now)
    submit(runtime, "c", 2, auto_resume=True)
    passes = reconciler(runtime)
    passes.reconcile_all(now)
    first, second = runtime.backend.observe_attempt("c", 0)
    for w in (first, second):
        table.update_worker(w.id, WorkerUpdate(phase=WorkerPhase.RUNNING))
    table.update_worker(first.id, WorkerUpdate(
        phase=WorkerPhase.FAILED, exit_code=1, ended_at=now,
        message="rank 0 (local rank 0) exited with code 1: RuntimeError: Connection closed by peer [127.0.0.1]:4000"))
    passes.reconcile_all(now)  # the symptom reported first: restart at once
    assert runtime.cluster.get_job("c").phase is JobPhase.RESTARTING
    table.update_worker(second.id, WorkerUpdate(phase=WorkerPhase.FAILED, exit_code=-9, ended_at=now + 0.2,
                                                message="rank 3 (local rank 1) exited with signal 9 (SIGKILL)"))
    for _ in range(3):
        passes.reconcile_all(now + 0.3)
    causes = runtime.cluster.list_events(object_kind="Job", object_name="c", reason="JobRestartCause")
    assert [e.message for e in causes] == [
        "attempt 0: the failure behind restart 1: worker on node-2: rank 3 (local rank 1) exited with signal 9 (SIGKILL)"]


def run_with_a_slow_node(runtime: Runtime, policy: str, *, until: str | None = None) -> float:
    """A 2-node job on node-1 and node-2 (node-3 spare) whose node-2 reports twice node-1's work per step,
    through the store as its agent would, over enough passes for the straggler rule (or until the pass
    that writes an ``until`` Event); returns the last pass's time."""
    table = runtime.worker_table
    assert table is not None
    now = time.time()
    add_nodes(runtime, "node-1", "node-2", "node-3", now=now)
    submit(runtime, "slow", 2, auto_resume=True, straggler_policy=policy, straggler_restart_cost=1)
    passes = reconciler(runtime)
    passes.reconcile_all(now)
    for w in runtime.backend.observe_attempt("slow", 0):
        table.update_worker(w.id, WorkerUpdate(phase=WorkerPhase.RUNNING))
    for i, step in enumerate((100, 110, 120, 130), start=1):
        at = now + i
        for node, work in (("node-1", 0.1), ("node-2", 0.2), ("node-3", None)):
            progress = [] if work is None else [WorkerProgress(
                job="slow", attempt=0, first_step=1, first_progress_at=now - 100, last_step=step, last_progress_at=at,
                step_timing=StepTiming(steps=30, median_s=0.25, longest_s=0.3, work_s=work, sections={"compute": work},
                                       slowest=RankTiming(int(node[-1]), work, {"compute": work})))]
            runtime.cluster.renew_lease(node, at=at, progress=progress)
        passes.reconcile_all(at)
        if until is not None and job_events(runtime, until):
            return at
    return now + 4


def job_events(runtime: Runtime, reason: str) -> list[str]:
    return [e.message for e in runtime.cluster.list_events(object_kind="Job", object_name="slow", reason=reason)]


@pytest.mark.parametrize("policy, reason, opening", [
    ("report", "StragglerDetected", "node node-2 is a straggler: rank 2 scores 0.5, slowest section 'compute' at 0.5"),
    ("shadow", "StragglerReplaceShadow", "would take out node node-2 now: straggler in job slow: rank 2 scores 0.5"),
])
def test_report_and_shadow_say_so_once_and_leave_the_node_be(runtime: Runtime, policy: str, reason: str, opening: str) -> None:
    run_with_a_slow_node(runtime, policy)
    [message] = job_events(runtime, reason)
    assert message.startswith(opening), message
    assert f"policy {policy}" in job_events(runtime, "StragglerDetected")[0]
    if policy == "shadow":
        assert "spare node-3 free" in message
    assert runtime.cluster.get_node("node-2").state is NodeState.SCHEDULABLE
    assert runtime.cluster.get_job("slow").phase is JobPhase.RUNNING


def test_replace_takes_the_straggler_out_and_restarts_the_job_in_the_same_pass_naming_it(runtime: Runtime) -> None:
    run_with_a_slow_node(runtime, "replace", until="StragglerReplaced")
    node = runtime.cluster.get_node("node-2")
    assert (node.state, node.fault_type) == (NodeState.PENDING_REPLACEMENT, "Straggler")
    [replaced] = job_events(runtime, "StragglerReplaced")
    assert "node node-2 taken out" in replaced and "spare node-3 free" in replaced
    job = runtime.cluster.get_job("slow")
    assert job.phase is JobPhase.RESTARTING
    assert (job.reason or "").startswith("node node-2 is UnschedulablePendingReplacement: straggler in job slow"), job.reason
