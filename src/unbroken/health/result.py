"""The one result format every check returns, and what a failure asks of the node."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from unbroken.config.health import FaultAction

__all__ = ["CheckResult", "FaultAction", "Outcome", "Status", "Suite", "TIMEOUT", "passed", "skip", "worst"]


class Status(StrEnum):
    PASS = "Pass"
    WARN = "Warn"
    """Worth a person's look; the node stays in service."""
    FAIL = "Fail"
    SKIP = "Skip"
    """Not applicable here (no GPU on a CPU profile, no RDMA expected), said in the message."""


class Suite(StrEnum):
    """Values match ``OnStartDeepHealthChecks`` (and ``Continuous`` for the monitor)."""

    INSTANCE_STRESS = "InstanceStress"
    INSTANCE_CONNECTIVITY = "InstanceConnectivity"
    CONTINUOUS = "Continuous"


def worst(actions: list[FaultAction]) -> FaultAction:
    return max(actions, key=lambda a: a.severity, default=FaultAction.NONE)


TIMEOUT = "Timeout"
"""``reason`` of a check that did not finish within its timeout (it was killed)."""


@dataclass(frozen=True)
class CheckResult:
    check: str
    """Catalogue id, e.g. ``stress.matmul`` or ``collective.allreduce``."""
    suite: Suite
    status: Status
    message: str
    reason: str = ""
    """Short machine-readable cause (``Timeout``, ``BelowThreshold``, ``NoDriver``...)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    action: FaultAction = FaultAction.REPLACE
    """Asked of the node if ``status`` is Fail. Most failed checks mean broken
    hardware, so the default is replacement; checks that a reboot can fix say so."""
    node: str = ""
    faulty_nodes: tuple[str, ...] = ()
    """Multi-node checks name the nodes they blame (empty: the node itself)."""
    duration_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status is Status.FAIL

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), default=str)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CheckResult":
        return cls(
            check=data["check"], suite=Suite(data["suite"]), status=Status(data["status"]), message=data["message"],
            reason=data.get("reason", ""), metrics=dict(data.get("metrics") or {}),
            action=FaultAction(data.get("action", FaultAction.REPLACE.value)), node=data.get("node", ""),
            faulty_nodes=tuple(data.get("faulty_nodes") or ()), duration_s=float(data.get("duration_s", 0.0)),
        )


@dataclass(frozen=True)
class Outcome:
    """What a check function returns; the runner adds id, suite, node and duration."""

    status: Status
    message: str
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    action: FaultAction = FaultAction.REPLACE
    faulty_nodes: tuple[str, ...] = ()


def skip(message: str, reason: str = "NotApplicable", **metrics: Any) -> Outcome:
    return Outcome(Status.SKIP, message, reason, metrics, FaultAction.NONE)


def passed(message: str, **metrics: Any) -> Outcome:
    return Outcome(Status.PASS, message, "", metrics, FaultAction.NONE)
