"""Node reconciler decisions: a pure function of (now, node, cluster) with an injected clock."""

from __future__ import annotations

import dataclasses

import pytest

from unbroken.config.cluster import ClusterConfig, InstanceGroup, LocalSettings, NodeRecovery
from unbroken.controller.node_decisions import MANUAL, NodeAction, NodeDecision, decide
from unbroken.state.phases import NODE_TRANSITIONS, DeepHealthStatus, NodeState
from unbroken.state.records import Node

NOW = 10_000.0
LOST_AFTER = 4.0
REBOOT_TIMEOUT = 60.0


def cluster(recovery: NodeRecovery = NodeRecovery.AUTOMATIC) -> ClusterConfig:
    return ClusterConfig(
        ClusterName="test",
        InstanceGroups=[InstanceGroup(InstanceGroupName="workers", InstanceCount=2)],
        NodeRecovery=recovery,
        Local=LocalSettings(NodeLostAfterSeconds=LOST_AFTER, RebootTimeoutSeconds=REBOOT_TIMEOUT),
    )


AUTOMATIC = cluster(NodeRecovery.AUTOMATIC)
NO_RECOVERY = cluster(NodeRecovery.NONE)


def node(state: NodeState, *, deep_health: DeepHealthStatus = DeepHealthStatus.PASSED, **fields) -> Node:
    defaults = dict(heartbeat_at=NOW - 0.5, registered_at=NOW - 100, state_changed_at=NOW - 50)
    return Node(name="node-1", group="workers", instance_type="cpu-dev", state=state, deep_health=deep_health,
                **{**defaults, **fields})


def assert_legal(n: Node, d: NodeDecision) -> None:
    """Whatever target a decision names must be one the lifecycle table allows."""
    if d.target is not None:
        assert d.target in NODE_TRANSITIONS[n.state], f"{n.state} -> {d.target}"


# -- lost heartbeats --------------------------------------------------------------------


@pytest.mark.parametrize("state", [NodeState.JOINING, NodeState.SCHEDULABLE, NodeState.UNSCHEDULABLE])
@pytest.mark.parametrize("recovery", [AUTOMATIC, NO_RECOVERY], ids=["automatic", "none"])
def test_stale_heartbeat_on_active_node_is_node_lost(state, recovery):
    n = node(state, heartbeat_at=NOW - LOST_AFTER - 0.1)
    d = decide(NOW, n, recovery)
    assert d.action is NodeAction.FAULT
    assert d.target is NodeState.PENDING_REPLACEMENT
    assert d.fault_type == "NodeLost"
    assert "heartbeat lost" in d.reason and "4.1 s ago" in d.reason and "NodeLostAfterSeconds 4" in d.reason
    assert_legal(n, d)


@pytest.mark.parametrize("state", [NodeState.SCHEDULABLE, NodeState.UNSCHEDULABLE])
def test_fresh_heartbeat_is_none(state):
    assert decide(NOW, node(state), AUTOMATIC) == NodeDecision(NodeAction.NONE)


@pytest.mark.parametrize("state", [NodeState.SCHEDULABLE, NodeState.UNSCHEDULABLE])
def test_heartbeat_just_under_the_limit_is_none(state):
    n = node(state, heartbeat_at=NOW - LOST_AFTER + 0.01)
    assert decide(NOW, n, AUTOMATIC).action is NodeAction.NONE


def test_no_heartbeat_yet_counts_from_state_change():
    young = node(NodeState.JOINING, deep_health=DeepHealthStatus.IN_PROGRESS, heartbeat_at=None, state_changed_at=NOW - 1)
    assert decide(NOW, young, AUTOMATIC).action is NodeAction.NONE
    old = dataclasses.replace(young, state_changed_at=NOW - LOST_AFTER - 1)
    d = decide(NOW, old, AUTOMATIC)
    assert (d.action, d.target, d.fault_type) == (NodeAction.FAULT, NodeState.PENDING_REPLACEMENT, "NodeLost")


@pytest.mark.parametrize(
    "state", [NodeState.PENDING_REBOOT, NodeState.PENDING_REPLACEMENT, NodeState.RETIRED]
)
def test_stale_heartbeat_on_inactive_node_is_not_node_lost(state):
    # No agent is expected to heartbeat: these are not lost again.
    n = node(state, heartbeat_at=NOW - 1000, fault_type="NodeLost")
    d = decide(NOW, n, NO_RECOVERY)
    assert d.action is NodeAction.NONE


# -- joining ----------------------------------------------------------------------------


def test_joining_passed_is_admitted():
    n = node(NodeState.JOINING, deep_health=DeepHealthStatus.PASSED)
    d = decide(NOW, n, AUTOMATIC)
    assert (d.action, d.target) == (NodeAction.ADMIT, NodeState.SCHEDULABLE)
    assert_legal(n, d)


def test_joining_in_progress_waits():
    n = node(NodeState.JOINING, deep_health=DeepHealthStatus.IN_PROGRESS)
    assert decide(NOW, n, AUTOMATIC) == NodeDecision(NodeAction.NONE)


def test_joining_failed_is_a_fault_to_replacement():
    n = node(NodeState.JOINING, deep_health=DeepHealthStatus.FAILED, fault_reason="stress: 3 of 4 cores failed")
    d = decide(NOW, n, AUTOMATIC)
    assert (d.action, d.target, d.fault_type) == (
        NodeAction.FAULT, NodeState.PENDING_REPLACEMENT, "DeepHealthCheckFailed"
    )
    assert d.reason == "join checks failed: stress: 3 of 4 cores failed"
    assert_legal(n, d)


def test_joining_failed_reboot_required_goes_to_pending_reboot():
    n = node(NodeState.JOINING, deep_health=DeepHealthStatus.FAILED, fault_type="RebootRequired", fault_reason="x")
    d = decide(NOW, n, NO_RECOVERY)
    assert (d.action, d.target, d.fault_type) == (NodeAction.FAULT, NodeState.PENDING_REBOOT, "RebootRequired")
    assert_legal(n, d)


# -- recovery actions -------------------------------------------------------------------


def test_pending_reboot_automatic_reboots():
    n = node(NodeState.PENDING_REBOOT, fault_type="Xid", fault_reason="Xid 79")
    d = decide(NOW, n, AUTOMATIC)
    assert (d.action, d.target, d.reason) == (NodeAction.REBOOT, NodeState.REBOOTING, "Xid 79")
    assert_legal(n, d)


def test_pending_reboot_without_recovery_waits_for_operator():
    n = node(NodeState.PENDING_REBOOT, fault_type="Xid", fault_reason="Xid 79")
    assert decide(NOW, n, NO_RECOVERY).action is NodeAction.NONE


def test_pending_reboot_manual_reboots_even_without_recovery():
    n = node(NodeState.PENDING_REBOOT, fault_type=MANUAL, fault_reason=None, recovery_requested=True)
    d = decide(NOW, n, NO_RECOVERY)
    assert (d.action, d.target, d.reason) == (NodeAction.REBOOT, NodeState.REBOOTING, "reboot requested")


def test_pending_replacement_automatic_replaces():
    n = node(NodeState.PENDING_REPLACEMENT, fault_type="NodeLost", fault_reason="heartbeat lost")
    d = decide(NOW, n, AUTOMATIC)
    assert (d.action, d.target, d.reason) == (NodeAction.REPLACE, NodeState.RETIRED, "heartbeat lost")
    assert_legal(n, d)


def test_pending_replacement_without_recovery_waits_for_operator():
    n = node(NodeState.PENDING_REPLACEMENT, fault_type="NodeLost", fault_reason="heartbeat lost")
    assert decide(NOW, n, NO_RECOVERY).action is NodeAction.NONE


def test_pending_replacement_manual_replaces_even_without_recovery():
    n = node(NodeState.PENDING_REPLACEMENT, fault_type=MANUAL, recovery_requested=True)
    d = decide(NOW, n, NO_RECOVERY)
    assert (d.action, d.target, d.reason) == (NodeAction.REPLACE, NodeState.RETIRED, "replacement requested")


def test_operator_go_ahead_replaces_a_lost_node_and_keeps_its_fault():
    n = node(NodeState.PENDING_REPLACEMENT, fault_type="NodeLost", fault_reason="heartbeat lost", recovery_requested=True)
    d = decide(NOW, n, NO_RECOVERY)
    assert (d.action, d.reason) == (NodeAction.REPLACE, "heartbeat lost")


def test_rebooting_past_timeout_is_replaced():
    n = node(NodeState.REBOOTING, heartbeat_at=None, state_changed_at=NOW - REBOOT_TIMEOUT - 1)
    d = decide(NOW, n, AUTOMATIC)
    assert (d.action, d.target, d.fault_type) == (NodeAction.FAULT, NodeState.PENDING_REPLACEMENT, "RebootFailed")
    assert "60 s" in d.reason
    assert_legal(n, d)


def test_rebooting_within_timeout_waits():
    n = node(NodeState.REBOOTING, heartbeat_at=None, state_changed_at=NOW - REBOOT_TIMEOUT + 1)
    assert decide(NOW, n, AUTOMATIC).action is NodeAction.NONE


@pytest.mark.parametrize("recovery", [AUTOMATIC, NO_RECOVERY], ids=["automatic", "none"])
def test_retired_is_left_alone(recovery):
    n = node(NodeState.RETIRED, fault_type=MANUAL, heartbeat_at=NOW - 10_000, state_changed_at=NOW - 10_000)
    assert decide(NOW, n, recovery) == NodeDecision(NodeAction.NONE)
