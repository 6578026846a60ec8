"""Job-level operations shared by the CLI, the demo and the benchmarks."""

from __future__ import annotations

import time

from unbroken.config.job import JobSpec
from unbroken.state.phases import JobPhase
from unbroken.state.records import Job, Worker
from unbroken.state.store import ClusterStore


def submit(store: ClusterStore, spec: JobSpec, *, note: str = "") -> Job:
    """Record ``spec`` as a Pending job, then its JobCreated event.

    Raises ConflictError if the name is taken; then nothing is written.
    """
    now = time.time()
    job = Job(name=spec.name, spec_json=spec.model_dump_json(), phase=JobPhase.PENDING, created_at=now, phase_changed_at=now)
    message = (f"{spec.size}; auto_resume={spec.resilience.auto_resume}, "
               f"max_retry={spec.resilience.max_retry}" + (f"; {note}" if note else ""))
    store.add_job(job)
    store.add_event("Job", spec.name, "JobCreated", message)
    return job


def current_step(workers: list[Worker]) -> int:
    """Step the slowest node of an attempt has reported (0 before the first step)."""
    return max((w.last_step or 0 for w in workers), default=0)
