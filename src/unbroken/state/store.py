"""The ``ClusterStore`` protocol: the control-plane objects every component shares.

Nodes (with their labels: health state, deep-check status, fault type and
reason), jobs (spec and status), events, and one lease per node. It is shaped
so that an API server can hold it: every method is one object read or write;
conditional writes carry the version the writer read (``resourceVersion``);
there is no transaction spanning objects and no catch-all key-value table.
High-churn data stays out: a node's heartbeat and its ranks' progress are one
lease renewal per node per second (``renew_lease``), and checkpoint bookkeeping
lives in the :class:`~unbroken.state.catalog.CheckpointCatalog`.

Local clusters use :class:`~unbroken.state.sqlite.SqliteStore`; the Kubernetes
backend maps the same methods onto Nodes (labels, taints, conditions),
PyTorchJob/TrainJob annotations and status, Events and coordination.k8s.io Leases.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from unbroken.errors import ConflictError
from unbroken.state.records import ClusterRecord, ClusterStatus, Event, EventType, Job, Node, WorkerProgress
from unbroken.state.updates import JobUpdate, NodeUpdate


class StaleUpdate(ConflictError):
    """A conditional write found a newer version than the one the writer read. Re-read and decide again."""


def check_version(what: str, current: int, expected: int | None) -> None:
    """The conditional-write check every store makes: StaleUpdate unless ``expected`` is None or current."""
    if expected is not None and current != expected:
        raise StaleUpdate(f"{what} changed since it was read (version {current}, expected {expected})")


class ClusterStore(Protocol):
    # the cluster object
    def cluster(self) -> ClusterRecord: ...
    def set_cluster_status(self, status: ClusterStatus) -> None: ...
    def set_controller_metrics(self, address: str | None) -> None:
        """Where the running controller serves its metrics (None: it stopped)."""

    # nodes
    def add_node(self, node: Node) -> None:
        """Raises ConflictError if a node of that name exists (names are never reused)."""
    def get_node(self, name: str) -> Node: ...
    def list_nodes(self) -> list[Node]: ...
    def update_node(self, name: str, update: NodeUpdate, *, expect_version: int | None = None) -> Node:
        """Apply ``update`` (state changes checked against the node lifecycle); with
        ``expect_version``, only if the node is still at that version, else StaleUpdate."""

    def renew_lease(self, node: str, *, at: float, progress: Sequence[WorkerProgress] = ()) -> None:
        """The node's heartbeat, with its workers' progress since the last renewal: one write.
        Agents call it at most once a second; it does not change the node's version."""

    # jobs
    def add_job(self, job: Job) -> None:
        """Raises ConflictError if the name is taken; then nothing is written."""
    def get_job(self, name: str) -> Job: ...
    def list_jobs(self) -> list[Job]: ...
    def update_job(self, name: str, update: JobUpdate, *, expect_version: int | None = None) -> Job: ...

    # events
    def add_event(
        self, object_kind: str, object_name: str, reason: str, message: str, *, type: EventType = EventType.NORMAL
    ) -> Event: ...
    def list_events(
        self, *, object_kind: str | None = None, object_name: str | None = None, reason: str | None = None
    ) -> list[Event]:
        """Oldest first."""
