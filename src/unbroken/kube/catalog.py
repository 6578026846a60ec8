"""The checkpoint catalog on Kubernetes: not kept yet.

The tiered checkpoint's bookkeeping (which shard of which step is in which
node's memory, in which replica, in the persistent tier) lives in the local
backend's SQLite file. On Kubernetes it has no home yet (a ConfigMap per job
would do for the step records; shard copies need more), so ranks in pods use
their file checkpoints (``UNBROKEN_CHECKPOINT_DIR`` on a shared volume) and the
operator reports no committed steps. Reads answer "nothing"; writes refuse
clearly instead of losing bookkeeping silently.
"""

from __future__ import annotations

from unbroken.errors import BackendError
from unbroken.state.records import CheckpointStep, CheckpointTier, ShardCopy

_REFUSAL = "the tiered checkpoint's catalog is not available on Kubernetes yet (docs/kubernetes.md): use a file checkpoint dir"


class NoCheckpointCatalog:
    def put_shard_copy(self, copy: ShardCopy) -> None:
        raise BackendError(_REFUSAL)

    def list_shard_copies(self, job: str, *, step: int | None = None, tier: CheckpointTier | None = None) -> list[ShardCopy]:
        return []

    def delete_shard_copies(self, job: str, step: int, *, tier: CheckpointTier | None = None, node: str | None = None,
                            rank: int | None = None) -> None:
        return None

    def put_checkpoint_step(self, record: CheckpointStep, *, only_if_absent: bool = False) -> bool:
        raise BackendError(_REFUSAL)

    def replace_checkpoint_step(self, current: CheckpointStep, new: CheckpointStep | None) -> bool:
        raise BackendError(_REFUSAL)

    def list_checkpoint_steps(self, job: str, *, tier: CheckpointTier | None = None) -> list[CheckpointStep]:
        return []

    def delete_checkpoint_step(self, job: str, step: int, tier: CheckpointTier) -> None:
        return None

    def set_shard_server(self, node: str, address: str) -> None:
        raise BackendError(_REFUSAL)

    def shard_servers(self) -> dict[str, str]:
        return {}
