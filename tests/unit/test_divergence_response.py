"""The cluster's answer to replicas that diverged, against a real local runtime (SQLite store and catalog, local
backend, no processes): the restart's reason, the untrusted catalog rows, the suspect nodes; and the pieces it
stands on: the agent's book, the store's column, the Kubernetes heartbeat, the planner, the restore catalog, the
file tier's quarantine and the known-answer check."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from unbroken.agent.progress import ProgressBook
from unbroken.checkpoint.format.restore_catalog import CatalogStep, RestoreCatalog
from unbroken.checkpoint.node import plan
from unbroken.checkpoint.rank.file import FileCheckpointer
from unbroken.config.cluster import ClusterConfig
from unbroken.config.job import JobSpec
from unbroken.controller import jobs
from unbroken.controller.fault_kinds import FaultKind, classify
from unbroken.controller.job_reconciler import JobReconciler
from unbroken.health import faults, join
from unbroken.health.checks import known_answer
from unbroken.health.context import CheckContext
from unbroken.health.result import CheckResult, FaultAction, Status, Suite
from unbroken.kubernetes.backend.heartbeats import progress_from_json, progress_to_json
from unbroken.plumbing.layout import ClusterLayout
from unbroken.rank.channel import MessageKind, RankMessage
from unbroken.runtime import Runtime, create_local
from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState, WorkerPhase
from unbroken.state.records import (CheckpointStep, CheckpointTier, Divergence, Node, RankInfo, StepStatus, WorkerProgress)
from unbroken.state.updates import WorkerUpdate

MEMORY, PERSISTENT = CheckpointTier.MEMORY, CheckpointTier.PERSISTENT


@pytest.fixture
def runtime(tmp_path: Path) -> Runtime:
    return create_local(ClusterLayout.at(tmp_path / "cluster"), ClusterConfig.with_nodes(3))


def row(step: int, tier: CheckpointTier, attempt: int = 0, status: StepStatus = StepStatus.COMMITTED) -> CheckpointStep:
    return CheckpointStep(job="j", step=step, tier=tier, attempt=attempt, world_size=4, status=status, size=8,
                          updated_at=1.0, committed_at=1.0)


def diverged_job(runtime: Runtime, *, majority: bool) -> JobReconciler:
    """A 2-node job of 2 ranks each (ranks 2 and 3 on node-2), checkpoints at 10-50 in memory and 20, 40 in the
    persistent tier, whose node-2 worker reports a divergence at step 50 (agreed 30)."""
    now = time.time()
    for name in ("node-1", "node-2", "node-3"):
        runtime.cluster.add_node(Node(name=name, group="workers", instance_type="cpu-dev", state=NodeState.SCHEDULABLE,
                                      deep_health=DeepHealthStatus.PASSED, state_changed_at=now))
        runtime.cluster.renew_lease(name, at=now)
    jobs.submit(runtime.cluster, JobSpec.model_validate({"name": "j", "nodes": 2, "command": ["-m", "x"],
                                                         "resilience": {"auto_resume": True, "max_retry": 3}}))
    passes = JobReconciler(runtime.cluster, runtime.backend, silent_after=2.0, catalog=runtime.catalog)
    passes.reconcile_all(now)
    for step in (10, 20, 30, 40, 50):
        runtime.catalog.put_checkpoint_step(row(step, MEMORY))
    for step in (20, 40):
        runtime.catalog.put_checkpoint_step(row(step, PERSISTENT))
    table = runtime.worker_table
    assert table is not None
    for w in runtime.backend.observe_attempt("j", 0):
        table.update_worker(w.id, WorkerUpdate(phase=WorkerPhase.RUNNING))
    suspects = (3,) if majority else (0, 1, 2, 3)
    ranks = {"node-1": (0, 1), "node-2": (2, 3)}
    for node, owned in ranks.items():
        runtime.cluster.renew_lease(node, at=now + 1, progress=[WorkerProgress(
            job="j", attempt=0, ranks=tuple(RankInfo(rank=r, local_rank=i, pid=100 + r) for i, r in enumerate(owned)),
            first_step=1, first_progress_at=now, last_step=50, last_progress_at=now + 1,
            divergence=Divergence(step=50, agreed_step=30, suspects=suspects, majority=majority, tensor="model.0.weight"))])
    passes.reconcile_all(now + 1)
    return passes


def job_event(runtime: Runtime, reason: str) -> list[str]:
    return [e.message for e in runtime.cluster.list_events(object_kind="Job", object_name="j", reason=reason)]


def test_an_outvoted_rank_restarts_the_job_marks_later_steps_untrusted_and_takes_its_node_out(runtime: Runtime) -> None:
    diverged_job(runtime, majority=True)
    job = runtime.cluster.get_job("j")
    assert job.phase is JobPhase.RESTARTING
    assert job.reason == ("silent data corruption: replicas disagree at step 50 in model.0.weight: rank 3 on node-2 outvoted "
                          "by its replicas; last agreed step 30, later checkpoints untrusted; restart 1 of 3")
    assert classify(job.reason) is FaultKind.SILENT_DATA_CORRUPTION
    statuses = {(r.step, r.tier): r.status for r in runtime.catalog.list_checkpoint_steps("j")}
    assert statuses == {(10, MEMORY): StepStatus.COMMITTED, (20, MEMORY): StepStatus.COMMITTED, (30, MEMORY): StepStatus.COMMITTED,
                        (40, MEMORY): StepStatus.UNTRUSTED, (50, MEMORY): StepStatus.UNTRUSTED,
                        (20, PERSISTENT): StepStatus.COMMITTED, (40, PERSISTENT): StepStatus.UNTRUSTED}
    node = runtime.cluster.get_node("node-2")
    assert (node.state, node.fault_type) == (NodeState.PENDING_REPLACEMENT, "SilentDataCorruption")
    assert runtime.cluster.get_node("node-1").state is NodeState.SCHEDULABLE
    [said] = job_event(runtime, "SilentDataCorruption")
    assert said.endswith("checkpoint steps 40, 50 marked untrusted; node node-2 taken out (SilentDataCorruption)"), said


def test_with_no_majority_both_nodes_are_cordoned_for_their_known_answer_check(runtime: Runtime) -> None:
    diverged_job(runtime, majority=False)
    for name in ("node-1", "node-2"):
        node = runtime.cluster.get_node(name)
        assert (node.state, node.fault_type) == (NodeState.UNSCHEDULABLE, faults.SDC_SUSPECT)
    [said] = job_event(runtime, "SilentDataCorruption")
    assert "no majority among ranks 0, 1, 2, 3 on node-1, node-2: the known-answer check decides" in said
    assert "node node-1 cordoned until its known-answer check; node node-2 cordoned until its known-answer check" in said


def test_a_commit_that_raced_the_first_mark_is_marked_on_a_later_pass_while_restarting(runtime: Runtime) -> None:
    passes = diverged_job(runtime, majority=True)
    runtime.catalog.put_checkpoint_step(row(60, MEMORY))  # an agent committed it after the controller's first mark
    passes.reconcile_all(time.time() + 2)
    assert {r.step: r.status for r in runtime.catalog.list_checkpoint_steps("j", tier=MEMORY)}[60] is StepStatus.UNTRUSTED
    assert job_event(runtime, "CheckpointsUntrusted") == ["steps 60 marked untrusted (committed after the first mark)"]
    assert len(job_event(runtime, "SilentDataCorruption")) == 1, "the suspects are taken out once"


def test_the_agent_book_store_and_heartbeat_carry_the_divergence(runtime: Runtime) -> None:
    book = ProgressBook()
    book.apply([RankMessage(kind=MessageKind.DIVERGED, job="j", attempt=2, rank=5, local_rank=1, pid=9, ts=1.0, step=80,
                            metrics={"agreed_step": 60.0, "majority": 1.0, "suspect:7": 1.0, "suspect:x": 1.0},
                            detail="optimizer.state.0.exp_avg")])
    [report] = book.take_dirty()
    expected = Divergence(step=80, agreed_step=60, suspects=(7,), majority=True, tensor="optimizer.state.0.exp_avg")
    assert report.divergence == expected
    assert progress_from_json(progress_to_json(report)).divergence == expected
    diverged_job(runtime, majority=True)
    stored = [w.divergence for w in runtime.backend.observe_attempt("j", 0) if w.divergence is not None]
    assert stored and stored[0].suspects == (3,) and stored[0].agreed_step == 30


def test_the_planner_commits_a_new_attempts_step_past_untrusted_rows_and_keeps_the_persistent_mark() -> None:
    rows = [row(40, MEMORY, status=StepStatus.UNTRUSTED), row(30, MEMORY), row(40, PERSISTENT, status=StepStatus.UNTRUSTED)]
    assert [r.step for r in plan.committed_steps(rows, MEMORY)] == [30]
    assert plan.committed_steps(rows, PERSISTENT) == []


def test_the_restore_catalog_never_offers_an_untrusted_persistent_step_but_does_a_new_attempts_memory_step() -> None:
    catalog = RestoreCatalog(job="j", memory=(CatalogStep(step=40, attempt=1, world_size=4),), persistent=(40, 30, 20),
                             untrusted=(40, 30))
    assert catalog.candidates() == [40, 20]


def test_the_file_tier_quarantines_what_it_saved_after_the_agreed_step(tmp_path: Path) -> None:
    ck = FileCheckpointer(tmp_path, rank=0, world_size=1, keep=5)
    for step in (10, 20, 30):
        ck.save(step, {"w": torch.full((2,), float(step))})
    ck.distrust_after(10, "replicas disagree at step 30")
    ck.save(20, {"w": torch.full((2,), 21.0)})  # the resumed run saves step 20 again
    ck.distrust_after(10, "a second time")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-000000010", "untrusted-step-000000020", "untrusted-step-000000020.1", "untrusted-step-000000030"]
    assert (tmp_path / "untrusted-step-000000030" / "UNTRUSTED").read_text() == "replicas disagree at step 30\n"
    restored = FileCheckpointer(tmp_path, rank=0, world_size=1).restore()
    assert restored is not None and restored.step == 10


def ctx_for(tmp_path: Path) -> CheckContext:
    cluster = ClusterConfig.with_nodes(1)
    return CheckContext(node="node-1", instance_type="cpu-dev", profile=cluster.profile("cpu-dev"), settings=cluster.Health,
                        node_dir=tmp_path, cluster_dir=tmp_path, params={"known_answer_n": 256})


def test_the_known_answer_check_passes_exactly_and_fails_a_node_that_computes_one_element_wrong(tmp_path: Path) -> None:
    healthy = known_answer.known_answer(ctx_for(tmp_path))
    assert healthy.status is Status.PASS and "exact results on 1 device(s)" in healthy.message
    (tmp_path / known_answer.FAULT_FILE).touch()
    wrong = known_answer.known_answer(ctx_for(tmp_path))
    assert wrong.status is Status.FAIL and wrong.reason == "SilentDataCorruption" and wrong.action is FaultAction.REPLACE
    assert "cpu float32: 1 element(s) differ" in wrong.message and "silent data corruption" in wrong.message
    bad = known_answer.known_answer(CheckContext(**{**ctx_for(tmp_path).__dict__, "params": {"known_answer_n": 9000}}))
    assert bad.status is Status.FAIL and bad.reason == "BadConfig" and "2 to 4096" in bad.message


def test_every_case_is_exact_in_its_dtype_on_this_machine() -> None:
    for case in known_answer.CASES:
        assert known_answer.on_device(torch, "cpu", 512, case) is None, case


def test_a_join_failed_on_the_known_answer_is_named_silent_data_corruption() -> None:
    results = [CheckResult("stress.matmul", Suite.INSTANCE_STRESS, Status.PASS, "ok", action=FaultAction.NONE, node="n"),
               CheckResult("stress.known_answer", Suite.INSTANCE_STRESS, Status.FAIL, "wrong results", "SilentDataCorruption",
                           node="n")]
    verdict = join.judge("n", results)
    assert not verdict.passed and verdict.fault_type == "SilentDataCorruption"
