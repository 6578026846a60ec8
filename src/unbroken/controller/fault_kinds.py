"""What kind of fault a restart or a final failure was, read from its reason: a short, bounded
word for metric labels and dashboards (``unbroken_job_restarts_total{reason="worker_killed"}``).

The reasons are this package's own sentences (``job_decisions``), so the patterns below
follow them; a test round-trips every kind from a reason the decisions actually write.
Order matters: a peer's "connection closed" is also an exit code, a lost node's worker
is also a node fault.
"""

from __future__ import annotations

import re
from enum import StrEnum

from unbroken.controller import divergence


class FaultKind(StrEnum):
    WORKER_KILLED = "worker_killed"
    """A rank died of a signal (SIGKILL, SIGSEGV, an OOM kill)."""
    WORKER_ERROR = "worker_error"
    """A rank exited with an error code of its own."""
    PEER_LOST = "peer_lost"
    """A rank failed because a peer went away (the cause is elsewhere; see JobRestartCause)."""
    HANG = "hang"
    """No progress for ``hang_timeout``."""
    STARTUP_TIMEOUT = "startup_timeout"
    """No first step within ``startup_timeout``."""
    NODE_LOST = "node_lost"
    """A node stopped renewing its lease (power, network, agent)."""
    STRAGGLER = "straggler"
    """A node was taken out for running persistently slower than its peers (``straggler_policy: replace``)."""
    SILENT_DATA_CORRUPTION = "silent_data_corruption"
    """The job's replicas stopped agreeing (``ctx.watch_replicas``): a rank computed wrong numbers without an error."""
    NODE_FAULT = "node_fault"
    """A node was taken out by a health fault (Xid, failed check) or by an operator."""
    LAUNCH_FAILED = "launch_failed"
    """The worker could not even start (``working_dir`` gone, no such script)."""
    OTHER = "other"


_PATTERNS: tuple[tuple[FaultKind, re.Pattern[str]], ...] = (
    (FaultKind.SILENT_DATA_CORRUPTION, re.compile("^" + re.escape(divergence.REASON_PREFIX))),
    (FaultKind.STARTUP_TIMEOUT, re.compile(r"^hang: no rank on \S+ reported progress within startup_timeout")),
    (FaultKind.HANG, re.compile(r"^hang: ")),
    (FaultKind.LAUNCH_FAILED, re.compile(r"cannot start torchrun")),
    (FaultKind.PEER_LOST, re.compile(r"Connection (closed|reset) by peer|Broken pipe|Connection refused|NCCL (error|communicator was "
                                     r"aborted)|ProcessGroup\w* .*(aborted|timed? ?out)|DistNetworkError|DistBackendError", re.I)),
    (FaultKind.NODE_LOST, re.compile(r"heartbeat lost|lost with its node|silent for")),
    (FaultKind.STRAGGLER, re.compile(r"^node \S+ is UnschedulablePendingReplacement: straggler in job ")),
    (FaultKind.NODE_FAULT, re.compile(r"^node \S+ is (Unschedulable|Retired|Rebooting|missing)")),
    (FaultKind.WORKER_KILLED, re.compile(r"exited with signal \d+")),
    (FaultKind.WORKER_ERROR, re.compile(r"exited with code \d+|stopped unexpectedly")),
)


def classify(reason: str) -> FaultKind:
    for kind, pattern in _PATTERNS:
        if pattern.search(reason):
            return kind
    return FaultKind.OTHER
