"""Derived job figures (steps lost, recovery, detection, goodput) from hand-built rows."""

from __future__ import annotations

from typing import Any

import pytest

from unbroken.controller.report import summarize
from unbroken.state.phases import JobPhase, WorkerPhase
from unbroken.state.records import Desired, Event, EventType, Job, Worker


def job(phase: JobPhase = JobPhase.SUCCEEDED, attempt: int = 1, **fields: Any) -> Job:
    defaults: dict[str, Any] = dict(created_at=0.0, started_at=1.0, ended_at=100.0)
    return Job(name="train", spec_json="{}", phase=phase, attempt=attempt, **{**defaults, **fields})


def worker(attempt: int, node: str, node_rank: int, **fields: Any) -> Worker:
    fields = {"phase": WorkerPhase.SUCCEEDED, **fields}
    return Worker(job="train", attempt=attempt, node=node, node_rank=node_rank, desired=Desired.RUN,
                  rdzv_endpoint="127.0.0.1:29500", **fields)


def event(ts: float, reason: str, kind: str = "job", name: str = "train") -> Event:
    return Event(ts=ts, object_kind=kind, object_name=name, type=EventType.NORMAL, reason=reason, message=reason)


# The timeline of a 2-node job with one restart (seconds from the job's creation):
#   t=1   JobScheduled, attempt 0 on node-1, node-2
#   t=10  attempt 0 reports step 1; ...; t=59 step 50 (1 s per step)
#   t=60  ChaosKillWorker on node-2
#   t=62  JobRestarting (the controller noticed)
#   t=64  JobScheduled, attempt 1 on node-1, node-3, restoring the checkpoint of step 40
#   t=70  attempt 1 reports step 41; ...; t=99 step 70 (1 s per step)
#   t=100 job Succeeded
ATTEMPT0 = [
    worker(0, "node-2", 1, created_at=1.0, first_step=1, first_progress_at=10.0, last_step=50, last_progress_at=59.0,
           phase=WorkerPhase.FAILED),
    worker(0, "node-1", 0, created_at=1.0, first_step=1, first_progress_at=10.5, last_step=49, last_progress_at=58.0,
           phase=WorkerPhase.STOPPED),
]
ATTEMPT1 = [
    worker(1, "node-1", 0, created_at=64.5, restored_step=40, first_step=41, first_progress_at=70.0,
           last_step=70, last_progress_at=99.0),
    worker(1, "node-3", 1, created_at=64.0, restored_step=40, first_step=41, first_progress_at=70.2,
           last_step=70, last_progress_at=98.9),
]
EVENTS = [
    event(0.5, "JobCreated"),
    event(1.0, "JobScheduled"),
    event(60.0, "ChaosKillWorker", kind="node", name="node-2"),
    event(62.0, "JobRestarting"),
    event(64.0, "JobScheduled"),
    event(100.0, "JobSucceeded"),
]


def test_two_attempts_figures():
    report = summarize(job(), ATTEMPT0 + ATTEMPT1, EVENTS, now=500.0)
    assert report.restarts == 1
    assert report.phase == "Succeeded"
    assert report.step == 70
    # last step of attempt 0 (50, the furthest of its workers) minus restored step of attempt 1 (40)
    assert report.steps_lost == 50 - 40
    # chaos at t=60 -> attempt 1's first step at t=70 (the earliest of its workers)
    assert report.recovery_seconds == [pytest.approx(70.0 - 60.0)]
    # chaos at t=60 -> JobRestarting at t=62
    assert report.detection_seconds == [pytest.approx(62.0 - 60.0)]
    [recovery] = report.recoveries
    assert (recovery.fault_at, recovery.detected_at, recovery.first_step_at) == (60.0, 62.0, 70.0)
    assert recovery.fault_at <= recovery.detected_at <= recovery.scheduled_at <= recovery.first_step_at
    # ended_at is used, not now
    assert report.wall_seconds == pytest.approx(100.0)


def test_goodput_hand_computed():
    # attempt 0: steps 1..50 over t=10..59 -> (59-10)/(50-1) = 1 s per step; kept 0..40 (the restore
    #            point of attempt 1) -> 40 steps * 1 s = 40 s of kept progress.
    # attempt 1: steps 41..70 over t=70..99 -> (99-70)/(70-41) = 1 s per step; from 40 to 70
    #            -> 30 steps * 1 s = 30 s.
    # goodput = (40 + 30) / wall (100 - 0) = 0.7
    report = summarize(job(), ATTEMPT0 + ATTEMPT1, EVENTS, now=500.0)
    assert 0.0 <= report.goodput <= 1.0
    assert report.goodput == pytest.approx(0.7)


def test_goodput_of_a_running_job_uses_now():
    # Same rows, job still Running (no ended_at): wall is now - created_at = 200 s -> 70 / 200.
    report = summarize(job(JobPhase.RUNNING, ended_at=None), ATTEMPT0 + ATTEMPT1, EVENTS, now=200.0)
    assert report.wall_seconds == pytest.approx(200.0)
    assert report.goodput == pytest.approx(70.0 / 200.0)


def test_recovery_without_chaos_counts_from_detection():
    events = [e for e in EVENTS if not e.reason.startswith("Chaos")]
    report = summarize(job(), ATTEMPT0 + ATTEMPT1, events, now=500.0)
    # JobRestarting at t=62 -> first step of attempt 1 at t=70
    assert report.recovery_seconds == [pytest.approx(70.0 - 62.0)]
    assert report.detection_seconds == [pytest.approx(0.0)]


def test_chaos_before_the_failed_attempt_was_scheduled_is_ignored():
    # A chaos event from before attempt 0 was placed is not this restart's fault.
    events = [event(0.2, "ChaosKillNode", kind="node", name="node-9")] + [
        e for e in EVENTS if not e.reason.startswith("Chaos")
    ]
    report = summarize(job(), ATTEMPT0 + ATTEMPT1, events, now=500.0)
    assert report.recovery_seconds == [pytest.approx(8.0)]


def test_attempt_summaries():
    report = summarize(job(), ATTEMPT0 + ATTEMPT1, EVENTS, now=500.0)
    first, second = report.attempts
    assert first.attempt == 0 and second.attempt == 1
    assert first.nodes == ["node-1", "node-2"]  # ordered by node_rank
    assert second.nodes == ["node-1", "node-3"]
    assert first.outcome == "restarted" and second.outcome == "Succeeded"
    assert second.scheduled_at == 64.0
    assert second.restored_step == 40
    assert first.fault_at is None and second.fault_at == 60.0 and second.detected_at == 62.0
    assert first.step_seconds == pytest.approx(1.0)
    d = report.to_dict()
    assert d["attempts"][1]["restored_step"] == 40 and d["steps_lost"] == 10


def test_restart_that_resumed_ahead_loses_no_steps():
    # A restored step beyond what the failed attempt reported (a peer's later checkpoint) is not negative loss.
    attempt1 = [worker(1, "node-1", 0, created_at=64.0, restored_step=55, first_step=56, first_progress_at=70.0,
                       last_step=70, last_progress_at=84.0)]
    report = summarize(job(), ATTEMPT0 + attempt1, EVENTS, now=500.0)
    assert report.steps_lost == 0
    assert 0.0 <= report.goodput <= 1.0


def test_job_without_progress_has_no_goodput():
    workers = [worker(0, "node-1", 0, created_at=1.0, phase=WorkerPhase.RUNNING)]
    report = summarize(job(JobPhase.RUNNING, attempt=0, ended_at=None), workers, [event(1.0, "JobScheduled")], now=30.0)
    assert report.step is None
    assert report.goodput is None
    assert report.steps_lost == 0
    assert report.recovery_seconds == [] and report.detection_seconds == []


def test_pending_job_without_workers():
    report = summarize(job(JobPhase.PENDING, attempt=0, ended_at=None), [], [], now=5.0)
    assert report.attempts == []
    assert report.goodput is None and report.step is None
    assert report.wall_seconds == pytest.approx(5.0)


def test_recovery_timeline_breaks_down_into_detect_reschedule_startup():
    from unbroken.controller.report import Recovery

    r = Recovery(attempt=1, fault_at=100.0, detected_at=101.5, scheduled_at=102.0, first_step_at=108.5)
    assert r.total_s == pytest.approx(8.5)
    assert r.describe() == "8.5 s (detect 1.5 + reschedule 0.5 + startup 6.5)"
