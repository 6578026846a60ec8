"""The node agent's half of tiered checkpointing.

One reconciler pass (every ``PASS_SECONDS``) over this node's shared memory and the store:

1. **record**: every complete shard found here (own slots, held replicas) becomes a
   ``ShardCopy`` row; copies that vanished (slot rewritten, file deleted) lose theirs.
   A shard from an attempt older than the job's current one is recorded only if
   its step already committed (fencing: a slow rank of a failed attempt cannot
   complete a step of the new timeline).
2. **commit (memory)**: a step whose every rank has a copy from one attempt gets its
   ``Committed`` row; the row is the memory tier's commit marker.
3. **replicate**: each own shard of the newest committed step goes to ``replicas``
   peers (ring order of the schedulable nodes, never this one), in a worker thread.
4. **drain**: the persistent policy picks committed steps; the first agent to see one
   due opens a ``Draining`` row, every agent uploads its ranks' shards, the agent that
   completes the set writes manifest + marker and commits the row. Failures retry
   with backoff and then mark the step ``Failed`` (warning event, log line): the
   tier degrades, training never stops.
5. **retain**: per tier, the newest ``keep`` committed steps stay; older rows, held
   replicas and slots of finished attempts go. Nothing newer than the newest
   committed step is touched, and files being read are only unlinked (a reader
   keeps its open file), never rewritten.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unbroken.checkpoint import shm
from unbroken.checkpoint.manifest import ShardInfo, StepManifest
from unbroken.checkpoint.peer import PeerClient, ShardServer
from unbroken.checkpoint.persistent import PersistentStore
from unbroken.config.checkpoint import TierPolicy
from unbroken.state.phases import NodeState
from unbroken.state.records import CheckpointStep, CheckpointTier, EventType, Job, ShardCopy, StepStatus
from unbroken.state.store import Store

log = logging.getLogger("unbroken.checkpoint")

PASS_SECONDS = 0.1
DRAIN_RETRIES = 3
RETRY_BASE_SECONDS = 0.5
COMMIT_CLAIM = "committing: "
COMMIT_CLAIM_SECONDS = 60.0
ENDPOINT_KEY = "ckpt-endpoint/"
"""Store meta key prefix: ``ckpt-endpoint/<node>`` = the node's shard server address."""


def endpoint_key(node: str) -> str:
    return ENDPOINT_KEY + node


def _copy_of(stored: shm.StoredShard, node: str) -> ShardCopy:
    info = stored.info
    return ShardCopy(
        job=info.job, step=info.step, rank=info.rank,
        tier=CheckpointTier.REPLICA if stored.held else CheckpointTier.MEMORY, node=node,
        attempt=info.attempt, world_size=info.world_size, size=info.size, checksum=info.checksum,
        info_json=info.model_dump_json(), created_at=time.time(),
    )


@dataclass
class _Background:
    """One worker thread running one task at a time, so a slow upload never blocks a pass."""

    name: str
    thread: threading.Thread | None = None

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def run(self, task: Callable[[], None]) -> bool:
        if self.busy():
            return False
        self.thread = threading.Thread(target=task, name=self.name, daemon=True)
        self.thread.start()
        return True


@dataclass
class CheckpointService:
    store: Store
    node: str
    root: Path
    """This node's folder in shared memory."""
    token: bytes
    host: str = "127.0.0.1"
    _known: dict[Path, str] = field(default_factory=dict)
    _replicated: set[tuple[str, int, int, int]] = field(default_factory=set)
    """(job, step, rank, attempt): a step re-saved by a later attempt is a new shard."""
    _drained: set[tuple[str, int, int, int]] = field(default_factory=set)
    _replicator: _Background = field(default_factory=lambda: _Background("ckpt-replicate"))
    _drainer: _Background = field(default_factory=lambda: _Background("ckpt-drain"))
    _pins: dict[Path, shm.SharedRead] = field(default_factory=dict)
    _policies: dict[str, TierPolicy | None] = field(default_factory=dict)
    server: ShardServer | None = None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.server = ShardServer(self.root, self.token, host=self.host, catalog=self.catalog).start()
        self.store.set_meta(endpoint_key(self.node), self.server.address)
        log.info("shard server listening", extra={"node": self.node, "address": self.server.address})

    def close(self) -> None:
        for pin in self._pins.values():
            pin.__exit__(None, None, None)
        self._pins.clear()
        if self.server is not None:
            self.server.close()

    # -- the pass -------------------------------------------------------------------

    def reconcile(self) -> None:
        jobs = {j.name: j for j in self.store.list_jobs()}
        found = shm.scan(self.root)
        by_job: dict[str, list[shm.StoredShard]] = {}
        for stored in found:
            by_job.setdefault(stored.info.job, []).append(stored)
        self._forget_vanished(found, jobs)
        for name, shards in by_job.items():
            job = jobs.get(name)
            if job is None:
                continue
            policy = self._policy(job)
            if policy is None:
                self._drop_job(name, shards)
                continue
            ended = job.phase.is_terminal
            self._record(job, shards)
            self._commit_memory(job)
            if not ended:
                self._replicate(job, policy, shards)
            if policy.persistent is not None:
                self._drain(job, policy, shards, open_new=not ended)
            if ended and not self._drain_pending(name):
                # A finished job's shared memory goes back to the node once its last
                # drain is done; what reached the persistent tier stays there.
                self._drop_job(name, shards)
            elif not ended:
                self._retain(job, policy, shards)

    def _drain_pending(self, job: str) -> bool:
        return any(r.status is StepStatus.DRAINING for r in self.store.list_checkpoint_steps(job, tier=CheckpointTier.PERSISTENT)) or self._drainer.busy()

    def _policy(self, job: Job) -> TierPolicy | None:
        """The job's tiers; a job's spec never changes, so it is parsed once, not every pass."""
        if job.spec_json not in self._policies:
            self._policies[job.spec_json] = job.spec().checkpoint.tiers
        return self._policies[job.spec_json]

    # -- 1. record ------------------------------------------------------------------

    def _record(self, job: Job, shards: list[shm.StoredShard]) -> None:
        for stored in shards:
            if self._known.get(stored.path) == stored.info.checksum:
                continue
            info = stored.info
            if info.attempt < job.attempt and not self._step_committed(job.name, info.step, info.attempt):
                continue  # fenced: a late shard of a failed attempt
            self._discard_older_timeline(job.name, info)
            self.store.put_shard_copy(_copy_of(stored, self.node))
            self._known[stored.path] = info.checksum

    def _step_committed(self, job: str, step: int, attempt: int) -> bool:
        return any(
            s.step == step and s.attempt == attempt and s.status is StepStatus.COMMITTED
            for s in self.store.list_checkpoint_steps(job, tier=CheckpointTier.MEMORY)
        )

    def _discard_older_timeline(self, job: str, info: ShardInfo) -> None:
        """A new attempt re-saving a step replaces whatever an older attempt left under it."""
        for row in self.store.list_checkpoint_steps(job):
            if row.step == info.step and row.attempt < info.attempt:
                log.info("step %d re-saved by attempt %d; dropping attempt %d's %s copy", info.step, info.attempt, row.attempt, row.tier.value,
                         extra={"node": self.node, "job": job})
                self.store.delete_checkpoint_step(job, row.step, row.tier)
        for copy in self.store.list_shard_copies(job, step=info.step):
            if copy.attempt < info.attempt:
                self.store.delete_shard_copies(job, info.step, tier=copy.tier, node=copy.node)

    def _forget_vanished(self, found: list[shm.StoredShard], jobs: dict[str, Job]) -> None:
        """Drop rows of this node's copies whose files are gone (slot rewritten, replica retired)."""
        present = {s.path for s in found}
        for path in [p for p in self._known if p not in present]:
            del self._known[path]
        present_keys = {(s.info.job, s.info.step, s.info.rank, s.held) for s in found}
        # A retired node's agent is gone for good: nobody else will delete its rows.
        retired = {n.name for n in self.store.list_nodes() if n.state is NodeState.RETIRED}
        for name, job in jobs.items():
            if self._policy(job) is None:
                continue
            for copy in self.store.list_shard_copies(name):
                if copy.tier is CheckpointTier.PERSISTENT:
                    continue
                if copy.node in retired:
                    self.store.delete_shard_copies(copy.job, copy.step, tier=copy.tier, node=copy.node)
                elif copy.node == self.node and (copy.job, copy.step, copy.rank, copy.tier is CheckpointTier.REPLICA) not in present_keys:
                    self.store.delete_shard_copies(copy.job, copy.step, tier=copy.tier, node=self.node)

    # -- 2. commit in memory --------------------------------------------------------

    def _commit_memory(self, job: Job) -> None:
        copies = self.store.list_shard_copies(job.name, tier=CheckpointTier.MEMORY)
        committed = {s.step for s in self.store.list_checkpoint_steps(job.name, tier=CheckpointTier.MEMORY)}
        by_step: dict[tuple[int, int, int], dict[int, ShardCopy]] = {}
        for copy in copies:
            by_step.setdefault((copy.step, copy.attempt, copy.world_size), {})[copy.rank] = copy
        for (step, attempt, world_size), ranks in sorted(by_step.items(), reverse=True):
            if step in committed or len(ranks) != world_size:
                continue
            now = time.time()
            record = CheckpointStep(
                job=job.name, step=step, tier=CheckpointTier.MEMORY, attempt=attempt, world_size=world_size,
                status=StepStatus.COMMITTED, size=sum(c.size for c in ranks.values()), updated_at=now, committed_at=now,
            )
            if self.store.put_checkpoint_step(record, only_if_absent=True):
                log.info("step %d committed in memory", step, extra={"node": self.node, "job": job.name, "bytes": record.size})

    def _committed(self, job: str, tier: CheckpointTier) -> list[CheckpointStep]:
        return [s for s in self.store.list_checkpoint_steps(job, tier=tier) if s.status is StepStatus.COMMITTED]

    # -- 3. replicate ---------------------------------------------------------------

    def ring_peers(self, count: int) -> list[tuple[str, str]]:
        """The next ``count`` schedulable nodes after this one in name order, with their addresses."""
        nodes = sorted(n.name for n in self.store.list_nodes() if n.state is NodeState.SCHEDULABLE or n.name == self.node)
        if self.node not in nodes or count == 0:
            return []
        start = nodes.index(self.node)
        ring = [nodes[(start + i) % len(nodes)] for i in range(1, len(nodes))]
        peers = []
        for name in ring:
            address = self.store.get_meta(endpoint_key(name))
            if address:
                peers.append((name, address))
            if len(peers) == count:
                break
        return peers

    def _replicate(self, job: Job, policy: TierPolicy, shards: list[shm.StoredShard]) -> None:
        if policy.memory.replicas == 0 or self._replicator.busy():
            return
        committed = self._committed(job.name, CheckpointTier.MEMORY)
        if not committed:
            return
        newest = committed[0]
        todo = [
            s for s in shards
            if not s.held and s.info.step == newest.step and s.info.attempt == newest.attempt
            and (job.name, s.info.step, s.info.rank, s.info.attempt) not in self._replicated
        ]
        if not todo:
            return
        peers = self.ring_peers(policy.memory.replicas)
        if not peers:
            return
        self._replicator.run(lambda: self._push(todo, peers))

    def _push(self, shards: list[shm.StoredShard], peers: list[tuple[str, str]]) -> None:
        for stored in shards:
            info = stored.info
            for name, address in peers:
                try:
                    with shm.SharedRead(stored) as read:
                        if not read.ok:
                            break  # rewritten since: a newer step supersedes it
                        started = time.monotonic()
                        with PeerClient(address, self.token) as client:
                            client.put(stored.path, info)
                    log.info("replicated step %d rank %d to %s", info.step, info.rank, name,
                             extra={"node": self.node, "job": info.job, "peer": name, "bytes": info.size,
                                    "seconds": round(time.monotonic() - started, 3)})
                except Exception as exc:  # noqa: BLE001 - a peer going away must not stop the agent
                    log.warning("replicating step %d rank %d to %s failed: %s", info.step, info.rank, name, exc,
                                extra={"node": self.node, "job": info.job, "peer": name})
            self._replicated.add((info.job, info.step, info.rank, info.attempt))

    # -- 4. drain to the persistent tier -------------------------------------------

    def _drain(self, job: Job, policy: TierPolicy, shards: list[shm.StoredShard], *, open_new: bool = True) -> None:
        assert policy.persistent is not None
        if open_new:
            self._open_drain_if_due(job, policy)
        if self._drainer.busy():
            return
        draining = [s for s in self.store.list_checkpoint_steps(job.name, tier=CheckpointTier.PERSISTENT) if s.status is StepStatus.DRAINING]
        for row in draining:
            mine = [
                s for s in shards
                if not s.held and s.info.step == row.step and s.info.attempt == row.attempt
                and (job.name, row.step, s.info.rank, row.attempt) not in self._drained
            ]
            if mine:
                self._drainer.run(functools.partial(self._upload, job.name, policy.persistent.uri, row, mine, policy))
                return
            self._try_commit_persistent(job.name, policy, row)

    def _open_drain_if_due(self, job: Job, policy: TierPolicy) -> None:
        assert policy.persistent is not None
        committed = self._committed(job.name, CheckpointTier.MEMORY)
        if not committed:
            return
        newest = committed[0]
        with self.store.transaction():  # one agent opens the drain; the others see its row
            rows = self.store.list_checkpoint_steps(job.name, tier=CheckpointTier.PERSISTENT)
            if any(r.status is StepStatus.DRAINING for r in rows):
                return  # one drain at a time: if the tier is slow, later steps are skipped, not queued
            last = rows[0] if rows else None
            since = None if last is None else time.time() - last.updated_at
            if not policy.persistent.due(newest.step, last_step=last.step if last else None, seconds_since_last=since):
                return
            try:
                target = PersistentStore(policy.persistent.uri)
                if newest.step in target.steps(job.name):
                    target.delete_step(job.name, newest.step)  # left by an older attempt: never mix the two
            except Exception as exc:  # noqa: BLE001 - the upload will fail too and mark the step Failed
                log.warning("persistent tier %s unreachable: %s", policy.persistent.uri, exc, extra={"node": self.node, "job": job.name})
            self.store.put_checkpoint_step(CheckpointStep(
                job=job.name, step=newest.step, tier=CheckpointTier.PERSISTENT, attempt=newest.attempt,
                world_size=newest.world_size, status=StepStatus.DRAINING, size=newest.size, updated_at=time.time(),
            ))
        log.info("draining step %d to %s", newest.step, policy.persistent.uri, extra={"node": self.node, "job": job.name})

    def _upload(self, job: str, uri: str, row: CheckpointStep, shards: list[shm.StoredShard], policy: TierPolicy) -> None:
        for stored in shards:
            info = stored.info
            # The shared lock is held across retries: while the tier is slow or failing,
            # the rank writes its spare slot instead of the one being drained.
            with shm.SharedRead(stored) as read:
                if not read.ok:
                    # The rank moved on (its slot holds a newer step): this step is superseded,
                    # not a tier failure. Give the drain up; a newer step will be due soon.
                    self._abandon_drain(job, row, f"rank {info.rank}'s shard was rewritten before it was drained")
                    return
                error = self._upload_with_retries(job, uri, stored)
            self._drained.add((job, info.step, info.rank, info.attempt))
            if error is not None:
                self._fail_drain(job, row, f"rank {info.rank}: {error}")
                return
        self._try_commit_persistent(job, policy, row)

    def _upload_with_retries(self, job: str, uri: str, stored: shm.StoredShard) -> str | None:
        """None once the shard is in the tier (and recorded), else the last error."""
        info = stored.info
        error: str | None = None
        for attempt in range(DRAIN_RETRIES):
            try:
                started = time.monotonic()
                PersistentStore(uri).upload_shard(stored.path, info)
                self.store.put_shard_copy(ShardCopy(
                    job=job, step=info.step, rank=info.rank, tier=CheckpointTier.PERSISTENT, node="",
                    attempt=info.attempt, world_size=info.world_size, size=info.size, checksum=info.checksum,
                    info_json=info.model_dump_json(), created_at=time.time(),
                ))
                log.info("drained step %d rank %d", info.step, info.rank,
                         extra={"node": self.node, "job": job, "bytes": info.size, "seconds": round(time.monotonic() - started, 3)})
                return None
            except Exception as exc:  # noqa: BLE001 - any tier failure degrades, never kills the agent
                error = f"{type(exc).__name__}: {exc}"
                log.warning("drain of step %d rank %d failed (try %d of %d): %s", info.step, info.rank, attempt + 1, DRAIN_RETRIES, error,
                            extra={"node": self.node, "job": job})
                if attempt + 1 < DRAIN_RETRIES:
                    time.sleep(RETRY_BASE_SECONDS * 2**attempt)  # backoff between retries of a failing tier
        return error

    def _fail_drain(self, job: str, row: CheckpointStep, message: str) -> None:
        with self.store.transaction():
            current = self._persistent_row(job, row.step)
            if current is None or current.status is not StepStatus.DRAINING or current.attempt != row.attempt:
                return  # committed (or failed, or replaced) by someone else meanwhile: their verdict stands
            self.store.put_checkpoint_step(dataclasses.replace(
                current, status=StepStatus.FAILED, updated_at=time.time(), message=message,
            ))
        text = f"persistent tier failed for step {row.step}: {message}; training continues on the memory tier"
        self.store.add_event("Job", job, "CheckpointTierFailing", text, type=EventType.WARNING)
        log.warning(text, extra={"node": self.node, "job": job, "tier": "persistent"})

    def _abandon_drain(self, job: str, row: CheckpointStep, why: str) -> None:
        with self.store.transaction():
            current = self._persistent_row(job, row.step)
            if current is not None and current.status is StepStatus.DRAINING and current.attempt == row.attempt:
                self.store.delete_checkpoint_step(job, row.step, CheckpointTier.PERSISTENT)
                self.store.delete_shard_copies(job, row.step, tier=CheckpointTier.PERSISTENT)
        log.info("drain of step %d given up: %s", row.step, why, extra={"node": self.node, "job": job})

    def _persistent_row(self, job: str, step: int) -> CheckpointStep | None:
        return next((r for r in self.store.list_checkpoint_steps(job, tier=CheckpointTier.PERSISTENT) if r.step == step), None)

    def _claim_commit(self, job: str, row: CheckpointStep) -> bool:
        """One agent writes a step's manifest and marker: the first to mark the Draining row
        as being committed by it. A claim older than ``COMMIT_CLAIM_SECONDS`` (its agent
        died mid-commit) may be taken over."""
        claim = f"{COMMIT_CLAIM}{self.node}"
        with self.store.transaction():
            current = self._persistent_row(job, row.step)
            if current is None or current.status is not StepStatus.DRAINING or current.attempt != row.attempt:
                return False
            claimed = (current.message or "").startswith(COMMIT_CLAIM)
            if claimed and time.time() - current.updated_at < COMMIT_CLAIM_SECONDS:
                return False
            self.store.put_checkpoint_step(dataclasses.replace(current, message=claim, updated_at=time.time()))
        return True

    def _try_commit_persistent(self, job: str, policy: TierPolicy, row: CheckpointStep) -> None:
        assert policy.persistent is not None
        copies = {c.rank: c for c in self.store.list_shard_copies(job, step=row.step, tier=CheckpointTier.PERSISTENT) if c.attempt == row.attempt}
        if len(copies) != row.world_size or not self._claim_commit(job, row):
            return
        manifest = StepManifest(
            job=job, step=row.step, world_size=row.world_size, attempt=row.attempt,
            shards=tuple(ShardInfo.model_validate_json(copies[r].info_json) for r in range(row.world_size)),
        )
        try:
            target = PersistentStore(policy.persistent.uri)
            target.commit(manifest)
        except Exception as exc:  # noqa: BLE001
            self._fail_drain(job, row, f"writing the manifest: {type(exc).__name__}: {exc}")
            return
        now = time.time()
        self.store.put_checkpoint_step(CheckpointStep(
            job=job, step=row.step, tier=CheckpointTier.PERSISTENT, attempt=row.attempt, world_size=row.world_size,
            status=StepStatus.COMMITTED, size=manifest.size, updated_at=now, committed_at=now,
        ))
        log.info("step %d committed in %s", row.step, policy.persistent.uri, extra={"node": self.node, "job": job, "bytes": manifest.size})
        self._retain_persistent(job, policy, target)

    # -- 5. retention ---------------------------------------------------------------

    def _retain(self, job: Job, policy: TierPolicy, shards: list[shm.StoredShard]) -> None:
        for stale in shm.stale_slots(self.root, job.name, job.attempt):
            stale.unlink(missing_ok=True)  # half-written by a rank of a failed attempt: unreadable
        committed = self._committed(job.name, CheckpointTier.MEMORY)
        kept = {s.step for s in committed[: policy.memory.keep]}
        # The replica tier's own "newest committed step": the newest step every rank has a
        # replica of. Replication skips ahead when it falls behind, so the newest memory
        # steps may have no replicas yet; until a newer step is fully replicated this one
        # is what survives losing a node, and it stays (rows, replicas, pinned own slots).
        replicated = self._newest_fully_replicated(job.name, committed) if policy.memory.replicas else None
        if replicated is not None:
            kept.add(replicated)
        self._pin_own_slots(job.name, replicated, shards)
        if not kept:
            return
        oldest_kept = min(kept)
        draining = {s.step for s in self.store.list_checkpoint_steps(job.name, tier=CheckpointTier.PERSISTENT) if s.status is StepStatus.DRAINING}
        for row in committed:
            if row.step not in kept and row.step < max(kept) and row.step not in draining:
                self.store.delete_checkpoint_step(job.name, row.step, CheckpointTier.MEMORY)
        for stored in shards:
            step = stored.info.step
            if step >= oldest_kept or step in kept or step in draining:
                continue
            # Held replicas and slots of finished attempts are ours to delete; the current
            # attempt's slots are reused by their rank, which never overwrites its newest ones.
            if stored.held or (shm.slot_attempt(stored.path) or 0) < job.attempt:
                shm.descriptor_path(stored.path).unlink(missing_ok=True)
                stored.path.unlink(missing_ok=True)

    def _newest_fully_replicated(self, job: str, committed: list[CheckpointStep]) -> int | None:
        replicas = {(c.step, c.rank, c.attempt) for c in self.store.list_shard_copies(job, tier=CheckpointTier.REPLICA)}
        for row in committed:  # newest first
            if all((row.step, rank, row.attempt) in replicas for rank in range(row.world_size)):
                return row.step
        return None

    def _pin_own_slots(self, job: str, step: int | None, shards: list[shm.StoredShard]) -> None:
        """Hold a shared lock on this node's own slots of ``step`` so their ranks write other
        slots (they have a spare) instead of overwriting the step a lost node would need."""
        wanted = {s.path: s for s in shards if not s.held and s.info.step == step} if step is not None else {}
        for path in [p for p in self._pins if p.parent.name == job and p not in wanted]:
            self._pins.pop(path).__exit__(None, None, None)
        for path, stored in wanted.items():
            if path not in self._pins:
                pin = shm.SharedRead(stored).__enter__()
                if pin.ok:
                    self._pins[path] = pin
                else:
                    pin.__exit__(None, None, None)

    def _retain_persistent(self, job: str, policy: TierPolicy, target: PersistentStore) -> None:
        assert policy.persistent is not None
        rows = self._committed(job, CheckpointTier.PERSISTENT)
        for row in rows[policy.persistent.keep :]:
            try:
                target.delete_step(job, row.step)
            except Exception as exc:  # noqa: BLE001
                log.warning("cannot delete step %d from the persistent tier: %s", row.step, exc, extra={"node": self.node, "job": job})
                continue
            self.store.delete_checkpoint_step(job, row.step, CheckpointTier.PERSISTENT)
            self.store.delete_shard_copies(job, row.step, tier=CheckpointTier.PERSISTENT)

    def _drop_job(self, job: str, shards: list[shm.StoredShard]) -> None:
        self._pin_own_slots(job, None, shards)
        for stale in shm.stale_slots(self.root, job, before_attempt=1 << 30):
            stale.unlink(missing_ok=True)
        for stored in shards:
            shm.descriptor_path(stored.path).unlink(missing_ok=True)
            stored.path.unlink(missing_ok=True)
        for row in self.store.list_checkpoint_steps(job, tier=CheckpointTier.MEMORY):
            self.store.delete_checkpoint_step(job, row.step, CheckpointTier.MEMORY)
            self.store.delete_shard_copies(job, row.step, tier=CheckpointTier.MEMORY)
            self.store.delete_shard_copies(job, row.step, tier=CheckpointTier.REPLICA)

    # -- what a restoring rank asks ------------------------------------------------

    def catalog(self, job: str) -> dict[str, Any]:
        """Steps committed in memory and where every copy of their shards is."""
        steps = [s for s in self._committed(job, CheckpointTier.MEMORY)]
        copies = [c for c in self.store.list_shard_copies(job) if c.tier is not CheckpointTier.PERSISTENT]
        nodes = {c.node for c in copies}
        return {
            "steps": [{"step": s.step, "attempt": s.attempt, "world_size": s.world_size} for s in steps],
            "copies": [{"step": c.step, "rank": c.rank, "node": c.node, "tier": c.tier.value, "attempt": c.attempt} for c in copies],
            "endpoints": {n: self.store.get_meta(endpoint_key(n)) for n in nodes},
        }
