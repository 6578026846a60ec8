"""The numbers of the step-time hang policy, in one low place: the controller's hang timeout
(``controller/hang_timeout.py``, which explains them) and ``unbroken run``'s in-pod hang watch
(``kubernetes/pod_launcher/hang.py``, which acts at a share of it) both read them, and neither imports the other."""

from __future__ import annotations

from unbroken.config.job import HANG_TIMEOUT_FALLBACK_S

FLOOR_S = 3.0
"""A stall shorter than this (a GC pause, a page-cache flush, a slow all-reduce) is not worth a restart."""
STEP_MULTIPLE = 20.0
"""A step this many times slower than the median is not a slow step."""
GAP_MULTIPLE = 2.0
"""Twice the longest pause seen (a checkpoint, an evaluation) is not a pause."""
MIN_STEPS = 10
"""Steps measured before the step times set the timeout."""
FALLBACK_S = HANG_TIMEOUT_FALLBACK_S
"""Until then."""
STARTUP_FLOOR_S = 60.0
STARTUP_MULTIPLE = 3.0
FINISHED_EXIT_GRACE_S = 30.0
"""How long ranks that said they finished may take to exit before their agent, or ``unbroken run`` in a pod, ends
them: a rank's exit (output, ``destroy_process_group``, CUDA's teardown) takes seconds, not tens of them."""


def finished_exit_grace(hang_timeout: float | None) -> float:
    """The grace, at most half the job's hang timeout: a hang watch must not read a finished rank's silence as a hang
    first (two layers of silence detection never share a floor)."""
    return FINISHED_EXIT_GRACE_S if not hang_timeout else min(FINISHED_EXIT_GRACE_S, hang_timeout / 2)


def from_step_times(median_s: float, longest_s: float) -> float:
    """The hang timeout a job's step times give: the largest of the floor and the two multiples."""
    return max(FLOOR_S, STEP_MULTIPLE * median_s, GAP_MULTIPLE * longest_s)
