"""What a restoring rank learns about a job's checkpoints: the restore catalog, typed and versioned.

The node agent answers with the steps committed in memory, where every copy of
each rank's shard is (own slot or replica, and on which node) and each node's
shard server; the rank adds the steps it finds committed in the persistent tier.
Rank 0 builds it and broadcasts it, so every rank walks the same candidates.

It crosses two wires (agent → rank as JSON, rank 0 → ranks pickled), so it is a
pydantic model: ranks are ints after a JSON round trip, a catalog of another
format version is refused with a clear error instead of misread.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CopyLocation(_Wire):
    node: str
    tier: Literal["memory", "replica"]
    """memory: the rank's own slot on the node that wrote it; replica: a copy a peer holds."""


class CatalogStep(_Wire):
    step: int
    attempt: int
    """Only copies of this attempt belong to the step (a re-saved step has a new attempt)."""
    world_size: int
    copies: dict[int, tuple[CopyLocation, ...]] = Field(default_factory=dict)
    """By rank."""


class RestoreCatalog(_Wire):
    version: Literal[1] = 1
    job: str
    memory: tuple[CatalogStep, ...] = ()
    """Steps committed in shared memory, newest first."""
    persistent: tuple[int, ...] = ()
    """Steps committed in the persistent tier, newest first."""
    endpoints: dict[str, str] = Field(default_factory=dict)
    """Each node's shard server, ``host:port``."""
    untrusted: tuple[int, ...] = ()
    """Persistent-tier steps the catalog marks Untrusted (saved after the replicas last agreed): the tier still holds
    them committed; they are never restored. (A memory step marked so is simply not in ``memory``; a later attempt's
    save of the same step number is, and is trusted.)"""

    def memory_step(self, step: int) -> CatalogStep | None:
        return next((s for s in self.memory if s.step == step), None)

    def candidates(self) -> list[int]:
        """Every step some tier has committed, newest first."""
        return sorted({s.step for s in self.memory} | (set(self.persistent) - set(self.untrusted)), reverse=True)
