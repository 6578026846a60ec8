"""Nodes back from a reboot join again: ``Rebooting`` → ``Joining``, deep checks first.

On a local cluster the node's agent says it is back (it registers again). On
Kubernetes the machine is rebooted by whoever the remediator hands it to, and the
DaemonSet's agent may come back before or after the kubelet; what says "this is a
new boot" is the kubelet's ``status.nodeInfo.bootID`` differing from the one
recorded when the reboot was asked for (``kubernetes/backend/node_repair.py``), on a Ready node.

Then, in this order (a pass that dies between the steps is finished by the next):

1. the node's record goes ``Joining`` with its deep check ``NotRun`` and its fault
   cleared; the taint stays, so nothing is scheduled there yet;
2. the reboot mark is dropped and unbroken's own cordon lifted;
3. an Event ``NodeRebooted`` on the node.

The deep-check pass (``deep_checks.py``) then runs the group's checks again (fresh
Jobs: their names hash the reboot count) and the node reconciler admits the node
or takes it out. A node that does not come back within ``RebootTimeoutSeconds``
is the node reconciler's: ``RebootFailed`` → replacement.
"""

from __future__ import annotations

import logging

from unbroken.kubernetes.backend import node_repair
from unbroken.kubernetes.backend.store import KubernetesStore
from unbroken.state.phases import DeepHealthStatus, NodeState
from unbroken.state.records import Node
from unbroken.state.store import StaleUpdate
from unbroken.state.updates import NodeUpdate

log = logging.getLogger("unbroken.kubernetes.operator.reboots")

_BACK = (NodeState.JOINING, NodeState.SCHEDULABLE)
"""States in which a leftover reboot mark is from a reboot already seen through (a pass died before step 2)."""


class RebootReturns:
    def __init__(self, store: KubernetesStore) -> None:
        self.store = store

    def reconcile(self) -> None:
        marked = [boot for boot in map(node_repair.boot_of, self.store.node_objects()) if boot.reboot_from is not None]
        for boot in marked:  # a reboot asked for: one read of the record, only for these nodes
            node = self.store.get_node(boot.node)
            if node.state in _BACK:
                node_repair.clear_repair(self.store, boot)
            elif node.state is NodeState.REBOOTING and boot.rebooted:
                self._rejoin(node, boot)

    def _rejoin(self, node: Node, boot: node_repair.NodeBoot) -> None:
        try:
            self.store.update_node(node.name, NodeUpdate(
                state=NodeState.JOINING, deep_health=DeepHealthStatus.NOT_RUN, fault_type=None, fault_reason=None,
            ), expect_version=node.version)
        except StaleUpdate:
            return  # changed under this pass (the reboot timed out, say): the next pass reads it again
        node_repair.clear_repair(self.store, boot)
        message = (f"back from the reboot (bootID {boot.reboot_from} -> {boot.boot_id}); "
                   "joins again: deep health checks before any work")
        self.store.add_event("Node", node.name, "NodeRebooted", message)
        log.info(message, extra={"node": node.name})
