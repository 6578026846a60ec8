"""When a pod's ranks are hung, from their own step times (relayed to the launcher, relay.py).

A hang stops every rank of the job: the hung one, and the others blocked in their
next collective on it. Every pod's launcher sees its ranks go silent; the first to
say so breaks the round (coordinator.py), every rank is asked to leave
(``rejoin.request_leave``: the blocked ones leave at once), and the ranks that do
not leave in a few steps' time (the hung one) are replaced from the warm spare.

The timeout is the operator's (config/hang_policy.py, explained in controller/hang_timeout.py: a floor, a multiple of
the median step, a multiple of the longest pause seen) at half its size, floor
included: the pods act first and in place, and the operator, which sees the same
silence later (through the agents' reports), recreates the pods only when they
could not. Acting at the operator's own floor raced it (both at about 3 s), and a
lost race costs a full restart. A false alarm is cheap instead: every rank leaves
when asked (rank/leave_watch.py), the same ranks form the next round from their live
state, no step is lost, and each hang a launcher declares doubles its next timeout
(a busy machine, a spare importing torch beside the ranks, stalled a healthy job
1.5 s here). No hang is declared before the round's ranks took ``MIN_STEPS``
steps: a round's start (a restore, a rendezvous) is no hang. A false alarm still
counts against ``--max-restarts``.
"""

from __future__ import annotations

from unbroken.config import hang_policy
from unbroken.supervision.step_clock import StepIntervals

SHARE_OF_THE_OPERATORS = 0.5
"""The launcher's timeout (its floor and multiples, or a job's own timeout) as a share of the operator's: it must act,
and be done, before the operator does."""
LEAVE_STEPS = 3.0
"""A held rank that has not left within this many median steps after it was asked is hung: its pod's ranks are
replaced (a healthy rank reaches its next collective, and fails there, within a step)."""
LEAVE_FLOOR_S = 0.5


class HangWatch:
    """The steps of one pod's ranks: their median step, their longest pause (the step clock's, over
    the pod's lowest local rank that steps), and how long they have been silent."""

    def __init__(self) -> None:
        self._last: dict[int, float] = {}
        self._finished: dict[int, float] = {}
        """Local ranks whose training returned in this round (``MessageKind.FINISHED``), with when: exiting, not hung."""
        self._round_steps = 0
        self._intervals = StepIntervals(window=200)
        """Across rounds: a pause seen in one round (a checkpoint) is still the job's in the next."""
        self._since = 0.0

    def new_round(self, started: float) -> None:
        """Steps from ``started`` on (a ``time.time()``) are the new round's; a pause across the round's start is
        the restart's, not the job's, and is not learned."""
        self._since = started
        self._last.clear()
        self._finished.clear()
        self._round_steps = 0

    def observe(self, local_rank: int, at: float) -> None:
        if at <= self._since:
            return
        previous = self._last.get(local_rank)
        self._last[local_rank] = max(at, previous or 0.0)
        if previous is not None and local_rank == min(self._last) and at > previous:
            self._round_steps += 1
            self._intervals.add(at - previous)

    def median_step(self) -> float | None:
        """None until ``hang_policy.MIN_STEPS`` steps were measured."""
        return self._intervals.median() if self._intervals.count >= hang_policy.MIN_STEPS else None

    def timeout(self, job_timeout: float | None = None) -> float | None:
        """Seconds of silence that make the pod's ranks hung (the share of ``job_timeout``, the job's own hang
        timeout, when it sets one); None until their steps are measured."""
        median = self.median_step()
        if median is None or self._round_steps < hang_policy.MIN_STEPS:
            return None
        if job_timeout:
            return SHARE_OF_THE_OPERATORS * job_timeout
        return SHARE_OF_THE_OPERATORS * hang_policy.from_step_times(median, self._intervals.longest)

    def finished(self, local_rank: int, at: float) -> None:
        if at > self._since:
            self._finished[local_rank] = at

    def all_finished_at(self, ranks: int) -> float | None:
        """When the last of the pod's ``ranks`` local ranks said it finished in this round; None until all have."""
        return max(self._finished.values()) if len(self._finished) >= ranks else None

    def silent_for(self, now: float) -> float | None:
        """Seconds since any of the pod's ranks still training stepped in this round (None: none has, or every rank
        that stepped has finished: the end of the job, whose exit may take seconds, is no hang)."""
        training = [at for local_rank, at in self._last.items() if local_rank not in self._finished]
        return now - max(training) if training else None

    def leave_timeout(self, cap: float) -> float:
        """How long the pod's ranks have to leave a round once asked, at most ``cap`` (``--abort-timeout``)."""
        median = self.median_step()
        return cap if median is None else min(cap, max(LEAVE_FLOOR_S, LEAVE_STEPS * median))
