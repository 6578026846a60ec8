"""Applies node decisions: admit, fault, reboot, replace (through the backend)."""

from __future__ import annotations

import logging


from unbroken.backends.base import Backend, provision_node
from unbroken.config.cluster import ClusterConfig
from unbroken.controller import node_decisions
from unbroken.controller.node_decisions import NodeAction, NodeDecision
from unbroken.state.phases import NodeState
from unbroken.state.records import EventType, Node
from unbroken.state.store import StaleUpdate, Store

log = logging.getLogger("unbroken.controller.nodes")


class NodeReconciler:
    def __init__(self, store: Store, backend: Backend, cluster: ClusterConfig) -> None:
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
            store.update_node(node.name, expect_state=node.state, state=NodeState.SCHEDULABLE)
            store.add_event("Node", node.name, "NodeSchedulable", decision.reason)
        elif decision.action is NodeAction.FAULT:
            assert decision.target is not None
            store.update_node(node.name, expect_state=node.state, state=decision.target,
                              fault_type=decision.fault_type, fault_reason=decision.reason)
            store.add_event("Node", node.name, decision.fault_type or "NodeFault",
                            f"{decision.reason} -> {decision.target.value}", type=EventType.WARNING)
        elif decision.action is NodeAction.REBOOT:
            store.update_node(node.name, expect_state=node.state, state=NodeState.REBOOTING, reboots=node.reboots + 1)
            store.add_event("Node", node.name, "NodeRebooting", decision.reason)
            self.backend.stop_node(node.name)
            self.backend.start_node(node.name)
        elif decision.action is NodeAction.REPLACE:
            self.backend.stop_node(node.name)
            replacement = provision_node(store, self.backend, self.cluster, node.group, address=node.address)
            store.update_node(node.name, expect_state=node.state, state=NodeState.RETIRED, replaced_by=replacement)
            store.add_event("Node", node.name, "NodeReplaced", f"{decision.reason}; replaced by {replacement}")
        return decision


