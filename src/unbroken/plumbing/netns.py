"""Network namespaces for local nodes (root only): each node behind its own veth on one bridge.

    root namespace:  bridge ub-<cid> 10.<a>.<b>.1/24
    node namespace:  ub-<cid>-<node>, interface ub0 = 10.<a>.<b>.<i>/24, default route via the bridge

``<cid>`` is a short hash of the cluster directory, so clusters side by side
(tests) get their own bridge and subnet. A link is limited with ``tc tbf`` on
both ends of the node's veth (``netem`` does not work on these machines).
Nothing here is needed without ``Local.NetworkNamespaces``.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from unbroken.errors import BackendError, UsageError

INNER_IFNAME = "ub0"
"""The node's interface inside its namespace; GLOO/NCCL_SOCKET_IFNAME point at it."""


def is_root() -> bool:
    return os.geteuid() == 0


def _cid(cluster_dir: Path) -> str:
    return hashlib.sha1(str(cluster_dir.resolve()).encode()).hexdigest()[:5]


def _index(node: str) -> int:
    match = re.search(r"(\d+)$", node)
    if not match or not 1 <= int(match.group(1)) <= 250:
        raise BackendError(f"node {node}: network namespaces need a node number 1-250")
    return int(match.group(1)) + 1


@dataclass(frozen=True)
class NodeNet:
    cluster_dir: Path
    node: str

    @property
    def cid(self) -> str:
        return _cid(self.cluster_dir)

    @property
    def namespace(self) -> str:
        return f"ub-{self.cid}-{self.node}"

    @property
    def bridge(self) -> str:
        return f"ub-{self.cid}"

    @property
    def host_veth(self) -> str:
        # interface names are at most 15 characters
        return f"u{self.cid}h{_index(self.node)}"

    @property
    def subnet_prefix(self) -> str:
        value = int(self.cid, 16)
        return f"10.{100 + value % 100}.{value // 100 % 250}"

    @property
    def address(self) -> str:
        return f"{self.subnet_prefix}.{_index(self.node)}"

    @property
    def gateway(self) -> str:
        return f"{self.subnet_prefix}.1"

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.namespace]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise BackendError(f"{' '.join(args)} failed: {result.stderr.strip()}")
    return result


def ensure_bridge(net: NodeNet) -> None:
    if _ip("ip", "link", "show", net.bridge, check=False).returncode == 0:
        return
    _ip("ip", "link", "add", net.bridge, "type", "bridge")
    _ip("ip", "addr", "add", f"{net.gateway}/24", "dev", net.bridge)
    _ip("ip", "link", "set", net.bridge, "up")


def create(net: NodeNet) -> None:
    """Namespace, veth pair, addresses, routes; replaces any leftover of the same node."""
    if not is_root():
        raise BackendError("Local.NetworkNamespaces needs root (ip netns, veth, bridge)")
    ensure_bridge(net)
    destroy(net)
    ns, host = net.namespace, net.host_veth
    _ip("ip", "netns", "add", ns)
    _ip("ip", "link", "add", host, "type", "veth", "peer", "name", INNER_IFNAME, "netns", ns)
    _ip("ip", "link", "set", host, "master", net.bridge)
    _ip("ip", "link", "set", host, "up")
    _ip("ip", "netns", "exec", ns, "ip", "addr", "add", f"{net.address}/24", "dev", INNER_IFNAME)
    _ip("ip", "netns", "exec", ns, "ip", "link", "set", INNER_IFNAME, "up")
    _ip("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    _ip("ip", "netns", "exec", ns, "ip", "route", "add", "default", "via", net.gateway)


def destroy(net: NodeNet) -> None:
    _ip("ip", "link", "del", net.host_veth, check=False)
    _ip("ip", "netns", "del", net.namespace, check=False)


def destroy_cluster(cluster_dir: Path, nodes: list[str]) -> None:
    for node in nodes:
        destroy(NodeNet(cluster_dir, node))
    _ip("ip", "link", "del", NodeNet(cluster_dir, "node-1").bridge, check=False)


_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)$", re.IGNORECASE)


def limit(net: NodeNet, rate: str) -> None:
    """Token-bucket limit both directions of the node's link (egress of each veth end)."""
    if not _RATE.match(rate):
        raise UsageError(f"rate {rate!r} is invalid; use tc units, e.g. 100mbit, 1gbit, 500kbit")
    for prefix, dev in (([], net.host_veth), (net.exec_prefix(), INNER_IFNAME)):
        _ip(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "64kb", "latency", "100ms")


def clear(net: NodeNet) -> None:
    for prefix, dev in (([], net.host_veth), (net.exec_prefix(), INNER_IFNAME)):
        _ip(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)


def namespace_exists(net: NodeNet) -> bool:
    return Path("/run/netns", net.namespace).exists()
