"""Start a local node inside its own network namespace when the cluster asks for it (``Local.NetworkNamespaces``).

The agent is started through ``ip netns exec``; everything it starts (torchrun,
ranks, check processes) inherits the namespace, and ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` point torch.distributed at the node's own link. The
node's address becomes its namespace address, so rendezvous and collectives
between nodes cross real (rate-limitable) veth links.
"""

from __future__ import annotations

from unbroken.plumbing import netns
from unbroken.config.cluster import ClusterConfig
from unbroken.plumbing.layout import ClusterLayout


def prepare(layout: ClusterLayout, config: ClusterConfig, node: str, env: dict[str, str]) -> tuple[list[str], dict[str, str], str | None]:
    """(argv prefix, environment, node address or None) to start ``node``'s agent with; creates its namespace."""
    if not config.Local.NetworkNamespaces:
        return [], env, None
    net = netns.NodeNet(layout.root, node)
    netns.create(net)
    return net.exec_prefix(), {**env, "GLOO_SOCKET_IFNAME": netns.INNER_IFNAME, "NCCL_SOCKET_IFNAME": netns.INNER_IFNAME}, net.address


def teardown(layout: ClusterLayout, config: ClusterConfig, nodes: list[str]) -> None:
    """Remove every node namespace, veth and the bridge of the cluster (after its processes are gone)."""
    if config.Local.NetworkNamespaces and netns.is_root():
        netns.destroy_cluster(layout.root, nodes)
