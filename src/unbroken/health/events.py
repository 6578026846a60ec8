"""Every health result as a JSON log line and a store event; every node move through the store.

A log line reads ``{"level":"error","ts":...,"node":"node-3","check":"collective.allreduce",
"msg":"FaultyInstance detected. Replace the instance. busbw below threshold: ...", ...metrics}``;
the same text is the node's event, so ``node describe`` shows it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from unbroken.health import faults
from unbroken.health.result import CheckResult, FaultAction, Status
from unbroken.state.records import EventType
from unbroken.state.store import ClusterStore, StaleUpdate
from unbroken.state.updates import NodeUpdate

log = logging.getLogger("unbroken.health")

_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "msg"}
_LEVEL = {Status.FAIL: logging.ERROR, Status.WARN: logging.WARNING, Status.PASS: logging.INFO, Status.SKIP: logging.INFO}
_EVENT_REASON = {Status.FAIL: "HealthCheckFailed", Status.WARN: "HealthCheckWarning",
                 Status.PASS: "HealthCheckPassed", Status.SKIP: "HealthCheckSkipped"}


def message(result: CheckResult) -> str:
    prefix = faults.advice(result.action) if result.failed else ""
    return f"{prefix} {result.message}".strip()


def log_result(result: CheckResult) -> None:
    extra: dict[str, Any] = {"node": result.node, "check": result.check, "suite": result.suite.value,
                             "status": result.status.value, "duration_s": result.duration_s}
    if result.reason:
        extra["reason"] = result.reason
    if result.faulty_nodes:
        extra["faulty_nodes"] = list(result.faulty_nodes)
    for key, value in result.metrics.items():
        if value is None or key == "report":
            continue
        extra[f"metric_{key}" if key in _RESERVED or key in extra else key] = value
    log.log(_LEVEL[result.status], message(result), extra=extra)


def record(store: ClusterStore, result: CheckResult, *, log_line: bool = True) -> None:
    """Log line (agents; the CLI prints tables instead) + node event for one result."""
    if log_line:
        log_result(result)
    store.add_event("Node", result.node, _EVENT_REASON[result.status], f"{result.check}: {result.status.value}: {message(result)}",
                    type=EventType.WARNING if result.status in (Status.FAIL, Status.WARN) else EventType.NORMAL)


JobsOn = Callable[[str], Iterable[str]]
"""The jobs running on a node (the backend knows: worker rows locally, pods on Kubernetes)."""


def apply_fault(store: ClusterStore, jobs_on: JobsOn, node_name: str, action: FaultAction, reason: str, *,
                source: str, fault_type: str | None = None) -> faults.NodeFault:
    """Move ``node_name`` out of service as ``action`` asks (through the node state machine),
    and tell the jobs running on it. Returns what was decided."""
    for _ in range(3):
        node = store.get_node(node_name)
        decision = faults.decide(node, action, reason, fault_type)
        if decision.target is not None:
            try:
                store.update_node(node_name, NodeUpdate(state=decision.target, fault_type=decision.fault_type,
                                                        fault_reason=decision.reason), expect_version=node.version)
            except StaleUpdate:
                continue  # the controller moved the node meanwhile: decide again on what it is now
            store.add_event("Node", node_name, decision.fault_type or "NodeFault",
                            f"{decision.reason} -> {decision.target.value}", type=EventType.WARNING)
        for job in sorted(set(jobs_on(node_name))):
            store.add_event("Job", job, "NodeFault", f"{source} on {node_name}: {decision.reason}", type=EventType.WARNING)
        if decision.target is not None:
            log.error("%s %s", faults.advice(decision.action), decision.reason,
                      extra={"node": node_name, "check": source, "state": decision.target.value,
                             "fault_type": decision.fault_type, "ts_detected": time.time()})
        return decision
    raise StaleUpdate(f"node {node_name} kept changing while a fault was being recorded")
