"""The memory tier on one node: shard files in ``/dev/shm`` that outlive the rank.

Layout, under :func:`node_root` (one folder per node of a cluster)::

    own/<job>/a0002-r00003-s1.slot    rank 3's slot 1 in attempt 2 (reused save after save)
    own/<job>/a0002-r00003-s1.json    its descriptor: present only while the slot holds
                                      a complete, checksummed shard
    held/<job>/s000000040-r00003.shard + .json   a copy received from a peer (replica)

A rank writes its own slots; its node agent reads them (to replicate and
drain), deletes those of finished attempts and owns the folder. The two
coordinate with ``flock``: the rank holds ``LOCK_EX`` while a slot is being
written, readers hold ``LOCK_SH`` while they copy it out, and a reader
re-reads the descriptor once it holds the lock, so it never ships a slot that
was rewritten under it. The descriptor is removed before a slot is rewritten
and written (atomically) after the checksum, so "descriptor present" is the
shard's commit marker on this node.

Slots are allocated once (``posix_fallocate``: tmpfs pages are zeroed and
mapped once, then rewritten at memory speed) and reused; a rank has
``keep + 1`` of them, and up to four more while its agent's readers hold some
(a drain, the pinned replicated step, the two newest pushed ones), so memory is
bounded and a save never waits on a reader while a free slot exists.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import re
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from unbroken.rank import env as launch_env
from unbroken.checkpoint.node.cuda_host import PinnedMemory
from unbroken.checkpoint.format.manifest import ShardInfo
from unbroken.errors import CheckpointError

SHM_BASE = Path(os.environ.get(launch_env.SHM_BASE, "/dev/shm"))
_SLOT = re.compile(r"^a(\d{4})-r(\d{5})-s(\d+)\.slot$")
CAPACITY_STEP = 2 << 20
"""Slots grow in 2 MiB steps, so a state whose pickled part changes by a few bytes
(a step counter crossing 256, a growing list) reuses its mapping."""
_HELD = re.compile(r"^s(\d{9})-r(\d{5})\.shard$")


def cluster_root(cluster_dir: Path) -> Path:
    """This cluster's folder in shared memory; named by a hash, as a path may be long."""
    digest = hashlib.sha1(str(cluster_dir.resolve()).encode()).hexdigest()[:12]
    return SHM_BASE / f"unbroken-{digest}"


def node_root(cluster_dir: Path, node: str) -> Path:
    return cluster_root(cluster_dir) / node


def job_folder(job: str) -> str:
    """``job`` as one folder name: Kubernetes jobs are ``<namespace>/<name>``, which must not nest.
    Percent-encoding keeps local names (no ``/`` or ``%``) as they are."""
    return urllib.parse.quote(job, safe="")


def own_dir(root: Path, job: str) -> Path:
    return root / "own" / job_folder(job)


def held_dir(root: Path, job: str) -> Path:
    return root / "held" / job_folder(job)


def held_path(root: Path, job: str, step: int, rank: int) -> Path:
    return held_dir(root, job) / f"s{step:09d}-r{rank:05d}.shard"


def descriptor_path(data_path: Path) -> Path:
    return data_path.with_suffix(".json")


def write_descriptor(data_path: Path, info: ShardInfo) -> None:
    """Atomically: a reader sees the old descriptor, none, or the new one, never half of one."""
    path = descriptor_path(data_path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(info.encode())
    os.replace(tmp, path)


def read_descriptor(data_path: Path) -> ShardInfo | None:
    try:
        return ShardInfo.read(descriptor_path(data_path))
    except CheckpointError:
        return None


@dataclass
class Slot:
    """One reusable shared-memory buffer of a rank, mapped once."""

    path: Path
    fd: int
    view: mmap.mmap | None = None
    capacity: int = 0
    step: int | None = None
    """The step of the complete shard it holds, None while empty or being written."""
    pinned_by: PinnedMemory | None = None
    """The record its mapping is registered in (page-locked, for device-to-host copies); None: not pinned."""
    pin_refused: bool = False
    """Pinning this mapping failed, or a copy into it did not verify: until it is re-mapped, device
    copies go through a bounce buffer and no second registration is tried."""

    def fits(self, size: int) -> bool:
        """Reuse the mapping for ``size`` bytes: small changes (the pickled part of a state
        changing length) must not cost a re-map, a large shrink should give memory back."""
        return self.view is not None and self.capacity // 2 < size <= self.capacity

    def ensure_capacity(self, size: int, *, populate: bool = True) -> mmap.mmap:
        """The slot mapped with room for ``size`` bytes (rounded up to ``CAPACITY_STEP``).

        A new or resized slot is allocated (``posix_fallocate``: ENOSPC here, not a
        SIGBUS mid-copy) and its page tables filled (``MAP_POPULATE``): a fresh tmpfs
        page written from user space costs ~3 µs, a rewritten one nothing. A pinned
        mapping is unpinned before it is re-mapped (cuda_host.py says why).
        """
        if self.view is not None and self.fits(size):
            return self.view
        self._unmap()
        capacity = max(CAPACITY_STEP, -(-size // CAPACITY_STEP) * CAPACITY_STEP)
        os.ftruncate(self.fd, capacity)
        try:
            os.posix_fallocate(self.fd, 0, capacity)
        except OSError as exc:
            raise CheckpointError(f"memory tier: cannot allocate {capacity / 2**20:.1f} MiB in {self.path.parent}: {exc.strerror}") from exc
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self.view = mmap.mmap(self.fd, capacity, flags=flags)
        self.capacity = capacity
        self.pin_refused = False
        return self.view

    def pin(self, pinning: PinnedMemory) -> bool:
        """Register the mapping for device copies (once per mapping); False: copies must go through a bounce buffer."""
        if self.pinned_by is not None:
            return True
        if self.view is None or self.pin_refused:
            return False
        if pinning.pin(self.view, self.capacity):
            self.pinned_by = pinning
            return True
        self.pin_refused = True
        return False

    def distrust_pinning(self) -> None:
        """A device copy into this slot did not verify: unpin it, and copy through a bounce buffer from now on."""
        self.unpin()
        self.pin_refused = True

    def unpin(self) -> None:
        if self.pinned_by is not None and self.view is not None:
            self.pinned_by.unpin(self.view)
        self.pinned_by = None

    def _unmap(self) -> None:
        self.unpin()  # CUDA's rule: a registered range is never unmapped while registered
        if self.view is not None:
            self.view.close()
            self.view = None

    def close(self) -> None:
        self._unmap()
        os.close(self.fd)


@dataclass
class SlotPool:
    """A rank's slots in the memory tier: pick one to write, never the newest complete one."""

    directory: Path
    attempt: int
    rank: int
    keep: int
    slots: list[Slot] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    @property
    def limit(self) -> int:
        # ``keep`` complete + one being written + four readers' at most: a drain uploading a step,
        # the pinned step that survives a node loss, and the two newest replicated steps (held by
        # their pushes until one becomes the pinned one). Slots are made only when needed: the cap
        # costs no memory unless readers hold that many.
        return self.keep + 5

    def acquire(self, *, wait_seconds: float) -> Slot:
        """A slot locked for writing, its descriptor removed. Waits at most ``wait_seconds``."""
        deadline = time.monotonic() + wait_seconds
        while True:
            slot = self._try_acquire()
            if slot is not None:
                descriptor_path(slot.path).unlink(missing_ok=True)
                slot.step = None
                return slot
            if time.monotonic() >= deadline:
                raise CheckpointError(
                    f"memory tier: all {len(self.slots)} slots of rank {self.rank} are being read (replication or drain) "
                    f"after {wait_seconds:g} s; step skipped"
                )
            time.sleep(0.005)  # a poll on a lock held by another process; nothing to wait on instead

    def _try_acquire(self) -> Slot | None:
        # The newest ``keep`` complete steps stay; of the others, empty slots go first,
        # then the oldest step. So the tier holds ``keep`` steps even while a save runs.
        protected = self._protected()
        candidates = sorted(
            (s for s in self.slots if s.step is None or s.step not in protected),
            key=lambda s: -1 if s.step is None else s.step,
        )
        for slot in candidates:
            try:
                fcntl.flock(slot.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return slot
            except BlockingIOError:
                continue
        if len(self.slots) < self.limit:
            return self._new_slot()
        return None

    def _new_slot(self) -> Slot:
        """A new slot file, locked for writing.

        A file of that name may exist already: an earlier pool's of this rank and attempt (a
        script that made its checkpointer twice), maybe still held by the agent (a pinned or
        pushed step). Such a file is skipped, never waited on; an unheld one is taken over.
        """
        index = len(self.slots)
        while True:
            path = self.directory / f"a{self.attempt:04d}-r{self.rank:05d}-s{index}.slot"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                os.close(fd)
                index += 1
        descriptor_path(path).unlink(missing_ok=True)  # whatever it held is being overwritten
        slot = Slot(path, fd)
        self.slots.append(slot)
        return slot

    def prepare(self, size: int, pinning: PinnedMemory | None = None) -> None:
        """Get the slots a steady state needs (``keep + 1``) mapped for ``size`` bytes, and pinned
        with ``pinning`` (a state of device tensors), so that no save pays for it.

        Run in a background thread after a save or a restore, or once the state is known
        (``TieredCheckpointer.prepare``): a fresh slot costs ~0.3 GB/s of page faults here and
        its registration with CUDA ~2 GB/s on an H100 host, all of it a stall on a save's path.
        Free slots of another size are re-mapped; slots being read are left alone. The page
        tables are filled by a torch fill, which releases the GIL, not by ``MAP_POPULATE``,
        whose ``mmap`` call would hold it.
        """
        import torch

        while len(self.slots) < self.keep + 1:
            fcntl.flock(self._new_slot().fd, fcntl.LOCK_UN)
        for slot in list(self.slots):
            if slot.fits(size) and (pinning is None or slot.pinned_by is not None or slot.pin_refused):
                continue
            try:
                fcntl.flock(slot.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a reader holds it; a save will size it when it takes it
            try:
                if slot.step is not None and slot.step in self._protected():
                    continue  # holds one of the newest complete steps: re-mapping it would drop that step
                if not slot.fits(size):
                    descriptor_path(slot.path).unlink(missing_ok=True)
                    slot.step = None
                    torch.frombuffer(slot.ensure_capacity(size, populate=False), dtype=torch.uint8).zero_()
                if pinning is not None:
                    slot.pin(pinning)
            finally:
                fcntl.flock(slot.fd, fcntl.LOCK_UN)

    def _protected(self) -> set[int]:
        complete = sorted((s.step for s in self.slots if s.step is not None), reverse=True)
        return set(complete[: self.keep])

    def release(self, slot: Slot, info: ShardInfo | None) -> None:
        """Publish ``info`` (the slot's commit marker on this node) and unlock."""
        if info is not None:
            write_descriptor(slot.path, info)
            slot.step = info.step
        fcntl.flock(slot.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        for slot in self.slots:
            slot.close()
        self.slots.clear()


@dataclass(frozen=True)
class StoredShard:
    """A complete shard found in a node's memory tier (own slot or held replica)."""

    path: Path
    info: ShardInfo
    held: bool


def scan(root: Path, job: str | None = None) -> list[StoredShard]:
    """Complete shards on this node (those with a descriptor), own and held."""
    found: list[StoredShard] = []
    for kind, pattern in (("own", _SLOT), ("held", _HELD)):
        base = root / kind
        jobs = [base / job_folder(job)] if job else (sorted(base.iterdir()) if base.is_dir() else [])
        for folder in jobs:
            if not folder.is_dir():
                continue
            for entry in folder.iterdir():
                if not pattern.match(entry.name):
                    continue
                info = read_descriptor(entry)
                if info is not None:
                    found.append(StoredShard(entry, info, held=kind == "held"))
    return found


def empty_slots(root: Path, job: str) -> list[tuple[Path, int]]:
    """Slot files of ``job`` holding no complete shard (no descriptor), with the attempt that made them.

    Those of an older attempt than the job's were half-written by a rank that died
    mid-save: nothing can ever read them."""
    folder = own_dir(root, job)
    if not folder.is_dir():
        return []
    return [
        (entry, int(m.group(1))) for entry in folder.iterdir()
        if (m := _SLOT.match(entry.name)) and not descriptor_path(entry).exists()
    ]


def slot_attempt(path: Path) -> int | None:
    match = _SLOT.match(path.name)
    return int(match.group(1)) if match else None


class SharedRead:
    """Hold ``LOCK_SH`` on a shard file and confirm it still holds ``expected``.

    ``ok`` is False when the rank is rewriting it (lock busy) or already has
    (descriptor changed): the caller skips it rather than waiting on a save.
    """

    def __init__(self, stored: StoredShard) -> None:
        self.stored = stored
        self.fd = -1
        self.ok = False

    def __enter__(self) -> "SharedRead":
        try:
            self.fd = os.open(self.stored.path, os.O_RDONLY)
        except FileNotFoundError:
            return self
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return self
        current = read_descriptor(self.stored.path)
        self.ok = current is not None and current.checksum == self.stored.info.checksum and current.step == self.stored.info.step
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the lock
