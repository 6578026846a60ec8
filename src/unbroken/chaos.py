"""Real faults for real processes: what ``unbroken chaos`` and the tests inject.

Every injection is recorded as a ``Chaos*`` event on the affected jobs (and
node), so ``job describe`` and the demo can measure recovery from the moment
of the fault, not from its detection.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from unbroken import procs
from unbroken.backends.local import LocalBackend
from unbroken.errors import UsageError
from unbroken.layout import ClusterLayout
from unbroken.state.records import EventType
from unbroken.state.store import Store


@dataclass(frozen=True)
class Target:
    job: str
    node: str
    rank: int
    pid: int


def pick_rank(store: Store, job: str, *, node: str | None = None, rank: int | None = None) -> Target:
    """The rank to hit: ``rank`` if given, else the lowest rank on ``node``, else the job's highest rank."""
    current = store.get_job(job)
    workers = [w for w in store.list_workers(job=job, attempt=current.attempt) if not w.phase.is_terminal]
    candidates = [Target(job, w.node, info.rank, info.pid) for w in workers for info in w.ranks
                  if node is None or w.node == node]
    if not candidates:
        where = f" on {node}" if node else ""
        raise UsageError(f"job {job} has no running rank{where} that has reported yet (phase {current.phase.value})")
    if rank is not None:
        chosen = [c for c in candidates if c.rank == rank]
        if not chosen:
            raise UsageError(f"job {job} has no running rank {rank}; running ranks: {sorted(c.rank for c in candidates)}")
        return chosen[0]
    return min(candidates, key=lambda c: c.rank) if node else max(candidates, key=lambda c: c.rank)


def signal_rank(store: Store, target: Target, sig: signal.Signals, reason: str) -> None:
    if not procs.alive(target.pid):
        raise UsageError(f"rank {target.rank} of job {target.job} (pid {target.pid}) is not running")
    store.add_event("Job", target.job, reason,
                    f"{sig.name} to rank {target.rank} (pid {target.pid}) on {target.node}", type=EventType.WARNING)
    os.kill(target.pid, sig)


def kill_node(store: Store, layout: ClusterLayout, node: str) -> int:
    """SIGKILL the node's agent and every process of the node at once, like a power loss."""
    store.get_node(node)  # a clear error for an unknown name
    backend = LocalBackend(layout)
    victims = backend.node_processes(node)
    jobs = sorted({w.job for w in store.list_workers(node=node) if not w.phase.is_terminal})
    with store.transaction():
        store.add_event("Node", node, "ChaosKillNode", f"SIGKILL to {len(victims)} processes", type=EventType.WARNING)
        for job in jobs:
            store.add_event("Job", job, "ChaosKillNode", f"node {node} lost power ({len(victims)} processes killed)",
                            type=EventType.WARNING)
    procs.kill_now(victims)
    procs.wait_gone(victims, 5.0)
    return len(victims)


def kill_controller(layout: ClusterLayout) -> int:
    pid = LocalBackend(layout).controller_pid()
    if pid is None:
        raise UsageError(f"no controller running for {layout.root}")
    os.kill(pid, signal.SIGKILL)
    return pid
