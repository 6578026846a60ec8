"""Real faults for real processes: what ``unbroken chaos`` and the tests inject.

Every injection is recorded as a ``Chaos*`` event on the affected jobs (and
node), so ``job describe`` and the demo can measure recovery from the moment
of the fault, not from its detection. Signals need the processes, so these
faults exist on the local backend only.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from unbroken.plumbing import procs
from unbroken.errors import UsageError
from unbroken.health.checks.known_answer import FAULT_FILE as SDC_FAULT_FILE
from unbroken.health.xid_lines import xid_line
from unbroken.rank.bit_flip import REQUEST_FILE, FlipRequest, FlipTarget, Flipped, read_done
from unbroken.rank.env import CLUSTER_DIR
from unbroken.plumbing.netns import NodeNet, clear, limit, namespace_exists
from unbroken.plumbing.layout import ClusterLayout
from unbroken.runtime import Runtime, open_local
from unbroken.state.records import EventType
from unbroken.plumbing.waiting import WaitTimeout, wait_until


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


def corrupt(runtime: Runtime, target: Target, *, step: int, what: FlipTarget, lasting: bool, wait_seconds: float,
            bit: int | None = None) -> Flipped:
    """Flip one bit of ``target``'s ``what`` in the first optimizer step after it reports ``step`` (rank/bit_flip.py);
    with ``lasting``, the node's devices also compute wrong from now on (its known-answer check fails), as a faulty GPU
    would. Returns what the rank flipped, once it has (every rank of a script that calls ``ctx.progress`` acts on it)."""
    job = runtime.cluster.get_job(target.job)
    node_dir = runtime.layout.node_dir(target.node)
    request = node_dir / REQUEST_FILE
    if bit is not None and not 0 <= bit < 64:
        raise UsageError(f"--bit {bit} is out of range: a bit of the element's word, 0 (lowest) to 63")
    FlipRequest(job=target.job, rank=target.rank, step=step, target=what, attempt=job.attempt, bit=bit).write(request)
    if lasting:
        (node_dir / SDC_FAULT_FILE).touch()
    detail = (f"one bit of rank {target.rank}'s {what.value} after step {step}"
              + (f"; node {target.node}'s devices compute wrong from now on" if lasting else ""))
    runtime.cluster.add_event("Job", target.job, "ChaosCorrupt", detail, type=EventType.WARNING)
    if lasting:
        runtime.cluster.add_event("Node", target.node, "ChaosCorrupt", "its devices compute wrong numbers (known-answer check fails)",
                                  type=EventType.WARNING)
    try:
        flipped = wait_until(lambda: read_done(request), wait_seconds, f"rank {target.rank} of {target.job} to flip the bit")
    except WaitTimeout:
        raise UsageError(f"rank {target.rank} of job {target.job} did not flip the bit within {wait_seconds:g} s: a rank acts "
                         f"on it at its first ctx.progress at or after step {step} (a script without unbroken.init never "
                         "does), in the optimizer step after it") from None
    assert flipped is not None  # wait_until returns a truthy value or raises
    return flipped


def clear_corrupt(runtime: Runtime, node: str) -> bool:
    """The node's devices compute right again (its known-answer check passes). False if they were not made wrong."""
    runtime.cluster.get_node(node)
    fault = runtime.layout.node_dir(node) / SDC_FAULT_FILE
    if not fault.exists():
        return False
    fault.unlink()
    runtime.cluster.add_event("Node", node, "ChaosCorruptCleared", "its devices compute right again")
    return True


SLOW_PERIOD_S = 0.05
"""One stop/continue cycle of ``slow-node``: short next to a step (tens of ms to seconds), so every
step is slowed by about the same factor rather than some by a lot and most by nothing."""


def slow_node(runtime: Runtime, node: str, factor: float, *, period: float = SLOW_PERIOD_S) -> int:
    """Slow every process of the jobs' workers on ``node`` by ``factor`` until ``stop_slowing``: a
    background process stops them (SIGSTOP) for ``1 - 1/factor`` of every ``period`` and lets them run
    the rest, as a throttled GPU or a noisy neighbour would. Wall-clock waits (a sleep) are not slowed.
    Returns the slower's pid. Workers started on the node later (a restart) are slowed too."""
    if not 1.0 < factor <= 20.0:
        raise UsageError(f"--factor {factor:g} is out of range: a slowdown is more than 1 (1.5: steps take 50% longer) and at most 20")
    if not 0.005 <= period <= 5.0:
        raise UsageError(f"--period {period:g} s is out of range (valid: 0.005 to 5 s)")
    runtime.cluster.get_node(node)  # a clear error for an unknown name
    runtime.local_backend("chaos slow-node")
    stop_slowing(runtime, node, quiet=True)
    pidfile = _slower_pidfile(runtime, node)
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    with open(pidfile.with_suffix(".log"), "ab") as log:
        # Tagged as the cluster's (UNBROKEN_CLUSTER_DIR): `cluster down` ends it with the cluster's other processes,
        # where a slowing nobody cleared (a test that failed half-way) once outlived its cluster.
        slower = subprocess.Popen([sys.executable, "-m", "unbroken.runtime.fault_injection", "--dir", str(runtime.layout.root), "--node", node,
                                   "--factor", repr(factor), "--period", repr(period)],
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, CLUSTER_DIR: str(runtime.layout.root)})
    pidfile.write_text(str(slower.pid))
    # Back only once the first cycle ran, so that "slowed at" (the event's time) is when it began.
    wait_until(lambda: _started_file(pidfile).exists() or slower.poll() is not None, 30, f"the slower of {node} to start")
    if slower.poll() is not None:
        raise UsageError(f"the slower of node {node} exited with code {slower.returncode}; see {pidfile.with_suffix('.log')}")
    detail = f"its workers' processes run {1 / factor:.0%} of every {period * 1000:g} ms (x{factor:g} slower)"
    runtime.cluster.add_event("Node", node, "ChaosSlowNode", detail, type=EventType.WARNING)
    for job in sorted({w.job for w in runtime.backend.active_workers() if w.node == node}):
        runtime.cluster.add_event("Job", job, "ChaosSlowNode", f"node {node} slowed: {detail}", type=EventType.WARNING)
    return slower.pid


def stop_slowing(runtime: Runtime, node: str, *, quiet: bool = False) -> bool:
    """End ``slow_node`` on ``node`` (its processes run at full speed again). False if it was not slowed."""
    pidfile = _slower_pidfile(runtime, node)
    try:
        pid = int(pidfile.read_text())
    except (FileNotFoundError, ValueError):
        return False
    slower = [p for p in procs.tree(pid) if p.pid == pid]
    procs.signal_all(slower, signal.SIGTERM)
    procs.wait_gone(slower, 5.0)
    pidfile.unlink(missing_ok=True)
    _started_file(pidfile).unlink(missing_ok=True)
    if not quiet:
        runtime.cluster.add_event("Node", node, "ChaosSlowNodeCleared", "its processes run at full speed again")
    return bool(slower)


def _slower_pidfile(runtime: Runtime, node: str) -> Path:
    return runtime.layout.node_dir(node) / "chaos-slow.pid"


def _started_file(pidfile: Path) -> Path:
    return pidfile.with_suffix(".started")


def _duty_cycle(root: Path, node: str, factor: float, period: float) -> None:
    """The slower's loop over the node's workers' processes, refreshed every second (a restart's new ones too)."""
    runtime = open_local(ClusterLayout.at(root))
    backend = runtime.local_backend("chaos slow-node")
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    started = _started_file(_slower_pidfile(runtime, node))

    def victims() -> list[int]:
        return [p.pid for w in backend.active_workers() if w.node == node and w.pid for p in procs.tree(w.pid)]

    procs.duty_cycle(victims, factor, period, done, started=started.touch)


if __name__ == "__main__":  # the slower started by slow_node
    parser = argparse.ArgumentParser(description="stop/continue a node's worker processes (unbroken chaos slow-node)")
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--factor", type=float, required=True)
    parser.add_argument("--period", type=float, default=SLOW_PERIOD_S)
    args = parser.parse_args()
    _duty_cycle(args.dir, args.node, args.factor, args.period)
