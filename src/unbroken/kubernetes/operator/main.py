"""The operator process: ``unbroken operator --namespace unbroken-system``.

Watch caches (kubernetes/backend/watch_cache.py) keep Nodes, the agents' Leases, the workloads and
their pods in memory: listed once, then watched from their resourceVersion, so a pass reads memory and
never LISTs the cluster. A change to a Node, a workload or a pod wakes the reconcile loop. The
loop lets nodes back from a reboot join again (:class:`RebootReturns`), runs joining
nodes' deep checks (:class:`DeepCheckJobs`), then the local
controller's: the same :class:`NodeReconciler` and
:class:`JobReconciler` over the Kubernetes store and backend, a full
level-triggered pass on every wake-up and at least every ``RESYNC_SECONDS``, so
a missed or coalesced event costs a second, not a decision. Only the holder of
the Lease ``unbroken-operator`` acts; a killed operator's successor takes over
when the Lease expires and carries on from what the objects' annotations say.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from collections.abc import Iterator
from types import FrameType

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from unbroken.plumbing import logs, metrics
from unbroken.kubernetes.backend import cluster_tls
from unbroken.controller.job_reconciler import JobReconciler
from unbroken.controller.metrics import ClusterCollector
from unbroken.controller.node_reconciler import NodeReconciler
from unbroken.errors import StoreUnavailable, UnbrokenError
from unbroken.kubernetes.backend import heartbeats, names
from unbroken.kubernetes.operator import deep_checks
from unbroken.kubernetes.operator.credential_issuer import CredentialIssuer, IssuerServer
from unbroken.kubernetes.operator.deep_checks import DeepCheckJobs
from unbroken.kubernetes.operator.reboots import RebootReturns
from unbroken.kubernetes.backend.client import api_client
from unbroken.kubernetes.backend.leader import LeaderLease
from unbroken.kubernetes.backend.store import KubernetesStore
from unbroken.runtime import KubernetesRuntime, open_kubernetes
from unbroken.state.records import EventType

log = logging.getLogger("unbroken.kubernetes.operator")

RESYNC_SECONDS = 1.0
"""A full pass at least this often, events or not (a lease going stale makes no event)."""
LOSS_MARGIN_SECONDS = 0.02
"""A pass timed for a node turning silent comes this much after (silence is "more than" the threshold)."""
SILENT_AFTER_SECONDS = 3.0
"""A node whose heartbeat is this much overdue is a suspect (agents beat every second: kubernetes/backend/heartbeats.py)."""


class Operator:
    def __init__(self, runtime: KubernetesRuntime, leader: LeaderLease, deep_checks: DeepCheckJobs, *,
                 issuer_at: tuple[str, int] | None = None) -> None:
        """``issuer_at``: where to certify the agents (kubernetes/operator/credential_issuer.py) once this replica
        leads; None: nowhere (a test's operator whose agents get nothing)."""
        self.runtime = runtime
        self.leader = leader
        self.deep_checks = deep_checks
        self.reboots = RebootReturns(self.store)
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.nodes = NodeReconciler(runtime.cluster, runtime.backend, runtime.config)
        self.jobs = JobReconciler(runtime.cluster, runtime.backend, silent_after=SILENT_AFTER_SECONDS, catalog=runtime.catalog)
        self.secrets_made = False
        self.issuer_at = issuer_at
        self.issuer: IssuerServer | None = None

    @property
    def store(self) -> KubernetesStore:
        return self.runtime.cluster

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self.wake.wait(self._next_pass_in())
                self.wake.clear()
                self.reconcile_once()
        finally:
            self.leader.release()

    def _next_pass_in(self) -> float:
        """``RESYNC_SECONDS``, or less where a node heard so far turns silent sooner: a dead node is then lost
        ``NodeLostAfterSeconds`` after its last beat, not up to a pass later."""
        due = self.nodes.next_loss_at
        if due is None:
            return RESYNC_SECONDS
        return min(RESYNC_SECONDS, max(0.0, due - self.runtime.clock()) + LOSS_MARGIN_SECONDS)

    def reconcile_once(self) -> None:
        now = self.runtime.clock()
        board = self.store.heartbeats
        try:
            if not self.leader.hold(now):
                if board is not None and self.leader.holder not in (None, self.leader.identity):
                    # Another replica leads: a later term of this one starts from the Leases, not from
                    # beats heard before. (An API server that cannot be reached only pauses this one:
                    # the beats it hears meanwhile are as good as ever.)
                    board.forget()
                return
            if not self.secrets_made:
                self._make_secrets()
            self.warn_invalid()
            self.reboots.reconcile()
            self.deep_checks.reconcile(self.runtime.config)
            self.nodes.reconcile_all(now)
            self.jobs.reconcile_all(now)
        except Exception:  # noqa: BLE001 - the loop must outlive one bad pass (an API hiccup); it is logged
            log.exception("reconcile pass failed; retrying")
            self.stopping.wait(1.0)

    def _make_secrets(self) -> None:
        """What the agents wait for, made by the first leader (kept if there): the heartbeat master key, which the
        board verifies datagrams with, and the cluster's CA; then the issuer that certifies each agent for its node
        (its certificate and heartbeat key), and the CA's certificate on the leader Lease for the agents to check it
        by. Only the operator may create or read these Secrets. A refusal (RBAC of an older install) or a port taken
        is logged and tried again next pass; the rest of the pass goes on: the nodes' Leases still vouch for them and
        jobs are still kept alive, without the memory tier."""
        try:
            key = heartbeats.ensure_key(self.store.api, self.store.namespace)
            authority = cluster_tls.make(self.store.api, self.store.namespace, self.runtime.config.ClusterName)
        except StoreUnavailable as exc:
            log.error("cannot make the agents' credentials (the nodes send no heartbeat datagrams and run no memory tier "
                      "until it can): %s", exc)
            return
        if self.store.heartbeats is not None:
            self.store.heartbeats.master = key  # agents certified by an earlier leader beat on at once
        self.leader.annotations[names.CLUSTER_CA] = authority.cert_pem.decode()  # published with the next renewal
        if self.issuer_at is not None and self.issuer is None:
            try:
                self.issuer = CredentialIssuer(self.store.api, self.store.namespace, authority, key).serve(*self.issuer_at)
            except OSError as exc:
                log.error("cannot certify node agents on %s:%s (agents that start meanwhile wait; tried again next pass): %s",
                          *self.issuer_at, exc)
                return
            log.info("certifying node agents", extra={"port": self.issuer.port})
        self.secrets_made = True

    def warn_invalid(self) -> None:
        """A job that opted in with a bad annotation: one Warning Event per distinct problem, job untouched."""
        for invalid in self.store.invalid_jobs():
            message = "; ".join(invalid.problems) + "; unbroken leaves this job alone until it is fixed"
            seen = self.store.list_events(object_kind=invalid.object_kind, object_name=invalid.name, reason="InvalidAnnotation")
            if not any(e.message == message for e in seen):
                self.store.add_event(invalid.object_kind, invalid.name, "InvalidAnnotation", message, type=EventType.WARNING)


class OperatorCollector:
    """The operator's own state: the disruption guard and the heartbeats it hears."""

    def __init__(self, operator: Operator) -> None:
        self.operator = operator

    def collect(self) -> Iterator[Metric]:
        leading = GaugeMetricFamily("unbroken_operator_leading", "1 while this replica holds the leader Lease (0 also "
                                    "while the API server cannot be reached: nothing is decided then)")
        leading.add_metric([], 1.0 if self.operator.leader.leading else 0.0)
        yield leading
        holding = self.operator.nodes.holding
        hold = GaugeMetricFamily("unbroken_liveness_hold", "1 while the disruption guard holds node-loss decisions "
                                 "(most nodes silent at once: controller/liveness.py)", labels=[])
        hold.add_metric([], 1.0 if holding is not None else 0.0)
        yield hold
        silent = GaugeMetricFamily("unbroken_liveness_hold_silent_nodes", "silent nodes behind the hold in force")
        silent.add_metric([], float(len(holding.silent)) if holding is not None else 0.0)
        yield silent
        board = self.operator.store.heartbeats
        if board is not None:
            beats = CounterMetricFamily("unbroken_heartbeats", "heartbeat datagrams heard from the agents",
                                        labels=["outcome"])
            beats.add_metric(["accepted"], float(board.received))
            beats.add_metric(["rejected"], float(board.rejected))
            yield beats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unbroken operator", description=__doc__.split("\n")[0])
    parser.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "unbroken-system"),
                        help="where unbroken is installed (its ConfigMaps and Leases)")
    parser.add_argument("--job-namespace", default=None, help="watch jobs in this namespace only (default: all)")
    parser.add_argument("--kubeconfig", type=Path, default=None)
    parser.add_argument("--context", default=None)
    parser.add_argument("--metrics-port", type=int, default=None, help="serve /metrics here (default: the cluster file's)")
    parser.add_argument("--metrics-host", default="0.0.0.0")
    parser.add_argument("--identity", default=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
                        help="this replica's name in the leader Lease")
    parser.add_argument("--heartbeat-host", default="0.0.0.0", help="where to hear the agents' heartbeat datagrams (UDP) and certify "
                        "them for their nodes (HTTPS, TCP, the same port)")
    parser.add_argument("--heartbeat-port", type=int, default=None,
                        help="their port (default: the cluster file's Kubernetes.HeartbeatPort, 9403; 0: any free one)")
    parser.add_argument("--heartbeat-address", default=os.environ.get("POD_IP", "127.0.0.1"),
                        help="the address agents send them to, published in the leader Lease (default: $POD_IP, which "
                             "the Deployment sets from status.podIP)")
    args = parser.parse_args(argv)
    logs.setup(component="operator")
    try:
        api = api_client(args.kubeconfig, args.context)
        runtime = open_kubernetes(api, args.namespace, job_namespace=args.job_namespace)
    except UnbrokenError as exc:
        log.error("cannot start: %s", exc)
        return 2
    port = args.heartbeat_port if args.heartbeat_port is not None else runtime.config.Kubernetes.HeartbeatPort
    try:
        board = heartbeats.HeartbeatBoard(args.heartbeat_host, port)
    except OSError as exc:
        log.error("cannot hear heartbeats on %s:%s: %s", args.heartbeat_host, port, exc)
        return 2
    runtime.cluster.heartbeats = board
    address = f"{args.heartbeat_address}:{board.port}"
    log.info("hearing heartbeats", extra={"address": address})
    operator = Operator(runtime, LeaderLease(api, args.namespace, names.LEADER_LEASE, args.identity,
                                             annotations={heartbeats.ADDRESS_ANNOTATION: address}),
                        deep_checks.DeepCheckJobs(api, args.namespace, runtime.cluster,
                                                  busy=lambda: {w.node for w in runtime.backend.active_workers()}),
                        issuer_at=(args.heartbeat_host, board.port))  # TCP beside the heartbeats' UDP: one address
    endpoint = None
    if runtime.config.Metrics.Enabled:
        registry = CollectorRegistry()
        registry.register(ClusterCollector(runtime.cluster, runtime.backend, runtime.catalog, runtime.clock))
        registry.register(OperatorCollector(operator))
        endpoint = metrics.serve(registry, args.metrics_host,
                                 args.metrics_port if args.metrics_port is not None else runtime.config.Metrics.ControllerPort)
        log.info("serving metrics", extra={"address": endpoint.address})
    def stop(signum: int, _frame: FrameType | None) -> None:
        log.info("stopping", extra={"signal": signal.Signals(signum).name})
        operator.stopping.set()
        operator.wake.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    caches = runtime.cluster.start_watches(on_change=operator.wake.set)
    runtime.catalog.follow(nodes=caches.nodes)  # what /metrics reads of the checkpoints, per scrape
    log.info("operator started", extra={"namespace": args.namespace, "identity": args.identity,
                                        "watches": [cache.name for cache in caches.all()]})
    try:
        operator.run()
    finally:
        runtime.cluster.stop_watches()
        if endpoint is not None:
            endpoint.close()
        if operator.issuer is not None:
            operator.issuer.close()
        board.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
