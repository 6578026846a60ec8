"""Prometheus metrics a node agent measures itself, and the endpoint every process serves on.

What the cluster's state says (jobs, restarts, goodput, node labels, committed steps) is
derived from the stores on every scrape by the controller (``controller/metrics.py``), so
it survives any process restart. What only a node sees happen is counted here, by the
agent that saw it: health-check runs, NPD rule matches, collective bandwidth, checkpoint
stalls, restores, bytes and tier failures (its counters start again at zero when the
agent does, as any Prometheus counter).

Every metric lives in the registry of the process that serves it (no module-level
default registry), so two agents of one test process never mix. Labels are bounded:
check ids, tiers, sources, reasons that are codes, never steps or pids.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from threading import Thread
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from unbroken.plumbing.http_bind import bind_without_lookup

SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""From a millisecond (a warm memory-tier stall) to five minutes (a slow persistent drain)."""


@dataclass
class Endpoint:
    """A running ``/metrics`` server."""

    address: str
    """``host:port`` as Prometheus scrapes it."""
    server: WSGIServer
    thread: Thread

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape a second is not news


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def server_bind(self) -> None:
        bind_without_lookup(self)  # no reverse DNS: in a node's namespace it blocks past the lease
        self.setup_environ()


class _MetricsServer6(_MetricsServer):
    address_family = socket.AF_INET6


def serve(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> Endpoint:
    """Serve ``registry`` on ``host:port`` (0: a free port) in a background thread
    (prometheus_client's WSGI app; the server binds without a DNS lookup)."""
    server_class = _MetricsServer6 if ":" in host else _MetricsServer
    server = make_server(host, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    thread = Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    shown = f"[{host}]" if ":" in host else host
    return Endpoint(f"{shown}:{server.server_port}", server, thread)


class _NpdProblemCounter(Collector):
    """node-problem-detector's ``problem_counter{reason}``, named exactly as NPD names it (no ``_total``),
    so dashboards built for NPD read it unchanged."""

    def __init__(self) -> None:
        self.counts: dict[str, float] = {}

    def collect(self) -> Iterable[Metric]:
        metric = Metric("problem_counter", "Number of times a specific type of problem has occurred (node-problem-detector)", "counter")
        for reason, value in sorted(self.counts.items()):
            metric.add_sample("problem_counter", {"reason": reason}, value)
        yield metric


class AgentMetrics:
    """What one node agent exposes on its ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.health_check_runs = Counter("unbroken_health_check_runs", "Health checks run on this node, by check and result",
                                         ["check", "result"], registry=r)
        self.health_check_duration = Histogram("unbroken_health_check_duration_seconds", "How long each health check ran",
                                               ["check"], buckets=SECONDS_BUCKETS, registry=r)
        self.collective_busbw = Gauge("unbroken_collective_busbw_bytes_per_second",
                                      "Bus bandwidth of the last collective sweep this node took part in (nccl-tests busbw)",
                                      ["op", "size"], registry=r)
        self._problems = _NpdProblemCounter()
        r.register(self._problems)
        self.problem_gauge = Gauge("problem_gauge", "Whether a permanent problem is affecting the node (node-problem-detector)",
                                   ["type", "reason"], registry=r)
        self.save_stall = Histogram("unbroken_checkpoint_save_stall_seconds", "How long a save blocked a rank's training loop",
                                    ["tier"], buckets=SECONDS_BUCKETS, registry=r)
        self.durable = Histogram("unbroken_checkpoint_durable_seconds",
                                 "From a shard's save to its step being committed in the tier (memory, replica, persistent)",
                                 ["tier"], buckets=SECONDS_BUCKETS, registry=r)
        self.restore = Histogram("unbroken_checkpoint_restore_seconds", "How long a rank's restore took, by where its shard came from",
                                 ["source"], buckets=SECONDS_BUCKETS, registry=r)
        self.checkpoint_bytes = Counter("unbroken_checkpoint_bytes", "Shard bytes this node wrote into each tier", ["tier"], registry=r)
        self.tier_failures = Counter("unbroken_checkpoint_tier_failures", "Failed writes to a checkpoint tier, by error",
                                     ["tier", "reason"], registry=r)
        self.last_xid: dict[str, int] = {}
        """The last Xid seen in the kernel log per GPU (its PCI bus id as the driver writes it)."""

    def check_ran(self, check: str, result: str, seconds: float) -> None:
        self.health_check_runs.labels(check, result).inc()
        self.health_check_duration.labels(check).observe(seconds)

    def problem(self, reason: str, *, condition: str | None = None) -> None:
        """An NPD rule matched: a temporary problem counts; a permanent one also sets its condition."""
        self._problems.counts[reason] = self._problems.counts.get(reason, 0.0) + 1
        if condition:
            self.problem_gauge.labels(condition, reason).set(1)

    def register(self, collector: Any) -> None:
        self.registry.register(collector)
