"""The cluster's metrics, derived from the stores on every scrape: jobs, nodes, checkpoints.

Nothing here counts in memory: a restart count is the number of ``JobRestarting``
events, goodput comes from the attempts' progress, a node's health status from its
labels. So a controller that restarts serves exactly what it served before, and a
counter never drops back to zero. Every label value is bounded (job and node names,
enum values, fault kinds, never steps, pids or free text).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from unbroken.controller import jobs as job_ops
from unbroken.controller import report
from unbroken.backends.base import Backend
from unbroken.controller import hang_timeout, stragglers
from unbroken.controller.fault_kinds import FaultKind, classify
from unbroken.state.catalog import CheckpointCatalog
from unbroken.state.phases import DeepHealthStatus, JobPhase, NodeState
from unbroken.state.records import CheckpointTier, Event, Job, StepStatus
from unbroken.state.store import ClusterStore

RECOVERY_BUCKETS = (1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
"""Fault to first step after resume: seconds (in-process restarts) to minutes (a cold restart elsewhere)."""

HEALTH_STATUSES = ("Schedulable", "Unschedulable", "UnschedulablePendingReboot", "UnschedulablePendingReplacement")
_REMEDIATIONS = {"NodeRebooting": "reboot", "NodeReplaced": "replace"}
_NODE_FAULTS = ("NodeLost", "FaultyInstance", "RebootRequired", "DeepHealthCheckFailed", "RebootFailed", "Straggler")


@dataclass(eq=False)  # registries key collectors by identity
class ClusterCollector(Collector):
    store: ClusterStore
    backend: Backend
    catalog: CheckpointCatalog
    clock: Callable[[], float]

    def describe(self) -> Iterable[Metric]:
        return []  # the names are known; no store read when the collector is registered

    def collect(self) -> Iterable[Metric]:
        now = self.clock()
        yield from self._jobs(now)
        yield from self._nodes()

    # -- jobs -----------------------------------------------------------------------

    def _jobs(self, now: float) -> Iterator[Metric]:
        restarts = CounterMetricFamily("unbroken_job_restarts", "Restarts of a job, by the kind of fault that caused them", labels=["job", "reason"])
        faults = CounterMetricFamily("unbroken_job_faults", "Faults that ended an attempt of a job (restarted or final)", labels=["job", "fault_type"])
        budget = GaugeMetricFamily("unbroken_job_retry_budget_remaining", "Restarts the job may still use (0 without auto_resume)", labels=["job"])
        step = GaugeMetricFamily("unbroken_job_step", "The step the slowest node of the current attempt reported", labels=["job"])
        last = GaugeMetricFamily("unbroken_job_last_progress_timestamp_seconds", "When a rank of the job last reported progress",
                                 labels=["job"])
        goodput = CounterMetricFamily("unbroken_job_goodput_seconds", "Seconds of kept training progress", labels=["job"])
        badput = CounterMetricFamily("unbroken_job_badput_seconds", "Seconds lost, by cause", labels=["job", "cause"])
        phase = GaugeMetricFamily("unbroken_job_phase", "1 for the job's current phase", labels=["job", "phase"])
        committed = GaugeMetricFamily("unbroken_checkpoint_last_committed_step", "Newest step committed in each checkpoint tier",
                                      labels=["job", "tier"])
        straggler = GaugeMetricFamily("unbroken_straggler_score", "A node's slowest rank's time in scored sections against the "
                                      "job's other nodes (1: keeps pace; under the job's threshold: a straggler)", labels=["job", "node"])
        hang_timeout_s = GaugeMetricFamily("unbroken_job_hang_timeout_seconds", "The hang timeout in force (set, or from step times)",
                                           labels=["job"])
        recoveries: list[float] = []
        for job in self.store.list_jobs():
            events = self.store.list_events(object_kind="Job", object_name=job.name)
            summary = report.summarize(job, self.backend.worker_history(job.name), events, now)
            kinds = _count(restart_kinds(events))
            for kind in FaultKind:  # every series from the start: increase() needs the zero it starts from
                restarts.add_metric([job.name, kind.value], kinds.get(kind, 0))
            final = [classify(e.message) for e in events if e.reason == "JobFailed"]
            for kind, count in _count([*_expand(kinds), *final]).items():
                faults.add_metric([job.name, kind.value], count)
            budget.add_metric([job.name], _budget(job))
            current = self.backend.observe_attempt(job.name, job.attempt)
            step.add_metric([job.name], job_ops.current_step(current))
            progress = max((w.last_progress_at for w in current if w.last_progress_at is not None), default=None)
            if progress is not None:
                last.add_metric([job.name], progress)
            if not job.phase.is_terminal:
                hang_timeout_s.add_metric([job.name], hang_timeout.in_force(job.spec(), current).seconds)
                for node, score in stragglers.scores(current).items():
                    straggler.add_metric([job.name, node], score.score)
            lost = report.badput(summary, lambda reason: classify(reason) in (FaultKind.HANG, FaultKind.STARTUP_TIMEOUT))
            goodput.add_metric([job.name], summary.goodput * summary.wall_seconds if summary.goodput is not None else 0.0)
            for cause, seconds in lost.items():
                badput.add_metric([job.name, cause], seconds)
            for value in JobPhase:
                phase.add_metric([job.name, value.value], 1.0 if job.phase is value else 0.0)
            recoveries += [r.total_s for r in summary.recoveries]
            for tier in (CheckpointTier.MEMORY, CheckpointTier.PERSISTENT):
                steps = [s.step for s in self.catalog.list_checkpoint_steps(job.name, tier=tier) if s.status is StepStatus.COMMITTED]
                if steps:
                    committed.add_metric([job.name, tier.value], max(steps))
        yield from (restarts, faults, budget, step, last, goodput, badput, phase, committed, straggler, hang_timeout_s)
        yield _histogram("unbroken_job_recovery_seconds", "Fault (or its detection) to the first step after the resume",
                         recoveries, RECOVERY_BUCKETS)

    # -- nodes ----------------------------------------------------------------------

    def _nodes(self) -> Iterator[Metric]:
        health = GaugeMetricFamily("unbroken_node_health_status", "1 for the node's unbroken.dev/node-health-status",
                                   labels=["node", "status"])
        deep = GaugeMetricFamily("unbroken_node_deep_health_check_status", "1 for the node's unbroken.dev/deep-health-check-status",
                                 labels=["node", "status"])
        faults = CounterMetricFamily("unbroken_node_faults", "Faults that took the node out of service", labels=["node", "fault_type", "reason"])
        remediations = CounterMetricFamily("unbroken_node_remediations", "Reboots and replacements of the node", labels=["node", "action"])
        events = self.store.list_events(object_kind="Node")
        for node in self.store.list_nodes():
            if node.state is NodeState.RETIRED:
                continue
            for status in HEALTH_STATUSES:
                health.add_metric([node.name, status], 1.0 if node.state.health_status_label == status else 0.0)
            for value in DeepHealthStatus:
                deep.add_metric([node.name, value.value], 1.0 if node.deep_health is value else 0.0)
        by_node: dict[str, list[Event]] = {}
        for event in events:
            by_node.setdefault(event.object_name, []).append(event)
        for name, node_events in sorted(by_node.items()):
            for (fault_type, reason), count in _count((e.reason, fault_reason_code(e.message)) for e in node_events
                                                      if e.reason in _NODE_FAULTS).items():
                faults.add_metric([name, fault_type, reason], count)
            for action, count in _count(_REMEDIATIONS[e.reason] for e in node_events if e.reason in _REMEDIATIONS).items():
                remediations.add_metric([name, action], count)
        yield from (health, deep, faults, remediations)


def restart_kinds(events: list[Event]) -> list[FaultKind]:
    """The kind of each restart of a job: its JobRestarting reason, or the cause a JobRestartCause
    named later when the restart was decided on a lost peer (the symptom, not the fault)."""
    causes = {}
    for event in events:
        if event.reason == "JobRestartCause" and (match := re.match(r"attempt (\d+): .*?: (worker on .*)$", event.message)):
            causes[int(match.group(1))] = match.group(2)
    restarts = [e for e in events if e.reason == "JobRestarting"]
    return [classify(causes.get(attempt, event.message)) for attempt, event in enumerate(restarts)]


def fault_reason_code(message: str) -> str:
    """A bounded code for why a node left service, from its fault event's sentence."""
    if match := re.search(r"\bSXid (\d+)", message):
        return f"SXid{match.group(1)}"
    if match := re.search(r"\bXid (\d+)", message):
        return f"Xid{match.group(1)}"
    if "heartbeat lost" in message:
        return "HeartbeatLost"
    if "did not come back" in message:
        return "RebootTimeout"
    if match := re.search(r"\b([a-z_]+\.[a-z_]+): ", message):
        return match.group(1)
    if "requested by operator" in message:
        return "Operator"
    if message.startswith("straggler in job "):
        return "Straggler"
    return "Other"


def _budget(job: Job) -> float:
    resilience = job.spec().resilience
    return float(max(0, resilience.max_retry - job.attempt)) if resilience.auto_resume else 0.0


def _count(items: Iterable) -> dict:
    counts: dict = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def _expand(counts: dict[FaultKind, int]) -> list[FaultKind]:
    return [kind for kind, n in counts.items() for _ in range(n)]


def _histogram(name: str, documentation: str, values: list[float], buckets: tuple[float, ...]) -> Metric:
    cumulative = [(str(bound), float(sum(v <= bound for v in values))) for bound in buckets]
    cumulative.append(("+Inf", float(len(values))))
    metric = HistogramMetricFamily(name, documentation, buckets=cumulative, sum_value=sum(values))
    return metric

