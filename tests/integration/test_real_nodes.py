"""Real nodes under the real control plane: containerd, runc and the kubelet (tests/controlplane/node.py).

Where the process kubelet (tests/controlplane/kubelet.py) stands in for a node elsewhere, these run pods as
containers of an image built here (tests/controlplane/image.py: Debian and Python from Debian's packages),
to test what only a container has: a per-pod network namespace and IP on a node's pod subnet, traffic
between pods of different nodes, a ``/dev/shm`` of the pod's own, the image's users, signals and grace
periods from the kubelet through containerd and runc, ``kubectl logs``/``exec`` through the kubelet's TLS
port, and a lost node noticed by Kubernetes itself.

Needs root (links, mounts, cgroups), runc and the CNI plugins (``make test`` installs them) and the node
binaries (``make control-plane``). Two nodes are shared by the module's tests (node-b with two fake GPUs,
offered through the kubelet's device-plugin API); the lost-node test has its own.
"""

from __future__ import annotations

import ipaddress
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane import image
from controlplane.cluster import NODE_GRACE_S, TOLERATION_S, ControlPlane
from controlplane.node import ClusterDNS, RealNode, ServiceProxy
from unbroken.plumbing.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("real-nodes")]
"""One pytest worker runs every real-node test: the nodes' links, subnets and /run/unbroken-nodes are the machine's."""


class Cluster:
    def __init__(self, plane: ControlPlane, nodes: dict[str, RealNode], base: image.Image) -> None:
        self.plane, self.nodes, self.base = plane, nodes, base

    def pod(self, name: str, node: str, command: list[str], labels: dict[str, str] | None = None,
            **spec: Any) -> dict[str, Any]:
        """A pod of the base image on ``node``, running ``command``, started and waited for (Running)."""
        container = {"name": "main", "image": self.base.ref, "imagePullPolicy": "Never", "command": command,
                     **spec.pop("container", {})}
        manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default", "labels": labels or {}},
                    "spec": {"nodeName": node, "containers": [container], **spec}}
        self.plane.apply([manifest])
        return wait_until(lambda: self._running(name), 60, f"pod {name} Running on {node}")

    def _running(self, name: str) -> dict[str, Any] | None:
        pod = json.loads(self.plane.kubectl("get", "pod", name, "-o", "json").stdout)
        return pod if pod["status"].get("phase") == "Running" and pod["status"].get("podIP") else None

    def exec(self, pod: str, *command: str) -> str:
        return self.plane.kubectl("exec", pod, "--", *command).stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("real-nodes")
    base = image.base_image()
    with ControlPlane(work / "plane", kubeflow=False) as plane, ClusterDNS(plane, work) as dns, \
            ServiceProxy(plane, work, "node-a"), \
            RealNode(plane, "node-a", 1, work / "nodes", images=(base,), dns=dns) as a, \
            RealNode(plane, "node-b", 2, work / "nodes", images=(base,), gpus=2, dns=dns) as b:
        yield Cluster(plane, {"node-a": a, "node-b": b}, base)


def test_a_pod_runs_in_a_container_as_the_images_user_with_its_own_ip_and_shared_memory(cluster: Cluster) -> None:
    pod = cluster.pod("alone", "node-a", ["python3", "-c", "import os, time; print('started as', os.getuid(), flush=True); "
                                                           "time.sleep(3600)"],
                      securityContext={"runAsUser": 65532, "runAsGroup": 65532})
    ip = ipaddress.ip_address(pod["status"]["podIP"])
    assert ip in ipaddress.ip_network(cluster.nodes["node-a"].pod_cidr) and str(ip) != cluster.nodes["node-a"].ip
    assert cluster.exec("alone", "id", "-un").strip() == "nonroot"  # the image's user, by the image's /etc/passwd
    assert "bookworm" in cluster.exec("alone", "cat", "/etc/os-release")
    # the pod's own network namespace: its interface holds the pod IP, not any of this machine's addresses
    assert str(ip) in cluster.exec("alone", "python3", "-c", "import socket; s = socket.socket(socket.AF_INET, "
                                   "socket.SOCK_DGRAM); s.connect(('10.99.1.2', 9)); print(s.getsockname()[0])")
    # /dev/shm: a tmpfs of the pod's (64 MiB, containerd's default), not this machine's
    mounts = cluster.exec("alone", "cat", "/proc/self/mounts")
    assert any(line.split()[1] == "/dev/shm" and line.split()[2] == "tmpfs" and "size=65536k" in line
               for line in mounts.splitlines()), mounts
    marker = f"unbroken-real-node-{time.monotonic_ns()}"
    cluster.exec("alone", "touch", f"/dev/shm/{marker}")
    assert marker in cluster.exec("alone", "ls", "/dev/shm") and not Path("/dev/shm", marker).exists()
    assert wait_until(lambda: cluster.plane.kubectl("logs", "alone").stdout, 30, "its first line") == "started as 65532\n"


def test_pods_on_two_nodes_reach_each_other_at_their_pod_ips(cluster: Cluster) -> None:
    server = cluster.pod("server", "node-b", ["python3", "-m", "http.server", "8080", "--directory", "/etc"])
    cluster.pod("client", "node-a", ["sleep", "3600"])
    server_ip = server["status"]["podIP"]
    assert ipaddress.ip_address(server_ip) in ipaddress.ip_network(cluster.nodes["node-b"].pod_cidr)
    fetch = f"import urllib.request; print(urllib.request.urlopen('http://{server_ip}:8080/hostname', timeout=10).read().decode())"
    # Running is not listening yet: poll until the server answers
    answer = wait_until(lambda: cluster.plane.kubectl("exec", "client", "--", "python3", "-c", fetch, check=False).stdout,
                        30, "the server answering")
    assert answer.strip() == "server"
    # the server saw the client's pod IP (no NAT between pods), in node-a's subnet
    client_ip = json.loads(cluster.plane.kubectl("get", "pod", "client", "-o", "json").stdout)["status"]["podIP"]
    wait_until(lambda: f"{client_ip} - -" in cluster.plane.kubectl("logs", "server").stdout, 30, "the request logged")


def test_fake_gpus_are_offered_through_the_device_plugin_api_and_allocated_to_containers(cluster: Cluster) -> None:
    """node-b's two ``nvidia.com/gpu`` come from its device plugin, not a patched Node status: the kubelet counts
    them, the scheduler places by them, the plugin's Allocate names the container's device."""
    assert cluster.nodes["node-b"].allocatable()["nvidia.com/gpu"] == "2"
    assert "nvidia.com/gpu" not in cluster.nodes["node-a"].allocatable()
    one_gpu = {"resources": {"limits": {"nvidia.com/gpu": "1"}}}
    cluster.pod("gpu-user", "node-b", ["sleep", "3600"], container=one_gpu)
    visible = cluster.exec("gpu-user", "printenv", "NVIDIA_VISIBLE_DEVICES").strip()
    assert visible in ("GPU-node-b-0", "GPU-node-b-1")
    # two more than the one left: the scheduler keeps it Pending, naming the resource
    greedy = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "greedy", "namespace": "default"},
              "spec": {"containers": [{"name": "main", "image": cluster.base.ref, "imagePullPolicy": "Never",
                                       "command": ["sleep", "3600"], "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}
    cluster.plane.apply([greedy])

    def unschedulable() -> str | None:
        pod = json.loads(cluster.plane.kubectl("get", "pod", "greedy", "-o", "json").stdout)
        condition = next((c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"), {})
        return condition.get("message") if condition.get("reason") == "Unschedulable" else None

    assert "Insufficient nvidia.com/gpu" in wait_until(unschedulable, 30, "greedy Unschedulable")
    cluster.plane.kubectl("delete", "pod", "gpu-user", "--grace-period=0", "--force")
    wait_until(lambda: json.loads(cluster.plane.kubectl("get", "pod", "greedy", "-o", "json").stdout)["status"]
               .get("phase") == "Running", 60, "greedy Running once both GPUs are free")
    assert sorted(cluster.exec("greedy", "printenv", "NVIDIA_VISIBLE_DEVICES").strip().split(",")) == \
        ["GPU-node-b-0", "GPU-node-b-1"]


def test_a_headless_services_names_resolve_in_a_pod_to_pod_ips(cluster: Cluster) -> None:
    """What a PyTorchJob's workers do to find their master: the headless Service's name, and the master pod's
    ``hostname.subdomain``, resolve through the cluster DNS (CoreDNS) to the master's pod IP, in a pod on another
    node."""
    cluster.plane.apply([{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "job-master", "namespace": "default"},
                          "spec": {"clusterIP": "None", "selector": {"role": "master"},
                                   "ports": [{"name": "c10d", "port": 23456}]}}])
    master = cluster.pod("master", "node-b", ["python3", "-m", "http.server", "23456"], labels={"role": "master"},
                         hostname="master-0", subdomain="job-master")
    cluster.pod("worker", "node-a", ["sleep", "3600"])
    ip = master["status"]["podIP"]

    def resolved(name: str) -> str:
        return cluster.plane.kubectl("exec", "worker", "--", "getent", "hosts", name, check=False).stdout

    for name in ("job-master", "job-master.default.svc.cluster.local", "master-0.job-master",
                 "master-0.job-master.default.svc.cluster.local"):
        assert ip in wait_until(lambda n=name: resolved(n), 30, f"{name} resolving in the worker")
    fetch = "import urllib.request; print(urllib.request.urlopen('http://master-0.job-master:23456/', timeout=10).status)"
    answer = wait_until(lambda: cluster.plane.kubectl("exec", "worker", "--", "python3", "-c", fetch, check=False).stdout,
                        30, "the master answering by name")  # Running is not listening yet
    assert answer.strip() == "200"


def test_a_cluster_ip_service_reaches_its_pod_on_another_node_through_kube_proxy(cluster: Cluster) -> None:
    """The operator's metrics and an agent's shard API are reached by Service: kube-proxy's rules take the
    ClusterIP (and the name, through the cluster DNS) to the pod on the other node."""
    cluster.pod("backend", "node-b", ["python3", "-m", "http.server", "8000", "--directory", "/etc"],
                labels={"app": "backend"})
    cluster.plane.apply([{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "backend", "namespace": "default"},
                          "spec": {"selector": {"app": "backend"}, "ports": [{"port": 80, "targetPort": 8000}]}}])
    cluster_ip = json.loads(cluster.plane.kubectl("get", "service", "backend", "-o", "json").stdout)["spec"]["clusterIP"]
    assert ipaddress.ip_address(cluster_ip) in ipaddress.ip_network("10.96.0.0/16")
    cluster.pod("caller", "node-a", ["sleep", "3600"])

    def fetched(host: str) -> str:
        script = f"import urllib.request; print(urllib.request.urlopen('http://{host}/hostname', timeout=5).read().decode())"
        return cluster.plane.kubectl("exec", "caller", "--", "python3", "-c", script, check=False).stdout.strip()

    assert wait_until(lambda: fetched(cluster_ip), 30, "the ClusterIP answering") == "backend"
    assert fetched("backend.default.svc.cluster.local") == "backend"


TRAP_SIGTERM = """
import signal, sys, time
def stop(signum, frame):
    print("got", signal.Signals(signum).name, flush=True)
    open("/out/signal", "w").write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("waiting", flush=True)
time.sleep(3600)
"""


def test_deleting_a_pod_sends_sigterm_into_its_container_and_waits_for_it(cluster: Cluster, tmp_path: Path) -> None:
    """The kubelet's graceful stop goes through containerd and runc to the container's PID 1 (python here): it
    gets SIGTERM, ends on its own well inside the grace period, and what it wrote to a hostPath volume is on the
    node's disk."""
    out = tmp_path / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)  # the container's user is not root
    cluster.pod("graceful", "node-a", ["python3", "-c", TRAP_SIGTERM],
                securityContext={"runAsUser": 65532},
                container={"volumeMounts": [{"name": "out", "mountPath": "/out"}]},
                volumes=[{"name": "out", "hostPath": {"path": str(out), "type": "Directory"}}])
    wait_until(lambda: "waiting" in cluster.plane.kubectl("logs", "graceful").stdout, 30, "the handler installed")
    started = time.monotonic()
    cluster.plane.kubectl("delete", "pod", "graceful", "--grace-period=60", "--wait=true", "--timeout=90s")
    assert (out / "signal").read_text() == "SIGTERM"
    assert time.monotonic() - started < 30, "the pod ended on its own, not at the end of its grace period"


def test_a_lost_node_goes_not_ready_and_its_pods_are_evicted(cluster: Cluster, tmp_path: Path) -> None:
    """A third node, failed at once (kubelet, containerd, shims and containers SIGKILLed, its link down): the node
    lifecycle controller marks it NotReady and evicts its pod; the other nodes stay Ready."""
    with RealNode(cluster.plane, "node-c", 3, tmp_path / "nodes", images=(cluster.base,)) as lost:
        cluster.pod("doomed", "node-c", ["sleep", "3600"])
        lost.fail()
        wait_until(lambda: not lost.ready(), NODE_GRACE_S + 30, "node-c NotReady")
        wait_until(lambda: cluster.plane.kubectl("get", "pod", "doomed", check=False).returncode != 0
                   or json.loads(cluster.plane.kubectl("get", "pod", "doomed", "-o", "json").stdout)["metadata"]
                   .get("deletionTimestamp"), TOLERATION_S + 60, "the pod on node-c evicted")
        assert all(node.ready() for node in cluster.nodes.values())
