"""The in-process restart's handshake between a node agent and the ranks of a worker it holds.

A job with ``resilience.in_process_restart`` keeps the processes of its healthy
workers across a restart: the ranks abort their process group, wait, and
re-form it with the next attempt's ranks (``Context.run`` in train.py). The
agent and its ranks talk through one folder per launched worker (``rejoin_dir``,
given to the ranks in ``UNBROKEN_REJOIN_DIR``):

| file | written by | says |
|---|---|---|
| ``aborted.<local rank>`` | the rank | "I left round N's process group and wait" (N, then the error in one line) |
| ``notice.json`` | the agent | "join round M (attempt A) as group rank G of NNODES, store at HOST:PORT" |
| ``leave`` | the launcher | "leave round N at your next step" (N, then why): the round ends elsewhere, or the job grows |

A *round* is one process group of the job. Under the local agent every round is
an attempt of the controller's (the round is the attempt). Under ``unbroken run``
in a Kubernetes pod (kubernetes/pod_launcher/), the pods restart in place without the
operator, so the rounds count within one attempt of the operator's, and the ranks
keep reporting that attempt (its checkpoints, its progress).

Files, not the agent's datagram channel: the rank must *wait* for an answer,
and a file is there whenever it looks, even if it looked before the agent wrote.
Each is written to a temporary name and renamed, so a reader never sees half of
one; nothing is fsynced: a notice is worth nothing after a crash of either side.

A rank's "aborted" is also how its agent learns first that the attempt is broken (the
worker turns Interrupted): when a whole node is lost, no agent reports the dead
ranks, and waiting for the node to be declared lost would take seconds.

The agent holds a worker only while every rank has said "aborted" for the
attempt being left (``acknowledged``); a rank that does not (stuck in a
compute, or in a collective with no timeout) makes the agent stop the whole
worker: the full restart, as for a job without in-process restarts.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

NOTICE = "notice.json"
LEAVE = "leave"
POLL_SECONDS = 0.01
"""How often a waiting rank looks for the notice: a stat of a local file, the rejoin's only latency."""


@dataclass(frozen=True)
class RejoinNotice:
    """Where a held worker's ranks go next: the agent writes it when the next attempt places the worker."""

    attempt: int
    """The attempt the ranks report (to their agent, in their checkpoints) from now on."""
    group_rank: int
    """The worker's node rank in the new attempt (it may differ from the old one: a lost node 0 moves rank 0)."""
    nnodes: int
    rendezvous: str
    """``host:port`` of the new attempt's store; its global rank 0 hosts it."""
    round: int | None = None
    """The handshake's count (module docstring); None: the attempt."""

    @property
    def round_number(self) -> int:
        return self.attempt if self.round is None else self.round

    def global_rank(self, local_rank: int, local_world_size: int) -> int:
        return self.group_rank * local_world_size + local_rank


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# -- the rank's side -----------------------------------------------------------------

def acknowledge_abort(rejoin_dir: Path, local_rank: int, round_number: int, why: str = "") -> None:
    """This rank has left ``round_number``'s process group (because of ``why``, one line) and waits for a notice."""
    rejoin_dir.mkdir(parents=True, exist_ok=True)
    _write(rejoin_dir / f"aborted.{local_rank}", f"{round_number} {why}".rstrip())


def await_notice(rejoin_dir: Path, after_round: int, timeout: float) -> RejoinNotice | None:
    """The notice of a round newer than ``after_round``, or None after ``timeout`` seconds.

    Polled: the writer is another process (the agent) that may not have decided yet,
    and a local ``stat`` every 10 ms costs nothing next to a restart."""
    deadline = time.monotonic() + timeout
    while True:
        notice = read_notice(rejoin_dir)
        if notice is not None and notice.round_number > after_round:
            return notice
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_SECONDS)


def read_notice(rejoin_dir: Path) -> RejoinNotice | None:
    try:
        return RejoinNotice(**json.loads((rejoin_dir / NOTICE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def leave_requested(rejoin_dir: Path, round_number: int) -> str | None:
    """Why this rank is asked to leave ``round_number`` at its step's end, or None. A read of a file that is
    almost always missing: one failed ``open``, a few microseconds of every ``ctx.progress``."""
    try:
        said, _, why = (rejoin_dir / LEAVE).read_text().partition(" ")
    except OSError:
        return None
    return why if said == str(round_number) else None


# -- the agent's side ----------------------------------------------------------------

def request_leave(rejoin_dir: Path, round_number: int, why: str) -> None:
    """Ask the ranks of ``rejoin_dir`` to leave ``round_number`` after their current step (``leave_requested``):
    ranks that did not see the round break (a peer of another pod failed, a pod is lost, the job grows) leave at
    once, not at their next collective's failure or timeout, and hold their state for the next round."""
    rejoin_dir.mkdir(parents=True, exist_ok=True)
    _write(rejoin_dir / LEAVE, f"{round_number} {' '.join(why.split())}".rstrip())



def acknowledged(rejoin_dir: Path, round_number: int, local_world_size: int) -> dict[int, str]:
    """The local ranks that have said they left ``round_number``, with why."""
    done = {}
    for local_rank in range(local_world_size):
        try:
            said, _, why = (rejoin_dir / f"aborted.{local_rank}").read_text().partition(" ")
            if int(said) == round_number:
                done[local_rank] = why
        except (OSError, ValueError):
            continue
    return done


def post_notice(rejoin_dir: Path, notice: RejoinNotice) -> None:
    rejoin_dir.mkdir(parents=True, exist_ok=True)
    _write(rejoin_dir / NOTICE, json.dumps(asdict(notice)))


__all__ = ["RejoinNotice", "acknowledge_abort", "acknowledged", "await_notice", "leave_requested", "post_notice",
           "read_notice", "request_leave"]
