"""Health faults for ``unbroken chaos``: a kernel-log line (Xid; SXid lines for tests), a slow link (tc tbf)."""

from __future__ import annotations

import os
import time
from datetime import datetime

from unbroken.config.cluster import ClusterConfig
from unbroken.errors import UsageError
from unbroken.health.kernel_log.xid import XidTable
from unbroken.layout import ClusterLayout
from unbroken.netns import NodeNet, clear, limit, namespace_exists
from unbroken.state.records import EventType
from unbroken.state.store import Store

_DETAIL = {
    79: "pid=0, GPU has fallen off the bus.",
    48: "pid=2417, DBE (0x1) detected at 0x12d4c0.",
    13: "pid=2417, name=python, Graphics Exception: ESR 0x405840=0x1000000b",
    94: "pid=2417, Contained: CE User Channel (0x9). RST: No, D-RST: No",
    154: "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
}


def xid_line(code: int, pci: str = "PCI:0000:b9:00", detail: str | None = None) -> str:
    """A kernel line as the NVIDIA driver writes it (``dmesg -T`` style timestamp)."""
    stamp = datetime.now().strftime("%a %b %d %H:%M:%S %Y")
    text = detail or _DETAIL.get(code) or f"pid=0, {XidTable().lookup(code).name}"
    return f"[{stamp}] NVRM: Xid ({pci}): {code}, {text}"


def sxid_line(code: int, severity: str = "Fatal", detail: str = "Link 30 LTSSM Fault Up",
              pci: str = "PCI:0000:08:00.0", switch: str = "nvidia-nvswitch3") -> str:
    """An NVSwitch line as the driver writes it: ``nvidia-nvswitch3: SXid (PCI:...): 20034, Fatal, ...``."""
    stamp = datetime.now().strftime("%a %b %d %H:%M:%S %Y")
    return f"[{stamp}] {switch}: SXid ({pci}): {code:05d}, {severity}, {detail}"


def append_kernel_line(store: Store, layout: ClusterLayout, node: str, line: str, reason: str) -> None:
    store.get_node(node)  # a clear error for an unknown node
    jobs = sorted({w.job for w in store.list_workers(node=node, active=True)})
    with store.transaction():
        store.add_event("Node", node, reason, line, type=EventType.WARNING)
        for job in jobs:
            store.add_event("Job", job, reason, f"on {node}: {line}", type=EventType.WARNING)
    path = layout.kernel_log(node)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:  # one write() of one line: the tail never sees half of it
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def inject_xid(store: Store, layout: ClusterLayout, node: str, code: int, pci: str = "PCI:0000:b9:00") -> str:
    if not 0 < code < 1000:
        raise UsageError(f"Xid code {code} is invalid; NVIDIA's codes are 1-999 (e.g. 79 fallen off the bus, 13 app error)")
    line = xid_line(code, pci)
    append_kernel_line(store, layout, node, line, "ChaosXid")
    return line


def slow_link(store: Store, layout: ClusterLayout, node: str, rate: str | None) -> str:
    """Rate-limit (or, with ``rate=None``, free) the node's link; the cluster must use network namespaces."""
    store.get_node(node)
    cluster = ClusterConfig.model_validate_json(store.cluster_json())
    if not cluster.Local.NetworkNamespaces:
        raise UsageError("chaos slow-link needs a cluster with Local.NetworkNamespaces: true (root), "
                         "so that each node has a link of its own to limit")
    net = NodeNet(layout.root, node)
    if not namespace_exists(net):
        raise UsageError(f"node {node} has no network namespace {net.namespace} (is it running?)")
    if rate is None:
        clear(net)
        store.add_event("Node", node, "ChaosSlowLinkCleared", f"tc qdisc removed from {net.host_veth} and {net.namespace}")
        return f"node {node}: link limit removed"
    limit(net, rate)
    store.add_event("Node", node, "ChaosSlowLink", f"tc tbf rate {rate} on {net.host_veth} and in {net.namespace}",
                    type=EventType.WARNING)
    return f"node {node}: link limited to {rate} (tc tbf, both directions) at {time.strftime('%H:%M:%S')}"
