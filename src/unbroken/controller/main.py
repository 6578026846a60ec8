"""The controller process: ``python -m unbroken.controller --dir DIR``.

Holds no state of its own: every pass reads the store, decides, writes back.
Kill it at any moment and start it again; it carries on where the store says.
An exclusive ``flock`` on ``controller.lock`` keeps a second one from running.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import signal
import sys
import threading

from prometheus_client import CollectorRegistry

from unbroken.plumbing import logs, metrics
from unbroken.controller.job_reconciler import JobReconciler
from unbroken.controller.metrics import ClusterCollector
from unbroken.controller.node_reconciler import NodeReconciler
from unbroken.plumbing.doorbell import Doorbell
from unbroken.plumbing.layout import ClusterLayout
from unbroken.runtime import Runtime, open_local
from unbroken.state.records import ClusterStatus

log = logging.getLogger("unbroken.controller")

LOOP_SECONDS = 0.2
"""Reaction time to any change nobody rang the doorbell for; a pass over a small cluster costs ~1 ms
of SQLite reads. An agent that saw a rank die rings (plumbing/doorbell.py): the next pass starts at once."""

SILENT_AFTER_HEARTBEATS = 1.5
"""A lease half an interval overdue makes a node a suspect, well before it is declared lost:
its workers are not waited for at a restart, and it is handed no new attempt. Renewals come
every interval plus the time of one write, so a healthy node is not a suspect; a dead one is
at most 1.5 s after its last renewal, which bounds what a lost node adds to a restart."""


def serve_metrics(runtime: Runtime) -> metrics.Endpoint | None:
    """The cluster's metrics on ``/metrics``, derived from the stores on every scrape."""
    settings = runtime.config.Metrics
    if not settings.Enabled:
        return None
    registry = CollectorRegistry()
    registry.register(ClusterCollector(runtime.cluster, runtime.backend, runtime.catalog, runtime.clock))
    endpoint = metrics.serve(registry, settings.Host, settings.ControllerPort)
    runtime.cluster.set_controller_metrics(endpoint.address)
    log.info("serving metrics", extra={"address": endpoint.address})
    return endpoint


def run(runtime: Runtime, stopping: threading.Event) -> None:
    cluster = runtime.config
    nodes = NodeReconciler(runtime.cluster, runtime.backend, cluster)
    jobs = JobReconciler(runtime.cluster, runtime.backend, catalog=runtime.catalog,
                         silent_after=SILENT_AFTER_HEARTBEATS * cluster.Local.HeartbeatIntervalSeconds)
    log.info("controller started", extra={"cluster": cluster.ClusterName})
    endpoint = serve_metrics(runtime)
    doorbell = Doorbell(runtime.layout.controller_doorbell)
    try:
        _loop(runtime, nodes, jobs, stopping, doorbell)
    finally:
        doorbell.close()
        if endpoint is not None:
            endpoint.close()


def _loop(runtime: Runtime, nodes: NodeReconciler, jobs: JobReconciler, stopping: threading.Event, doorbell: Doorbell) -> None:
    while not stopping.is_set():
        now = runtime.clock()
        try:
            if runtime.cluster.cluster().status is not ClusterStatus.UP:
                log.info("cluster is going down; controller exits")
                return
            nodes.reconcile_all(now)
            jobs.reconcile_all(now)
        except Exception:  # noqa: BLE001 - the supervisor loop must outlive one bad pass; it is logged
            log.exception("reconcile pass failed; retrying")
            stopping.wait(1.0)
        doorbell.wait(LOOP_SECONDS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unbroken-controller", description="unbroken controller")
    parser.add_argument("--dir", required=True, help="cluster directory")
    args = parser.parse_args(argv)
    layout = ClusterLayout.at(args.dir)
    logs.setup(component="controller")
    lock = open(layout.controller_lock, "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log.error("another controller holds %s; exiting", layout.controller_lock)
        return 1
    # Agents this process starts (replacements) are never waited on: let the kernel reap them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    run(open_local(layout), stopping)
    return 0


if __name__ == "__main__":
    sys.exit(main())
