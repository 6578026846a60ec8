"""Kubernetes at scale: N simulated nodes against the real control plane, unbroken beside its baseline.

For each size N and each system, on a fresh control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler from tests/controlplane; the Kubeflow
CRDs; no kubelet):

* N Nodes are created Ready. They have no kubelet, so the controller-manager
  runs without its node lifecycle controller (it would mark them all NotReady).
* N simulated node agents speak what a real agent speaks, from this process:
  - ``unbroken``: a signed heartbeat datagram to the operator every second
    (kubernetes/backend/heartbeats.py), and a Lease renewal every 10 s followed by a read of
    the leader Lease (the heartbeat address), through the real KubernetesStore;
  - ``baseline``: the design before it (commit ``BASELINE_COMMIT``): a Lease
    renewal every second, nothing else. Its operator runs from that commit's
    sources (``git archive``), the same way.
* the real operator (``unbroken operator``) runs as its own process.

Phases, in order: a steady minute (API writes and bytes read from the API
server's own ``apiserver_request_total`` and ``apiserver_response_sizes``,
operator CPU and RSS, etcd's database size), every agent paused for 8 s (a
stalled host, a rolling update), kube-apiserver down for 30 s, then node losses
(an agent stopped: no more beats or renewals) one a second; a watch on the
Nodes times when each is labelled lost. A node labelled lost that was not
stopped is a false loss, counted in the phase it happened in.

What this does not simulate: kubelets (their own ~0.1 writes/node/s of Node
Leases and status), training pods, the checkpoint catalog. The simulated
agents share this process: where it cannot keep up with the renewals due,
``renewals_kept_up`` says so, and ``beat_round_max_s`` how far apart its beats
of one node came at worst; ``udp_rcvbuf_drops`` counts the datagrams the kernel
dropped because the operator did not read them in time.

    .venv/bin/python benchmarks/scale.py --nodes 1000              # one size, both systems
    .venv/bin/python benchmarks/scale.py --sizes 100,500,1000,2000 --baseline-sizes 100,500 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import psutil
import urllib3
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import baseline  # noqa: E402 - benchmarks/baseline.py, beside this script
from controlplane.cluster import ControlPlane  # noqa: E402

from unbroken.kubernetes.backend import heartbeats, names  # noqa: E402
from unbroken.kubernetes.backend.client import api_client  # noqa: E402
from unbroken.kubernetes.backend.heartbeats import HeartbeatSender  # noqa: E402
from unbroken.kubernetes.backend.store import KubernetesStore  # noqa: E402
from unbroken.errors import UnbrokenError  # noqa: E402
from unbroken.plumbing.waiting import wait_until  # noqa: E402

BASELINE_COMMIT = "fed85c2"
"""The last commit whose agents renewed their Lease every second and whose operator had no heartbeat datagrams."""
NAMESPACE = "unbroken-system"
WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE", "APPLY"}
LOST = "UnschedulablePendingReplacement"
STEADY_S = 60.0
PAUSE_S = 8.0
OUTAGE_S = 30.0
SETTLE_S = 25.0
"""After a pause or an outage: how long false losses are looked for."""
urllib3.disable_warnings()


@dataclass
class Row:
    system: str
    nodes: int
    detect_p50_s: float | None
    detect_p99_s: float | None
    losses: int
    missed: int
    false_losses: int
    pause_false_losses: int
    outage_false_losses: int
    writes_per_node_s: float
    read_bytes_s: float
    lists_per_s: float
    """LIST requests per second during the steady minute, from every client (the controller-manager's and the
    scheduler's informers list only at their start)."""
    operator_cpu_cores: float
    operator_rss_mb: float
    etcd_db_mb: float
    renewals_kept_up: float
    beat_round_max_s: float | None = None
    """The simulator's slowest round of datagrams to every node (a node's beats are this much further apart
    than 1 s): past a few seconds the simulator, not the operator, makes nodes silent."""
    udp_rcvbuf_drops: int | None = None
    """Datagrams the kernel dropped for a full receive buffer during the run (``/proc/net/snmp``, the machine's
    only UDP traffic being the heartbeats): beats the operator did not read in time."""
    notes: list[str] = field(default_factory=list)


# --- the simulated agents --------------------------------------------------------------------------


class SimulatedAgents:
    """N node agents in one process: beats from one thread, Lease renewals from a pool, each node on its own phase."""

    def __init__(self, api: kubernetes.client.ApiClient, nodes: list[str], system: str, pool: int = 24) -> None:
        self.system = system
        self.store = KubernetesStore(api, NAMESPACE)
        self.renew_every = 10.0 if system == "unbroken" else 1.0
        self.store.lease_renew_seconds = self.renew_every
        self.nodes = nodes
        self.alive = {n: True for n in nodes}
        self.paused = threading.Event()
        self.stopping = threading.Event()
        self.pool = ThreadPoolExecutor(pool)
        self.in_flight: set[str] = set()
        self.lock = threading.Lock()
        self.due = self.done = 0
        self.beat_rounds: list[float] = []
        self.senders: dict[str, HeartbeatSender] = {}
        if system == "unbroken":
            master = heartbeats.ensure_key(api, NAMESPACE)  # each simulated agent holds its node's key, as the operator gives it
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            self.senders = {n: HeartbeatSender(heartbeats.node_key(master, n), n, sock=self.sock) for n in nodes}
        step = self.renew_every / len(nodes)
        now = time.monotonic()
        self.next_renewal = {n: now + i * step for i, n in enumerate(nodes)}

    def start(self) -> None:
        for node in self.nodes:  # every Lease exists before the operator starts, as with real agents
            self.store.renew_lease(node, at=time.time())
        threading.Thread(target=self._renewals, daemon=True).start()
        if self.senders:
            threading.Thread(target=self._beats, daemon=True).start()

    def _beats(self) -> None:
        while not self.stopping.wait(1.0):
            if self.paused.is_set():
                continue
            started = time.monotonic()
            for node, sender in self.senders.items():
                if self.alive[node]:
                    sender.send(())
            self.beat_rounds.append(time.monotonic() - started)

    def _renewals(self) -> None:
        while not self.stopping.wait(0.05):
            now = time.monotonic()
            for node in self.nodes:
                if self.next_renewal[node] > now:
                    continue
                self.next_renewal[node] = max(self.next_renewal[node] + self.renew_every, now)
                if not self.alive[node] or self.paused.is_set():
                    continue
                with self.lock:
                    self.due += 1
                    if node in self.in_flight:
                        continue  # the previous renewal is still running: this one is not kept up
                    self.in_flight.add(node)
                self.pool.submit(self._renew, node)

    def _renew(self, node: str) -> None:
        try:
            if not self.alive[node]:
                return  # stopped while this renewal waited for a thread of the pool: a dead agent sends nothing
            self.store.renew_lease(node, at=time.time())
            if node in self.senders:
                address = heartbeats.parse_address(
                    self.store.lease_annotations(names.LEADER_LEASE).get(heartbeats.ADDRESS_ANNOTATION, ""))
                self.senders[node].address = address
            with self.lock:
                self.done += 1
        except UnbrokenError:
            pass  # the API server is down (the outage phase): a real agent logs it and tries at its next renewal
        finally:
            with self.lock:
                self.in_flight.discard(node)

    def stop(self) -> None:
        self.stopping.set()
        self.pool.shutdown(wait=False, cancel_futures=True)


# --- observing -------------------------------------------------------------------------------------


class LossWatch:
    """A watch on the Nodes: each time one is labelled lost (the operator's decision, as the API has it)."""

    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self.core = kubernetes.client.CoreV1Api(api)
        self.losses: list[tuple[str, float]] = []
        self.lost_now: set[str] = set()
        self.stopping = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                for event in kubernetes.watch.Watch().stream(self.core.list_node, timeout_seconds=30, _request_timeout=40):
                    labels = event["object"].metadata.labels or {}
                    name = event["object"].metadata.name
                    if labels.get(names.NODE_HEALTH_STATUS) == LOST:
                        if name not in self.lost_now:
                            self.lost_now.add(name)
                            self.losses.append((name, time.time()))
                    else:
                        self.lost_now.discard(name)
                    if self.stopping.is_set():
                        return
            except Exception:  # noqa: BLE001 - the API server is down (the outage): watch again
                self.stopping.wait(0.5)

    def lost_between(self, start: float, end: float) -> list[str]:
        return [n for n, at in self.losses if start <= at <= end]

    def first_loss_after(self, node: str, start: float) -> float | None:
        return next((at for n, at in self.losses if n == node and at >= start), None)


def reset_nodes(api: kubernetes.client.ApiClient, nodes: list[str]) -> None:
    """Nodes the operator took out brought back as new (what a repair would do), so the next phase starts with all."""
    core = kubernetes.client.CoreV1Api(api)
    for node in nodes:
        core.patch_node(node, {"metadata": {"labels": {names.NODE_HEALTH_STATUS: None, names.FAULT_TYPES: None,
                                                       names.FAULT_REASONS: None},
                                            "annotations": {names.NODE_STATE: None, names.FAULT_DETAILS: None,
                                                            names.CORDONED: None}},
                               "spec": {"taints": None, "unschedulable": None}})


def apiserver_totals(plane: ControlPlane) -> tuple[float, float, float]:
    """(write requests, response bytes, LIST requests) so far, from the API server's own /metrics."""
    return plane.requests_answered(WRITE_VERBS), plane.response_bytes(), plane.requests_answered({"LIST"})


def etcd_db_mb(plane: ControlPlane) -> float:
    http = urllib3.PoolManager()
    text = http.request("GET", f"http://127.0.0.1:{plane.etcd_port}/metrics").data.decode()
    for family in text_string_to_metric_families(text):
        if family.name == "etcd_mvcc_db_total_size_in_bytes":
            return family.samples[0].value / 2**20
    return float("nan")


def baseline_sources() -> Path:
    return baseline.sources(BASELINE_COMMIT)


def start_operator(system: str, plane: ControlPlane, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "unbroken.kubernetes.operator", "--kubeconfig", str(plane.kubeconfig), "--namespace", NAMESPACE,
               "--metrics-port", "0", "--metrics-host", "127.0.0.1", "--identity", f"{system}-operator"]
    env = dict(os.environ)
    if system == "unbroken":
        command += ["--heartbeat-host", "127.0.0.1", "--heartbeat-port", "0", "--heartbeat-address", "127.0.0.1"]
    else:
        env["PYTHONPATH"] = str(baseline_sources())
    return subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env)


def create_nodes(api: kubernetes.client.ApiClient, count: int) -> list[str]:
    core = kubernetes.client.CoreV1Api(api)
    nodes = [f"sim-{i:05d}" for i in range(count)]

    def create(name: str) -> None:
        core.create_node({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
                          "status": {"conditions": [{"type": "Ready", "status": "True"}],
                                     "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}]}})
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(create, nodes))
    return nodes


def install(plane: ControlPlane) -> None:
    plane.create_namespace(NAMESPACE)
    plane.apply([{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": names.CLUSTER_CONFIGMAP, "namespace": NAMESPACE},
                  "data": {"cluster.yaml": (ROOT / "deploy/base/config/cluster.yaml").read_text()}}])


def udp_rcvbuf_errors() -> int:
    """The machine's UDP datagrams dropped so far for a full receive buffer (``Udp: RcvbufErrors``)."""
    lines = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines() if line.startswith("Udp:")]
    header, values = lines[0], lines[1]
    return int(values[header.index("RcvbufErrors")])


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_one(system: str, count: int, losses: int, workdir: Path, say: Any) -> Row:
    notes: list[str] = []
    with ControlPlane(workdir / "plane", kubeflow=False, crds=True, controllers="*,-node-lifecycle-controller") as plane:
        api = api_client(plane.kubeconfig)
        install(plane)
        say(f"{system} N={count}: creating {count} Nodes")
        nodes = create_nodes(api, count)
        agents = SimulatedAgents(api, nodes, system)
        agents.start()
        operator = start_operator(system, plane, workdir / "operator.log")
        watch = LossWatch(api)
        try:
            wait_until(lambda: '"msg": "leading"' in (workdir / "operator.log").read_text(errors="replace"), 60, "the operator to lead")
            warm = time.monotonic()
            wait_until(lambda: time.monotonic() - warm > agents.renew_every + 5, 60, "a full round of renewals (agents learn the address)")
            say(f"{system} N={count}: steady {STEADY_S:.0f} s")
            proc = psutil.Process(operator.pid)
            writes0, bytes0, lists0 = apiserver_totals(plane)
            drops0 = udp_rcvbuf_errors()
            cpu0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
            due0, done0 = agents.due, agents.done
            rss = 0.0
            while time.monotonic() - t0 < STEADY_S:
                rss = max(rss, proc.memory_info().rss / 2**20)
                time.sleep(1)
            cpu1, t1 = sum(proc.cpu_times()[:2]), time.monotonic()
            writes1, bytes1, lists1 = apiserver_totals(plane)
            kept_up = (agents.done - done0) / max(1, agents.due - due0)
            seconds = t1 - t0
            db = etcd_db_mb(plane)

            say(f"{system} N={count}: every agent paused {PAUSE_S:.0f} s")
            pause_start = time.time()
            agents.paused.set()
            time.sleep(PAUSE_S)  # the fault's length
            agents.paused.clear()
            time.sleep(SETTLE_S)  # what happens after it is what is measured
            pause_false = watch.lost_between(pause_start, time.time())
            reset_nodes(api, pause_false)

            say(f"{system} N={count}: kube-apiserver down {OUTAGE_S:.0f} s")
            outage_start = time.time()
            plane.stop_apiserver()
            time.sleep(OUTAGE_S)
            plane.start_apiserver()
            time.sleep(SETTLE_S)
            outage_false = watch.lost_between(outage_start, time.time())
            reset_nodes(api, outage_false)
            time.sleep(5)  # the reset nodes are heard again before the losses start

            say(f"{system} N={count}: {losses} node losses")
            killed: dict[str, float] = {}
            losses_start = time.time()
            candidates = [n for n in nodes if n not in watch.lost_now]
            random.Random(count).shuffle(candidates)
            for victim in candidates[:losses]:
                killed[victim] = time.time()
                agents.alive[victim] = False
                time.sleep(1.0)
            wait_until(lambda: all(watch.first_loss_after(n, at) for n, at in killed.items())
                       or time.time() - max(killed.values()) > 30, 60, "the losses to be detected")
            found = {n: watch.first_loss_after(n, at) for n, at in killed.items()}
            detections = [seen - killed[n] for n, seen in found.items() if seen is not None]
            false = pause_false + outage_false + [n for n in watch.lost_between(losses_start, time.time()) if n not in killed]
            rss = max(rss, proc.memory_info().rss / 2**20)
            drops = udp_rcvbuf_errors() - drops0
            if operator.poll() is not None:
                notes.append(f"the operator exited {operator.returncode}")
        finally:
            watch.stopping.set()
            agents.stop()
            operator.send_signal(signal.SIGKILL)
            operator.wait()
    return Row(system=system, nodes=count, detect_p50_s=percentile(detections, 0.5), detect_p99_s=percentile(detections, 0.99),
               losses=len(killed), missed=len(killed) - len(detections), false_losses=len(false),
               pause_false_losses=len(pause_false), outage_false_losses=len(outage_false),
               writes_per_node_s=(writes1 - writes0) / seconds / count, read_bytes_s=(bytes1 - bytes0) / seconds,
               lists_per_s=(lists1 - lists0) / seconds,
               operator_cpu_cores=(cpu1 - cpu0) / seconds, operator_rss_mb=rss, etcd_db_mb=db,
               renewals_kept_up=kept_up, beat_round_max_s=max(agents.beat_rounds, default=None),
               udp_rcvbuf_drops=drops, notes=notes)


def table(rows: list[Row]) -> str:
    header = ("system", "nodes", "detect p50", "detect p99", "missed", "false", "pause false", "outage false",
              "writes/node/s", "read KB/s", "LIST/s", "op CPU", "op RSS MB", "etcd MB", "renewals kept up", "beat round max s",
              "UDP drops")
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for r in rows:
        def s(v: float | None, fmt: str = "{:.2f}") -> str:
            return "-" if v is None else fmt.format(v)
        lines.append(" | ".join([r.system, str(r.nodes), s(r.detect_p50_s), s(r.detect_p99_s), f"{r.missed}/{r.losses}",
                                 str(r.false_losses), str(r.pause_false_losses), str(r.outage_false_losses),
                                 s(r.writes_per_node_s, "{:.3f}"), s(r.read_bytes_s / 1024, "{:.0f}"),
                                 s(r.lists_per_s, "{:.1f}"), s(r.operator_cpu_cores), s(r.operator_rss_mb, "{:.0f}"), s(r.etcd_db_mb, "{:.1f}"),
                                 s(r.renewals_kept_up, "{:.0%}"), s(r.beat_round_max_s),
                                 "-" if r.udp_rcvbuf_drops is None else str(r.udp_rcvbuf_drops)]))
    by = {(r.system, r.nodes): r for r in rows}
    ratios = []
    for (system, n), r in sorted(by.items()):
        base = by.get(("baseline", n))
        if system == "unbroken" and base is not None and r.writes_per_node_s:
            ratios.append(f"N={n}: baseline writes {base.writes_per_node_s / r.writes_per_node_s:.1f}x unbroken's, "
                          f"reads {base.read_bytes_s / max(r.read_bytes_s, 1):.1f}x, operator CPU "
                          f"{base.operator_cpu_cores / max(r.operator_cpu_cores, 1e-3):.1f}x")
    return "\n".join(lines + [""] + ratios)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("--nodes", type=int, default=None, help="one size (both systems)")
    parser.add_argument("--sizes", default="100,500,1000,2000", help="sizes for unbroken (default: %(default)s)")
    parser.add_argument("--baseline-sizes", default=None, help="sizes for the baseline (default: --nodes, else 100,500; \"\": none)")
    parser.add_argument("--losses", type=int, default=50, help="node losses per size (default: %(default)s; at most N/2)")
    parser.add_argument("--json", action="store_true", help='print {"results": [...]} instead of a table')
    args = parser.parse_args(argv)
    sizes = [args.nodes] if args.nodes else [int(s) for s in args.sizes.split(",")]
    baseline = [args.nodes] if args.nodes and args.baseline_sizes is None else \
        [int(s) for s in (args.baseline_sizes if args.baseline_sizes is not None else "100,500").split(",") if s]
    runs = [("baseline", n) for n in baseline] + [("unbroken", n) for n in sizes]
    rows = []

    def say(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    for i, (system, count) in enumerate(runs, 1):
        say(f"run {i}/{len(runs)}: {system} at {count} nodes")
        with tempfile.TemporaryDirectory(prefix=f"scale-{system}-{count}-") as scratch:
            rows.append(run_one(system, count, min(args.losses, count // 2), Path(scratch), say))
        say(f"done: {json.dumps(asdict(rows[-1]))}")
    if args.json:
        print(json.dumps({"results": [asdict(r) for r in rows]}, indent=2))
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
