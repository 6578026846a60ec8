"""Cluster validation before a big run: every check on every node, the collective sweep, and a real training job.

The verdict per node is the worst of its results: a node passes only if its
devices, stress, storage, network and collective results and its share of the
end-to-end training job all pass (Skip counts as pass: not applicable here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from unbroken.health.result import CheckResult, Status

FAMILIES = ("devices", "stress", "storage", "network", "collective", "training")


@dataclass
class NodeVerdict:
    node: str
    cells: dict[str, Status] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> Status:
        return Status.FAIL if Status.FAIL in self.cells.values() else (
            Status.WARN if Status.WARN in self.cells.values() else Status.PASS)


_RANK = {Status.SKIP: 0, Status.PASS: 1, Status.WARN: 2, Status.FAIL: 3}


def tabulate(nodes: list[str], results: list[CheckResult], training: dict[str, tuple[Status, str]]) -> list[NodeVerdict]:
    verdicts = {n: NodeVerdict(n) for n in nodes}
    for result in results:
        family = result.check.split(".", 1)[0]
        # a multi-node result counts for every node it covered; a failure only against the blamed ones
        covered = result.metrics.get("nodes") or [result.node]
        for node in covered:
            if node not in verdicts:
                continue
            status = result.status
            if status is Status.FAIL and result.faulty_nodes and node not in result.faulty_nodes:
                status = Status.PASS
            cells = verdicts[node].cells
            if _RANK[status] >= _RANK[cells.get(family, Status.SKIP)]:
                cells[family] = status
            if status in (Status.FAIL, Status.WARN):
                verdicts[node].notes.append(f"{result.check}: {result.message}")
    for node, (status, note) in training.items():
        if node in verdicts:
            verdicts[node].cells["training"] = status
            if status is Status.FAIL:
                verdicts[node].notes.append(f"training: {note}")
    return [verdicts[n] for n in nodes]


def to_json(verdicts: list[NodeVerdict]) -> list[dict[str, Any]]:
    return [{"node": v.node, "verdict": v.verdict.value, **{f: v.cells.get(f, Status.SKIP).value for f in FAMILIES},
             "notes": v.notes} for v in verdicts]
