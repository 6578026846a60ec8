"""Workers an agent keeps alive between two attempts of a job with in-process restarts.

The controller restarts such a job by asking the healthy nodes to *hold* their
workers (``Desired.HOLD``) instead of stopping them. On each node:

    Running --a rank left its group--> Interrupted (the agent reports it: the controller restarts now)
    Running | Interrupted --hold asked--> Leaving --every rank left--> Held --next attempt here--> adopted (Running)
                               |                              |
                               +--abort_timeout--> stopped    +--HOLD_SECONDS or job over--> killed

*Leaving*: the ranks leave the broken process group (their collective failed when
the peer died) and say so (rank/rejoin.py). *Held*: the row of the old attempt is
closed as Stopped and the processes wait. *Adopted*: the agent writes the next
attempt's notice and the worker becomes that attempt's worker on this node, with
the same torchrun and ranks. Every way out of the happy path ends in a full stop,
after which the next attempt launches this node's worker fresh (a warm spare or
cold): the fallback is today's restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from unbroken.rank import rejoin
from unbroken.supervision.torchrun import RunningWorker

log = logging.getLogger("unbroken.agent.held")

HOLD_SECONDS = 60.0
"""A held worker not adopted by its job's next attempt within this is killed. The next attempt is
placed within a controller pass or two when its nodes are free; a job left waiting for nodes
should not pin a node's memory (or GPUs) with processes nobody may come back for."""


class Leaving(StrEnum):
    WAITING = "Waiting"
    """Not every rank has left the process group yet."""
    LEFT = "Left"
    """Every rank has left and waits for the next attempt: hold it."""
    TIMED_OUT = "TimedOut"
    """A rank did not leave within the worker's abort timeout: stop the worker (full restart)."""


def leaving(running: RunningWorker, attempt: int, now: float) -> tuple[Leaving, set[int]]:
    """Where a worker asked to hold stands: its ranks that left ``attempt`` so far, and the verdict."""
    assert running.rejoin_dir is not None
    if running.hold_started is None:
        running.hold_started = now
    left = set(rejoin.acknowledged(running.rejoin_dir, attempt, running.ranks))
    if len(left) == running.ranks:
        return Leaving.LEFT, left
    if now - running.hold_started > running.abort_timeout:
        return Leaving.TIMED_OUT, left
    return Leaving.WAITING, left


@dataclass
class Held:
    running: RunningWorker
    attempt: int
    """The attempt its ranks left."""
    since: float


class HeldWorkers:
    """At most one held worker per job on this node (a node runs one worker of a job)."""

    def __init__(self) -> None:
        self._by_job: dict[str, Held] = {}

    def keep(self, job: str, running: RunningWorker, attempt: int) -> None:
        running.hold_started = None
        self._by_job[job] = Held(running, attempt, time.monotonic())

    def take(self, job: str) -> Held | None:
        """The job's held worker if its torchrun is alive, for adoption. (A rank that died while held
        makes torchrun stop the rest and exit; caught between the two, the adopted attempt fails at
        its rendezvous and the next restart is a full one.)"""
        held = self._by_job.pop(job, None)
        if held is None:
            return None
        if held.running.exited() is not None:
            return None
        return held

    def expire(self, job_over: Callable[[str], bool]) -> None:
        """Kill held workers that waited ``HOLD_SECONDS`` or whose job ended; forget exited ones."""
        now = time.monotonic()
        for job, held in list(self._by_job.items()):
            if held.running.exited() is not None:
                del self._by_job[job]
            elif now - held.since > HOLD_SECONDS or job_over(job):
                log.warning("held worker not adopted after %.0f s; killing it", now - held.since,
                            extra={"job": job, "attempt": held.attempt, "pid": held.running.process.pid})
                held.running.kill()
                del self._by_job[job]

    def kill_all(self) -> None:
        for held in self._by_job.values():
            held.running.kill()
        self._by_job.clear()

    def __bool__(self) -> bool:
        return bool(self._by_job)


__all__ = ["HOLD_SECONDS", "Held", "HeldWorkers", "Leaving", "leaving"]
