"""Collect several findings of one check into one Outcome (worst status and action win)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unbroken.health.result import FaultAction, Outcome, Status

_RANK = {Status.SKIP: 0, Status.PASS: 1, Status.WARN: 2, Status.FAIL: 3}


@dataclass
class Findings:
    ok_message: str
    metrics: dict[str, Any] = field(default_factory=dict)
    items: list[tuple[Status, FaultAction, str, str]] = field(default_factory=list)

    def fail(self, message: str, reason: str, action: FaultAction = FaultAction.REPLACE) -> None:
        self.items.append((Status.FAIL, action, message, reason))

    def warn(self, message: str, reason: str) -> None:
        self.items.append((Status.WARN, FaultAction.NONE, message, reason))

    def outcome(self) -> Outcome:
        if not self.items:
            return Outcome(Status.PASS, self.ok_message, "", self.metrics, FaultAction.NONE)
        top = max(_RANK[s] for s, *_ in self.items)
        worst = [item for item in self.items if _RANK[item[0]] == top]
        action = max((a for _, a, _, _ in worst), key=lambda a: a.severity)
        status = worst[0][0]
        message = "; ".join(m for _, _, m, _ in sorted(self.items, key=lambda i: -_RANK[i[0]]))
        return Outcome(status, message, worst[0][3], self.metrics, action if status is Status.FAIL else FaultAction.NONE)
