"""Applies node decisions: admit, fault, reboot, replace (the backend carries out the last two)."""

from __future__ import annotations

import logging

from unbroken.backends.base import Backend
from unbroken.config.cluster import ClusterConfig
from unbroken.controller import liveness, node_decisions
from unbroken.controller.node_decisions import NodeAction, NodeDecision
from unbroken.state.phases import NodeState
from unbroken.state.records import EventType, Node
from unbroken.state.store import ClusterStore, StaleUpdate
from unbroken.state.updates import NodeUpdate

log = logging.getLogger("unbroken.controller.nodes")

CLUSTER_OBJECT = ("Cluster", "cluster")
"""Where cluster-wide Events go (the hold): ``unbroken events`` lists them; on Kubernetes the operator's namespace."""


class NodeReconciler:
    def __init__(self, store: ClusterStore, backend: Backend, cluster: ClusterConfig) -> None:
        self.store = store
        self.backend = backend
        self.cluster = cluster
        self.holding: liveness.Hold | None = None
        """The disruption guard's hold in force (controller/liveness.py), None when none is."""
        self.next_loss_at: float | None = None
        """When the last pass's first heard node would turn silent (liveness.next_loss_at): a loop wakes then."""

    def reconcile_all(self, now: float) -> None:
        nodes = self.store.list_nodes()
        self._guard(liveness.hold(now, nodes, self.cluster.Local.NodeLostAfterSeconds))
        self.next_loss_at = liveness.next_loss_at(now, nodes, self.cluster.Local.NodeLostAfterSeconds)
        for node in nodes:
            if node.state is NodeState.RETIRED:
                continue
            try:
                self.reconcile(now, node)
            except StaleUpdate:
                continue

    def _guard(self, hold: liveness.Hold | None) -> None:
        """Enter or leave the hold, with one Event each way (on the cluster record's object)."""
        if (hold is None) == (self.holding is None):
            self.holding = hold
            return
        if hold is not None:
            log.warning("holding: %s", hold.reason, extra={"silent": len(hold.silent), "active": hold.active})
            self.store.add_event(*CLUSTER_OBJECT, "LivenessHold", hold.reason, type=EventType.WARNING)
        else:
            assert self.holding is not None
            log.info("hold lifted: heartbeats are back", extra={"silent_before": len(self.holding.silent)})
            self.store.add_event(*CLUSTER_OBJECT, "LivenessHoldLifted",
                                 f"heartbeats are back ({len(self.holding.silent)} nodes were silent); nodes still silent "
                                 "are judged as usual")
        self.holding = hold

    def reconcile(self, now: float, node: Node) -> NodeDecision:
        decision = node_decisions.decide(now, node, self.cluster)
        if decision.action is NodeAction.NONE:
            return decision
        if self.holding is not None and decision.action is not NodeAction.ADMIT and (
                decision.fault_type == node_decisions.NODE_LOST or decision.action in (NodeAction.REBOOT, NodeAction.REPLACE)):
            return NodeDecision(NodeAction.NONE, f"held: {decision.reason}")
        extra = {"node": node.name, "action": decision.action.value}
        log.log(logging.INFO if decision.action is NodeAction.ADMIT else logging.WARNING,
                "%s: %s", decision.action.value, decision.reason, extra=extra)
        store = self.store
        if decision.action is NodeAction.ADMIT:
            store.update_node(node.name, NodeUpdate(state=NodeState.SCHEDULABLE), expect_version=node.version)
            store.add_event("Node", node.name, "NodeSchedulable", decision.reason)
        elif decision.action is NodeAction.FAULT:
            assert decision.target is not None
            store.update_node(node.name, NodeUpdate(state=decision.target, fault_type=decision.fault_type, fault_reason=decision.reason),
                              expect_version=node.version)
            store.add_event("Node", node.name, decision.fault_type or "NodeFault",
                            f"{decision.reason} -> {decision.target.value}", type=EventType.WARNING)
        elif decision.action is NodeAction.REBOOT:
            store.update_node(node.name, NodeUpdate(state=NodeState.REBOOTING, reboots=node.reboots + 1), expect_version=node.version)
            store.add_event("Node", node.name, "NodeRebooting", decision.reason)
            self.backend.reboot_node(node)
        elif decision.action is NodeAction.REPLACE:
            replacement = self.backend.replace_node(node)
            store.update_node(node.name, NodeUpdate(state=NodeState.RETIRED, replaced_by=replacement), expect_version=node.version)
            store.add_event("Node", node.name, "NodeReplaced",
                            f"{decision.reason}; replaced by {replacement}" if replacement else f"{decision.reason}; retired")
        return decision
