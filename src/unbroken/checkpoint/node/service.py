"""The node agent's half of tiered checkpointing: the I/O around :func:`unbroken.checkpoint.node.plan.plan`.

Every ``PASS_SECONDS`` the service reads a snapshot (this node's shared memory,
the catalog's rows and copies, the nodes and their shard servers), asks the
planner what to do for each job, and does it: catalog writes, replication to
peers and uploads to the persistent tier (each in its own background thread,
one task at a time, so a slow tier never blocks a pass), deleting files,
pinning slots. Agents race for the same rows only through the catalog's
insert-if-absent and compare-and-swap, so two agents never both open or both
commit one drain, and a failed drain never overwrites a committed one.
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


from unbroken.checkpoint.node import plan, shm
from unbroken.checkpoint.node.drain import PersistentDrain
from unbroken.checkpoint.node.credentials import Credentials
from unbroken.checkpoint.node.peer import PeerClient, ShardServer
from unbroken.checkpoint.format.restore_catalog import CatalogStep, CopyLocation, RestoreCatalog
from unbroken.config.checkpoint import TierPolicy
from unbroken.plumbing.metrics import AgentMetrics
from unbroken.state.catalog import CheckpointCatalog, CopyKey
from unbroken.state.phases import NodeState
from unbroken.state.records import CheckpointTier, Job, ShardCopy, StepStatus
from unbroken.state.store import ClusterStore

log = logging.getLogger("unbroken.checkpoint")

PASS_SECONDS = 0.1

PERSISTENT = CheckpointTier.PERSISTENT


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
class _CopyChanges:
    """Copy records this agent holds back to send together (``CheckpointCatalog.copy_write_delay``)."""

    put: dict[CopyKey, ShardCopy] = field(default_factory=dict)
    forget: set[CopyKey] = field(default_factory=set)
    put_since: float | None = None
    forget_since: float | None = None

    def record(self, copy: ShardCopy, now: float) -> None:
        key = CopyKey(copy.step, copy.tier, copy.node, copy.rank)
        self.forget.discard(key)
        self.put[key] = copy
        self.put_since = now if self.put_since is None else self.put_since

    def drop(self, key: CopyKey, now: float) -> None:
        self.put.pop(key, None)
        if key not in self.forget:
            self.forget.add(key)
            self.forget_since = now if self.forget_since is None else self.forget_since

    def due(self, now: float, catalog: CheckpointCatalog, *, receiving: bool = False) -> bool:
        """New copies once they are ``copy_write_delay`` old, or while a peer is pushing replicas here
        (``receiving``) once they are ``replica_write_wait`` older still: a save's own copies and the replicas
        this node holds of it go out as one write. Forgotten ones alone only after ``forget_write_delay``:
        until then they ride with the next save's write (a copy record of a retired step misleads no one:
        its step row is gone, and readers read the rows first)."""
        if self.put_since is not None:
            held = now - self.put_since
            if held >= catalog.copy_write_delay and (not receiving or held >= catalog.copy_write_delay + catalog.replica_write_wait):
                return True
        return self.forget_since is not None and now - self.forget_since >= catalog.forget_write_delay

    def applied_to(self, copies: list[ShardCopy]) -> list[ShardCopy]:
        """What the catalog will hold once these are written: the plan decides on that, not on the catalog's lag."""
        kept = [c for c in copies if CopyKey(c.step, c.tier, c.node, c.rank) not in self.forget and
                CopyKey(c.step, c.tier, c.node, c.rank) not in self.put]
        return sorted([*kept, *self.put.values()], key=lambda c: (-c.step, c.rank, c.tier.value, c.node))


PUSHED_HOLDS = 2
"""Own slots a rank's pushes hold at most (besides the pinned step's): see ``_hold_pushed``."""


@dataclass
class CheckpointService(PersistentDrain):
    catalog: CheckpointCatalog
    cluster: ClusterStore
    node: str
    root: Path
    """This node's folder in shared memory."""
    credentials: Credentials
    host: str = "127.0.0.1"
    port: int = 0
    """0: any free port (locally); a DaemonSet gives a fixed one it declares."""
    _known: dict[Path, str] = field(default_factory=dict)
    """Shard files recorded in the catalog, with the checksum they had then."""
    _replicated: set[plan.ShardKey] = field(default_factory=set)
    _drained: set[plan.ShardKey] = field(default_factory=set)
    _replicator: _Background = field(default_factory=lambda: _Background("ckpt-replicate"))
    _drainer: _Background = field(default_factory=lambda: _Background("ckpt-drain"))
    _pins: dict[Path, shm.SharedRead] = field(default_factory=dict)
    """Own slots of each job's newest step that survives losing a node (see plan._retain)."""
    _pushed: dict[tuple[str, int], list[shm.SharedRead]] = field(default_factory=dict)
    """(job, rank): the own slots of the rank's newest replicated steps, held by their pushes, oldest first."""
    _pins_lock: threading.Lock = field(default_factory=threading.Lock)
    """The replicator thread adds to ``_pushed``; the pass releases."""
    _policies: dict[str, TierPolicy | None] = field(default_factory=dict)
    _copy_changes: dict[str, _CopyChanges] = field(default_factory=dict)
    """By job: copy records not written yet (see ``_flush_copies``)."""
    server: ShardServer | None = None
    metrics: AgentMetrics | None = None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.server = ShardServer(self.root, self.credentials, host=self.host, catalog=self.restore_catalog, port=self.port).start()
        self.catalog.set_shard_server(self.node, self.server.address)
        log.info("shard server listening", extra={"node": self.node, "address": self.server.address})

    def run_passes(self, stopping: threading.Event, every: float = PASS_SECONDS) -> None:
        """``reconcile`` every ``every`` seconds until ``stopping``, on the caller's thread (the agent gives it
        its own, so a slow pass never delays worker supervision). A failed pass is logged and retried: the
        memory tier degrades, the agent stays up."""
        while not stopping.wait(every):
            try:
                self.reconcile()
            except Exception:  # noqa: BLE001 - checkpoints degrade; the agent must stay up
                log.exception("checkpoint pass failed; retrying", extra={"node": self.node})
                stopping.wait(1.0)

    def close(self) -> None:
        try:
            self._flush_copies(force=True)
        except Exception as exc:  # noqa: BLE001 - closing anyway: the next agent on this node records them again
            log.warning("copy records not written at close: %s", exc, extra={"node": self.node})
        with self._pins_lock:
            for read in [*self._pins.values(), *(r for reads in self._pushed.values() for r in reads)]:
                read.__exit__(None, None, None)
            self._pins.clear()
            self._pushed.clear()
        if self.server is not None:
            self.server.close()

    # -- the pass -------------------------------------------------------------------

    def reconcile(self) -> None:
        nodes = self.cluster.list_nodes()
        servers = self.catalog.shard_servers()
        # Before the scan: a push that ends after it is not in this pass's records, so its job's held
        # records wait for the next pass rather than go out a moment before the replicas it brings.
        receiving = self.server.receiving() if self.server is not None else frozenset()
        found = shm.scan(self.root)
        present = {s.path for s in found}
        for path in [p for p in self._known if p not in present]:
            del self._known[path]
        by_job: dict[str, list[shm.StoredShard]] = {}
        for stored in found:
            by_job.setdefault(stored.info.job, []).append(stored)
        retired = frozenset(n.name for n in nodes if n.state is NodeState.RETIRED)
        ring = plan.ring(self.node, [n.name for n in nodes if n.state is NodeState.SCHEDULABLE], servers)
        for job in self.cluster.list_jobs():
            policy = self._policy(job)
            local = by_job.get(job.name, [])
            if not local and (policy is None or job.phase.is_terminal):
                continue  # nothing of it here, and nothing of it to look after
            view = plan.JobView(
                job=job, policy=policy,
                shards=tuple(plan.LocalShard(s.path, s.info, s.held, shm.slot_attempt(s.path)) for s in local),
                steps=tuple(self.catalog.list_checkpoint_steps(job.name)),
                copies=tuple(self._copies(job.name)),
                empty_slots=tuple(shm.empty_slots(self.root, job.name)),
            )
            here = plan.NodeView(
                node=self.node, now=time.time(), ring=ring, retired=retired, recorded=dict(self._known),
                replicated=frozenset(self._replicated), drained=frozenset(self._drained),
                replicator_busy=self._replicator.busy(), drainer_busy=self._drainer.busy(),
            )
            for action in plan.plan(view, here):
                self._do(view, action)
        self._flush_copies(receiving=receiving)

    def _copies(self, job: str) -> list[ShardCopy]:
        copies = self.catalog.list_shard_copies(job)
        changes = self._copy_changes.get(job)
        return changes.applied_to(copies) if changes is not None else copies

    def _change_copies(self, job: str) -> _CopyChanges:
        return self._copy_changes.setdefault(job, _CopyChanges())

    def _flush_copies(self, *, force: bool = False, job: str | None = None,
                      receiving: frozenset[tuple[str, int]] = frozenset()) -> None:
        """Write the held copy records of every job (of ``job``) that are due (``_CopyChanges.due``; ``receiving``:
        the (job, step)s a peer is pushing here): one ``update_shard_copies`` each. A write that fails keeps them
        for the next pass."""
        now = time.monotonic()
        for name, changes in list(self._copy_changes.items()):
            if job is not None and name != job:
                continue
            # Held longer only for the replicas of a step this node is recording: a push of an older
            # step (replication lagging behind the saves) never holds up a newer save's records.
            incoming = any((name, key.step) in receiving for key in changes.put)
            if not force and not changes.due(now, self.catalog, receiving=incoming):
                continue
            self.catalog.update_shard_copies(name, put=list(changes.put.values()), forget=sorted(changes.forget))
            del self._copy_changes[name]

    def _policy(self, job: Job) -> TierPolicy | None:
        """The job's tiers; a job's spec never changes, so it is parsed once, not every pass."""
        if job.spec_json not in self._policies:
            self._policies[job.spec_json] = job.spec().checkpoint.tiers
        return self._policies[job.spec_json]

    def _do(self, view: plan.JobView, action: plan.Action) -> None:
        catalog, job, policy = self.catalog, view.job.name, view.policy
        match action:
            case plan.RecordCopy(copy=copy, path=path):
                self._change_copies(job).record(copy, time.monotonic())
                self._known[path] = copy.checksum
                if self.metrics is not None and copy.tier is CheckpointTier.MEMORY:
                    self.metrics.checkpoint_bytes.labels("memory").inc(copy.size)
            case plan.ForgetCopies(step=step, tier=tier, node=node, rank=rank) if node is not None and rank is not None:
                self._change_copies(job).drop(CopyKey(step, tier, node, rank), time.monotonic())
            case plan.ForgetCopies(step=step, tier=tier, node=node, rank=rank):
                self._flush_copies(force=True, job=job)  # held records first: the delete comes after them
                catalog.delete_shard_copies(job, step, tier=tier, node=node, rank=rank)
            case plan.DeleteStep(step=step, tier=tier):
                catalog.delete_checkpoint_step(job, step, tier)
            case plan.CommitMemory(record=record):
                if catalog.put_checkpoint_step(record, only_if_absent=True):
                    log.info("step %d committed in memory", record.step, extra={"node": self.node, "job": job, "bytes": record.size})
                    saved = [s.info.saved_at for s in view.shards if (s.info.step, s.info.attempt) == (record.step, record.attempt)]
                    self._durable("memory", min(saved) if saved else None)
            case plan.Replicate(shards=shards, peers=peers):
                self._replicator.run(functools.partial(self._push, shards, peers))
            case plan.OpenDrain(record=record):
                if catalog.put_checkpoint_step(record, only_if_absent=True):
                    self._prepare(record, policy)
            case plan.TakeOverDrain(row=row):
                taken = dataclasses.replace(row, updated_at=time.time())
                if catalog.replace_checkpoint_step(row, taken):
                    self._prepare(taken, policy)
            case plan.Upload(row=row, shards=shards):
                assert policy is not None and policy.persistent is not None
                self._drainer.run(functools.partial(self._upload, job, policy, row, shards))
            case plan.CommitPersistent(row=row):
                assert policy is not None
                self._try_commit_persistent(job, policy, row)
            case plan.DeleteFiles(paths=paths):
                for path in paths:
                    shm.descriptor_path(path).unlink(missing_ok=True)
                    path.unlink(missing_ok=True)
            case plan.Pin():
                self._pin(view.job, action)

    # -- replication ----------------------------------------------------------------

    def _push(self, shards: tuple[plan.LocalShard, ...], peers: tuple[tuple[str, str], ...]) -> None:
        """Send ``shards`` to each peer, all on one connection per peer: the peer reads them as one push
        (``ShardServer.receiving``) and records them with its own copies of the save, in one write."""
        reads = [(shard, shm.SharedRead(shm.StoredShard(shard.path, shard.info, shard.held)).__enter__()) for shard in shards]
        pushed: set[plan.ShardKey] = set()
        try:
            for name, address in peers:
                client: PeerClient | None = None
                try:
                    for shard, read in reads:
                        if not read.ok:
                            continue  # rewritten since: a newer step supersedes it
                        info = shard.info
                        started = time.monotonic()
                        try:
                            client = client or PeerClient(address, self.credentials)
                            client.put(shard.path, info)
                        except Exception as exc:  # noqa: BLE001 - a peer going away must not stop the agent
                            log.warning("replicating step %d rank %d to %s failed: %s", info.step, info.rank, name, exc,
                                        extra={"node": self.node, "job": info.job, "peer": name})
                            if client is not None:
                                client.__exit__(None, None, None)
                            client = None  # the next shard tries a fresh connection
                            continue
                        pushed.add(shard.key)
                        if self.metrics is not None:
                            self.metrics.checkpoint_bytes.labels("replica").inc(info.size)
                        self._durable("replica", info.saved_at)
                        log.info("replicated step %d rank %d to %s", info.step, info.rank, name,
                                 extra={"node": self.node, "job": info.job, "peer": name, "bytes": info.size,
                                        "seconds": round(time.monotonic() - started, 3)})
                finally:
                    if client is not None:
                        client.__exit__(None, None, None)
        finally:
            for shard, read in reads:
                if shard.key in pushed and not shard.held:
                    self._hold_pushed(shard, read)
                else:
                    read.__exit__(None, None, None)
                self._replicated.add(shard.key)

    # -- the persistent tier ----------------------------------------------------------

    def _pin(self, job: Job, pin: plan.Pin) -> None:
        """Hold a shared lock on these own slots so their ranks write other slots (they have
        spares) instead of overwriting the step a lost node would need; release the job's others,
        and the pushed slots that can no longer become that step."""
        wanted = {s.path: s for s in pin.shards}
        with self._pins_lock:
            for path in [p for p in self._pins if p.parent.name == shm.job_folder(job.name) and p not in wanted]:
                self._pins.pop(path).__exit__(None, None, None)
            for path, shard in wanted.items():
                if path not in self._pins:
                    read = shm.SharedRead(shm.StoredShard(shard.path, shard.info, shard.held)).__enter__()
                    if read.ok:
                        self._pins[path] = read
                    else:
                        read.__exit__(None, None, None)
            for key, reads in list(self._pushed.items()):
                if key[0] != job.name:
                    continue
                for read in list(reads):
                    info = read.stored.info
                    if pin.final or info.attempt < job.attempt or (pin.step is not None and info.step <= pin.step):
                        reads.remove(read)
                        read.__exit__(None, None, None)

    def _hold_pushed(self, shard: plan.LocalShard, read: shm.SharedRead) -> None:
        """Keep the lock a push took on an own slot until the pass after the step is fully replicated.

        Released now, the rank could reuse the slot before the next pass pins it (a rank saving
        every step does): its peers would hold replicas of a step this node no longer has, and
        that step would not survive losing a peer. At most ``PUSHED_HOLDS`` per rank, its newest:
        the other nodes may complete either (each pushes the newest step it sees, and they differ).
        """
        with self._pins_lock:
            reads = self._pushed.setdefault((shard.info.job, shard.info.rank), [])
            reads.append(read)
            dropped = reads[:-PUSHED_HOLDS]
            del reads[:-PUSHED_HOLDS]
        for older in dropped:
            older.__exit__(None, None, None)

    # -- what a restoring rank asks ------------------------------------------------

    def restore_catalog(self, job: str) -> RestoreCatalog:
        """Steps committed in memory and where every copy of their shards is (the rank adds the persistent tier)."""
        rows = self.catalog.list_checkpoint_steps(job)
        steps = plan.committed_steps(rows, CheckpointTier.MEMORY)
        untrusted = tuple(sorted({r.step for r in rows if r.tier is PERSISTENT and r.status is StepStatus.UNTRUSTED}, reverse=True))
        copies = [c for c in self.catalog.list_shard_copies(job) if c.tier is not PERSISTENT]
        servers = self.catalog.shard_servers()
        entries = []
        for row in steps:
            by_rank: dict[int, list[CopyLocation]] = {}
            for c in copies:
                if (c.step, c.attempt) == (row.step, row.attempt):
                    by_rank.setdefault(c.rank, []).append(CopyLocation(node=c.node, tier=c.tier.value))  # type: ignore[arg-type]
            entries.append(CatalogStep(step=row.step, attempt=row.attempt, world_size=row.world_size,
                                       copies={r: tuple(v) for r, v in by_rank.items()}))
        nodes = {c.node for c in copies}
        return RestoreCatalog(job=job, memory=tuple(entries), endpoints={n: a for n, a in servers.items() if n in nodes},
                              untrusted=untrusted)
