"""Typed records of the stores. Field names are the column names of the local (SQLite) store.

``version`` on nodes and jobs plays the part of Kubernetes' ``resourceVersion``:
every write bumps it, and a conditional write (``expect_version=``) of a record
someone changed since it was read raises ``StaleUpdate``. Heartbeats and rank
progress are not part of these records' versions (they are lease renewals), so a
busy node never makes the controller's conditional writes stale.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState, WorkerPhase

if TYPE_CHECKING:
    from unbroken.config.cluster import ClusterConfig
    from unbroken.config.job import JobSpec


class Desired(StrEnum):
    """What the controller wants of a worker; the agent makes it so."""

    RUN = "Run"
    STOP = "Stop"
    HOLD = "Hold"
    """Leave this attempt but keep the processes: an in-process restart. The ranks leave their process
    group and the agent keeps them (the row closes as Stopped) for the next attempt on this node."""


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


class ClusterStatus(StrEnum):
    UP = "Up"
    STOPPING = "Stopping"
    """``cluster down`` is under way: nothing may start a node or a worker (the fence)."""
    DOWN = "Down"


@dataclass(frozen=True)
class ClusterRecord:
    """The cluster object: its configuration (the cluster file, validated) and whether it is up."""

    name: str
    config_json: str
    status: ClusterStatus
    created_at: float
    controller_metrics: str | None = None
    """Where the controller serves ``/metrics`` (``host:port``), once it runs."""

    def config(self) -> "ClusterConfig":
        from unbroken.config.cluster import ClusterConfig

        return ClusterConfig.model_validate_json(self.config_json)


@dataclass(frozen=True)
class Node:
    name: str
    group: str
    instance_type: str
    state: NodeState
    deep_health: DeepHealthStatus
    address: str = "127.0.0.1"
    fault_type: str | None = None
    fault_reason: str | None = None
    agent_pid: int | None = None
    heartbeat_at: float | None = None
    """The node's lease: when its agent last renewed it (read only; ``renew_lease`` writes it)."""
    registered_at: float | None = None
    state_changed_at: float = 0.0
    reboots: int = 0
    replaced_by: str | None = None
    recovery_requested: bool = False
    """An operator asked for this node's reboot/replacement: carried out even with NodeRecovery None."""
    metrics_address: str | None = None
    """Where its agent serves ``/metrics`` (``host:port``)."""
    version: int = 0


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    pid: int


@dataclass(frozen=True)
class RankTiming:
    """One rank's recent step times, as its agent measured them (``supervision/step_clock.py``)."""

    rank: int
    work_s: float | None = None
    """Median seconds per step in the rank's scored sections (``ctx.section``, not ``waits_on_peers``)."""
    sections: dict[str, float] = field(default_factory=dict)
    """Median seconds per step of each scored section, by name."""


@dataclass(frozen=True)
class StepTiming:
    """A worker's step times over its recent steps (the first steps of a process excluded), summed up
    by its agent: the same few figures whether the node runs one rank or 64, so a heartbeat stays small."""

    steps: int
    """Step intervals measured so far this attempt."""
    median_s: float
    """Median wall seconds between two steps over the recent window (slowest rank)."""
    longest_s: float
    """Longest wall gap between two progress reports of a rank this attempt: a checkpoint, an evaluation."""
    work_s: float | None = None
    """The median over the worker's ranks of their work per step: what the job's other nodes are scored against."""
    sections: dict[str, float] = field(default_factory=dict)
    """Per scored section, the median over the worker's ranks."""
    slowest: RankTiming | None = None
    """The rank with the most work per step, with its sections: the node's straggler score is its."""

    def to_json(self) -> dict[str, Any]:
        def rounded(sections: dict[str, float]) -> dict[str, float]:
            return {k: round(v, 6) for k, v in sections.items()}

        out: dict[str, Any] = {"steps": self.steps, "median_s": round(self.median_s, 6), "longest_s": round(self.longest_s, 6)}
        if self.work_s is not None:
            out["work_s"] = round(self.work_s, 6)
            out["sections"] = rounded(self.sections)
        if self.slowest is not None and self.slowest.work_s is not None:
            out["slowest"] = {"rank": self.slowest.rank, "work_s": round(self.slowest.work_s, 6), "sections": rounded(self.slowest.sections)}
        return out

    @classmethod
    def from_json(cls, raw: Any) -> StepTiming | None:
        """The timing in ``raw``, or None if it is not one (an older or foreign writer): timing is advice."""
        try:
            slowest = raw.get("slowest")
            return cls(steps=int(raw["steps"]), median_s=float(raw["median_s"]), longest_s=float(raw["longest_s"]),
                       work_s=None if raw.get("work_s") is None else float(raw["work_s"]), sections=_seconds(raw.get("sections")),
                       slowest=None if slowest is None else RankTiming(rank=int(slowest["rank"]), work_s=float(slowest["work_s"]),
                                                                       sections=_seconds(slowest.get("sections"))))
        except (AttributeError, KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True)
class Divergence:
    """A worker's ranks found their replicas' state differing (``ctx.watch_replicas``): silent data corruption."""

    step: int
    """The step the fingerprints differed at."""
    agreed_step: int
    """The last step they agreed on (-1: none this attempt): what was saved after it is not to be restored."""
    suspects: tuple[int, ...]
    """Global ranks outvoted by the majority; with no strict majority, every rank of the replica group."""
    majority: bool
    tensor: str | None = None
    """The first tensor that differed, as the script's state names it."""

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "agreed_step": self.agreed_step, "suspects": list(self.suspects), "majority": self.majority,
                "tensor": self.tensor}

    @classmethod
    def from_json(cls, raw: Any) -> Divergence | None:
        """The divergence in ``raw``, or None if it is not one (an older or foreign writer)."""
        try:
            return cls(step=int(raw["step"]), agreed_step=int(raw["agreed_step"]), suspects=tuple(int(r) for r in raw["suspects"]),
                       majority=bool(raw["majority"]), tensor=None if raw.get("tensor") is None else str(raw["tensor"]))
        except (AttributeError, KeyError, TypeError, ValueError):
            return None


def _seconds(raw: Any) -> dict[str, float]:
    return {str(k): float(v) for k, v in (raw or {}).items()}


@dataclass(frozen=True)
class Job:
    name: str
    spec_json: str
    phase: JobPhase
    attempt: int = 0
    """0 for the first run; each restart adds one (``attempt - resizes`` is the retries used)."""
    reason: str | None = None
    created_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    phase_changed_at: float = 0.0
    cancel_requested: bool = False
    nodes: tuple[str, ...] = ()
    """Where the current attempt was placed: written with the decision, before the backend
    launches it, so a controller killed in between launches the same placement again."""
    resizes: int = 0
    """Attempts started to grow an elastic job: restarts of choice, not counted against max_retry."""
    version: int = 0

    def spec(self) -> "JobSpec":
        from unbroken.config.job import JobSpec

        return JobSpec.model_validate_json(self.spec_json, context={"trusted": True})


@dataclass(frozen=True)
class Worker:
    job: str
    attempt: int
    node: str
    node_rank: int
    desired: Desired
    phase: WorkerPhase
    rdzv_endpoint: str
    id: int = 0
    pid: int | None = None
    created_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    message: str | None = None
    log_dir: str | None = None
    first_step: int | None = None
    first_progress_at: float | None = None
    last_step: int | None = None
    last_progress_at: float | None = None
    """Oldest of the node's ranks' latest progress: a single stuck rank shows here."""
    restored_step: int | None = None
    ranks: tuple[RankInfo, ...] = field(default_factory=tuple)
    checkpoint_stall_s: float | None = None
    """Time its ranks spent blocked in checkpoint saves (the most of any rank), for badput."""
    saved_step: int | None = None
    """The newest step every rank of the worker has saved (an elastic job grows after one)."""
    step_timing: StepTiming | None = None
    """Its ranks' recent step and section times: hang timeouts and straggler scores read them."""
    divergence: Divergence | None = None
    finished_at: float | None = None
    """When the last of its ranks said it finished training (``ctx.finished()``), once every rank that reported has:
    it is exiting, and its silence is not a hang."""
    """Its ranks' replicas stopped agreeing (silent data corruption): the controller restarts from the agreed step."""


@dataclass(frozen=True)
class WorkerProgress:
    """What a node agent reports of one of its workers with its lease renewal.

    Local: the worker row's progress columns; Kubernetes: an annotation on the node's Lease.
    """

    job: str
    attempt: int
    ranks: tuple[RankInfo, ...] = ()
    first_step: int | None = None
    first_progress_at: float | None = None
    last_step: int | None = None
    last_progress_at: float | None = None
    restored_step: int | None = None
    checkpoint_stall_s: float | None = None
    saved_step: int | None = None
    """The newest step every rank of the worker has saved (an elastic job grows after one)."""
    step_timing: StepTiming | None = None
    divergence: Divergence | None = None
    finished_at: float | None = None
    """When the last of its ranks said it finished, once every rank that reported has (``Worker.finished_at``)."""


@dataclass(frozen=True)
class Event:
    ts: float
    object_kind: str
    object_name: str
    type: EventType
    reason: str
    message: str
    id: int = 0


class CheckpointTier(StrEnum):
    MEMORY = "memory"
    """The rank's own slot in its node's shared memory."""
    REPLICA = "replica"
    """A copy held in a peer node's shared memory."""
    PERSISTENT = "persistent"
    """The job's file:// or s3:// URI."""


class StepStatus(StrEnum):
    DRAINING = "Draining"
    """Shards are being copied into the tier; not restorable from it yet."""
    COMMITTED = "Committed"
    """Every rank's shard and the manifest are there and the commit marker was written last."""
    FAILED = "Failed"
    """Copying into the tier failed; ``message`` says why. Training went on."""
    UNTRUSTED = "Untrusted"
    """Saved after the last step the job's replicas agreed on (silent data corruption): never restored; ``message``
    says why. Kept for whoever investigates until a later attempt saves the same step again (its rows replace these)
    or the job's checkpoints go; retention counts only committed steps."""


@dataclass(frozen=True)
class ShardCopy:
    """One copy of one rank's shard of one step: where it is and what it must hash to."""

    job: str
    step: int
    rank: int
    tier: CheckpointTier
    node: str
    """The node whose shared memory holds it; "" in the persistent tier."""
    attempt: int
    world_size: int
    size: int
    checksum: str
    info_json: str
    """The full ShardInfo (tensor dtypes/shapes), for restore and ``ckpt list``."""
    created_at: float


@dataclass(frozen=True)
class CheckpointStep:
    """A step's state in one tier (memory or persistent)."""

    job: str
    step: int
    tier: CheckpointTier
    attempt: int
    world_size: int
    status: StepStatus
    size: int
    """Total over all ranks."""
    updated_at: float
    committed_at: float | None = None
    message: str | None = None
