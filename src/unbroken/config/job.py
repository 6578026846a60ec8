"""The job file: what to run, on how many nodes, and how to survive failures.

Relative paths (the entry script, ``working_dir``, ``checkpoint.dir``) are
resolved against the job file's folder at load time, so a job file can be
submitted from anywhere. ``resilience`` mirrors the HyperPod job annotations
``unbroken.dev/enable-job-auto-resume`` and ``unbroken.dev/job-max-retry-count``.
"""

from __future__ import annotations

import shlex
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from unbroken.config.checkpoint import MemoryTier, PersistentTier, TierPolicy
from unbroken.config.cluster import NAME_PATTERN


class RestartPolicy(StrEnum):
    """Which failures a restart is spent on (Kubeflow's vocabulary)."""

    ON_FAILURE = "OnFailure"
    """Any failure: a worker exit, a lost node, a hang."""
    EXIT_CODE = "ExitCode"
    """Like Kubeflow: a worker exit code 1-127 is the program's own error and is not
    retried; signals, codes >= 128, lost nodes and hangs are."""
    NEVER = "Never"


STARTUP_TIMEOUT_FALLBACK_S = 600.0
"""The startup timeout of a job that sets none, until one of its attempts' startup is seen."""
HANG_TIMEOUT_FALLBACK_S = 300.0
"""The hang timeout of a job that sets none, until its step times are measured (5 minutes covers a
slow checkpoint or evaluation step)."""


STRAGGLER_RESTART_COST_S = 30.0
"""A cold restart elsewhere (processes or pods recreated, a checkpoint read), as ``replace`` weighs it by default."""


class StragglerPolicy(StrEnum):
    """What unbroken does about a straggler node (docs/stragglers.md)."""

    REPORT = "report"
    """A metric and a Warning Event naming the node, the rank, the score and the slow section."""
    SHADOW = "shadow"
    """As ``report``, plus an Event saying what ``replace`` would have done and when: try the policy out."""
    REPLACE = "replace"
    """Take a persistent straggler out like a faulty node (fault type ``Straggler``) when a spare node is
    free and the expected gain exceeds a restart's cost; the job moves (in-process where it can)."""
    OFF = "off"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ResilienceSpec(_Strict):
    auto_resume: bool = False
    """Off unless asked for, as HyperPod's annotation: a restart costs GPU time."""
    max_retry: int = Field(default=3, ge=0, le=1000)
    """Restarts allowed over the job's life; the next failure after that is final."""
    restart_policy: RestartPolicy = RestartPolicy.ON_FAILURE
    hang_timeout: float | None = Field(default=None, gt=0)
    """Seconds without ``ctx.progress`` from any rank before the job counts as hung. Unset: set
    from the job's own step times once it has run a few (``controller/hang_timeout.py``: a
    multiple of the median step and of the longest gap seen, never under a few seconds), 5
    minutes until then. Set it for a job with rare long pauses that report no progress (an
    evaluation every few thousand steps)."""
    startup_timeout: float | None = Field(default=None, gt=0)
    """Seconds from launch to a rank's first ``ctx.progress``: imports, rendezvous,
    restore. Longer than ``hang_timeout`` because a cold start is slower than a step.
    Unset: 10 minutes until an attempt's startup has been seen, then 3 x the slowest
    seen, never under a minute (``controller/hang_timeout.py``)."""
    require_deep_health_passed: bool = True
    """Only place the job on nodes whose deep-health-check-status is Passed."""
    warm_spares: int = Field(default=0, ge=0, le=4)
    """Warm spares each of the job's nodes keeps for it (0: off): torchrun processes that have
    imported torch and started a forkserver whose ranks need not import it again. A restart
    takes one instead of starting torchrun and every rank cold. Each costs a few hundred MB of
    host memory, nothing on the GPU; 1 is enough (a node runs one worker per job)."""
    in_process_restart: bool = False
    """Keep the processes of healthy workers across a restart: their ranks abort the process group,
    wait, and re-form it with the replacement ranks, then re-enter the training function given to
    ``ctx.run`` (no new process, no imports, no CUDA context or data loader rebuilt). Needs the
    script to train inside ``ctx.run(train)``; a worker whose ranks do not abort within
    ``in_process_abort_timeout`` is restarted in full, as without it. Local backend only."""
    node_losses_in_place: int = Field(default=0, ge=0, le=1000)
    """Kubernetes: how many of an attempt's pods may be lost with their nodes while the job goes on without a
    restart -- spare pods take their places, or an elastic job trains on fewer (``unbroken run``, or torchrun's
    elastic agent, regroups the pods left). The lost pods are deleted as any on a lost node, and their controller
    recreates them: new spare pods, or pods the job grows back onto. Node rank 0's pod (the Master) is never one:
    it hosts the rendezvous. Set by the operator from ``unbroken.dev/spare-pods`` and ``elasticPolicy``."""
    in_process_abort_timeout: float = Field(default=10.0, gt=0)
    """Seconds a held worker's ranks have to leave the broken process group (a rank in a long step
    reaches its next collective first). Also every collective's timeout under in-process restarts,
    at least ``hang_timeout``, so no survivor stays blocked on a dead peer."""
    straggler_policy: StragglerPolicy = StragglerPolicy.REPORT
    """What to do about a node whose ranks run persistently slower than their peers."""
    straggler_threshold: float = Field(default=0.75, gt=0, lt=1)
    """A rank is slow while its score (its peers' median time in scored sections over
    its own) is below this; NVIDIA's resiliency extension uses 0.75 too."""
    straggler_restart_cost: float = Field(default=STRAGGLER_RESTART_COST_S, gt=0)
    """Seconds a restart is taken to cost this job when ``replace`` weighs taking a straggler out (a cold
    restart elsewhere: processes or pods recreated, a checkpoint read). Replace only pays when the time
    the straggler would cost over the job's remaining run (estimated as the time it has run) is larger."""
    warm_imports: list[str] = Field(default_factory=list)
    """Modules the spares' forkserver imports besides torch (the script's heavy imports:
    ``transformers``, your model package). Never the script itself: importing runs it."""


class CheckpointSpec(_Strict):
    dir: Path | None = None
    """Where the file checkpointer writes. Default: ``<cluster dir>/checkpoints/<job name>``."""
    keep: int = Field(default=2, ge=1, le=1000)
    """Committed steps kept; 2 so that a torn newest step still leaves one behind."""
    memory: MemoryTier | None = None
    """Set it (even to ``{}``) to use the tiered checkpointer: shared memory, peer
    replicas and, with ``persistent``, a file:// or s3:// tier. Unset: one file per
    rank under ``dir`` (the foundation's checkpointer)."""
    persistent: PersistentTier | None = None

    @model_validator(mode="after")
    def _tiers_consistent(self) -> "CheckpointSpec":
        if self.persistent is not None and self.memory is None:
            raise ValueError("persistent needs memory: the persistent tier is drained from the memory tier (add 'memory: {}')")
        return self

    @property
    def tiers(self) -> TierPolicy | None:
        return None if self.memory is None else TierPolicy(memory=self.memory, persistent=self.persistent)


class JobSpec(_Strict):
    name: str = Field(pattern=NAME_PATTERN)
    """A DNS label, so the same name works as a PyTorchJob name on Kubernetes."""
    nodes: int = Field(default=1, ge=1, le=64)
    """Nodes the job runs on; for an elastic job, the most it grows to. Written ``nodes: 4``,
    or elastic ``nodes: {min: 2, max: 4}`` / ``nodes: "2:4"`` (torchrun's ``--nnodes`` form)."""
    min_nodes: int | None = Field(default=None, ge=1, le=64)
    """Elastic: the fewest nodes the job keeps running on when nodes are lost and none is free.
    Set through ``nodes: {min, max}``; None: always exactly ``nodes``."""
    procs_per_node: int = Field(default=1, ge=1, le=64)
    command: list[str] = Field(min_length=1)
    """Entry script then its arguments; ``["-m", "pkg.module", ...]`` runs a module."""
    env: dict[str, str] = Field(default_factory=dict)
    working_dir: Path | None = None
    """Default: the job file's folder."""
    resilience: ResilienceSpec = Field(default_factory=ResilienceSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)

    @model_validator(mode="before")
    @classmethod
    def _node_range(cls, data: Any) -> Any:
        """``nodes: {min: 2, max: 4}`` or ``nodes: "2:4"`` into ``nodes: 4, min_nodes: 2``."""
        if not isinstance(data, dict) or not isinstance(data.get("nodes"), (dict, str)):
            return data
        value = data["nodes"]
        if isinstance(value, str):
            low, colon, high = value.partition(":")
            if not (low.strip().isdigit() and (high.strip().isdigit() or not colon)):
                shown = value if len(value) <= 40 else value[:37] + "..."
                raise ValueError(f"nodes: {shown!r} is not N or MIN:MAX (e.g. 4 or \"2:4\")")
            return {**data, "nodes": int(high or low), "min_nodes": int(low) if colon else None}
        if set(value) != {"min", "max"}:
            raise ValueError(f"nodes: {value!r} must have exactly the keys min and max (e.g. {{min: 2, max: 4}})")
        return {**data, "nodes": value["max"], "min_nodes": value["min"]}

    @model_validator(mode="after")
    def _min_within_max(self) -> "JobSpec":
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"nodes: min {self.min_nodes} is more than max {self.nodes}")
        return self

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nodes

    @property
    def fewest_nodes(self) -> int:
        return self.min_nodes if self.min_nodes is not None else self.nodes

    @property
    def size(self) -> str:
        """``2 nodes x 2 procs``, or ``1-2 nodes (elastic) x 2 procs``: how a person reads the job's shape."""
        nodes = f"{self.fewest_nodes}-{self.nodes} nodes (elastic)" if self.elastic else f"{self.nodes} nodes"
        return f"{nodes} x {self.procs_per_node} procs"

    @field_validator("command", mode="before")
    @classmethod
    def _split_command(cls, value: Any) -> Any:
        if isinstance(value, str):
            return shlex.split(value)
        if isinstance(value, list):
            return [str(v) if isinstance(v, (int, float)) else v for v in value]
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: str(v) if isinstance(v, (int, float, bool)) else v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _resolve_paths(self, info: ValidationInfo) -> "JobSpec":
        context = info.context or {}
        if context.get("trusted"):
            return self  # read back from the store: paths were resolved at submit time
        if context.get("in_image"):
            return self  # a container's job (Kubernetes): its paths are the image's, not this machine's
        base = Path(context.get("base_dir", Path.cwd()))
        working_dir = (base / self.working_dir) if self.working_dir else base
        if not working_dir.is_dir():
            raise ValueError(f"working_dir {str(self.working_dir)!r} is not a directory (resolved to {working_dir})")
        command = list(self.command)
        if command[0] == "-m":
            if len(command) < 2:
                raise ValueError("command: '-m' must be followed by a module name")
        else:
            script = Path(command[0])
            resolved = script if script.is_absolute() else working_dir / script
            if not resolved.is_file():
                raise ValueError(f"command: entry script {command[0]!r} not found (looked at {resolved})")
            command[0] = str(resolved.resolve())
        ckpt = self.checkpoint
        if ckpt.dir is not None and not ckpt.dir.is_absolute():
            ckpt = ckpt.model_copy(update={"dir": (base / ckpt.dir).resolve()})
        object.__setattr__(self, "command", command)
        object.__setattr__(self, "working_dir", working_dir.resolve())
        object.__setattr__(self, "checkpoint", ckpt)
        return self

    @property
    def world_size(self) -> int:
        """Ranks at full size (an elastic job may run on fewer)."""
        return self.nodes * self.procs_per_node


def with_entry_script(command: list[str], script: str) -> list[str]:
    """``command`` running ``script`` instead of its own script (or ``-m module``), with the same arguments
    (HyperPod's ``--entry-script``)."""
    arguments = command[2:] if command[:1] == ["-m"] else command[1:]
    return [script, *arguments]


def load_job(path: Path, *, overrides: dict[str, Any] | None = None, entry_script: str | None = None,
             in_image: bool = False) -> JobSpec:
    """Load a job file; ``overrides`` are dotted paths from CLI flags (``resilience.max_retry``);
    ``entry_script`` replaces the command's script (``with_entry_script``).
    ``in_image``: the job runs in a container, so its script and paths are not looked up here."""
    from unbroken.config.loading import read_mapping, validate_mapping

    data = read_mapping(path)
    if entry_script is not None:
        command = data.get("command", [])
        if isinstance(command, (str, list)):  # anything else: validation names it below
            data["command"] = with_entry_script(shlex.split(command) if isinstance(command, str) else [str(c) for c in command],
                                                entry_script)
    for dotted, value in (overrides or {}).items():
        target = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                break
        else:
            target[leaf] = value
    return validate_mapping(data, JobSpec, source=str(path), context={"base_dir": path.parent.resolve(), "in_image": in_image})
