"""The node agent's drains to the persistent tier (a mixin of ``CheckpointService``): upload this node's
shards of a step, with retries and backoff; record each copy; open, fail, abandon or commit the drain
through the catalog's compare-and-swap, so two agents never both commit one step and a failed drain
never overwrites a committed one."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import tenacity

from unbroken.checkpoint.node import plan, shm
from unbroken.checkpoint.format.manifest import ShardInfo, StepManifest
from unbroken.checkpoint.node.persistent import PersistentStore
from unbroken.config.checkpoint import TierPolicy
from unbroken.plumbing.metrics import AgentMetrics
from unbroken.state.catalog import CheckpointCatalog
from unbroken.state.records import CheckpointStep, CheckpointTier, EventType, ShardCopy, StepStatus
from unbroken.state.store import ClusterStore

log = logging.getLogger("unbroken.checkpoint")

DRAIN_RETRIES = 3
RETRY_BASE_SECONDS = 0.5
"""Backoff between upload retries of a failing tier: 0.5 s, then 1 s."""

PERSISTENT = CheckpointTier.PERSISTENT


@dataclass(frozen=True)
class _DrainStop:
    """Why a drain stopped short: the rank moved on (``superseded``: given up, its copies dropped), or the tier failed."""

    superseded: bool
    why: str


class PersistentDrain:
    """What ``CheckpointService`` does for the persistent tier; the service's fields it reads are declared here."""

    catalog: CheckpointCatalog
    cluster: ClusterStore
    node: str
    metrics: AgentMetrics | None
    _drained: set[plan.ShardKey]

    def _prepare(self, row: CheckpointStep, policy: TierPolicy | None) -> None:
        """This agent opened (or took over) the drain: clear what an older attempt left in the tier
        under that step, then let every agent upload (message cleared)."""
        assert policy is not None and policy.persistent is not None
        try:
            target = PersistentStore(policy.persistent.uri)
            if row.step in target.steps(row.job):
                target.delete_step(row.job, row.step)  # never mix two attempts' shards under one step
        except Exception as exc:  # noqa: BLE001 - the upload will fail too and mark the step Failed
            log.warning("persistent tier %s unreachable: %s", policy.persistent.uri, exc, extra={"node": self.node, "job": row.job})
        if self.catalog.replace_checkpoint_step(row, dataclasses.replace(row, message=None, updated_at=time.time())):
            log.info("draining step %d to %s", row.step, policy.persistent.uri, extra={"node": self.node, "job": row.job})

    def _upload(self, job: str, policy: TierPolicy, row: CheckpointStep, shards: tuple[plan.LocalShard, ...]) -> None:
        """Upload ``shards``, record their persistent copies in one write (those uploaded before a failure too),
        then commit the step, fail the drain, or give it up."""
        assert policy.persistent is not None
        uploaded: list[ShardCopy] = []
        stop: _DrainStop | None = None
        try:
            stop = self._upload_each(job, policy.persistent.uri, shards, uploaded)
        finally:
            if uploaded and not (stop is not None and stop.superseded):
                self.catalog.update_shard_copies(job, put=uploaded)
        if stop is None:
            self._try_commit_persistent(job, policy, row)
        elif stop.superseded:
            self._abandon_drain(job, row, stop.why)
        else:
            self._fail_drain(job, row, stop.why)

    def _upload_each(self, job: str, uri: str, shards: tuple[plan.LocalShard, ...],
                     uploaded: list[ShardCopy]) -> _DrainStop | None:
        """Upload one shard after the other, appending each one's copy to ``uploaded``; why it stopped short."""
        for shard in shards:
            info = shard.info
            # The shared lock is held across retries: while the tier is slow or failing,
            # the rank writes its spare slot instead of the one being drained.
            with shm.SharedRead(shm.StoredShard(shard.path, info, shard.held)) as read:
                if not read.ok:
                    # The rank moved on (its slot holds a newer step): this step is superseded,
                    # not a tier failure. Give the drain up; a newer step will be due soon.
                    return _DrainStop(superseded=True, why=f"rank {info.rank}'s shard was rewritten before it was drained")
                outcome = self._upload_with_retries(job, uri, shard)
            self._drained.add(shard.key)
            if isinstance(outcome, str):
                return _DrainStop(superseded=False, why=f"rank {info.rank}: {outcome}")
            uploaded.append(outcome)
        return None

    def _upload_with_retries(self, job: str, uri: str, shard: plan.LocalShard) -> ShardCopy | str:
        """The shard's persistent copy once it is in the tier (to record), else the last error."""
        info = shard.info

        def warn(state: tenacity.RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            log.warning("drain of step %d rank %d failed (try %d of %d): %s: %s", info.step, info.rank, state.attempt_number,
                        DRAIN_RETRIES, type(exc).__name__, exc, extra={"node": self.node, "job": job})

        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(DRAIN_RETRIES), wait=tenacity.wait_exponential(multiplier=RETRY_BASE_SECONDS),
            retry=tenacity.retry_if_exception_type(Exception), before_sleep=warn, reraise=True,
        )
        started = time.monotonic()
        try:
            retrying(PersistentStore(uri).upload_shard, shard.path, info)
        except Exception as exc:  # noqa: BLE001 - any tier failure degrades, never kills the agent
            if self.metrics is not None:
                self.metrics.tier_failures.labels("persistent", type(exc).__name__).inc()
            return f"{type(exc).__name__}: {exc}"
        if self.metrics is not None:
            self.metrics.checkpoint_bytes.labels("persistent").inc(info.size)
        log.info("drained step %d rank %d", info.step, info.rank,
                 extra={"node": self.node, "job": job, "bytes": info.size, "seconds": round(time.monotonic() - started, 3)})
        return ShardCopy(
            job=job, step=info.step, rank=info.rank, tier=PERSISTENT, node="", attempt=info.attempt,
            world_size=info.world_size, size=info.size, checksum=info.checksum, info_json=info.model_dump_json(),
            created_at=time.time(),
        )

    def _persistent_row(self, job: str, step: int) -> CheckpointStep | None:
        return next((r for r in self.catalog.list_checkpoint_steps(job, tier=PERSISTENT) if r.step == step), None)

    def _draining(self, job: str, row: CheckpointStep) -> CheckpointStep | None:
        """The row as it is now, if it is still this drain (Draining, same attempt)."""
        current = self._persistent_row(job, row.step)
        if current is None or current.status is not StepStatus.DRAINING or current.attempt != row.attempt:
            return None
        return current

    def _fail_drain(self, job: str, row: CheckpointStep, message: str) -> None:
        current = self._draining(job, row)
        if current is None or not self.catalog.replace_checkpoint_step(
            current, dataclasses.replace(current, status=StepStatus.FAILED, updated_at=time.time(), message=message)
        ):
            return  # committed (or failed, or replaced) by someone else meanwhile: their verdict stands
        text = f"persistent tier failed for step {row.step}: {message}; training continues on the memory tier"
        self.cluster.add_event("Job", job, "CheckpointTierFailing", text, type=EventType.WARNING)
        log.warning(text, extra={"node": self.node, "job": job, "tier": "persistent"})

    def _abandon_drain(self, job: str, row: CheckpointStep, why: str) -> None:
        current = self._draining(job, row)
        if current is not None and self.catalog.replace_checkpoint_step(current, None):
            self.catalog.delete_shard_copies(job, row.step, tier=PERSISTENT)
        log.info("drain of step %d given up: %s", row.step, why, extra={"node": self.node, "job": job})

    def _claim_commit(self, job: str, row: CheckpointStep) -> bool:
        """One agent writes a step's manifest and marker: the first to mark the Draining row
        as being committed by it. A claim whose agent died (stale) may be taken over."""
        current = self._draining(job, row)
        if current is None or current.message == plan.PREPARING:
            return False
        claimed = (current.message or "").startswith(plan.COMMIT_CLAIM)
        if claimed and not plan.claim_is_stale(current, time.time()):
            return False
        claim = dataclasses.replace(current, message=f"{plan.COMMIT_CLAIM}{self.node}", updated_at=time.time())
        return self.catalog.replace_checkpoint_step(current, claim)

    def _try_commit_persistent(self, job: str, policy: TierPolicy, row: CheckpointStep) -> None:
        assert policy.persistent is not None
        copies = {c.rank: c for c in self.catalog.list_shard_copies(job, step=row.step, tier=PERSISTENT) if c.attempt == row.attempt}
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
            if self.metrics is not None:
                self.metrics.tier_failures.labels("persistent", type(exc).__name__).inc()
            self._fail_drain(job, row, f"writing the manifest: {type(exc).__name__}: {exc}")
            return
        now = time.time()
        claimed = self._draining(job, row)
        committed = CheckpointStep(job=job, step=row.step, tier=PERSISTENT, attempt=row.attempt, world_size=row.world_size,
                                   status=StepStatus.COMMITTED, size=manifest.size, updated_at=now, committed_at=now)
        # From the row this drain claimed, not over whatever is there: a step the controller marked Untrusted
        # meanwhile (silent data corruption) stays so, although its manifest is written.
        if claimed is None or not self.catalog.replace_checkpoint_step(claimed, committed):
            log.warning("step %d: its row changed while its manifest was written (marked untrusted?); not committed",
                        row.step, extra={"node": self.node, "job": job})
            return
        log.info("step %d committed in %s", row.step, policy.persistent.uri, extra={"node": self.node, "job": job, "bytes": manifest.size})
        self._durable("persistent", min(s.saved_at for s in manifest.shards))
        for old in plan.persistent_excess(self.catalog.list_checkpoint_steps(job, tier=PERSISTENT), policy.persistent.keep):
            try:
                target.delete_step(job, old.step)
            except Exception as exc:  # noqa: BLE001
                log.warning("cannot delete step %d from the persistent tier: %s", old.step, exc, extra={"node": self.node, "job": job})
                continue
            self.catalog.delete_checkpoint_step(job, old.step, PERSISTENT)
            self.catalog.delete_shard_copies(job, old.step, tier=PERSISTENT)

    def _durable(self, tier: str, saved_at: float | None) -> None:
        """A step (or a replica) became durable in ``tier``, this long after its save."""
        if self.metrics is not None and saved_at is not None:
            self.metrics.durable.labels(tier).observe(max(0.0, time.time() - saved_at))

    # -- pins -----------------------------------------------------------------------
