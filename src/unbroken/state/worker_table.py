"""The ``WorkerTable`` protocol: the local backend's record of the workers it runs.

A worker is one attempt's ``torchrun`` group on one node, the local analogue of
a pod. The controller never writes it directly: it asks the backend to launch
or stop an attempt, and the local backend does so by writing rows here that
the node agents carry out (like a kubelet reading its pods) and report back on.
On Kubernetes there is no such table: pods are the workers, and kubelet runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from unbroken.state.records import Worker
from unbroken.state.updates import WorkerUpdate


class WorkerTable(Protocol):
    def add_workers(self, workers: Sequence[Worker]) -> list[Worker]:
        """All or none (an attempt is launched on all its nodes at once); returns them with their ids."""
    def list_workers(
        self, *, job: str | None = None, node: str | None = None, attempt: int | None = None, active: bool = False
    ) -> list[Worker]:
        """Oldest first; ``active`` keeps only Pending and Running workers."""
    def update_worker(self, worker_id: int, update: WorkerUpdate) -> Worker: ...
    def progress_samples(self, job: str) -> list[tuple[int, float, int]]:
        """(attempt, time, step) of the job over its life, from the lease renewals (the step-over-time plot)."""
