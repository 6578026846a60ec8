"""The ``CheckpointCatalog`` protocol: where every shard copy is, and each step's state per tier.

Separate from the :class:`~unbroken.state.store.ClusterStore` because of its
churn: the node agents record copies, commits, replicas and drains several times
a second while a job checkpoints. Locally it is the same SQLite file; on
Kubernetes, ConfigMaps written about twice per node per save (kubernetes/backend/catalog.py),
which holds to a few hundred nodes; past that the design wants it served off the API server.

Agents on different nodes race for the same rows (two of them see a step due
for the persistent tier, or finish its last shard together). Instead of
transactions the catalog offers two atomic primitives, which an agent-served
catalog can provide as easily as SQLite: insert-if-absent
(``put_checkpoint_step(..., only_if_absent=True)``) and compare-and-swap
(``replace_checkpoint_step(current, new)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from unbroken.state.records import CheckpointStep, CheckpointTier, ShardCopy


class CopyKey(NamedTuple):
    """One shard copy's identity: at most one copy of a rank's shard of a step per tier and node."""

    step: int
    tier: CheckpointTier
    node: str
    rank: int


class CheckpointCatalog(Protocol):
    copy_write_delay: float
    """How long an agent may hold its copy changes to send them together (0: write each pass's at once):
    what a write costs the catalog's home."""
    forget_write_delay: float
    """How long forgotten copies alone may wait for the next write (they ride with the next save's)."""
    replica_write_wait: float
    """How much longer than ``copy_write_delay`` an agent may hold its copy changes while a peer pushes it
    replicas, so that a save's own copies and held replicas are one write (0: no wait)."""

    # shard copies
    def put_shard_copy(self, copy: ShardCopy) -> None: ...
    def update_shard_copies(self, job: str, *, put: Sequence[ShardCopy] = (), forget: Sequence[CopyKey] = ()) -> None:
        """Record the copies ``put`` and forget exactly the copies ``forget``, in as few writes as the catalog allows."""
    def list_shard_copies(self, job: str, *, step: int | None = None, tier: CheckpointTier | None = None) -> list[ShardCopy]:
        """Newest step first."""
    def delete_shard_copies(self, job: str, step: int, *, tier: CheckpointTier | None = None, node: str | None = None,
                            rank: int | None = None) -> None: ...

    # step states per tier
    def put_checkpoint_step(self, record: CheckpointStep, *, only_if_absent: bool = False) -> bool:
        """Write a step's row in one tier; with ``only_if_absent``, False if someone wrote it first."""
    def replace_checkpoint_step(self, current: CheckpointStep, new: CheckpointStep | None) -> bool:
        """Compare-and-swap: if the stored row still equals ``current`` field for field, write
        ``new`` (None deletes it) and return True; else change nothing and return False."""
    def list_checkpoint_steps(self, job: str, *, tier: CheckpointTier | None = None) -> list[CheckpointStep]:
        """Newest first."""
    def delete_checkpoint_step(self, job: str, step: int, tier: CheckpointTier) -> None: ...

    # where each node's shard server listens
    def set_shard_server(self, node: str, address: str) -> None: ...
    def shard_servers(self) -> dict[str, str]: ...
