"""States of nodes, jobs and workers, and the transitions allowed between them.

Persisted values never change meaning: add new members, never rename old ones.
The transition tables are the single place that says what may follow what;
every writer goes through :func:`check_transition`.
"""

from __future__ import annotations

from enum import StrEnum

from unbroken.errors import UnbrokenError


class IllegalTransition(UnbrokenError):
    """A state change that the lifecycle tables do not allow: a bug, not user error."""


class NodeState(StrEnum):
    """A node's lifecycle: Joining, then Schedulable or pending a reboot or a replacement, and back to Joining."""

    JOINING = "Joining"
    """Registered; join checks InProgress; takes no work."""
    SCHEDULABLE = "Schedulable"
    UNSCHEDULABLE = "Unschedulable"
    """Cordoned by an operator."""
    PENDING_REBOOT = "UnschedulablePendingReboot"
    PENDING_REPLACEMENT = "UnschedulablePendingReplacement"
    REBOOTING = "Rebooting"
    """Recovery in progress: the agent and everything of the node was stopped and is restarting."""
    RETIRED = "Retired"
    """Replaced; kept for history."""

    @property
    def health_status_label(self) -> str:
        """The value of ``unbroken.dev/node-health-status`` (four values, shared with k8s)."""
        return {
            NodeState.JOINING: "Unschedulable",
            NodeState.REBOOTING: "UnschedulablePendingReboot",
            NodeState.RETIRED: "UnschedulablePendingReplacement",
        }.get(self, self.value)

    @property
    def is_active(self) -> bool:
        """An agent is expected to be heartbeating for this node."""
        return self in (NodeState.JOINING, NodeState.SCHEDULABLE, NodeState.UNSCHEDULABLE)


NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    NodeState.JOINING: frozenset(
        {NodeState.SCHEDULABLE, NodeState.PENDING_REBOOT, NodeState.PENDING_REPLACEMENT, NodeState.UNSCHEDULABLE}
    ),
    NodeState.SCHEDULABLE: frozenset(
        {NodeState.UNSCHEDULABLE, NodeState.PENDING_REBOOT, NodeState.PENDING_REPLACEMENT}
    ),
    NodeState.UNSCHEDULABLE: frozenset(
        {NodeState.SCHEDULABLE, NodeState.JOINING, NodeState.PENDING_REBOOT, NodeState.PENDING_REPLACEMENT}
    ),
    NodeState.PENDING_REBOOT: frozenset({NodeState.REBOOTING, NodeState.PENDING_REPLACEMENT}),
    NodeState.PENDING_REPLACEMENT: frozenset({NodeState.RETIRED}),
    NodeState.REBOOTING: frozenset({NodeState.JOINING, NodeState.PENDING_REPLACEMENT}),
    NodeState.RETIRED: frozenset(),
}


class DeepHealthStatus(StrEnum):
    """``unbroken.dev/deep-health-check-status``."""

    NOT_RUN = "NotRun"
    """Never checked (a Kubernetes node before its first deep check; the label is then absent)."""
    IN_PROGRESS = "InProgress"
    PASSED = "Passed"
    FAILED = "Failed"


class JobPhase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    """The failed attempt's workers are being stopped, then the job is placed again."""
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.CANCELLED)


JOB_TRANSITIONS: dict[JobPhase, frozenset[JobPhase]] = {
    JobPhase.PENDING: frozenset({JobPhase.RUNNING, JobPhase.CANCELLED, JobPhase.FAILED}),
    JobPhase.RUNNING: frozenset({JobPhase.SUCCEEDED, JobPhase.FAILED, JobPhase.RESTARTING, JobPhase.CANCELLED}),
    JobPhase.RESTARTING: frozenset({JobPhase.RUNNING, JobPhase.FAILED, JobPhase.CANCELLED}),
    JobPhase.SUCCEEDED: frozenset(),
    JobPhase.FAILED: frozenset(),
    JobPhase.CANCELLED: frozenset(),
}


class WorkerPhase(StrEnum):
    """One job attempt's torchrun group on one node."""

    PENDING = "Pending"
    """Assigned by the controller; the node's agent has not launched it yet."""
    RUNNING = "Running"
    INTERRUPTED = "Interrupted"
    """Still running, but its ranks left the process group after a collective failed (a peer is gone)
    and wait to be held for the next attempt: a job with in-process restarts. Its agent reports it
    at once, so a restart does not wait for the lost peer's node to be declared lost."""
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    """Exited non-zero or by a signal on its own."""
    STOPPED = "Stopped"
    """Stopped on purpose (restart, cancel) or lost with its node."""

    @property
    def is_terminal(self) -> bool:
        return self in (WorkerPhase.SUCCEEDED, WorkerPhase.FAILED, WorkerPhase.STOPPED)


WORKER_TRANSITIONS: dict[WorkerPhase, frozenset[WorkerPhase]] = {
    WorkerPhase.PENDING: frozenset({WorkerPhase.RUNNING, WorkerPhase.FAILED, WorkerPhase.STOPPED}),
    WorkerPhase.RUNNING: frozenset({WorkerPhase.INTERRUPTED, WorkerPhase.SUCCEEDED, WorkerPhase.FAILED, WorkerPhase.STOPPED}),
    WorkerPhase.INTERRUPTED: frozenset({WorkerPhase.SUCCEEDED, WorkerPhase.FAILED, WorkerPhase.STOPPED}),
    WorkerPhase.SUCCEEDED: frozenset(),
    WorkerPhase.FAILED: frozenset(),
    WorkerPhase.STOPPED: frozenset(),
}


def check_transition(kind: str, table: dict, current: StrEnum, new: StrEnum) -> None:
    """Raise :class:`IllegalTransition` unless ``current → new`` is in ``table`` (or a no-op)."""
    if current != new and new not in table[current]:
        raise IllegalTransition(f"{kind}: {current.value} -> {new.value} is not an allowed transition")
