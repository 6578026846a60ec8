"""Applies node decisions: admit, fault, reboot, replace (the backend carries out the last two)."""

from __future__ import annotations

import logging

from unbroken.backends.base import Backend
from unbroken.config.cluster import ClusterConfig
from unbroken.controller import node_decisions
from unbroken.controller.node_decisions import NodeAction, NodeDecision
from unbroken.state.phases import NodeState
from unbroken.state.records import EventType, Node
from unbroken.state.store import ClusterStore, StaleUpdate
from unbroken.state.updates import NodeUpdate

log = logging.getLogger("unbroken.controller.nodes")


class NodeReconciler:
    def __init__(self, store: ClusterStore, backend: Backend, cluster: ClusterConfig) -> None:
        self.store = store
        self.backend = backend
        self.cluster = cluster

    def reconcile_all(self, now: float) -> None:
        for node in self.store.list_nodes():
            if node.state is NodeState.RETIRED:
                continue
            try:
                self.reconcile(now, node)
            except StaleUpdate:
                continue

    def reconcile(self, now: float, node: Node) -> NodeDecision:
        decision = node_decisions.decide(now, node, self.cluster)
        if decision.action is NodeAction.NONE:
            return decision
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
