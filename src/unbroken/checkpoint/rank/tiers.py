"""The tiers a restore reads from, behind one small protocol, and the order it tries them in.

Each tier says where it holds a copy of a rank's shard of a step (``locate``)
and reads one copy, checking its checksum (``read``). A restore tries every
location of a step in :data:`RESTORE_ORDER` and takes the first copy that
reads and verifies; only when none does is the step given up for an older one.

- shared memory on this node: the rank's own slot, or a replica held here
  (a rank restarted on a node holding its peer's replica reads it locally);
- a peer's shared memory: a replica first (it exists to be read), then the shard's
  primary slot on the node that wrote it, over the authenticated shard protocol;
- the persistent tier (``file://``, ``s3://``), read back through fsspec.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from unbroken.checkpoint.format import shard
from unbroken.checkpoint.node import shm
from unbroken.checkpoint.rank import device_restore
from unbroken.checkpoint.node.credentials import Credentials
from unbroken.checkpoint.node.cuda_host import CudaRuntime
from unbroken.checkpoint.format.manifest import ShardInfo
from unbroken.checkpoint.node.peer import PeerClient
from unbroken.checkpoint.node.persistent import PersistentStore
from unbroken.checkpoint.format.restore_catalog import RestoreCatalog
from unbroken.errors import CheckpointError


class SourceKind(StrEnum):
    LOCAL = "local"
    PEER_REPLICA = "peer-replica"
    PEER_PRIMARY = "peer-primary"
    PERSISTENT = "persistent"


RESTORE_ORDER: tuple[SourceKind, ...] = (SourceKind.LOCAL, SourceKind.PEER_REPLICA, SourceKind.PEER_PRIMARY, SourceKind.PERSISTENT)
"""Fastest first: a local memory read at memcpy speed, a peer over the network, then storage."""


@dataclass(frozen=True)
class Location:
    kind: SourceKind
    description: str
    """For the rank's log: ``memory on node-1``, ``replica on node-3``, ``persistent s3://...``."""
    where: str = ""
    """A node's shard server or the tier's URI."""
    attempt: int | None = None
    """The attempt whose copy this is (memory tiers): a re-saved step has copies of two attempts."""
    source: str = ""
    """The metric label of a restore from here: ``memory``, ``replica``, ``peer`` or ``persistent``."""


@dataclass(frozen=True)
class Loaded:
    payload: Any
    size: int


class Tier(Protocol):
    def locate(self, catalog: RestoreCatalog, step: int, rank: int) -> list[Location]:
        """Where this tier holds rank ``rank``'s shard of ``step``, by the catalog."""

    def read(self, location: Location, step: int, rank: int) -> Loaded:
        """The shard's payload from that copy; raises if it is missing or fails its checksum."""


def locations(tiers: list[Tier], catalog: RestoreCatalog, step: int, rank: int) -> list[tuple[Tier, Location]]:
    """Every copy of the shard with the tier that reads it, in restore order (stable within a kind)."""
    found = [(tier, loc) for tier in tiers for loc in tier.locate(catalog, step, rank)]
    return sorted(found, key=lambda pair: RESTORE_ORDER.index(pair[1].kind))


Mapper = Callable[[shm.StoredShard], mmap.mmap]


@dataclass
class SharedMemoryTier:
    """This node's shared memory: the rank's own slots and the replicas held here."""

    job: str
    node: str
    root: Path
    attempt: int
    """The reading rank's attempt: its own slots of this attempt are reused by later saves."""
    rank: int
    mapper: Mapper
    """Maps a shard file privately (the checkpointer's prefetch may have mapped it already)."""

    def locate(self, catalog: RestoreCatalog, step: int, rank: int) -> list[Location]:
        entry = catalog.memory_step(step)
        copies = entry.copies.get(rank, ()) if entry else ()
        here = [c for c in copies if c.node == self.node]
        if not here:
            return []
        tier = "memory" if any(c.tier == "memory" for c in here) else "replica"
        assert entry is not None
        return [Location(SourceKind.LOCAL, f"{tier} on {self.node}", self.node, entry.attempt, tier)]

    def read(self, location: Location, step: int, rank: int) -> Loaded:
        """Straight from shared memory, checksum first.

        Files of an earlier attempt (and held replicas) are never rewritten in place,
        only unlinked or replaced by a rename, so the tensors can be views of a
        private mapping of them: no copy, and the pages live as long as the tensors.
        This rank's own slots of its own attempt are reused by later saves: those are copied.
        """
        stored = self._find(location, step, rank)
        info = stored.info
        reused_later = not stored.held and info.attempt == self.attempt and info.rank == self.rank
        view = self.mapper(stored)
        got = shard.checksum(view, info.size, like=info.checksum)
        if got != info.checksum:
            view.close()
            raise CheckpointError(f"{stored.path}: checksum mismatch (descriptor {info.checksum}, data {got})")
        return Loaded(shard.read(view, info.metas(), info.skeleton_offset, info.size, copy=reused_later), info.size)

    def read_to_device(self, location: Location, step: int, rank: int, device: Any, runtime: CudaRuntime,
                       timing: dict[str, float] | None = None) -> Loaded:
        """Straight from the shard file onto ``device`` through pinned memory (device_restore.py), checksum on the way."""
        stored = self._find(location, step, rank)
        return Loaded(device_restore.read_file(stored.path, stored.info, device, runtime, timing), stored.info.size)

    def _find(self, location: Location, step: int, rank: int) -> shm.StoredShard:
        for stored in shm.scan(self.root, self.job):
            info = stored.info
            if info.step == step and info.rank == rank and info.attempt == location.attempt:
                return stored
        raise CheckpointError(f"no copy of step {step} rank {rank} in {self.root}")


@dataclass
class PeerTier:
    """Other nodes' shared memory, through their shard servers."""

    job: str
    node: str
    credentials: Credentials

    def locate(self, catalog: RestoreCatalog, step: int, rank: int) -> list[Location]:
        entry = catalog.memory_step(step)
        copies = entry.copies.get(rank, ()) if entry else ()
        return [
            Location(SourceKind.PEER_REPLICA if c.tier == "replica" else SourceKind.PEER_PRIMARY, f"{c.tier} on {c.node}",
                     catalog.endpoints[c.node], source="replica" if c.tier == "replica" else "peer")
            for c in copies if c.node != self.node and catalog.endpoints.get(c.node)
        ]

    def read(self, location: Location, step: int, rank: int) -> Loaded:
        holder: dict[str, bytearray] = {}

        def into(info: ShardInfo) -> memoryview:
            holder["buffer"] = bytearray(info.size)
            return memoryview(holder["buffer"])

        with PeerClient(location.where, self.credentials) as peer:
            info = peer.get(self.job, step, rank, into)
        buffer = holder.get("buffer", bytearray(1))
        return Loaded(shard.read(buffer, info.metas(), info.skeleton_offset, info.size, copy=False), info.size)


@dataclass
class PersistentTier:
    """The job's ``file://`` or ``s3://`` tier."""

    job: str
    uri: str

    def locate(self, catalog: RestoreCatalog, step: int, rank: int) -> list[Location]:
        return [Location(SourceKind.PERSISTENT, f"persistent {self.uri}", self.uri, source="persistent")] if step in catalog.persistent else []

    def read(self, location: Location, step: int, rank: int) -> Loaded:
        store = PersistentStore(self.uri)
        info = store.manifest(self.job, step).shard(rank)
        data = store.read_shard(info)
        return Loaded(shard.read(data, info.metas(), info.skeleton_offset, info.size, copy=False), info.size)
