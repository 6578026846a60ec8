"""What the node reconciler should do next: a pure function of (now, node, cluster).

The node lifecycle itself (which state may follow which) lives in
``state.phases.NODE_TRANSITIONS``; this module decides *when* to move.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from unbroken.config.cluster import ClusterConfig, NodeRecovery
from unbroken.controller import liveness
from unbroken.state.phases import DeepHealthStatus, NodeState
from unbroken.state.records import Node

NODE_LOST = "NodeLost"
"""fault-type of a node whose heartbeat stopped."""
MANUAL = "Manual"
"""fault-type of a node an operator took out of service (``node reboot|replace``)."""


class NodeAction(StrEnum):
    NONE = "None"
    ADMIT = "Admit"
    """Joining → Schedulable: join checks passed."""
    FAULT = "Fault"
    """→ Pending{Reboot,Replacement}, with ``fault_type``/``reason``."""
    REBOOT = "Reboot"
    REPLACE = "Replace"


@dataclass(frozen=True)
class NodeDecision:
    action: NodeAction
    reason: str = ""
    target: NodeState | None = None
    fault_type: str | None = None


def decide(now: float, node: Node, cluster: ClusterConfig) -> NodeDecision:
    settings = cluster.Local
    automatic = cluster.NodeRecovery is NodeRecovery.AUTOMATIC
    if liveness.silent(now, node, settings.NodeLostAfterSeconds):
        last = node.heartbeat_at or node.state_changed_at
        return NodeDecision(
            NodeAction.FAULT, f"heartbeat lost: last seen {now - last:.1f} s ago "
            f"(NodeLostAfterSeconds {settings.NodeLostAfterSeconds:g})",
            NodeState.PENDING_REPLACEMENT, NODE_LOST,
        )
    if node.state is NodeState.JOINING:
        if node.deep_health is DeepHealthStatus.PASSED:
            return NodeDecision(NodeAction.ADMIT, "join checks passed", NodeState.SCHEDULABLE)
        if node.deep_health is DeepHealthStatus.FAILED:
            target = NodeState.PENDING_REBOOT if node.fault_type == "RebootRequired" else NodeState.PENDING_REPLACEMENT
            return NodeDecision(
                NodeAction.FAULT, f"join checks failed: {node.fault_reason}", target, node.fault_type or "DeepHealthCheckFailed"
            )
    manual = node.recovery_requested
    if node.state is NodeState.PENDING_REBOOT and (automatic or manual):
        return NodeDecision(NodeAction.REBOOT, node.fault_reason or "reboot requested", NodeState.REBOOTING)
    if node.state is NodeState.REBOOTING and now - node.state_changed_at > settings.RebootTimeoutSeconds:
        return NodeDecision(
            NodeAction.FAULT, f"did not come back within {settings.RebootTimeoutSeconds:g} s of a reboot",
            NodeState.PENDING_REPLACEMENT, "RebootFailed",
        )
    if node.state is NodeState.PENDING_REPLACEMENT and (automatic or manual):
        return NodeDecision(NodeAction.REPLACE, node.fault_reason or "replacement requested", NodeState.RETIRED)
    return NodeDecision(NodeAction.NONE)
