"""The node agent process: ``python -m unbroken.agent --dir DIR --node NAME``.

A reconciler like the controller. Whatever the backend, it registers its node,
renews the node's lease once a second (carrying its ranks' progress), runs the
join checks, watches the kernel log and the continuous checks, and owns the
node's checkpoint memory tier. On the local backend it also runs the node's
workers (:mod:`unbroken.agent.workers`), as a kubelet runs pods.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
import time

from unbroken.plumbing import logs, metrics
from unbroken.agent import join_checks
from unbroken.health import suspect
from unbroken.supervision import torchrun
from unbroken.agent.progress import ProgressBook
from unbroken.agent.workers import WorkerRunner
from unbroken.rank.channel import AgentReceiver, agent_socket
from unbroken.checkpoint.node import shm
from unbroken.checkpoint.node import credentials
from unbroken.checkpoint.node.service import CheckpointService
from unbroken.errors import StoreUnavailable
from unbroken.health import join as health_join
from unbroken.health.gpu_metrics import GpuCollector
from unbroken.health.monitor import HealthMonitor
from unbroken.health.result import CheckResult
from unbroken.plumbing.metrics import AgentMetrics
from unbroken.plumbing.layout import ClusterLayout
from unbroken.runtime import Runtime, open_local
from unbroken.state.phases import DeepHealthStatus, NodeState
from unbroken.state.records import ClusterStatus, EventType
from unbroken.state.updates import NodeUpdate

log = logging.getLogger("unbroken.agent")

LOOP_SECONDS = 0.1

_REJOIN_FROM = {NodeState.JOINING, NodeState.REBOOTING, NodeState.SCHEDULABLE}


class Agent:
    def __init__(self, runtime: Runtime, node: str) -> None:
        self.runtime = runtime
        self.store = runtime.cluster
        self.node = node
        self.layout = runtime.layout
        self.cluster = runtime.config
        self.metrics = AgentMetrics()
        self.book = ProgressBook(self.metrics)
        self.stopping = threading.Event()
        self.node_root = shm.node_root(self.layout.root, node)
        """The agent's own folder on the node: memory tier, and the socket its ranks report to."""
        self.checkpoints = CheckpointService(runtime.catalog, runtime.cluster, node, self.node_root,
                                             credentials.load(self.layout.root), metrics=self.metrics)
        self.suspect = suspect.SuspectWatch(self._check_suspect, node)
        """The known-answer check, run when the controller suspects this node of silent data corruption."""
        self.workers = (WorkerRunner(node, runtime.worker_table, self.store, self.layout, self.book, self._launch_settings)
                        if runtime.worker_table is not None else None)

    # -- lifecycle ------------------------------------------------------------------

    def register(self) -> bool:
        """Announce this agent; False if the node is not ours to run any more, or the cluster is going down."""
        if self.store.cluster().status is not ClusterStatus.UP:
            log.warning("cluster is not up; agent exits", extra={"node": self.node})
            return False
        node = self.store.get_node(self.node)
        if node.state in (NodeState.RETIRED, NodeState.PENDING_REPLACEMENT, NodeState.PENDING_REBOOT):
            log.warning("node is %s; agent exits", node.state.value, extra={"node": self.node})
            return False
        state = NodeState.JOINING if node.state in _REJOIN_FROM else node.state
        now = time.time()
        self.store.update_node(self.node, NodeUpdate(
            state=state, deep_health=DeepHealthStatus.IN_PROGRESS, agent_pid=os.getpid(), registered_at=now,
            fault_type=None, fault_reason=None, recovery_requested=False,
        ))
        self.store.renew_lease(self.node, at=now)
        self.store.add_event("Node", self.node, "NodeRegistered", f"agent pid {os.getpid()} registered; running join checks")
        log.info("registered", extra={"node": self.node, "state": state.value})
        if self.workers is not None:
            self.workers.stop_orphans()
        return True

    def run(self) -> None:
        if not self.register():
            return
        self.receiver = AgentReceiver(agent_socket(self.node_root))
        endpoint = self._serve_metrics()
        threading.Thread(target=self._lease_loop, name="lease", daemon=True).start()
        self.checkpoints.start()
        threading.Thread(target=self.checkpoints.run_passes, args=(self.stopping,), name="checkpoints", daemon=True).start()
        threading.Thread(target=self._join_checks, name="join-checks", daemon=True).start()
        HealthMonitor(self.store, self._jobs_on, self.layout, self.node, self.cluster, self.stopping, self.metrics).start()
        try:
            while not self.stopping.is_set():
                try:
                    node = self.store.get_node(self.node)
                    if node.state is NodeState.RETIRED:
                        log.info("node retired; stopping", extra={"node": self.node})
                        break
                    self.suspect.look(node)
                    self.book.apply(self.receiver.drain())
                    if self.workers is not None:
                        self.workers.reconcile()
                except StoreUnavailable:
                    # A store hiccup must not kill the agent: that would look like a lost
                    # node and cost a replacement plus a restart of every job on it.
                    log.exception("agent pass failed; retrying", extra={"node": self.node})
                    self.stopping.wait(1.0)
                self.stopping.wait(LOOP_SECONDS)
        finally:
            if self.workers is not None:
                self.workers.kill_all()
                self.workers.close()
            self.receiver.close()
            self.checkpoints.close()
            if endpoint is not None:
                endpoint.close()

    def _serve_metrics(self) -> metrics.Endpoint | None:
        """This node's ``/metrics``: what its agent measures, and its GPUs under dcgm-exporter's names."""
        settings = self.cluster.Metrics
        if not settings.Enabled:
            return None
        if settings.GpuMetrics:
            self.metrics.register(GpuCollector(self.node, self.metrics.last_xid))
        node = self.store.get_node(self.node)
        # In its own network namespace a node binds its namespace address: that is what reaches it.
        host = node.address if self.cluster.Local.NetworkNamespaces else settings.Host
        number = int(match.group(1)) if (match := re.search(r"(\d+)$", self.node)) else 0
        port = settings.AgentBasePort + number if settings.AgentBasePort else 0
        endpoint = metrics.serve(self.metrics.registry, host, port)
        self.store.update_node(self.node, NodeUpdate(metrics_address=endpoint.address))
        log.info("serving metrics", extra={"node": self.node, "address": endpoint.address})
        return endpoint

    def _lease_loop(self) -> None:
        """One write per interval: the heartbeat and whatever progress the ranks reported since."""
        interval = self.cluster.Local.HeartbeatIntervalSeconds
        while not self.stopping.wait(interval):
            try:
                self.book.apply(self.receiver.drain())
                self.store.renew_lease(self.node, at=time.time(), progress=self.book.take_dirty())
            except StoreUnavailable:
                log.exception("lease renewal failed; retrying", extra={"node": self.node})

    def _join_checks(self) -> None:
        node = self.store.get_node(self.node)
        suites = [s.value for s in self.cluster.group(node.group).OnStartDeepHealthChecks]

        def deep(suite: str) -> health_join.Verdict:
            busy = {w.node for w in self.runtime.backend.active_workers()}
            return health_join.run_suite(suite, self.node, store=self.store, jobs_on=self._jobs_on, layout=self.layout,
                                         cluster=self.cluster, busy=busy, on_result=self._measure_check)

        result, notes = join_checks.run_join_checks(self.node, self.layout.node_dir(self.node), suites, deep)
        for note in notes:
            self.store.add_event("Node", self.node, "DeepHealthCheckNote", note)
        status = DeepHealthStatus.PASSED if result.passed else DeepHealthStatus.FAILED
        update = (NodeUpdate(deep_health=status) if result.passed else
                  NodeUpdate(deep_health=status, fault_type=result.fault_type, fault_reason=result.reason))
        self.store.update_node(self.node, update)
        self.store.add_event(
            "Node", self.node, f"JoinChecks{status.value}", result.reason,
            type=EventType.NORMAL if result.passed else EventType.WARNING,
        )
        log.info("join checks %s: %s", status.value, result.reason, extra={"node": self.node})

    def _check_suspect(self) -> CheckResult:
        result = suspect.check(self.store, self._jobs_on, self.layout, self.cluster, self.node)
        self._measure_check(result)
        return result

    def _measure_check(self, result: CheckResult) -> None:
        self.metrics.check_ran(result.check, result.status.value, result.duration_s)
        busbw = result.metrics.get("busbw") if result.check.startswith("collective.") else None
        if busbw is not None and result.node == self.node and result.metrics.get("sizes"):
            self.metrics.collective_busbw.labels("all_reduce", str(max(result.metrics["sizes"]))).set(float(busbw) * 1e9)

    def _jobs_on(self, node: str) -> list[str]:
        return [w.job for w in self.runtime.backend.active_workers() if w.node == node]

    def _launch_settings(self) -> torchrun.NodeSettings:
        return torchrun.NodeSettings(
            agent_socket=self.receiver.path,
            checkpoint_endpoint=self.checkpoints.server.address if self.checkpoints.server else None,
            local_addr=self.store.get_node(self.node).address,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unbroken-agent", description="unbroken node agent")
    parser.add_argument("--dir", required=True, help="cluster directory")
    parser.add_argument("--node", required=True, help="name of the node this agent runs")
    args = parser.parse_args(argv)
    logs.setup(component="agent", node=args.node)
    agent = Agent(open_local(ClusterLayout.at(args.dir)), args.node)
    signal.signal(signal.SIGTERM, lambda *_: agent.stopping.set())
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
