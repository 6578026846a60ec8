"""Build a check's context for a node: its profile, directories and network identity."""

from __future__ import annotations

from typing import Any

from unbroken.config.cluster import ClusterConfig
from unbroken.health.context import CheckContext, Peer
from unbroken.plumbing.layout import ClusterLayout
from unbroken.plumbing.netns import NodeNet
from unbroken.state.records import Node


def peer(layout: ClusterLayout, cluster: ClusterConfig, node: Node) -> Peer:
    if cluster.Local.NetworkNamespaces:
        net = NodeNet(layout.root, node.name)
        return Peer(node.name, node.address, net.namespace)
    return Peer(node.name, node.address)


def context(layout: ClusterLayout, cluster: ClusterConfig, node: Node, *, peers: tuple[Peer, ...] = (),
            params: dict[str, Any] | None = None) -> CheckContext:
    """ValueError if no health profile fits the node (its group's InstanceType, else its own)."""
    group = cluster.group_matching(node.group, node.instance_type)
    instance_type = group.InstanceType if group is not None else node.instance_type
    return CheckContext(
        node=node.name, instance_type=instance_type, profile=cluster.profile(instance_type),
        settings=cluster.Health, node_dir=layout.node_dir(node.name), cluster_dir=layout.root,
        storage_dir=layout.root / "checkpoints", peers=peers, params=dict(params or {}),
    )
