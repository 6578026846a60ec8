"""Real faults for real processes: what ``unbroken chaos`` and the tests inject.

Every injection is recorded as a ``Chaos*`` event on the affected jobs (and
node), so ``job describe`` and the demo can measure recovery from the moment
of the fault, not from its detection. Signals need the processes, so these
faults exist on the local backend only.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from unbroken import procs
from unbroken.errors import UsageError
from unbroken.health.chaos import xid_line
from unbroken.netns import NodeNet, clear, limit, namespace_exists
from unbroken.runtime import Runtime
from unbroken.state.records import EventType


@dataclass(frozen=True)
class Target:
    job: str
    node: str
    rank: int
    pid: int


def pick_rank(runtime: Runtime, job: str, *, node: str | None = None, rank: int | None = None) -> Target:
    """The rank to hit: ``rank`` if given, else the lowest rank on ``node``, else the job's highest rank.

    Ranks are found in each worker's process tree (torchrun gives every rank ``RANK`` and
    ``LOCAL_RANK``), so a plain torchrun script that never imports unbroken is a target too.
    """
    backend = runtime.local_backend("chaos on a rank")
    current = runtime.cluster.get_job(job)
    workers = [w for w in backend.observe_attempt(job, current.attempt) if not w.phase.is_terminal]
    candidates = [Target(job, w.node, found.rank, found.pid) for w in workers if node is None or w.node == node
                  for found in backend.rank_processes(w)]
    if not candidates:
        where = f" on {node}" if node else ""
        raise UsageError(f"job {job} has no running rank{where} (phase {current.phase.value}); its ranks may still be starting")
    if rank is not None:
        chosen = [c for c in candidates if c.rank == rank]
        if not chosen:
            raise UsageError(f"job {job} has no running rank {rank}; running ranks: {sorted(c.rank for c in candidates)}")
        return chosen[0]
    return min(candidates, key=lambda c: c.rank) if node else max(candidates, key=lambda c: c.rank)


def signal_rank(runtime: Runtime, target: Target, sig: signal.Signals, reason: str) -> None:
    if not procs.alive(target.pid):
        raise UsageError(f"rank {target.rank} of job {target.job} (pid {target.pid}) is not running")
    runtime.cluster.add_event("Job", target.job, reason, f"{sig.name} to rank {target.rank} (pid {target.pid}) on {target.node}",
                              type=EventType.WARNING)
    os.kill(target.pid, sig)


def kill_node(runtime: Runtime, node: str) -> int:
    """SIGKILL the node's agent and every process of the node at once, like a power loss."""
    runtime.cluster.get_node(node)  # a clear error for an unknown name
    backend = runtime.local_backend("chaos kill-node")
    victims = backend.node_processes(node)
    jobs = sorted({w.job for w in backend.active_workers() if w.node == node})
    runtime.cluster.add_event("Node", node, "ChaosKillNode", f"SIGKILL to {len(victims)} processes", type=EventType.WARNING)
    for job in jobs:
        runtime.cluster.add_event("Job", job, "ChaosKillNode", f"node {node} lost power ({len(victims)} processes killed)",
                                  type=EventType.WARNING)
    procs.kill_now(victims)
    procs.wait_gone(victims, 5.0)
    return len(victims)


def kill_controller(runtime: Runtime) -> int:
    pid = runtime.local_backend("chaos kill-controller").controller_pid()
    if pid is None:
        raise UsageError(f"no controller running for {runtime.layout.root}")
    os.kill(pid, signal.SIGKILL)
    return pid


def append_kernel_line(runtime: Runtime, node: str, line: str, reason: str) -> None:
    """Write ``line`` to the node's kernel log (the file the local agent tails), after its events."""
    runtime.cluster.get_node(node)  # a clear error for an unknown node
    jobs = sorted({w.job for w in runtime.backend.active_workers() if w.node == node})
    runtime.cluster.add_event("Node", node, reason, line, type=EventType.WARNING)
    for job in jobs:
        runtime.cluster.add_event("Job", job, reason, f"on {node}: {line}", type=EventType.WARNING)
    path = runtime.layout.kernel_log(node)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:  # one write() of one line: the tail never sees half of it
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def inject_xid(runtime: Runtime, node: str, code: int, pci: str = "PCI:0000:b9:00") -> str:
    if not 0 < code < 1000:
        raise UsageError(f"Xid code {code} is invalid; NVIDIA's codes are 1-999 (e.g. 79 fallen off the bus, 13 app error)")
    line = xid_line(code, pci)
    append_kernel_line(runtime, node, line, "ChaosXid")
    return line


def slow_link(runtime: Runtime, node: str, rate: str | None) -> str:
    """Rate-limit (or, with ``rate=None``, free) the node's link; the cluster must use network namespaces."""
    runtime.cluster.get_node(node)
    if not runtime.config.Local.NetworkNamespaces:
        raise UsageError("chaos slow-link needs a cluster with Local.NetworkNamespaces: true (root), "
                         "so that each node has a link of its own to limit")
    net = NodeNet(runtime.layout.root, node)
    if not namespace_exists(net):
        raise UsageError(f"node {node} has no network namespace {net.namespace} (is it running?)")
    if rate is None:
        clear(net)
        runtime.cluster.add_event("Node", node, "ChaosSlowLinkCleared", f"tc qdisc removed from {net.host_veth} and {net.namespace}")
        return f"node {node}: link limit removed"
    limit(net, rate)
    runtime.cluster.add_event("Node", node, "ChaosSlowLink", f"tc tbf rate {rate} on {net.host_veth} and in {net.namespace}",
                              type=EventType.WARNING)
    return f"node {node}: link limited to {rate} (tc tbf, both directions) at {time.strftime('%H:%M:%S')}"
