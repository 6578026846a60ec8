"""Ranks that said they finished (``ctx.finished()``) are exiting, not hung.

Seen in CI under load: a job's ranks trained to their last step and said so, their exit took longer than the
job's automatic hang timeout (3 s), and the controller, timing the worker's oldest report, restarted a finished
job ("hang: ... last step 400"). The agent's book, the store, the heartbeat and the controller are real here; the
ranks' messages are the datagrams a rank sends.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from unbroken.agent.progress import ProgressBook
from unbroken.config.cluster import ClusterConfig
from unbroken.config.job import JobSpec
from unbroken.controller import jobs
from unbroken.controller.job_reconciler import JobReconciler
from unbroken.kubernetes.backend.heartbeats import progress_from_json, progress_to_json
from unbroken.plumbing.layout import ClusterLayout
from unbroken.rank.channel import MessageKind, RankMessage
from unbroken.runtime import Runtime, create_local
from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState, WorkerPhase
from unbroken.state.records import Node, RankInfo, WorkerProgress
from unbroken.state.updates import WorkerUpdate


def message(kind: MessageKind, rank: int, ts: float, step: int | None = None) -> RankMessage:
    return RankMessage(kind=kind, job="j", attempt=0, rank=rank, local_rank=rank, pid=100 + rank, ts=ts, step=step)


def test_a_finished_ranks_silence_is_not_its_workers_and_the_worker_is_finished_once_every_rank_is() -> None:
    book = ProgressBook()
    book.apply([message(MessageKind.PROGRESS, 0, 100.0, 400), message(MessageKind.FINISHED, 0, 100.5),
                message(MessageKind.PROGRESS, 1, 104.0, 400)])
    [report] = book.take_dirty()
    assert report.last_progress_at == 104.0, "rank 0 finished: its last report is not the worker's oldest"
    assert report.last_step == 400 and report.finished_at is None, report

    book.apply([message(MessageKind.FINISHED, 1, 105.0)])
    [report] = book.take_dirty()
    assert report.finished_at == 105.0
    assert progress_from_json(progress_to_json(report)).finished_at == 105.0


def test_a_report_from_a_newer_agent_with_fields_this_operator_does_not_know_is_read() -> None:
    entry = progress_to_json(WorkerProgress(job="j", attempt=0, last_step=5, last_progress_at=1.0))
    read = progress_from_json({**entry, "a_field_of_the_future": [1, 2]})
    assert (read.job, read.last_step, read.last_progress_at) == ("j", 5, 1.0)


@pytest.fixture
def runtime(tmp_path: Path) -> Runtime:
    return create_local(ClusterLayout.at(tmp_path / "cluster"), ClusterConfig.with_nodes(1))


@pytest.mark.parametrize("finished", [True, False])
def test_a_worker_whose_ranks_all_finished_is_not_restarted_for_a_hang_however_long_their_exit(runtime: Runtime,
                                                                                                finished: bool) -> None:
    now = time.time()
    runtime.cluster.add_node(Node(name="node-1", group="workers", instance_type="cpu-dev", state=NodeState.SCHEDULABLE,
                                  deep_health=DeepHealthStatus.PASSED, state_changed_at=now))
    runtime.cluster.renew_lease("node-1", at=now)
    jobs.submit(runtime.cluster, JobSpec.model_validate({
        "name": "j", "nodes": 1, "procs_per_node": 2, "command": ["-m", "x"],
        "resilience": {"auto_resume": True, "max_retry": 3, "hang_timeout": 3}}))
    passes = JobReconciler(runtime.cluster, runtime.backend, silent_after=60.0, catalog=runtime.catalog)
    passes.reconcile_all(now)
    assert runtime.worker_table is not None
    for w in runtime.backend.observe_attempt("j", 0):
        runtime.worker_table.update_worker(w.id, WorkerUpdate(phase=WorkerPhase.RUNNING))
    # the last step 10 s ago, both ranks finished 9 s ago, and still not exited; the agent beats on
    runtime.cluster.renew_lease("node-1", at=now + 10, progress=[WorkerProgress(
        job="j", attempt=0, ranks=(RankInfo(rank=0, local_rank=0, pid=100), RankInfo(rank=1, local_rank=1, pid=101)),
        first_step=1, first_progress_at=now - 60, last_step=400, last_progress_at=now,
        finished_at=now + 1 if finished else None)])
    passes.reconcile_all(now + 10)
    job = runtime.cluster.get_job("j")
    if finished:
        assert job.phase is JobPhase.RUNNING and job.attempt == 0, job.reason
    else:  # the same silence from ranks that did not say they finished is a hang, as before
        assert job.phase is JobPhase.RESTARTING and "hang" in (job.reason or ""), job.reason
