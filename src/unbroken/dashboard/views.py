"""What the dashboard shows, as plain data read through the runtime's seams (so it reads the
Kubernetes backend the same way once it exists): pure functions of a runtime and a clock."""

from __future__ import annotations

import re
from typing import Any

from unbroken.controller import jobs as job_ops
from unbroken.controller import report
from unbroken.controller import hang_timeout, stragglers
from unbroken.controller.fault_kinds import FaultKind, classify
from unbroken.runtime import Runtime
from unbroken.state.phases import NodeState
from unbroken.state.records import CheckpointTier, Event, Job, StepStatus

EVENTS_SHOWN = 200


def snapshot(runtime: Runtime, now: float) -> dict[str, Any]:
    """Everything the overview page shows, in one object (pushed to the browser as it changes)."""
    store, backend = runtime.cluster, runtime.backend
    running = {w.node: w.job for w in backend.active_workers()}
    nodes = [{
        "name": n.name, "group": n.group, "state": n.state.value, "health_status": n.state.health_status_label,
        "deep_health": n.deep_health.value, "fault_type": n.fault_type, "fault_reason": n.fault_reason,
        "heartbeat_age_s": None if n.heartbeat_at is None else round(now - n.heartbeat_at, 1), "job": running.get(n.name),
    } for n in store.list_nodes() if n.state is not NodeState.RETIRED]
    jobs = [job_row(runtime, job.name, now) for job in store.list_jobs()]
    checkpoints = [row for job in store.list_jobs() for row in checkpoint_rows(runtime, job.name, now)]
    events = [event_row(e) for e in store.list_events()[-EVENTS_SHOWN:]]
    cluster = store.cluster()
    return {"cluster": {"name": cluster.name, "status": cluster.status.value}, "nodes": nodes, "jobs": jobs,
            "checkpoints": checkpoints, "events": events}


def node_detail(runtime: Runtime, name: str, now: float) -> dict[str, Any]:
    """One node, retired ones included (a replaced node's page says what replaced it)."""
    n = runtime.cluster.get_node(name)
    running = next((w.job for w in runtime.backend.active_workers() if w.node == name), None)
    return {
        "name": n.name, "group": n.group, "state": n.state.value, "health_status": n.state.health_status_label,
        "deep_health": n.deep_health.value, "fault_type": n.fault_type, "fault_reason": n.fault_reason,
        "heartbeat_age_s": None if n.heartbeat_at is None else round(now - n.heartbeat_at, 1), "job": running,
        "address": n.address, "reboots": n.reboots, "replaced_by": n.replaced_by,
    }


def job_row(runtime: Runtime, name: str, now: float) -> dict[str, Any]:
    job = runtime.cluster.get_job(name)
    spec = job.spec()
    summary = report.summarize(job, runtime.backend.worker_history(name), [], now)
    current = runtime.backend.observe_attempt(name, job.attempt)
    return {
        "name": job.name, "phase": job.phase.value, "reason": job.reason, "restarts": job.attempt,
        "max_retry": spec.resilience.max_retry, "step": job_ops.current_step(current), "total_steps": _total_steps(spec.command),
        "goodput": None if summary.goodput is None else round(summary.goodput, 4), "nodes": list(job.nodes),
    }


def checkpoint_rows(runtime: Runtime, job: str, now: float) -> list[dict[str, Any]]:
    rows = runtime.catalog.list_checkpoint_steps(job)
    out = []
    for tier in (CheckpointTier.MEMORY, CheckpointTier.PERSISTENT):
        committed = [r for r in rows if r.tier is tier and r.status is StepStatus.COMMITTED]
        failed = [r for r in rows if r.tier is tier and r.status is StepStatus.FAILED]
        if not committed and not failed:
            continue
        newest = max(committed, key=lambda r: r.step) if committed else None
        out.append({
            "job": job, "tier": tier.value, "newest_step": newest.step if newest else None,
            "age_s": round(now - (newest.committed_at or newest.updated_at), 1) if newest else None,
            "failures": len(failed), "last_failure": max(failed, key=lambda r: r.updated_at).message if failed else None,
        })
    return out


def event_row(event: Event) -> dict[str, Any]:
    return {"id": event.id, "ts": event.ts, "kind": event.object_kind, "name": event.object_name, "type": event.type.value,
            "reason": event.reason, "message": event.message}


def timeline(runtime: Runtime, name: str, now: float) -> dict[str, Any]:
    """The job's step over wall time, with every fault, detection and resume marked and the steps
    each failure cost: the picture of what a failure cost."""
    job = runtime.cluster.get_job(name)
    events = runtime.cluster.list_events(object_kind="Job", object_name=name)
    summary = report.summarize(job, runtime.backend.worker_history(name), events, now)
    samples = [{"attempt": attempt, "t": ts, "step": step} for attempt, ts, step in runtime.backend.progress_history(name)]
    markers: list[dict[str, Any]] = []
    lost: list[dict[str, Any]] = []
    for index, attempt in enumerate(summary.attempts):
        if attempt.fault_at is not None:
            kind = classify(attempt.restart_reason)
            markers.append({"kind": "fault", "t": attempt.fault_at, "attempt": attempt.attempt, "label": _fault_label(events, attempt.fault_at, kind)})
        if attempt.detected_at is not None:
            markers.append({"kind": "detected", "t": attempt.detected_at, "attempt": attempt.attempt, "label": "restart decided"})
        if attempt.attempt > 0 and attempt.first_step_at is not None:
            markers.append({"kind": "resumed", "t": attempt.first_step_at, "attempt": attempt.attempt,
                            "label": f"resumed from step {attempt.restored_step or 0}"})
        previous = summary.attempts[index - 1] if index > 0 else None
        if previous is not None and previous.last_step is not None and attempt.fault_at is not None:
            restored = attempt.restored_step or 0
            if previous.last_step > restored:
                lost.append({"from_step": restored, "to_step": previous.last_step, "from_t": attempt.fault_at,
                             "to_t": attempt.first_step_at or now, "steps": previous.last_step - restored})
    return {"job": job_row(runtime, name, now), "history": history(events), "samples": samples, "markers": markers, "lost": lost,
            "steps_lost": summary.steps_lost, "recoveries": [r.total_s for r in summary.recoveries], "now": now,
            "created_at": job.created_at, **step_times(runtime, job)}


def step_times(runtime: Runtime, job: Job) -> dict[str, Any]:
    """The current attempt's step time and straggler score per node, and the hang timeout in force."""
    spec = job.spec()
    workers = [] if job.phase.is_terminal else runtime.backend.observe_attempt(job.name, job.attempt)
    scores = stragglers.scores(workers)
    rows = []
    for w in sorted(workers, key=lambda w: w.node_rank):
        score = scores.get(w.node)
        rows.append({"node": w.node, "median_step_s": None if w.step_timing is None else round(w.step_timing.median_s, 4),
                     "score": None if score is None else score.score, "rank": None if score is None else score.rank,
                     "section": None if score is None else score.section,
                     "slow": score is not None and score.score < spec.resilience.straggler_threshold})
    timeout = hang_timeout.in_force(spec, workers)
    return {"step_times": rows, "straggler_threshold": spec.resilience.straggler_threshold,
            "straggler_policy": spec.resilience.straggler_policy.value,
            "hang_timeout": {"seconds": timeout.seconds, "why": timeout.why}}


_PHASE_OF_EVENT = {"JobScheduled": "Running", "JobRestarting": "Restarting", "JobResumed": "Resumed",
                   "JobSucceeded": "Succeeded", "JobFailed": "Failed", "JobCancelled": "Cancelled"}


def history(events: list[Event]) -> list[dict[str, Any]]:
    """The job's phases in order, from its events: kept in the store, so a page opened late or a
    restart quicker than a push still shows Running → Restarting → Resumed."""
    return [{"t": e.ts, "phase": _PHASE_OF_EVENT[e.reason], "message": e.message}
            for e in events if e.reason in _PHASE_OF_EVENT]


def _fault_label(events: list[Event], at: float, kind: FaultKind) -> str:
    chaos = next((e for e in events if e.ts == at and e.reason.startswith(report.CHAOS_PREFIX)), None)
    return f"{chaos.reason}: {chaos.message}" if chaos else kind.value


def _total_steps(command: list[str]) -> int | None:
    """``--steps N`` in the job's command, for the progress bar (scripts that take another flag show no total)."""
    joined = " ".join(command)
    match = re.search(r"--steps[ =](\d+)", joined)
    return int(match.group(1)) if match else None
