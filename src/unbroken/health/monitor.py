"""The agent's continuous monitor: kernel-log rules in near real time, cheap checks periodically.

Two threads, so that a slow periodic check (bounded by its timeout) never
delays a kernel-log fault: Xid 79 moves the node within a poll interval of
the line being written. Findings become results (log line + node event); a
fault with a node action moves the node through the state machine
(``events.apply_fault``); application-level findings are events only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from unbroken.config.cluster import ClusterConfig
from unbroken.errors import StoreUnavailable
from unbroken.health import catalogue, events, runner, targets
from unbroken.health.kernel_log.sources import LineSource, open_source
from unbroken.health.kernel_log.watch import Finding, KernelLogWatch
from unbroken.health.result import CheckResult, FaultAction, Status, Suite
from unbroken.plumbing.layout import ClusterLayout
from unbroken.plumbing.metrics import AgentMetrics
from unbroken.state.phases import NodeState
from unbroken.state.records import Node
from unbroken.state.store import ClusterStore

log = logging.getLogger("unbroken.health.monitor")

POLL_SECONDS = 0.2
"""Kernel-log poll: one stat() of a file, or a non-blocking read of /dev/kmsg."""


def finding_result(node: str, finding: Finding) -> CheckResult:
    status = Status.FAIL if finding.action is not FaultAction.NONE else Status.WARN
    if finding.check == "kernel_log.xid":
        short = f"Xid{finding.metrics['xid']}"
    elif finding.check == "kernel_log.sxid":
        short = f"SXid{finding.metrics['sxid']}"
    else:
        short = finding.check.split(".", 1)[1]
    return CheckResult(finding.check, Suite.CONTINUOUS, status, f"{finding.reason}: {finding.line.strip()}", short,
                       dict(finding.metrics), finding.action, node)


class HealthMonitor:
    def __init__(self, store: ClusterStore, jobs_on: events.JobsOn, layout: ClusterLayout, node: str, cluster: ClusterConfig,
                 stopping: threading.Event, metrics: AgentMetrics | None = None, source: LineSource | None = None, *,
                 kernel_log: bool = True, on_node: Callable[[Node], None] | None = None) -> None:
        """``source``: the kernel log to watch (default: the cluster file's KernelLogSource for this
        node); ``kernel_log=False`` watches none and runs the continuous checks only (a Kubernetes
        agent given no kernel log). ``on_node`` sees the node's record each interval, as read for the checks (the
        Kubernetes agent's suspect watch: no read of its own)."""
        self.on_node = on_node
        self.store, self.jobs_on, self.layout, self.node, self.cluster, self.stopping = store, jobs_on, layout, node, cluster, stopping
        self.metrics = metrics
        self.settings = cluster.Health
        # Opened now, in the agent's start-up: the source starts at "now" and later lines are ours.
        self.source: LineSource | None = (source or open_source(self.settings.KernelLogSource, layout.kernel_log(node))
                                          if kernel_log else None)
        self.watch = KernelLogWatch(self.settings)
        self._last: dict[str, Status] = {}
        self._no_profile: str | None = None
        """The last "no health profile" error logged (once, not every interval)."""

    def start(self) -> None:
        if self.source is not None:
            threading.Thread(target=self._kernel_log_loop, args=(self.source,), name="kernel-log", daemon=True).start()
        threading.Thread(target=self._periodic_loop, name="continuous-checks", daemon=True).start()

    def _kernel_log_loop(self, source: LineSource) -> None:
        store = self.store
        try:
            while not self.stopping.wait(POLL_SECONDS):
                try:
                    for line in source.read():
                        for finding in self.watch.push(line):
                            self.handle(store, finding)
                except StoreUnavailable:
                    log.exception("kernel-log monitor pass failed; retrying", extra={"node": self.node})
        finally:
            source.close()

    def handle(self, store: ClusterStore, finding: Finding) -> None:
        if self.metrics is not None and finding.check == "kernel_log.xid":
            self.metrics.last_xid[str(finding.metrics["pci"])] = int(finding.metrics["xid"])  # type: ignore[call-overload]
        if self.metrics is not None and "rule_type" in finding.metrics:  # an NPD rule, as NPD itself would count it
            condition = finding.metrics.get("condition") if finding.metrics["rule_type"] == "permanent" else None
            self.metrics.problem(finding.check.removeprefix("kernel_log."), condition=str(condition) if condition else None)
        events.record(store, finding_result(self.node, finding))
        if finding.action is not FaultAction.NONE:
            events.apply_fault(store, self.jobs_on, self.node, finding.action, finding.reason, source=finding.check)

    def _periodic_loop(self) -> None:
        store = self.store
        interval = self.settings.MonitorIntervalSeconds
        while not self.stopping.wait(interval):
            try:
                node = store.get_node(self.node)
                if self.on_node is not None:
                    self.on_node(node)
                if node.state is not NodeState.SCHEDULABLE:
                    continue
                try:
                    ctx = targets.context(self.layout, self.cluster, node)
                except ValueError as exc:  # a Kubernetes Node of an instance type the cluster file has no profile for
                    if self._no_profile != str(exc):
                        self._no_profile = str(exc)
                        log.error("continuous checks cannot run on this node: %s", exc, extra={"node": self.node})
                    continue
                for spec in catalogue.for_suite(Suite.CONTINUOUS, self.settings):
                    if self.stopping.is_set():
                        return
                    self.report(store, runner.run_check(spec, ctx, Suite.CONTINUOUS))
            except StoreUnavailable:
                log.exception("continuous checks pass failed; retrying", extra={"node": self.node})

    def report(self, store: ClusterStore, result: CheckResult) -> None:
        """Every run is logged; only failures and changes become events (no event flood every interval)."""
        if self.metrics is not None:
            self.metrics.check_ran(result.check, result.status.value, result.duration_s)
        previous = self._last.get(result.check)
        self._last[result.check] = result.status
        if result.status is Status.FAIL or result.status is not previous:
            events.record(store, result)
        else:
            events.log_result(result)
        if result.failed and result.action is not FaultAction.NONE:
            events.apply_fault(store, self.jobs_on, self.node, result.action, f"{result.check}: {result.message}", source=result.check)
