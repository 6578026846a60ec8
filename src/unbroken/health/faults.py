"""Pure: what a failed check or a kernel-log match does to a node, and why.

``decide(node, action, reason)`` returns the node's next state, the fault type
(``fault-type`` label) and the reason (``fault-reason``). The fault type names
the recovery it asks for, which is what the node reconciler acts on:
``RebootRequired`` -> UnschedulablePendingReboot, ``FaultyInstance`` ->
UnschedulablePendingReplacement. A reboot-class fault on a node that was
already rebooted escalates to replacement: the reboot did not fix it.
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.health.result import FaultAction
from unbroken.state.phases import NodeState
from unbroken.state.records import Node

REBOOT_REQUIRED = "RebootRequired"
FAULTY_INSTANCE = "FaultyInstance"
SILENT_DATA_CORRUPTION = "SilentDataCorruption"
"""A replacement's fault type when the node computed wrong numbers without an error (known-answer check, replica vote)."""
SDC_SUSPECT = "SilentDataCorruptionSuspect"
"""The fault type of a node cordoned by the controller until its known-answer check says whether it computes right:
one of two replicas that disagreed, with no majority to say which (the node's agent runs the check)."""

_ADVICE = {
    FaultAction.REPLACE: f"{FAULTY_INSTANCE} detected. Replace the instance.",
    FaultAction.REBOOT: f"{REBOOT_REQUIRED} detected. Reboot the instance.",
}

_CAN_FAULT = {NodeState.JOINING, NodeState.SCHEDULABLE, NodeState.UNSCHEDULABLE, NodeState.PENDING_REBOOT}


@dataclass(frozen=True)
class NodeFault:
    action: FaultAction
    target: NodeState | None
    """None: event only (application-level fault, or the node is already out of service)."""
    fault_type: str | None
    reason: str


def advice(action: FaultAction) -> str:
    """The sentence a log line starts with, so that people and log alerts read the action first."""
    return _ADVICE.get(action, "")


def decide(node: Node, action: FaultAction, reason: str, fault_type: str | None = None) -> NodeFault:
    """``fault_type``: a replacement's more precise name than FaultyInstance (SilentDataCorruption)."""
    if action is FaultAction.REBOOT and node.reboots >= 1:
        action = FaultAction.REPLACE
        reason = f"{reason} (again after {node.reboots} reboot{'s' if node.reboots > 1 else ''}: replacing)"
    if action is FaultAction.NONE or node.state not in _CAN_FAULT:
        return NodeFault(action, None, None, reason)
    if action is FaultAction.REBOOT:
        if node.state is NodeState.PENDING_REBOOT:
            return NodeFault(action, None, None, reason)  # already waiting for exactly that
        return NodeFault(action, NodeState.PENDING_REBOOT, REBOOT_REQUIRED, reason)
    return NodeFault(action, NodeState.PENDING_REPLACEMENT, fault_type or FAULTY_INSTANCE, reason)
