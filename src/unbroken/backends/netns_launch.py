"""Start a local node inside its own network namespace when the cluster asks for it (``Local.NetworkNamespaces``).

The agent is started through ``ip netns exec``; everything it starts (torchrun,
ranks, check processes) inherits the namespace, and ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` point torch.distributed at the node's own link. The
node's address in the store becomes its namespace address, so rendezvous and
collectives between nodes cross real (rate-limitable) veth links.
"""

from __future__ import annotations

from unbroken import netns
from unbroken.config.cluster import ClusterConfig
from unbroken.layout import ClusterLayout
from unbroken.state.sqlite import SqliteStore


def _enabled(store: SqliteStore) -> bool:
    return ClusterConfig.model_validate_json(store.cluster_json()).Local.NetworkNamespaces


def prepare(layout: ClusterLayout, node: str, env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """(argv prefix, environment) to start ``node``'s agent with; creates its namespace."""
    store = SqliteStore(layout.state_db)
    if not _enabled(store):
        return [], env
    net = netns.NodeNet(layout.root, node)
    netns.create(net)
    store.update_node(node, address=net.address)
    return net.exec_prefix(), {**env, "GLOO_SOCKET_IFNAME": netns.INNER_IFNAME, "NCCL_SOCKET_IFNAME": netns.INNER_IFNAME}


def teardown(layout: ClusterLayout, store: SqliteStore) -> None:
    """Remove every node namespace, veth and the bridge of the cluster (after its processes are gone)."""
    if _enabled(store) and netns.is_root():
        netns.destroy_cluster(layout.root, [n.name for n in store.list_nodes()])
