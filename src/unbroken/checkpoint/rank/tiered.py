"""The rank's half of tiered checkpointing: ``ctx.checkpoint`` when the job file has tiers.

``save(step, state)`` lays the state out, takes one of the rank's
shared-memory slots and returns: the copy into the slot runs in a background
thread while the script goes on with its next forward and backward, and the
next ``optimizer.step()`` waits for it (checkpoint/rank/fence.py; ``fence()`` for
scripts that change the saved state otherwise). The same thread then
checksums the slot and publishes its descriptor; the node agent takes it
from there (commit, replicas, persistent tier). A second ``save`` first waits
for the previous one (tens of milliseconds per GiB) and, if every slot is
being read by a replication or a drain, waits at most ``save_wait_seconds``
before skipping the step with a warning: memory stays bounded.

``restore()`` takes the newest step every rank can load and verify, trying
for each step the rank's shard in shared memory on its node, then the copies
on peers (replicas, or the primary on another node), then the persistent
tier; any mismatch falls back to the next copy or an older step. All ranks
agree on the outcome through two small collectives.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import mmap
import threading
import time
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from unbroken.checkpoint.format import shard
from unbroken.checkpoint.node import cuda_host, shm
from unbroken.checkpoint.rank import beside, collectives, device_restore, fence, rng, tiers
from unbroken.checkpoint.api import CheckpointObserver, Restored, RestoreReport, SaveReport
from unbroken.checkpoint.node.credentials import Credentials
from unbroken.checkpoint.node.cuda_host import PinnedMemory
from unbroken.checkpoint.rank.device_copy import DeviceCopy, Expected
from unbroken.checkpoint.rank.landing import Landing
from unbroken.checkpoint.format.manifest import ShardInfo
from unbroken.checkpoint.format.restore_catalog import RestoreCatalog
from unbroken.checkpoint.node.peer import PeerClient
from unbroken.checkpoint.node.persistent import PersistentStore
from unbroken.config.checkpoint import TierPolicy
from unbroken.errors import CheckpointError

log = logging.getLogger("unbroken.checkpoint")
T = TypeVar("T")


def _say(message: str) -> None:
    """Checkpoint decisions go to the rank's log, which ``unbroken job logs`` shows."""
    print(f"unbroken: {message}", flush=True)


@dataclass(frozen=True)
class _SlotReads:
    """What reads a device save's slot beside its copy: the shard's checksum and the device tensors' fingerprints."""

    checksum: Future[str]
    fingerprints: Future[dict[int, torch.Tensor]]

    def settle(self) -> None:
        """Until neither reads the slot any more, however they ended."""
        pending: list[Future[Any]] = [self.checksum, self.fingerprints]
        futures.wait(pending)


@dataclass(frozen=True)
class Loaded:
    """A shard's payload (``step``, ``state``, ``rng``) and where it came from."""

    payload: dict[str, Any]
    source: str
    size: int = 0
    kind: str = ""
    """The restore's source as a metric label (``tiers.Location.source``)."""


@dataclass(eq=False)  # identity, not field equality: the fence keeps live checkpointers in a weak set
class TieredCheckpointer:
    job: str
    attempt: int
    rank: int
    world_size: int
    node: str
    shm_root: Path
    """This node's memory-tier folder."""
    policy: TierPolicy
    endpoint: str | None
    """The local agent's shard server (``host:port``); None outside an agent."""
    credentials: Credentials
    """The cluster's TLS credentials: to ask the agent for the catalog and read peers' copies."""
    observer: CheckpointObserver | None = None
    save_wait_seconds: float = 30.0
    pinning: PinnedMemory | None = None
    """The process's record of pinned memory over its CUDA runtime (node/cuda_host.py); None: the real
    one, taken when the first device tensor is saved. Tests pass one over a stand-in."""
    _pool: shm.SlotPool = field(init=False)
    _pending: threading.Thread | None = field(default=None, init=False)
    _last_step: int | None = field(default=None, init=False)
    _last_at: float | None = field(default=None, init=False)
    _device: DeviceCopy | None = field(default=None, init=False)
    _device_given: bool = field(default=False, init=False)
    _prefetched: dict[tuple[Path, str], mmap.mmap] = field(default_factory=dict, init=False)
    _prefetch: threading.Thread | None = field(default=None, init=False)
    _copied: threading.Event | None = field(default=None, init=False)
    _unreported: SaveReport | None = field(default=None, init=False)
    """The last save, told to the observer once its stall is known (at the fence)."""
    last_stall_seconds: float = field(default=0.0, init=False)
    """How long the last save blocked the script: ``save()``'s return plus the fence's wait."""
    last_fence_seconds: float = field(default=0.0, init=False)
    last_save_timing: dict[str, float] = field(default_factory=dict, init=False)
    """Where the last save's time went, in its background thread: ``copy_s`` (map, pin and copy; the fence waits for
    this), ``checksum_s``, ``published_s`` (all of it), and for device tensors ``verify_s``. For device tensors the
    checksum and the read-back (``verify_s``) read what the copy has landed while it goes on, so theirs count from
    the save's start too; for host tensors ``checksum_s`` is the checksum's own time, after the copy."""
    last_restore_timing: dict[str, float] = field(default_factory=dict, init=False)
    """A restore to a device from this node's shared memory: where its time went (device_restore.StreamTiming)."""

    def __post_init__(self) -> None:
        self._device_given = self.pinning is not None
        self._pool = shm.SlotPool(shm.own_dir(self.shm_root, self.job), self.attempt, self.rank, self.policy.memory.keep)
        if self.attempt > 0:
            # A restart: while the process imports, rendezvous and builds its model (seconds),
            # map this rank's newest shards on the node (~0.1 s per GiB of page tables);
            # restore() then only checksums (~35 GB/s) and makes views.
            self._prefetch = threading.Thread(target=self._map_ahead, name="ckpt-prefetch", daemon=True)
            self._prefetch.start()
        # A script that saves its last step and exits must not lose it to the interpreter
        # killing the (daemon) checksum thread: publish it on the way out.
        atexit.register(self.wait)
        fence.watch(self)

    # -- save -----------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Stage ``state`` for ``step`` if the memory policy wants it; returns once the copy is
        scheduled (the next optimizer step, or ``fence()``, waits for it)."""
        if step < 0:
            raise CheckpointError(f"checkpoint step must be >= 0, got {step}")
        if self._due(step):
            self.stage(step, state, overlap=True)

    def stage(self, step: int, state: dict[str, Any], *, overlap: bool = False) -> bool:
        """Copy ``state`` into a slot, whatever the cadence; False if the tier could not take it.
        With ``overlap`` the copy runs in the background until ``fence()``; without, it is done on return.

        No collective: callers that decide the cadence themselves (the DCP writer) use this.
        The training thread only lays the state out and takes a slot: mapping, pinning and
        copying it all run in the copy thread.
        """
        started = time.perf_counter()
        self.wait()
        layout, tensors = shard.plan({"step": step, "state": state, "rng": rng.capture()})
        try:
            slot = self._pool.acquire(wait_seconds=self.save_wait_seconds)
        except CheckpointError as exc:
            # Readers holding every slot: this step is not staged, training goes on.
            _say(f"step {step} not checkpointed: {exc}")
            return False
        device = self._device_copy(tensors)
        ready = device.pinning.runtime.marker() if device is not None else None
        copied = threading.Event()
        self._copied = copied
        self._pending = threading.Thread(target=self._copy_and_finalize, args=(slot, layout, tensors, step, device, ready, copied),
                                         name="ckpt-copy", daemon=True)
        self._pending.start()
        self._last_step, self._last_at = step, time.monotonic()
        self._unreported = SaveReport(step, "memory", 0.0, layout.size)
        self.last_fence_seconds = 0.0
        if not overlap:
            copied.wait()
        self.last_stall_seconds = time.perf_counter() - started
        if not overlap:
            self._report_save()
        return True

    def prepare(self, state: dict[str, Any]) -> None:
        """Map (and for device tensors pin) this rank's slots for ``state``'s size now, in the background, so that
        the first save costs what the others do. Call it once the state has its full size (after the first
        optimizer step, which makes Adam's moments). Without it the first save maps and pins its slot
        while the next optimizer step waits for it: seconds for GiBs."""
        self.wait()
        layout, tensors = shard.plan({"step": 0, "state": state, "rng": rng.capture()})
        device = self._device_copy(tensors)
        self._pending = threading.Thread(target=self._prepare_slots, args=(layout.size, device), name="ckpt-prepare", daemon=True)
        self._pending.start()

    def fence(self) -> None:
        """Return once the last save's bytes are all in its slot. The optimizer step does it by itself;
        call it before changing the saved state any other way."""
        copied = self._copied
        if copied is not None and not copied.is_set():
            started = time.perf_counter()
            copied.wait()
            self.last_fence_seconds = time.perf_counter() - started
            self.last_stall_seconds += self.last_fence_seconds
        self._report_save()

    def _report_save(self) -> None:
        """Tell the observer of the last save, its stall being ``save()``'s return plus the fence's wait."""
        report, self._unreported = self._unreported, None
        if report is not None and self.observer is not None:
            self.observer.saved(dataclasses.replace(report, stall_seconds=self.last_stall_seconds))

    def _runtime(self) -> cuda_host.CudaRuntime:
        if self.pinning is None:
            self.pinning = cuda_host.process_pinned_memory()
        return self.pinning.runtime

    def _device_copy(self, tensors: list[torch.Tensor]) -> DeviceCopy | None:
        """How device tensors reach a slot, if ``tensors`` has any (made on first use: it owns the bounce buffer)."""
        if self._device is None:
            pinning = self.pinning
            if pinning is None:
                if not any(t.is_cuda for t in tensors):
                    return None
                pinning = self.pinning = cuda_host.process_pinned_memory()
            self._device = DeviceCopy(pinning)
        return self._device if self._device.holds_device_tensors(tensors) else None

    def _copy_and_finalize(self, slot: shm.Slot, layout: shard.ShardLayout, tensors: list[torch.Tensor], step: int,
                           device: DeviceCopy | None, ready: Any, copied: threading.Event) -> None:
        expected: Expected | None = None
        reads: _SlotReads | None = None
        started = time.perf_counter()
        self.last_save_timing = {}
        try:
            if (slot.view is None or not slot.fits(layout.size)) and layout.size >= SAY_MAPPING_BYTES:
                _say(f"step {step}: mapping{' and pinning' if device else ''} a {layout.size / 2**30:.2f} GiB slot while the "
                     "next optimizer step waits (ctx.checkpoint.prepare(state) does it ahead)")
            buffer = slot.ensure_capacity(layout.size)
            if device is None:
                shard.write(buffer, layout, tensors)
            else:
                landing = Landing(device.pinning.runtime, layout.size)
                reads = self._read_as_landed(buffer, layout, device.device_indices(layout, tensors), landing)
                try:
                    expected = device.into(slot, buffer, layout, tensors, ready, landing)
                except BaseException as exc:
                    landing.failed(exc)
                    raise
        except BaseException as exc:  # noqa: BLE001 - a failing tier degrades: the step is lost, training goes on
            copied.set()
            if reads is not None:
                reads.settle()  # nothing reads the slot once it is given back
            self._pool.release(slot, None)
            _say(f"step {step} not checkpointed: copying it into the memory tier failed: {exc!r}")
            return
        copied.set()  # the state is the script's again; what follows reads the slot only
        self.last_save_timing["copy_s"] = time.perf_counter() - started
        self._finalize(slot, buffer, layout, step, device, expected, reads)
        self.last_save_timing["published_s"] = time.perf_counter() - started

    def _read_as_landed(self, buffer: Any, layout: shard.ShardLayout, indices: list[int], landing: Landing) -> _SlotReads:
        """Start the slot's checksum and the read-back of its device tensors' fingerprints, each reading what has
        landed while the rest is still being copied (landing.py). Their ``_s`` timings count from the copy's start."""
        timing = self.last_save_timing
        return _SlotReads(
            checksum=beside.beside(lambda: beside.timed(timing, "checksum_s",
                                                        lambda: shard.checksum(buffer, layout.size, ready=landing.wait_for)),
                                   name="ckpt-checksum"),
            fingerprints=beside.beside(lambda: beside.timed(timing, "verify_s",
                                                            lambda: DeviceCopy.fingerprint_slot(buffer, layout, indices, landing.wait_for)),
                                       name="ckpt-verify"),
        )

    @property
    def last_step(self) -> int | None:
        """The last step this rank staged (its shard may still be checksumming)."""
        return self._last_step

    def wait(self) -> None:
        """Until the last save's shard is checksummed and visible to the agent."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        self.fence()  # nothing left to wait for: reports the save if no optimizer step did

    def _due(self, step: int) -> bool:
        memory = self.policy.memory
        since = None if self._last_at is None else time.monotonic() - self._last_at
        due = memory.due(step, last_step=self._last_step, seconds_since_last=since)
        if memory.every_seconds is None:
            return due
        # Ranks reach a step at slightly different times: agree, or no step would ever commit.
        return collectives.any_rank(due)

    def _finalize(self, slot: shm.Slot, buffer: Any, layout: shard.ShardLayout, step: int, device: DeviceCopy | None,
                  expected: Expected | None, reads: _SlotReads | None) -> None:
        """Checksum the slot and publish it, once a device copy's bytes are proven to be the device's."""
        info: ShardInfo | None = None
        try:
            differs: str | None = None
            if reads is None:
                digest = beside.timed(self.last_save_timing, "checksum_s", lambda: shard.checksum(buffer, layout.size))
            else:
                try:
                    differs = ("the device's fingerprints are missing" if expected is None
                               else DeviceCopy.verify(reads.fingerprints.result(), layout, expected))
                except Exception as exc:  # noqa: BLE001 - a check that cannot be made is a check that failed
                    differs = f"the check itself failed: {exc!r}"
                digest = reads.checksum.result()
            if differs is None:
                info = ShardInfo.describe(
                    job=self.job, step=step, rank=self.rank, world_size=self.world_size, attempt=self.attempt,
                    layout=layout, checksum=digest,
                )
            else:
                path = "the bounce buffer" if expected is not None and expected.through_bounce else "its pinned mapping"
                _say(f"step {step} not checkpointed: the slot's copy through {path} is not what the device held "
                     f"({differs}); the newest checkpoint is the one before, and this slot's next copies go "
                     "through a bounce buffer")
                slot.distrust_pinning()
        finally:
            if reads is not None:
                reads.settle()
            self._pool.release(slot, info)
        self._prepare_slots(layout.size, device)

    def _after_restore(self, size: int, device: DeviceCopy | None) -> None:
        self.wait_prefetch()  # a restore to the device reads the files itself: the head start may still be mapping
        unused, self._prefetched = self._prefetched, {}
        for view in unused.values():
            try:
                view.close()
            except BufferError:
                pass  # something still views it: its pages go with the last view
        self._prepare_slots(size, device)

    def _prepare_slots(self, size: int, device: DeviceCopy | None = None) -> None:
        try:
            self._pool.prepare(size, device.pinning if device is not None else None)
        except (OSError, CheckpointError) as exc:
            _say(f"memory tier: could not allocate slots ahead of time ({exc}); saves will allocate them")

    def agreed(self, step: int) -> None:
        """Nothing here: the memory tier keeps ``memory.keep`` steps per job and the persistent tier its own; a
        check every ``keep - 1`` saves or more often keeps the agreed step among them
        (docs/silent-data-corruption.md)."""

    def distrust_after(self, step: int, why: str) -> None:
        """Nothing here: the steps committed after ``step`` are rows in the catalog every node shares, and the
        controller marks them ``Untrusted`` when it restarts the job (a rank cannot speak for the other nodes')."""
        _say(f"steps after {step} are not to be restored: {why}")

    def close(self) -> None:
        self.wait()
        fence.forget(self)
        self._pool.close()

    # -- restore --------------------------------------------------------------------

    def restore(self, device: torch.device | str | None = None) -> Restored | None:
        """The newest step every rank can load and verify, or None. With ``device`` (``"cuda"``), its
        tensors come back on that device, streamed from shared memory through pinned memory
        (device_restore.py); without, they are host tensors (views of the shard where they can be)."""
        started = time.perf_counter()
        target = torch.device(device) if device is not None else None
        if target is not None and target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        catalog = collectives.from_rank0(self.catalog)
        for step in catalog.candidates():
            loaded = self.load_shard(step, self.rank, catalog, device=target)
            if collectives.all_ok(loaded is not None):
                assert loaded is not None
                rng.apply(loaded.payload["rng"])
                _say(f"restored step {step} from {loaded.source}")
                # The next saves will be about this size: get their slots ready (pinned, for a device state) meanwhile,
                # and let the mappings restore did not use go there too (unmapping GiBs takes a while).
                device_copy = self._device_copy(list(device_restore.tensors_in(loaded.payload["state"])))
                self._pending = threading.Thread(target=self._after_restore, args=(loaded.size, device_copy),
                                                 name="ckpt-prepare", daemon=True)
                self._pending.start()
                if self.observer is not None:
                    self.observer.restored(RestoreReport(step, loaded.kind, time.perf_counter() - started))
                return Restored(step=step, state=loaded.payload["state"], source=loaded.source)
            _say(f"step {step} is not restorable on every rank; trying an older step")
        return None

    def catalog(self, *, any_world_size: bool = False) -> RestoreCatalog:
        """Steps committed in memory (from the agent) and in the persistent tier, and where
        each shard's copies are. No collective: ``restore`` has rank 0 build it and broadcast.
        ``any_world_size`` keeps steps saved by a different number of ranks (DCP reshards)."""
        catalog = RestoreCatalog(job=self.job)
        if self.endpoint is not None:
            try:
                with PeerClient(self.endpoint, self.credentials) as agent:
                    catalog = agent.catalog(self.job)
            except (OSError, CheckpointError) as exc:
                _say(f"memory tier catalog unavailable ({exc}); looking at the persistent tier only")
        if not any_world_size:
            # written by a run of another size: not ours to load per rank
            catalog = catalog.model_copy(update={"memory": tuple(s for s in catalog.memory if s.world_size == self.world_size)})
        if self.policy.persistent is not None:
            try:
                persistent = PersistentStore(self.policy.persistent.uri).committed_steps(self.job)
                # committed in the tier but marked Untrusted in the catalog (silent data corruption): never a candidate
                catalog = catalog.model_copy(update={"persistent": tuple(s for s in persistent if s not in catalog.untrusted)})
            except Exception as exc:  # noqa: BLE001 - an unreachable tier is a fallback lost, not a crash
                _say(f"persistent tier {self.policy.persistent.uri} unavailable for restore: {exc}")
        return catalog

    def tiers(self) -> list[tiers.Tier]:
        """Where this rank can read shards from; :func:`tiers.locations` orders their copies."""
        found: list[tiers.Tier] = [
            tiers.SharedMemoryTier(self.job, self.node, self.shm_root, self.attempt, self.rank, self._mapping),
            tiers.PeerTier(self.job, self.node, self.credentials),
        ]
        if self.policy.persistent is not None:
            found.append(tiers.PersistentTier(self.job, self.policy.persistent.uri))
        return found

    def load_shard(self, step: int, rank: int, catalog: RestoreCatalog | None = None, *,
                   device: torch.device | None = None) -> Loaded | None:
        """Rank ``rank``'s payload of ``step`` from the fastest copy that verifies, or None; its state's
        tensors on ``device`` if one is given.

        Any rank's shard can be loaded from anywhere (the DCP reader needs that when
        the world size changes); ``restore`` loads its own.
        """
        catalog = catalog if catalog is not None else self.catalog()
        # A CPU "device" goes through the stream only with a runtime of the checkpointer's own (a stand-in that plays the device).
        runtime = self._runtime() if device is not None and (device.type != "cpu" or self._device_given) else None
        for tier, location in tiers.locations(self.tiers(), catalog, step, rank):
            try:
                if runtime is None:
                    loaded = tier.read(location, step, rank)
                elif isinstance(tier, tiers.SharedMemoryTier):
                    self.last_restore_timing = {}
                    loaded = tier.read_to_device(location, step, rank, device, runtime, self.last_restore_timing)
                else:
                    loaded = tier.read(location, step, rank)
                    loaded = tiers.Loaded(device_restore.to_device(loaded.payload, device, runtime), loaded.size)  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - any unreadable copy means: try the next one
                _say(f"step {step} rank {rank} from {location.description}: {exc}")
                continue
            payload = loaded.payload
            if not isinstance(payload, dict) or payload.get("step") != step or "state" not in payload:
                _say(f"step {step} rank {rank} from {location.description}: not a step-{step} checkpoint")
                continue
            return Loaded(payload, location.description, loaded.size, location.source)
        return None

    PREFETCH_STEPS = 2

    def wait_prefetch(self) -> None:
        """Until the restart's head start (mapping this rank's newest local shards) is done."""
        if self._prefetch is not None:
            self._prefetch.join()

    def _map_ahead(self) -> None:
        try:
            mine = sorted(
                (s for s in shm.scan(self.shm_root, self.job) if s.info.rank == self.rank and s.info.attempt < self.attempt),
                key=lambda s: s.info.step, reverse=True,
            )[: self.PREFETCH_STEPS]
            for stored in mine:
                self._prefetched[(stored.path, stored.info.checksum)] = beside.map_private(stored.path, stored.info.size)
        except (OSError, ValueError):
            pass  # only a head start: restore maps what it needs itself

    def _mapping(self, stored: shm.StoredShard) -> mmap.mmap:
        if self._prefetch is not None:
            self._prefetch.join()
        return self._prefetched.pop((stored.path, stored.info.checksum), None) or beside.map_private(stored.path, stored.info.size)

SAY_MAPPING_BYTES = 64 << 20
"""A save that must map its slot first says so from this size on, where the stall starts to show."""


def from_environment(env: Any, rank: int, world_size: int, policy: TierPolicy, observer: CheckpointObserver | None) -> TieredCheckpointer:
    """The checkpointer a rank launched by an agent gets (``unbroken.init``)."""
    from unbroken.checkpoint.node import credentials
    from unbroken.plumbing.layout import ClusterLayout

    assert env.cluster_dir is not None
    return TieredCheckpointer(
        job=env.job, attempt=env.attempt, rank=rank, world_size=world_size, node=env.node,
        shm_root=shm.node_root(env.cluster_dir, env.node), policy=policy, endpoint=env.advertised_endpoint,
        credentials=credentials.load_when_written(ClusterLayout.at(env.cluster_dir).root), observer=observer,
    )

