"""Typed partial updates of nodes, jobs and workers: what a writer changes, nothing else.

A field left at :data:`UNSET` is not touched; any other value (``None`` included)
is written. They replace ``update(**changes)``: a typo is a type error, not a
silently ignored keyword, and each backend maps the same update onto its own
storage (a SQLite ``UPDATE``, a Kubernetes merge patch).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState, WorkerPhase
from unbroken.state.records import Desired, Divergence, RankInfo


class _Unset(Enum):
    UNSET = "unset"

    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset.UNSET
"""Leave this field as it is."""


class _Update:
    def changes(self) -> dict[str, Any]:
        """The fields this update sets, by name."""
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not UNSET}  # type: ignore[arg-type]

    def __bool__(self) -> bool:
        return bool(self.changes())


@dataclass(frozen=True, kw_only=True)
class NodeUpdate(_Update):
    state: NodeState | _Unset = UNSET
    deep_health: DeepHealthStatus | _Unset = UNSET
    address: str | _Unset = UNSET
    fault_type: str | None | _Unset = UNSET
    fault_reason: str | None | _Unset = UNSET
    agent_pid: int | None | _Unset = UNSET
    registered_at: float | None | _Unset = UNSET
    reboots: int | _Unset = UNSET
    replaced_by: str | None | _Unset = UNSET
    recovery_requested: bool | _Unset = UNSET
    metrics_address: str | None | _Unset = UNSET


@dataclass(frozen=True, kw_only=True)
class JobUpdate(_Update):
    phase: JobPhase | _Unset = UNSET
    attempt: int | _Unset = UNSET
    reason: str | None | _Unset = UNSET
    started_at: float | None | _Unset = UNSET
    ended_at: float | None | _Unset = UNSET
    cancel_requested: bool | _Unset = UNSET
    nodes: tuple[str, ...] | _Unset = UNSET
    resizes: int | _Unset = UNSET


@dataclass(frozen=True, kw_only=True)
class WorkerUpdate(_Update):
    desired: Desired | _Unset = UNSET
    phase: WorkerPhase | _Unset = UNSET
    pid: int | None | _Unset = UNSET
    started_at: float | None | _Unset = UNSET
    ended_at: float | None | _Unset = UNSET
    exit_code: int | None | _Unset = UNSET
    message: str | None | _Unset = UNSET
    log_dir: str | None | _Unset = UNSET
    ranks: tuple[RankInfo, ...] | _Unset = UNSET
    first_step: int | None | _Unset = UNSET
    first_progress_at: float | None | _Unset = UNSET
    last_step: int | None | _Unset = UNSET
    last_progress_at: float | None | _Unset = UNSET
    restored_step: int | None | _Unset = UNSET
    checkpoint_stall_s: float | None | _Unset = UNSET
    saved_step: int | None | _Unset = UNSET
    divergence: Divergence | None | _Unset = UNSET
    finished_at: float | None | _Unset = UNSET
