"""What a node agent does next with one job's checkpoints: a pure function of a snapshot.

``plan(job_view, node_view)`` reads what this node holds in shared memory, what
the catalog says (every tier's rows and copies), and what this agent has done
already (recorded, replicated, drained), and returns the actions of one pass,
in order. It reads no file and no store and does no I/O: the service
(:mod:`unbroken.checkpoint.node.service`) gathers the snapshot and carries the
actions out. Every rule of the tiers is here, so every rule is tested without
shared memory, peers or S3.

The steps of a pass, for one job:

1. **forget** copies the catalog lists on this node that are gone from it (a slot
   rewritten, a replica retired), and every copy on a retired node;
2. **record** each complete shard found here that the catalog does not have yet;
   a shard of an attempt older than the job's is recorded only if its step already
   committed (fencing: a slow rank of a failed attempt cannot complete a step of
   the new timeline), and a step re-saved by a newer attempt replaces the older
   attempt's rows and copies;
3. **commit in memory** a step whose every rank has a copy from one attempt (the
   row is the memory tier's commit marker);
4. **replicate** this node's shards of the newest step it recorded, committed or not,
   to the ring peers (first those of a newer committed step than the one that survives
   a node loss, if other nodes have begun replicating it);
5. **drain** to the persistent tier: open a drain when the policy says a step is
   due (one at a time: a slow tier skips steps, never queues them), upload this
   node's shards of a draining step, and try to commit it once every rank's
   shard is there;
6. **retain** per tier the newest ``keep`` committed steps, plus the newest step
   every rank has copies of on two nodes (with its own slots pinned) until a newer
   one has; never anything newer than the newest committed step or
   being drained. A finished job's shared memory is freed once its drain is done.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from unbroken.checkpoint.format.manifest import ShardInfo
from unbroken.config.checkpoint import TierPolicy
from unbroken.state.records import CheckpointStep, CheckpointTier, Job, ShardCopy, StepStatus

MEMORY, REPLICA, PERSISTENT = CheckpointTier.MEMORY, CheckpointTier.REPLICA, CheckpointTier.PERSISTENT

PREPARING = "preparing"
"""``message`` of a Draining row whose opener is still clearing what an older attempt left
in the tier under that step; nobody uploads to it until the opener clears the message."""
COMMIT_CLAIM = "committing: "
"""``message`` prefix of a Draining row an agent is writing the manifest and marker of."""
CLAIM_SECONDS = 60.0
"""A preparation or commit claim older than this lost its agent: another one may take it over."""

ShardKey = tuple[str, int, int, int]
"""(job, step, rank, attempt): a step re-saved by a later attempt is a new shard."""


# -- the snapshot ----------------------------------------------------------------------


@dataclass(frozen=True)
class LocalShard:
    """A complete shard (it has a descriptor) in this node's shared memory."""

    path: Path
    info: ShardInfo
    held: bool
    """A replica this node holds for a peer (else one of this node's ranks' own slots)."""
    slot_attempt: int | None = None
    """Own slots: the attempt that created the slot file (its name says so)."""

    @property
    def key(self) -> ShardKey:
        return (self.info.job, self.info.step, self.info.rank, self.info.attempt)


@dataclass(frozen=True)
class JobView:
    job: Job
    policy: TierPolicy | None
    shards: tuple[LocalShard, ...] = ()
    steps: tuple[CheckpointStep, ...] = ()
    """The catalog's rows of this job, every tier."""
    copies: tuple[ShardCopy, ...] = ()
    """The catalog's shard copies of this job, every tier and node."""
    empty_slots: tuple[tuple[Path, int], ...] = ()
    """This node's slot files of the job without a complete shard, with their attempt."""


@dataclass(frozen=True)
class NodeView:
    node: str
    now: float
    ring: tuple[tuple[str, str], ...] = ()
    """The other schedulable nodes with a shard server, in ring order after this one: (name, address)."""
    retired: frozenset[str] = frozenset()
    recorded: Mapping[Path, str] = field(default_factory=dict)
    """Shard files this agent already recorded, with the checksum they had."""
    replicated: frozenset[ShardKey] = frozenset()
    drained: frozenset[ShardKey] = frozenset()
    replicator_busy: bool = False
    drainer_busy: bool = False


# -- the actions -----------------------------------------------------------------------


@dataclass(frozen=True)
class RecordCopy:
    copy: ShardCopy
    path: Path


@dataclass(frozen=True)
class ForgetCopies:
    step: int
    tier: CheckpointTier
    node: str | None = None
    """None: on every node."""
    rank: int | None = None
    """None: every rank's."""


@dataclass(frozen=True)
class DeleteStep:
    step: int
    tier: CheckpointTier


@dataclass(frozen=True)
class CommitMemory:
    record: CheckpointStep


@dataclass(frozen=True)
class Replicate:
    shards: tuple[LocalShard, ...]
    peers: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class OpenDrain:
    """Insert this Draining row (if nobody did first) and prepare it."""

    record: CheckpointStep


@dataclass(frozen=True)
class TakeOverDrain:
    """A preparation whose agent died: take it over and prepare the step again."""

    row: CheckpointStep


@dataclass(frozen=True)
class Upload:
    row: CheckpointStep
    shards: tuple[LocalShard, ...]


@dataclass(frozen=True)
class CommitPersistent:
    row: CheckpointStep


@dataclass(frozen=True)
class DeleteFiles:
    """Unlink shard files (descriptor first) or empty slots; a reader keeps its open file."""

    paths: tuple[Path, ...]


@dataclass(frozen=True)
class Pin:
    """Hold a shared lock on this node's own slots of ``step`` (None: no step survives losing a
    node yet) and release the job's other pins, and the slots pushes hold for steps up to it."""

    step: int | None
    shards: tuple[LocalShard, ...] = ()
    final: bool = False
    """The job ended: release everything of it."""


Action = (RecordCopy | ForgetCopies | DeleteStep | CommitMemory | Replicate | OpenDrain | TakeOverDrain | Upload
          | CommitPersistent | DeleteFiles | Pin)


# -- the decision ----------------------------------------------------------------------


def plan(view: JobView, here: NodeView) -> list[Action]:
    """The actions of one pass for one job on this node, in the order they are to be done."""
    if view.policy is None:
        # Shards of a job without tiers: nothing will ever read them.
        return _drop(view, here, memory_rows=[r for r in view.steps if r.tier is MEMORY]) if view.shards else []
    policy = view.policy
    job = view.job
    ended = job.phase.is_terminal
    actions: list[Action] = []
    steps = list(view.steps)
    copies = _forget(view, here, actions)
    copies = _record(view, here, steps, copies, actions)
    _commit_memory(view, here, steps, copies, actions)
    committed = committed_steps(steps, MEMORY)
    if not ended and policy.memory.replicas and not here.replicator_busy:
        peers = here.ring[: policy.memory.replicas]
        todo = _to_replicate(view, here, committed, copies)
        if todo and peers:
            actions.append(Replicate(todo, peers))
    if policy.persistent is not None:
        _drain(view, here, steps, committed, actions, open_new=not ended)
    draining = {r.step for r in steps if r.tier is PERSISTENT and r.status is StepStatus.DRAINING}
    if ended:
        if not draining and not here.drainer_busy:
            actions += _drop(view, here, memory_rows=[r for r in steps if r.tier is MEMORY])
    else:
        _retain(view, policy, committed, copies, draining, actions)
    return actions


def committed_steps(steps: Sequence[CheckpointStep], tier: CheckpointTier) -> list[CheckpointStep]:
    """The tier's committed rows, newest first."""
    return sorted((s for s in steps if s.tier is tier and s.status is StepStatus.COMMITTED), key=lambda s: s.step, reverse=True)


def ring(node: str, schedulable: Sequence[str], servers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The nodes after ``node`` in name order, wrapping around, that serve shards: where its replicas go."""
    names = sorted(set(schedulable) | {node})
    start = names.index(node)
    after = [names[(start + i) % len(names)] for i in range(1, len(names))]
    return tuple((name, servers[name]) for name in after if servers.get(name))


def persistent_excess(steps: Sequence[CheckpointStep], keep: int) -> list[CheckpointStep]:
    """Committed persistent steps beyond the newest ``keep``: what the tier's retention deletes."""
    return committed_steps(steps, PERSISTENT)[keep:]


def claim_is_stale(row: CheckpointStep, now: float) -> bool:
    return now - row.updated_at >= CLAIM_SECONDS


# -- the steps of a pass ---------------------------------------------------------------


def _forget(view: JobView, here: NodeView, actions: list[Action]) -> list[ShardCopy]:
    present = {(s.info.step, s.info.rank, s.held) for s in view.shards}
    kept = []
    for copy in view.copies:
        gone = copy.tier is not PERSISTENT and (
            copy.node in here.retired  # a retired node's agent is gone for good: nobody else deletes its rows
            or (copy.node == here.node and (copy.step, copy.rank, copy.tier is REPLICA) not in present)
        )
        if gone:
            actions.append(ForgetCopies(copy.step, copy.tier, copy.node, copy.rank))
        else:
            kept.append(copy)
    return kept


def _record(view: JobView, here: NodeView, steps: list[CheckpointStep], copies: list[ShardCopy],
            actions: list[Action]) -> list[ShardCopy]:
    for shard in view.shards:
        info = shard.info
        if here.recorded.get(shard.path) == info.checksum:
            continue
        if info.attempt < view.job.attempt and not any(
            s.tier is MEMORY and s.status is StepStatus.COMMITTED and (s.step, s.attempt) == (info.step, info.attempt) for s in steps
        ):
            continue  # fenced: a late shard of a failed attempt
        # Re-saved by a newer attempt: the old timeline's rows go, except a persistent one marked Untrusted: the tier
        # still holds that step's files, committed, and the mark is what keeps a restore from them (until a later
        # attempt's drain of the same step replaces them, which the mark's row keeps from opening: that step
        # number stays out of the persistent tier, the next one goes in).
        for row in [r for r in steps if r.step == info.step and r.attempt < info.attempt
                    and not (r.tier is PERSISTENT and r.status is StepStatus.UNTRUSTED)]:
            actions.append(DeleteStep(row.step, row.tier))
            steps.remove(row)
        older = [c for c in copies if c.step == info.step and c.attempt < info.attempt]
        actions += [ForgetCopies(c.step, c.tier, c.node, c.rank) for c in older]
        copies = [c for c in copies if c not in older]
        copy = ShardCopy(
            job=info.job, step=info.step, rank=info.rank, tier=REPLICA if shard.held else MEMORY, node=here.node,
            attempt=info.attempt, world_size=info.world_size, size=info.size, checksum=info.checksum,
            info_json=info.model_dump_json(), created_at=here.now,
        )
        actions.append(RecordCopy(copy, shard.path))
        copies = [c for c in copies if (c.step, c.rank, c.tier, c.node) != (copy.step, copy.rank, copy.tier, copy.node)]
        copies.append(copy)
    return copies


def _commit_memory(view: JobView, here: NodeView, steps: list[CheckpointStep], copies: list[ShardCopy],
                   actions: list[Action]) -> None:
    have = {s.step for s in steps if s.tier is MEMORY}
    newer_kept = {s.step for s in steps if s.tier is MEMORY and s.status is StepStatus.COMMITTED}
    groups: dict[tuple[int, int, int], dict[int, ShardCopy]] = {}
    for copy in copies:
        if copy.tier is MEMORY:
            groups.setdefault((copy.step, copy.attempt, copy.world_size), {})[copy.rank] = copy
    keep = view.policy.memory.keep if view.policy is not None else 1
    for (step, attempt, world_size), ranks in sorted(groups.items(), reverse=True):
        if step in have or len(ranks) != world_size:
            continue
        if sum(other > step for other in newer_kept) >= keep:
            # Retention already let this step go (its files linger until the ranks reuse their
            # slots): committing it again would only have the next pass retire it again.
            continue
        record = CheckpointStep(
            job=view.job.name, step=step, tier=MEMORY, attempt=attempt, world_size=world_size, status=StepStatus.COMMITTED,
            size=sum(c.size for c in ranks.values()), updated_at=here.now, committed_at=here.now,
        )
        actions.append(CommitMemory(record))
        steps.append(record)
        have.add(step)


def _drain(view: JobView, here: NodeView, steps: list[CheckpointStep], committed: list[CheckpointStep],
           actions: list[Action], *, open_new: bool) -> None:
    policy = view.policy
    assert policy is not None and policy.persistent is not None
    rows = sorted((s for s in steps if s.tier is PERSISTENT), key=lambda s: s.step, reverse=True)
    draining = [r for r in rows if r.status is StepStatus.DRAINING]
    if open_new and committed and not draining:
        newest, last = committed[0], (rows[0] if rows else None)
        since = None if last is None else here.now - last.updated_at
        if policy.persistent.due(newest.step, last_step=last.step if last else None, seconds_since_last=since):
            record = CheckpointStep(
                job=view.job.name, step=newest.step, tier=PERSISTENT, attempt=newest.attempt, world_size=newest.world_size,
                status=StepStatus.DRAINING, size=newest.size, updated_at=here.now, message=PREPARING,
            )
            actions.append(OpenDrain(record))
            return  # uploads start once the row is prepared (next pass)
    if here.drainer_busy:
        return
    for row in draining:
        if row.message == PREPARING:
            if claim_is_stale(row, here.now):
                actions.append(TakeOverDrain(row))
            continue
        mine = tuple(s for s in view.shards if not s.held and (s.info.step, s.info.attempt) == (row.step, row.attempt)
                     and s.key not in here.drained)
        if mine:
            actions.append(Upload(row, mine))
            return  # one upload at a time
        actions.append(CommitPersistent(row))


def _to_replicate(view: JobView, here: NodeView, committed: list[CheckpointStep], copies: list[ShardCopy]) -> tuple[LocalShard, ...]:
    """This node's shards to push next: of a step other nodes have begun replicating, newer than
    the one that survives a node loss now, if its own slots still hold it (completing it makes
    a newer such step); else of the newest step this node has recorded its own copies of,
    committed or not. Replication skips steps when it falls behind, and nodes that skipped
    different steps would otherwise rarely complete one.

    A step is pushed before its commit, as soon as this node recorded it: the peer then records
    the replicas with its own copies of the same save, in one catalog write (service.py), and the
    step survives losing a node sooner. Only this attempt's recorded copies are pushed, so what
    fencing kept out of the catalog is never replicated; a step that never commits costs its
    bytes on the wire, and its replicas go with retention like any other."""
    safe = _newest_surviving_a_node_loss(committed, copies)
    begun = {(c.step, c.attempt) for c in copies if c.tier is REPLICA}
    newest_committed = committed[0].step if committed else -1
    recorded = max((c.step for c in copies if c.tier is MEMORY and c.node == here.node and c.attempt == view.job.attempt
                    and c.step > newest_committed), default=None)
    rows = ([(r.step, r.attempt) for r in committed if (r.step, r.attempt) in begun and (safe is None or r.step > safe)]
            + ([(recorded, view.job.attempt)] if recorded is not None else []) + [(r.step, r.attempt) for r in committed[:1]])
    for step, attempt in rows:
        todo = tuple(s for s in view.shards if not s.held and (s.info.step, s.info.attempt) == (step, attempt)
                     and s.key not in here.replicated)
        if todo:
            return todo
    return ()


def _retain(view: JobView, policy: TierPolicy, committed: list[CheckpointStep], copies: list[ShardCopy],
            draining: set[int], actions: list[Action]) -> None:
    stale = tuple(path for path, attempt in view.empty_slots if attempt < view.job.attempt)
    if stale:
        actions.append(DeleteFiles(stale))  # half-written by a rank of a failed attempt: unreadable
    kept = {s.step for s in committed[: policy.memory.keep]}
    # The replica tier's own "newest committed step": the newest step every rank has copies of
    # on two nodes (after a node loss: on one). Replication skips ahead when it falls behind,
    # so the newest memory steps may have no replicas yet; until a newer step is on two nodes
    # this one is what survives losing a node, and it stays (rows, replicas, pinned own slots).
    replicated = _newest_surviving_a_node_loss(committed, copies) if policy.memory.replicas else None
    if replicated is not None:
        kept.add(replicated)
    actions.append(Pin(replicated, tuple(s for s in view.shards if not s.held and s.info.step == replicated)))
    if not kept:
        return
    oldest_kept, newest_kept = min(kept), max(kept)
    for row in committed:
        if row.step not in kept and row.step < newest_kept and row.step not in draining:
            actions.append(DeleteStep(row.step, MEMORY))
    doomed = []
    for shard in view.shards:
        step = shard.info.step
        if step >= oldest_kept or step in kept or step in draining:
            continue
        # Held replicas and slots of finished attempts are ours to delete; the current
        # attempt's slots are reused by their rank, which never overwrites its newest ones.
        if shard.held or (shard.slot_attempt or 0) < view.job.attempt:
            doomed.append(shard.path)
    if doomed:
        actions.append(DeleteFiles(tuple(doomed)))


def _newest_surviving_a_node_loss(committed: list[CheckpointStep], copies: list[ShardCopy]) -> int | None:
    """The newest committed step of which every rank has copies (own slot or replica) on two
    nodes; failing that (a node was just lost), the newest of which every rank has one.

    A replica alone is not enough: a rank may have reused its own slot of the step (this node
    forgot that copy), and then losing the replica's node loses the step.
    """
    nodes: dict[tuple[int, int, int], set[str]] = {}
    for c in copies:
        if c.tier in (MEMORY, REPLICA):
            nodes.setdefault((c.step, c.rank, c.attempt), set()).add(c.node)

    def spread(row: CheckpointStep) -> int:
        return min(min(len(nodes.get((row.step, rank, row.attempt), ())), 2) for rank in range(row.world_size))

    best = max(committed, key=lambda row: (spread(row), row.step), default=None)
    return best.step if best is not None and spread(best) > 0 else None


def _drop(view: JobView, here: NodeView, memory_rows: Sequence[CheckpointStep] = ()) -> list[Action]:
    """Give a finished job's shared memory back to the node: what reached the persistent tier stays there."""
    actions: list[Action] = [Pin(None, final=True)]
    paths = tuple(path for path, _ in view.empty_slots) + tuple(s.path for s in view.shards)
    if paths:
        actions.append(DeleteFiles(paths))
    for row in memory_rows:
        actions += [DeleteStep(row.step, MEMORY), ForgetCopies(row.step, MEMORY), ForgetCopies(row.step, REPLICA)]
    return actions


__all__ = [
    "Action", "CommitMemory", "CommitPersistent", "DeleteFiles", "DeleteStep", "ForgetCopies", "JobView", "LocalShard",
    "NodeView", "OpenDrain", "Pin", "RecordCopy", "Replicate", "TakeOverDrain", "Upload", "claim_is_stale", "committed_steps",
    "persistent_excess", "plan", "ring",
]
