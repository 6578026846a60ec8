"""The ``Backend`` protocol: how the controller's decisions about nodes and attempts are carried out.

The controller decides ("attempt 3 of job mlp on node-1, node-4", "stop attempt 2",
"reboot node-2"); the backend does it and reports what it sees. The two backends:

| | local | Kubernetes |
|---|---|---|
| a node | an agent process (optionally in its own network namespace) | a Node; its agent is a DaemonSet pod |
| reboot / replace | restart the agent / retire it and start a new node | a Remediator: node condition for external repair, a command, or self-reboot |
| an attempt | one worker row per node, which the node agents run with ``torchrun`` | the PyTorchJob / TrainJob's pods, created by its own controller |
| rendezvous | a free port on the first node, chosen here | the workload's controller (``MASTER_ADDR``/``MASTER_PORT``) |

Every attempt operation is idempotent: the controller may be killed between
deciding and doing, and does the same again on its next pass.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from unbroken.state.records import Job, Node, Worker


@dataclass(frozen=True)
class AttemptWait:
    """Why a launched attempt has no running worker: said in an Event, and whether launching again may help."""

    reason: str
    nudge: bool = False
    """True where nothing of the attempt exists yet: its launch was missed and is sent again once."""


class Backend(Protocol):
    places_workers: bool
    """True where the platform's own scheduler decides where an attempt's workers go and what fits beside what
    (Kubernetes: kube-scheduler, with the job's own placement rules and resources): a node that runs another job's
    workers is then not busy to unbroken, and a restart waits only for what the scheduler waits for. False where
    unbroken places them, one job's worker per node (local)."""

    # -- nodes ----------------------------------------------------------------------
    def reboot_node(self, node: Node) -> None:
        """Stop everything of the node and bring its agent back; it joins again (re-runs its checks)."""

    def replace_node(self, node: Node) -> str | None:
        """Take the node out for good; the name of its replacement if this backend provisions
        one itself (local), None where something else brings capacity back (a cloud's repair)."""

    # -- attempts -------------------------------------------------------------------
    def held(self, job: str) -> str | None:
        """Why someone other than unbroken holds the job back, so that unbroken must not start it (a queue that has
        not admitted it, another controller that manages it); None: unbroken may."""

    def attempt_waits_for(self, job: str, attempt: int) -> AttemptWait | None:
        """What a launched attempt none of whose workers runs yet is waiting for, where the platform can say
        (its workers never created, not placed, not starting); None if it waits for nothing unusual (a worker
        being created or starting, its image being pulled)."""

    def nudge_attempt(self, job: str, attempt: int) -> None:
        """Launch the attempt once more where its workers were never created (a controller that missed the
        launch, as after an API-server outage); nothing where the backend starts them itself."""

    def launch_attempt(self, job: Job, attempt: int, placement: Sequence[Node]) -> str:
        """Start ``attempt`` of ``job`` on ``placement`` (node rank = position); returns the
        rendezvous endpoint. Launching an attempt that exists already changes nothing."""

    def stop_attempt(self, job: str, attempt: int, *, hold: Collection[str] = ()) -> None:
        """Ask every worker of the attempt to stop; they report Stopped once gone. The workers on the
        ``hold`` nodes keep their processes for the next attempt (in-process restart; a backend that
        cannot keep them stops them)."""

    def observe_attempt(self, job: str, attempt: int) -> list[Worker]:
        """Each worker of the attempt: running, exited (code or signal), stopped, or lost with its node."""

    def active_workers(self) -> list[Worker]:
        """Every worker not yet ended, of any job: what makes a node busy."""

    def worker_history(self, job: str) -> list[Worker]:
        """Every worker of every attempt of ``job``, oldest first (for reports)."""

    def progress_history(self, job: str) -> list[tuple[int, float, int]]:
        """(attempt, time, step) over the job's life, oldest first, about one sample a second."""

    def release_workers(self, node: Node, reason: str) -> None:
        """The node's agent is gone and can never confirm its workers stopped: close them as
        Stopped (local: the rows; Kubernetes: force-delete pods stuck Terminating)."""
