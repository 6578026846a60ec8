"""The hang timeout in force for a job: the one it set, or one set from its own step times.

Any fixed default is wrong for some job: 5 minutes wastes minutes of a job
whose steps take 50 ms, and 30 s declares a healthy job with 40 s steps hung.
So a job that sets no ``hang_timeout`` is timed by what it does: once every
worker has measured ``MIN_STEPS`` steps (after the warm-up its agent skips),
the timeout is the largest of

- ``FLOOR_S``: a stall shorter than a few seconds (a GC pause, a page-cache
  flush, a slow all-reduce on a busy network) is not worth a restart;
- ``STEP_MULTIPLE`` x the slowest worker's median step: a step twenty times
  slower than usual is not a slow step;
- ``GAP_MULTIPLE`` x the longest gap seen between two reports this attempt:
  checkpoints and evaluations that happen every so many steps have shown
  how long they take.

It is recomputed every pass, so it follows the job as it runs. The startup
timeout (launch to the first step) likewise: once an attempt's startup has been
seen, ``STARTUP_MULTIPLE`` x the slowest seen, never under ``STARTUP_FLOOR_S``. Until the steps
are measured (startup, the first steps) ``FALLBACK_S`` holds, the old default.
A job whose rare long pause has not happened yet (an evaluation every 5,000
steps) can be declared hung by it: such a job reports progress during the
pause, or sets ``hang_timeout``. NVIDIA's resiliency extension derives its
timeouts from observed step times the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.config.hang_policy import (FALLBACK_S, FLOOR_S, GAP_MULTIPLE, MIN_STEPS, STARTUP_FLOOR_S, STARTUP_MULTIPLE,
                                         STEP_MULTIPLE, from_step_times)
from unbroken.config.job import STARTUP_TIMEOUT_FALLBACK_S, JobSpec
from unbroken.state.records import Worker

__all__ = ["FALLBACK_S", "FLOOR_S", "GAP_MULTIPLE", "MIN_STEPS", "STARTUP_FLOOR_S", "STARTUP_MULTIPLE", "STEP_MULTIPLE",
           "HangTimeout", "in_force", "observed_startup", "startup_in_force"]


@dataclass(frozen=True)
class HangTimeout:
    seconds: float
    why: str
    """For ``job describe`` and the hang's Event: where the number comes from."""
    measured: bool = False
    """Set from step times (the job's previous attempt may use it until its own are measured)."""


def in_force(spec: JobSpec, workers: list[Worker], *, previous: HangTimeout | None = None) -> HangTimeout:
    """The hang timeout of the attempt whose ``workers`` these are. ``previous``: the last one measured
    for this job (an earlier attempt's), which holds until this attempt's steps are measured: a job
    restarted after a hang that hangs again is not given the 5-minute default."""
    if spec.resilience.hang_timeout is not None:
        return HangTimeout(spec.resilience.hang_timeout, "hang_timeout set by the job")
    timings = [w.step_timing for w in workers if not w.phase.is_terminal]
    measured = [t for t in timings if t is not None]
    # A spare pod stands by with no ranks, so it never steps: up to node_losses_in_place workers that have not
    # stepped yet are taken for spare pods (a job without spare pods waits for every worker's steps, as it must).
    unmeasured = len(timings) - len(measured)
    if not measured or unmeasured > spec.resilience.node_losses_in_place or any(t.steps < MIN_STEPS for t in measured):
        if previous is not None and previous.measured:
            return HangTimeout(previous.seconds, "from the step times of an earlier attempt, until this one's are measured")
        return HangTimeout(FALLBACK_S, f"from step times once every worker has run {MIN_STEPS} steps; until then the default")
    median = max(t.median_s for t in measured)
    longest = max(t.longest_s for t in measured)
    seconds = from_step_times(median, longest)
    return HangTimeout(round(seconds, 3), f"from step times: max({FLOOR_S:g} s, {STEP_MULTIPLE:g} x median step {median:.3f} s, "
                                          f"{GAP_MULTIPLE:g} x longest gap {longest:.3f} s)", measured=True)


def observed_startup(workers: list[Worker]) -> float | None:
    """Launch to first step of the attempt's slowest worker, once every worker has stepped."""
    if not workers or any(w.started_at is None or w.first_progress_at is None for w in workers):
        return None
    return max((w.first_progress_at or 0.0) - (w.started_at or 0.0) for w in workers)


def startup_in_force(spec: JobSpec, observed: float | None) -> HangTimeout:
    """The startup timeout: the job's, or from the slowest startup seen among its attempts."""
    if spec.resilience.startup_timeout is not None:
        return HangTimeout(spec.resilience.startup_timeout, "startup_timeout set by the job")
    if observed is None:
        return HangTimeout(STARTUP_TIMEOUT_FALLBACK_S, "the default, until an attempt's startup is seen")
    seconds = max(STARTUP_FLOOR_S, STARTUP_MULTIPLE * observed)
    return HangTimeout(round(seconds, 3), f"max({STARTUP_FLOOR_S:g} s, {STARTUP_MULTIPLE:g} x the slowest startup seen, {observed:.1f} s)",
                       measured=True)
