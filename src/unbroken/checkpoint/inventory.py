"""What a job's checkpoints look like across tiers, for ``unbroken ckpt list/verify/prune``.

Built from the store (where the agents record every copy) plus, for
``verify``, the bytes themselves: every node's shard server re-checksums its
copies, and the persistent tier is read back through fsspec.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from unbroken.checkpoint.node.credentials import Credentials
from unbroken.checkpoint.node.peer import PeerClient
from unbroken.checkpoint.node.persistent import PersistentStore
from unbroken.errors import CheckpointError
from unbroken.state.catalog import CheckpointCatalog
from unbroken.state.records import CheckpointStep, CheckpointTier, Event
from unbroken.state.store import ClusterStore


@dataclass(frozen=True)
class StepSummary:
    step: int
    world_size: int
    attempt: int
    size: int
    memory: str
    """Committed / - (not or no longer in shared memory)."""
    memory_copies: int
    """Ranks with their own copy still in shared memory."""
    replicated: int
    """Ranks with at least one replica on a peer."""
    persistent: str
    """Committed / Draining / Failed / Untrusted (saved after the replicas last agreed) / -."""
    persistent_message: str | None
    committed_at: float | None


@dataclass(frozen=True)
class Inventory:
    job: str
    steps: list[StepSummary]
    tier_warnings: list[Event] = field(default_factory=list)


def inventory(catalog: CheckpointCatalog, cluster: ClusterStore, job: str) -> Inventory:
    rows = catalog.list_checkpoint_steps(job)
    copies = catalog.list_shard_copies(job)
    by_step: dict[int, dict[CheckpointTier, CheckpointStep]] = {}
    for row in rows:
        by_step.setdefault(row.step, {})[row.tier] = row
    summaries = []
    for step in sorted(by_step, reverse=True):
        tiers = by_step[step]
        first = tiers.get(CheckpointTier.MEMORY) or tiers[CheckpointTier.PERSISTENT]
        mem = tiers.get(CheckpointTier.MEMORY)
        per = tiers.get(CheckpointTier.PERSISTENT)
        here = [c for c in copies if c.step == step and c.attempt == first.attempt]
        summaries.append(StepSummary(
            step=step, world_size=first.world_size, attempt=first.attempt, size=first.size,
            memory=mem.status.value if mem else "-",
            memory_copies=len({c.rank for c in here if c.tier is CheckpointTier.MEMORY}),
            replicated=len({c.rank for c in here if c.tier is CheckpointTier.REPLICA}),
            persistent=per.status.value if per else "-", persistent_message=per.message if per else None,
            committed_at=min((t.committed_at for t in tiers.values() if t.committed_at), default=None),
        ))
    warnings = cluster.list_events(object_kind="Job", object_name=job, reason="CheckpointTierFailing")
    return Inventory(job, summaries, warnings[-3:])


@dataclass(frozen=True)
class CopyCheck:
    step: int
    rank: int
    tier: str
    where: str
    ok: bool | None
    """None: could not be checked (node unreachable); restore would skip those copies."""
    detail: str = ""


def verify_memory(catalog: CheckpointCatalog, job: str, credentials: Credentials) -> Iterator[CopyCheck]:
    """Every node's shard server re-checksums its copies of ``job``."""
    for node, address in sorted(catalog.shard_servers().items()):
        try:
            with PeerClient(address, credentials) as peer:
                results = peer.verify(job)
        except (OSError, CheckpointError) as exc:
            if any(c.node == node for c in catalog.list_shard_copies(job)):
                yield CopyCheck(-1, -1, "memory", node, None, f"node unreachable: {exc}")
            continue
        for r in results:
            tier = "replica" if r["held"] else "memory"
            yield CopyCheck(r["step"], r["rank"], tier, node, bool(r["ok"]), "" if r["ok"] else "checksum mismatch")


def verify_persistent(uri: str, job: str, steps: list[int] | None, on_bytes: Callable[[int], None] | None = None) -> Iterator[CopyCheck]:
    """Read back every shard of the committed steps (or ``steps``) and check it."""
    tier = PersistentStore(uri)
    for step in steps if steps is not None else tier.committed_steps(job):
        where = tier.display(job, step)
        if not tier.is_committed(job, step):
            yield CopyCheck(step, -1, "persistent", where, False, "no COMMITTED marker")
            continue
        try:
            manifest = tier.manifest(job, step)
        except (OSError, CheckpointError) as exc:
            yield CopyCheck(step, -1, "persistent", where, False, str(exc))
            continue
        for info in manifest.shards:
            try:
                tier.read_shard(info)
                yield CopyCheck(step, info.rank, "persistent", where, True)
            except (OSError, CheckpointError) as exc:
                yield CopyCheck(step, info.rank, "persistent", where, False, str(exc))
            if on_bytes:
                on_bytes(info.size)
