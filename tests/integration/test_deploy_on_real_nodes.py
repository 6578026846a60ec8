"""deploy/ applied unchanged to real nodes (issue 36): ``kubectl apply -k`` of an overlay that only names the image
built here, and the operator's Deployment and the agents' DaemonSet run from it, in containers, with their
ServiceAccounts, security contexts, hostPath mounts and probes, as on a cluster.

The nodes are real (tests/controlplane/node.py: kubelet, containerd, runc, CNI, CoreDNS, kube-proxy); the
image is unbroken's (tests/controlplane/image.py ``unbroken_image``: the Dockerfile's layout on Debian, this
checkout's unbroken, without torch, which neither the operator nor the agent imports). The API server listens
where pods reach it (``ApiAddress``): the operator and the agents use their in-cluster configuration, through the
``kubernetes`` Service and kube-proxy, as they would on EKS. The host folders the DaemonSet mounts are each node's
own. What stays simulated: no GPU is behind the nodes' ``nvidia.com/gpu`` (docs/kubernetes.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane import image
from controlplane.cluster import ControlPlane
from controlplane.node import ApiAddress, ClusterDNS, RealNode, ServiceProxy
from unbroken.kubernetes.backend import names
from unbroken.plumbing.waiting import WaitTimeout, wait_until

pytestmark = pytest.mark.slow

REPOSITORY = Path(__file__).resolve().parents[2]
SYSTEM = "unbroken-system"
NODES = ("node-a", "node-b")


class Deployed:
    def __init__(self, plane: ControlPlane, nodes: dict[str, RealNode], unbroken: image.Image, overlay: Path) -> None:
        self.plane, self.nodes, self.image, self.overlay = plane, nodes, unbroken, overlay

    def get(self, *args: str) -> Any:
        return json.loads(self.plane.kubectl("get", *args, "-o", "json").stdout)

    def pods(self, component: str) -> list[dict[str, Any]]:
        selector = f"app.kubernetes.io/name=unbroken,app.kubernetes.io/component={component}"
        return self.get("pods", "-n", SYSTEM, "-l", selector)["items"]

    def ready_pods(self, component: str) -> list[dict[str, Any]]:
        return [p for p in self.pods(component) if p["metadata"].get("deletionTimestamp") is None
                and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]

    def node_health(self) -> dict[str, str | None]:
        return {n: self.get("node", n)["metadata"]["labels"].get(names.NODE_HEALTH_STATUS) for n in NODES}

    def logs(self, pod: str) -> str:
        return self.plane.kubectl("logs", "-n", SYSTEM, pod).stdout

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """``wait_until``, failing with what the cluster shows: unbroken's pods, their events and their logs."""
        try:
            return wait_until(predicate, timeout, what)
        except WaitTimeout as exc:
            pytest.fail(f"{exc}\n{self.diagnosis()}")

    def diagnosis(self) -> str:
        kubectl = self.plane.kubectl
        parts = [kubectl("get", "pods,daemonsets,deployments", "-n", SYSTEM, "-o", "wide", check=False).stdout,
                 kubectl("get", "events", "-n", SYSTEM, "--sort-by=.lastTimestamp", check=False).stdout[-4000:]]
        for pod in self.pods("operator") + self.pods("agent"):
            name = pod["metadata"]["name"]
            for previous in ((), ("--previous",)):
                parts.append(f"--- logs {name} {' '.join(previous)}\n"
                             + kubectl("logs", "-n", SYSTEM, name, *previous, check=False).stdout[-3000:])
        return "\n".join(parts)


def overlay(folder: Path, unbroken: image.Image) -> Path:
    """The overlay a platform engineer writes: deploy/ as it is, the image named."""
    folder.mkdir(parents=True)
    name, tag = unbroken.ref.rsplit(":", 1)
    (folder / "kustomization.yaml").write_text(json.dumps({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [str(Path("..") / Path(*[".."] * (len(folder.parts) - 1)) / REPOSITORY.relative_to("/") / "deploy")],
        "images": [{"name": "ghcr.io/unbroken-dev/unbroken", "newName": name, "newTag": tag}]}, indent=1))
    return folder


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    work = tmp_path_factory.mktemp("deploy")
    unbroken = image.unbroken_image()
    with ApiAddress(), ControlPlane(work / "plane", address=ApiAddress.ADDRESS) as plane, ClusterDNS(plane, work) as dns, \
            ServiceProxy(plane, work, NODES[0]), \
            RealNode(plane, NODES[0], 1, work / "nodes", images=(unbroken,), dns=dns) as a, \
            RealNode(plane, NODES[1], 2, work / "nodes", images=(unbroken,), gpus=2, dns=dns) as b:
        folder = overlay(work / "overlay", unbroken)
        plane.kubectl("apply", "-k", str(folder))
        yield Deployed(plane, {NODES[0]: a, NODES[1]: b}, unbroken, folder)


def test_deploy_runs_unchanged_from_the_image_and_its_agents_join_the_operator(deployed: Deployed) -> None:
    operator = deployed.wait(lambda: deployed.ready_pods("operator"), 120, "the operator's pod Ready")[0]
    agents = deployed.wait(lambda: (ready := deployed.ready_pods("agent")) and len(ready) == len(NODES) and ready, 120,
                           "an agent pod Ready on every node")
    assert {a["spec"]["nodeName"] for a in agents} == set(NODES)
    for pod in (operator, *agents):
        [container] = pod["status"]["containerStatuses"]
        assert container["image"].endswith(deployed.image.ref.split("/", 1)[1]), container["image"]
    name = operator["metadata"]["name"]
    # the operator as the manifest's user, on a read-only root filesystem
    assert deployed.plane.kubectl("exec", "-n", SYSTEM, name, "--", "id", "-u").stdout.strip() == "65532"
    touched = deployed.plane.kubectl("exec", "-n", SYSTEM, name, "--", "touch", "/opt/unbroken/x", check=False)
    assert touched.returncode != 0 and "Read-only file system" in touched.stderr, touched
    # each agent reached the API server in-cluster (its node's Lease, through the kubernetes Service and kube-proxy),
    # got its node's certificate from the operator over HTTPS and beats to the operator's pod IP over UDP
    leases = {lease["metadata"]["name"] for lease in deployed.get("leases", "-n", SYSTEM)["items"]}
    assert {f"{names.LEASE_PREFIX}{n}" for n in NODES} <= leases, leases
    deployed.wait(lambda: all(f'"node certified", "component": "operator", "node": "{n}"' in deployed.logs(name)
                              and f'"hearing a node", "component": "operator", "node": "{n}"' in deployed.logs(name) for n in NODES),
                  60, "the operator to certify and hear every node's agent")
    # each agent's host folders are its node's own: one memory tier and one socket per node
    for node in deployed.nodes.values():
        assert (node.host_path("/run/unbroken") / "agent.sock").is_socket(), node.name
        assert any(p.name == node.name for p in node.host_path("/dev/shm/unbroken").glob("*/*")), node.name


def test_a_rolling_update_of_the_agents_loses_no_node(deployed: Deployed) -> None:
    before = deployed.wait(lambda: (ready := deployed.ready_pods("agent")) and len(ready) == len(NODES) and ready, 120,
                           "an agent pod Ready on every node")
    operator = deployed.wait(lambda: deployed.ready_pods("operator"), 120, "the operator's pod Ready")[0]["metadata"]["name"]
    old = {p["metadata"]["name"] for p in before}
    deployed.plane.kubectl("rollout", "restart", "daemonset/unbroken-agent", "-n", SYSTEM)
    deployed.wait(lambda: (ready := deployed.ready_pods("agent")) and len(ready) == len(NODES)
                  and not old & {p["metadata"]["name"] for p in ready} and len(deployed.pods("agent")) == len(NODES),
                  180, "every agent replaced by a Ready new one")
    # every stopping agent said it was leaving: the operator saw an update, not a lost node
    lost = deployed.get("events", "-A", "--field-selector", "reason=NodeLost")["items"]
    assert not lost, [e["message"] for e in lost]
    assert set(deployed.node_health().values()) <= {None, "Schedulable"}, deployed.node_health()
    log = deployed.logs(operator)
    assert log.count('"hearing a node"') >= 2 * len(NODES), "the operator hears each node's new agent"
