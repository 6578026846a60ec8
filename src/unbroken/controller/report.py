"""Derived job figures: steps lost, recovery times, goodput. Pure functions of store rows.

Definitions (also in docs/concepts.md, "What a failure costs"):

* **steps lost** at a restart: the last step the failed attempt reported minus the
  step the next attempt resumed from.
* **recovery time**: fault (the chaos injection if one was recorded, else the
  moment the controller detected the failure) to the first step the next
  attempt reports.
* **goodput**: seconds of kept training progress divided by the job's wall time
  (creation to end, or to now). Time lost to startup, detection, restarts and
  recomputed steps all count against it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from unbroken.state.records import Event, Job, Worker

CHAOS_PREFIX = "Chaos"


@dataclass(frozen=True)
class AttemptSummary:
    attempt: int
    nodes: list[str]
    scheduled_at: float | None
    first_step_at: float | None
    restored_step: int | None
    first_step: int | None
    last_step: int | None
    last_progress_at: float | None
    outcome: str
    fault_at: float | None = None
    detected_at: float | None = None
    restart_reason: str = ""
    """The JobRestarting message that ended the previous attempt and led to this one."""
    checkpoint_stall_s: float = 0.0
    """Training time its ranks spent blocked in checkpoint saves (the slowest node's ranks)."""

    @property
    def step_seconds(self) -> float | None:
        if None in (self.first_step, self.last_step, self.first_step_at, self.last_progress_at):
            return None
        steps = self.last_step - self.first_step  # type: ignore[operator]
        return (self.last_progress_at - self.first_step_at) / steps if steps > 0 else None  # type: ignore[operator]


@dataclass(frozen=True)
class Recovery:
    """One restart's timeline: fault -> detected -> next attempt placed -> its first step."""

    attempt: int
    fault_at: float
    detected_at: float
    scheduled_at: float
    first_step_at: float

    @property
    def total_s(self) -> float:
        return self.first_step_at - self.fault_at

    def describe(self) -> str:
        return (f"{self.total_s:.1f} s (detect {self.detected_at - self.fault_at:.1f} + reschedule "
                f"{self.scheduled_at - self.detected_at:.1f} + startup {self.first_step_at - self.scheduled_at:.1f})")


@dataclass(frozen=True)
class JobReport:
    name: str
    phase: str
    restarts: int
    step: int | None
    steps_lost: int
    recovery_seconds: list[float]
    detection_seconds: list[float]
    goodput: float | None
    wall_seconds: float
    attempts: list[AttemptSummary]
    recoveries: list[Recovery]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(job: Job, workers: list[Worker], events: list[Event], now: float | None = None) -> JobReport:
    now = now if now is not None else time.time()
    attempts = [_attempt(job, a, [w for w in workers if w.attempt == a], events) for a in range(job.attempt + 1)]
    attempts = [a for a in attempts if a.nodes]
    steps_lost = 0
    recovery, detection = [], []
    recoveries: list[Recovery] = []
    useful = 0.0
    for index, attempt in enumerate(attempts):
        start = attempt.restored_step or 0
        following = attempts[index + 1] if index + 1 < len(attempts) else None
        if following is not None:
            resumed = following.restored_step or 0
            if attempt.last_step is not None:
                steps_lost += max(0, attempt.last_step - resumed)
            fault = following.fault_at
            if fault is not None and following.first_step_at is not None:
                recovery.append(following.first_step_at - fault)
            if fault is not None and following.detected_at is not None:
                detection.append(following.detected_at - fault)
            if None not in (fault, following.detected_at, following.scheduled_at, following.first_step_at):
                recoveries.append(Recovery(following.attempt, fault, following.detected_at,  # type: ignore[arg-type]
                                           following.scheduled_at, following.first_step_at))  # type: ignore[arg-type]
        kept_until = attempt.last_step if following is None else min(attempt.last_step or 0, following.restored_step or 0)
        if attempt.step_seconds is not None and kept_until is not None:
            useful += max(0, kept_until - start) * attempt.step_seconds
    end = job.ended_at or now
    wall = max(end - job.created_at, 1e-9)
    step = max((a.last_step for a in attempts if a.last_step is not None), default=None)
    goodput = min(useful / wall, 1.0) if step is not None else None
    return JobReport(
        name=job.name, phase=job.phase.value, restarts=job.attempt, step=step, steps_lost=steps_lost,
        recovery_seconds=recovery, detection_seconds=detection, goodput=goodput, wall_seconds=wall, attempts=attempts,
        recoveries=recoveries,
    )


def _attempt(job: Job, attempt: int, workers: list[Worker], events: list[Event]) -> AttemptSummary:
    def earliest(values):
        values = [v for v in values if v is not None]
        return min(values) if values else None

    def latest(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    scheduled = earliest(w.created_at for w in workers)
    fault_at = detected_at = None
    restart_reason = ""
    if attempt > 0 and scheduled is not None:
        restarts = [e for e in events if e.reason == "JobRestarting" and e.ts <= scheduled]
        if restarts:
            detected_at = restarts[-1].ts
            restart_reason = restarts[-1].message
            previous_start = _previous_schedule(events, detected_at)
            chaos = [e for e in events if e.reason.startswith(CHAOS_PREFIX) and previous_start <= e.ts <= detected_at]
            fault_at = chaos[-1].ts if chaos else detected_at
    if not workers:
        outcome = ""
    elif attempt < job.attempt:
        outcome = "restarted"
    else:
        outcome = job.phase.value
    return AttemptSummary(
        attempt=attempt, nodes=[w.node for w in sorted(workers, key=lambda w: w.node_rank)], scheduled_at=scheduled,
        first_step_at=earliest(w.first_progress_at for w in workers),
        restored_step=next((w.restored_step for w in workers if w.restored_step is not None), None),
        first_step=earliest(w.first_step for w in workers), last_step=latest(w.last_step for w in workers),
        last_progress_at=latest(w.last_progress_at for w in workers), outcome=outcome,
        fault_at=fault_at, detected_at=detected_at, restart_reason=restart_reason,
        checkpoint_stall_s=latest(w.checkpoint_stall_s for w in workers) or 0.0,
    )


def _previous_schedule(events: list[Event], before: float) -> float:
    scheduled = [e.ts for e in events if e.reason == "JobScheduled" and e.ts <= before]
    return scheduled[-1] if scheduled else 0.0


BADPUT_CAUSES = ("startup", "restart", "lost_steps", "checkpoint_stall", "hang_wait")
"""Where a job's time went other than into kept training progress (Google's goodput/badput split)."""


def badput(report: JobReport, is_hang: Callable[[str], bool]) -> dict[str, float]:
    """Seconds lost per cause, from an attempt summary (``is_hang`` says which restart reasons were hangs).

    - startup: each attempt's placement to its first step (imports, rendezvous, restore);
    - hang_wait: for a hang, the time from the last step to its detection (the hang timeout);
    - restart: fault to the next attempt's placement, less any hang wait (detection, stopping, placing);
    - lost_steps: steps recomputed after a restart, at the failed attempt's step time;
    - checkpoint_stall: time the training loop was blocked in saves.
    """
    spent = dict.fromkeys(BADPUT_CAUSES, 0.0)
    attempts = report.attempts
    for index, attempt in enumerate(attempts):
        if attempt.scheduled_at is not None and attempt.first_step_at is not None:
            spent["startup"] += max(0.0, attempt.first_step_at - attempt.scheduled_at)
        spent["checkpoint_stall"] += attempt.checkpoint_stall_s
        following = attempts[index + 1] if index + 1 < len(attempts) else None
        if following is None:
            continue
        if attempt.last_step is not None and attempt.step_seconds is not None:
            spent["lost_steps"] += max(0, attempt.last_step - (following.restored_step or 0)) * attempt.step_seconds
        hang = 0.0
        if is_hang(following.restart_reason) and following.detected_at is not None and attempt.last_progress_at is not None:
            hang = max(0.0, following.detected_at - attempt.last_progress_at)
            spent["hang_wait"] += hang
        if following.fault_at is not None and following.scheduled_at is not None:
            spent["restart"] += max(0.0, following.scheduled_at - following.fault_at - hang)
    return spent
