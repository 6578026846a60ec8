"""The ``Backend`` protocol: how the controller gets, restarts and gives back nodes.

Local: a node is an agent process. Kubernetes: a node is a Node object whose
reboot/replacement is asked of the cloud provider (later).
"""

from __future__ import annotations

import time
from typing import Protocol

from unbroken.config.cluster import ClusterConfig
from unbroken.state.phases import DeepHealthStatus, NodeState
from unbroken.state.records import Node
from unbroken.state.store import Store


class Backend(Protocol):
    def start_node(self, name: str) -> None:
        """Start the node's agent; it registers itself in the store."""

    def stop_node(self, name: str) -> None:
        """Stop the node's agent and every process of the node."""


def provision_node(store: Store, backend: Backend, cluster: ClusterConfig, group: str, *, address: str = "127.0.0.1") -> str:
    """Add a new node (``node-<n>``, never a reused name) to ``group`` and start it."""
    spec = cluster.group(group)
    name = f"node-{store.allocate_node_index()}"
    store.add_node(
        Node(
            name=name, group=group, instance_type=spec.InstanceType, state=NodeState.JOINING,
            deep_health=DeepHealthStatus.IN_PROGRESS, address=address, state_changed_at=time.time(),
        )
    )
    store.add_event("Node", name, "NodeProvisioned", f"added to instance group {group} ({spec.InstanceType})")
    backend.start_node(name)
    return name
