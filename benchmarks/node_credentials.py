"""What each node's own credentials cost: N agents certified by the operator, beside the Secret read they replace.

On a real control plane (etcd, kube-apiserver, controller-manager and scheduler from tests/controlplane; no kubelet):
N Nodes, the agents' ServiceAccount, and for each node a token bound to it (what its DaemonSet pod holds). Side by
side in one run:

* **unbroken (per-node credentials)**: each simulated agent asks the operator's issuer
  (kubernetes/operator/credential_issuer.py, in this process, HTTPS on loopback) as a real agent does
  (kubernetes/backend/node_credentials.request: a new key and CSR, TLS checked by the cluster CA); the issuer reviews
  each token with the API server (a TokenReview) and signs. ``CONCURRENCY`` agents at a time: a cluster's agents all
  starting at once.
* **baseline (shared Secrets)**: the design before it: each agent GETs the two Secrets (the heartbeat key and the
  cluster's TLS credentials) with its own token.

Printed: agents per second, the p50/p99 of one agent's wait, and the issuer's own CPU per certification (the
signature and the TLS handshake, timed on the issuer's threads), extrapolated to 1,000 and 10,000 agents starting
at once. What it does not include: the network between nodes and the operator (loopback here).

    .venv/bin/python benchmarks/node_credentials.py [--agents 200] [--json]
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from controlplane.cluster import ControlPlane  # noqa: E402

from unbroken.checkpoint.node.credentials import Authority  # noqa: E402
from unbroken.kubernetes.backend import names, node_credentials  # noqa: E402
from unbroken.kubernetes.backend.client import api_client  # noqa: E402
from unbroken.kubernetes.operator.credential_issuer import CredentialIssuer  # noqa: E402

NAMESPACE = "unbroken-system"
CONCURRENCY = 16


def say(text: str) -> None:
    print(f"# {text}", file=sys.stderr, flush=True)


class TimedIssuer(CredentialIssuer):
    """The issuer, its own thread CPU per certification recorded (the TokenReview's wait is not CPU)."""

    cpu: list[float]

    def issue(self, token: str, body: dict[str, Any]) -> dict[str, str]:
        started = time.thread_time()
        try:
            return super().issue(token, body)
        finally:
            self.cpu.append(time.thread_time() - started)


def setup(plane: ControlPlane, count: int) -> tuple[kubernetes.client.CoreV1Api, list[str], list[str]]:
    core = kubernetes.client.CoreV1Api(api_client(plane.kubeconfig))
    plane.create_namespace(NAMESPACE)
    core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": names.AGENT_ACCOUNT}})
    nodes = [f"node-{i:05d}" for i in range(count)]
    tokens = []
    for node in nodes:
        uid = core.create_node({"metadata": {"name": node}}).metadata.uid
        spec = {"expirationSeconds": 3600, "boundObjectRef": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}}
        tokens.append(core.create_namespaced_service_account_token(names.AGENT_ACCOUNT, NAMESPACE, {"spec": spec}).status.token)
    return core, nodes, tokens


def timed_all(work: list[Any], one: Any) -> tuple[float, list[float]]:
    """``one(item)`` for every item, ``CONCURRENCY`` at a time: the wall time and each call's seconds."""
    def timed(item: Any) -> float:
        started = time.perf_counter()
        one(item)
        return time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        each = list(pool.map(timed, work))
    return time.perf_counter() - started, each


def summary(system: str, count: int, wall: float, each: list[float], cpu: list[float] | None) -> dict[str, Any]:
    ordered = sorted(each)
    rate = count / wall
    row: dict[str, Any] = {"system": system, "agents": count, "per_second": round(rate, 1),
                           "p50_ms": round(1000 * statistics.median(ordered), 1),
                           "p99_ms": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 1),
                           "at_1000_s": round(1000 / rate, 1), "at_10000_s": round(10_000 / rate, 1)}
    if cpu:
        row["issuer_cpu_ms"] = round(1000 * statistics.median(cpu), 2)
        row["issuer_cpu_at_10000_s"] = round(10_000 * statistics.median(cpu), 1)
    return row


def run(count: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="unbroken-creds-") as scratch, \
            ControlPlane(Path(scratch) / "plane", kubeflow=False, crds=False) as plane:
        say(f"{count} Nodes and node-bound agent tokens")
        core, nodes, tokens = setup(plane, count)
        authority = Authority.new("bench")
        admin = api_client(plane.kubeconfig)
        for name, data in ((names.CLUSTER_TLS_SECRET, {"cluster-ca.crt": base64.b64encode(authority.cert_pem).decode()}),
                           ("unbroken-heartbeat-key", {"key": base64.b64encode(b"k" * 32).decode()})):
            core.create_namespaced_secret(NAMESPACE, {"metadata": {"name": name}, "data": data})
        # the baseline's Role: the two Secrets by name (what deploy/ granted the agents before)
        kubernetes.client.RbacAuthorizationV1Api(admin).create_namespaced_role(NAMESPACE, {
            "metadata": {"name": "baseline-agent"},
            "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"],
                       "resourceNames": [names.CLUSTER_TLS_SECRET, "unbroken-heartbeat-key"]}]})
        kubernetes.client.RbacAuthorizationV1Api(admin).create_namespaced_role_binding(NAMESPACE, {
            "metadata": {"name": "baseline-agent"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                                 "name": "baseline-agent"},
            "subjects": [{"kind": "ServiceAccount", "name": names.AGENT_ACCOUNT, "namespace": NAMESPACE}]})

        issuer = TimedIssuer(admin, NAMESPACE, authority, b"m" * 32)
        issuer.cpu = []
        server = issuer.serve("127.0.0.1", 0)
        work = list(zip(nodes, tokens, strict=True))
        agents = {token: agent_core(plane, token) for token in tokens}
        try:
            rows = []
            say("unbroken: every agent certified by the operator")
            wall, each = timed_all(work, lambda item: node_credentials.request(
                ("127.0.0.1", server.port), authority.cert_pem, item[1], item[0], Path(scratch) / "agents" / item[0]))
            rows.append(summary("unbroken (per-node credentials)", count, wall, each, issuer.cpu))
            say("baseline: every agent reads the two shared Secrets")
            wall, each = timed_all(work, lambda item: [agents[item[1]].read_namespaced_secret(name, NAMESPACE)
                                                       for name in (names.CLUSTER_TLS_SECRET, "unbroken-heartbeat-key")])
            rows.append(summary("baseline (shared Secrets)", count, wall, each, None))
            return rows
        finally:
            server.close()


def agent_core(plane: ControlPlane, token: str) -> kubernetes.client.CoreV1Api:
    configuration = kubernetes.client.Configuration()
    configuration.host = plane.server
    configuration.ssl_ca_cert = str(plane.ca.cert)
    configuration.api_key = {"authorization": f"Bearer {token}"}
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(configuration))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--agents", type=int, default=200, help="simulated agents (default 200)")
    parser.add_argument("--json", action="store_true", help='print {"results": [...]} instead of a table')
    args = parser.parse_args(argv)
    rows = run(args.agents)
    if args.json:
        print(json.dumps({"results": rows}, indent=2))
        return 0
    ours, baseline = rows
    print("| system | agents | agents/s | p50 ms | p99 ms | 1,000 at once | 10,000 at once | issuer CPU per agent |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        cpu = f"{row['issuer_cpu_ms']} ms ({row['issuer_cpu_at_10000_s']} s for 10,000)" if "issuer_cpu_ms" in row else "-"
        print(f"| {row['system']} | {row['agents']} | {row['per_second']} | {row['p50_ms']} | {row['p99_ms']} | "
              f"{row['at_1000_s']} s | {row['at_10000_s']} s | {cpu} |")
    print(f"\nratio (per-node credentials / shared Secrets), time for all agents: "
          f"{baseline['per_second'] / ours['per_second']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
