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

import copy
import json
import re
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane import image
from helpers import run_cli
from controlplane.cluster import ControlPlane
from controlplane.node import ApiAddress, ClusterDNS, RealNode, ServiceProxy
from unbroken.health.xid_lines import xid_line
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.rank_env import with_rank_env
from unbroken.plumbing.waiting import WaitTimeout, wait_until
from unbroken.state.phases import NodeState

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("real-nodes")]
"""One pytest worker runs every real-node test: the nodes' links, subnets and /run/unbroken-nodes are the machine's."""

REPOSITORY = Path(__file__).resolve().parents[2]
SYSTEM = "unbroken-system"
NODES = ("node-a", "node-b")


class Deployed:
    def __init__(self, plane: ControlPlane, nodes: dict[str, RealNode], unbroken: image.Image, overlay: Path,
                 dns: ClusterDNS, images: tuple[image.Image, ...]) -> None:
        self.plane, self.nodes, self.image, self.overlay = plane, nodes, unbroken, overlay
        self.dns, self.images = dns, images
        """What a node a test starts of its own needs: the cluster DNS, and the images to import."""

    def get(self, *args: str) -> Any:
        return json.loads(self.plane.kubectl("get", *args, "-o", "json").stdout)

    def pods(self, component: str) -> list[dict[str, Any]]:
        selector = f"app.kubernetes.io/name=unbroken,app.kubernetes.io/component={component}"
        return self.get("pods", "-n", SYSTEM, "-l", selector)["items"]

    def ready_pods(self, component: str) -> list[dict[str, Any]]:
        return [p for p in self.pods(component) if p["metadata"].get("deletionTimestamp") is None
                and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]

    def pod_nodes(self, job: str) -> dict[str, str | None]:
        """The nodes of the job's pods in namespace default, by pod name (None: not placed)."""
        pods = self.get("pods", "-n", "default", "-l", f"training.kubeflow.org/job-name={job}")["items"]
        return {p["metadata"]["name"]: p["spec"].get("nodeName") for p in pods}

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
        parts = [kubectl("get", "nodes", "-L", names.NODE_HEALTH_STATUS, check=False).stdout,
                 kubectl("get", "pods,daemonsets,deployments", "-n", SYSTEM, "-o", "wide", check=False).stdout,
                 kubectl("get", "events", "-n", SYSTEM, "--sort-by=.lastTimestamp", check=False).stdout[-4000:],
                 kubectl("get", "pods", "-n", "default", "-o", "wide", check=False).stdout,  # a training job's
                 kubectl("get", "events", "-n", "default", "--sort-by=.lastTimestamp", check=False).stdout[-3000:]]
        for pod in self.get("pods", "-n", "default")["items"]:  # a training job's
            name = pod["metadata"]["name"]
            for previous in ((), ("--previous",)):  # a container the kubelet restarted in place: why it ended
                parts.append(f"--- logs {name} {' '.join(previous)}\n"
                             + kubectl("logs", "-n", "default", name, "--all-containers", *previous, check=False).stdout[-2500:])
        for pod in self.pods("operator") + self.pods("agent"):
            name = pod["metadata"]["name"]
            for previous in ((), ("--previous",)):
                parts.append(f"--- logs {name} {' '.join(previous)}\n"
                             + kubectl("logs", "-n", SYSTEM, name, *previous, check=False).stdout[-3000:])
        return "\n".join(parts)


def overlay(folder: Path, unbroken: image.Image, base: Path = REPOSITORY / "deploy") -> Path:
    """The overlay a platform engineer writes: ``base`` (deploy/ or one of its overlays) as it is, the image named."""
    folder.mkdir(parents=True)
    name, tag = unbroken.ref.rsplit(":", 1)
    (folder / "kustomization.yaml").write_text(json.dumps({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [str(Path("..") / Path(*[".."] * (len(folder.parts) - 1)) / base.relative_to("/"))],
        "images": [{"name": "ghcr.io/unbroken-dev/unbroken", "newName": name, "newTag": tag}]}, indent=1))
    return folder


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    work = tmp_path_factory.mktemp("deploy")
    unbroken, busybox = image.unbroken_image(), image.busybox_image()
    with ApiAddress(), ControlPlane(work / "plane", address=ApiAddress.ADDRESS, init_image=busybox.ref) as plane, \
            ClusterDNS(plane, work) as dns, ServiceProxy(plane, work, NODES[0]), \
            RealNode(plane, NODES[0], 1, work / "nodes", images=(unbroken, busybox), gpus=1, dns=dns) as a, \
            RealNode(plane, NODES[1], 2, work / "nodes", images=(unbroken, busybox), gpus=1, dns=dns) as b:
        folder = overlay(work / "overlay", unbroken)
        plane.kubectl("apply", "-k", str(folder))
        yield Deployed(plane, {NODES[0]: a, NODES[1]: b}, unbroken, folder, dns, (unbroken, busybox))


@pytest.fixture(autouse=True)
def no_training_job_left(deployed: Deployed) -> Iterator[None]:
    """A test that fails leaves its PyTorchJob behind, holding the nodes' GPUs: the tests after it would fail on
    that too. Each test's jobs go when it ends, and their pods with them."""
    yield
    deployed.plane.kubectl("delete", "pytorchjobs", "--all", "-n", "default", "--wait=false", check=False)
    deployed.wait(lambda: not deployed.get("pods", "-n", "default")["items"], 120, "the training pods of the test gone")


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
    def certified_and_heard() -> bool:
        log = deployed.logs(name)  # once a poll
        return all(f'"node certified", "component": "operator", "node": "{n}"' in log
                   and f'"hearing a node", "component": "operator", "node": "{n}"' in log for n in NODES)
    deployed.wait(certified_and_heard, 60, "the operator to certify and hear every node's agent")
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


HOST_SITE = sysconfig.get_paths()["purelib"]
"""torch for the training pods: this machine's venv, read-only through a hostPath (the image has no torch: see
image.py). The image's Python is the same minor version (3.11), so its compiled modules load."""
KILL_THE_RANK = """
import os, signal
for pid in (p for p in os.listdir('/proc') if p.isdigit() and p != '1'):
    try:
        command, parent = open(f'/proc/{pid}/cmdline').read(), open(f'/proc/{pid}/stat').read().split()[3]
    except OSError:
        continue
    if 'unbroken.workloads.mlp' in command and 'torch.distributed.run' not in command and parent == '1':
        os.kill(int(pid), signal.SIGKILL)
        print('killed', pid)
"""


def training_job(name: str, ref: str, steps: int, *, spare_pods: int = 0) -> dict[str, Any]:
    """A PyTorchJob as a user writes it (Master + Worker, one pod a node, torchrun the container's command, OnFailure),
    opted in to unbroken's auto-resume and the memory tier (the rank env of kubernetes/backend/rank_env.py). With
    ``spare_pods``, ``unbroken run --spare-pods`` is the command in torchrun's place, and that many more Workers
    stand by."""
    tiers = json.dumps({"memory": {"every_steps": 10, "keep": 2, "replicas": 1}})
    launcher = (["unbroken", "run", "--spare-pods", str(spare_pods)] if spare_pods
                else ["python", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"])
    container = {"name": "pytorch", "image": ref, "imagePullPolicy": "IfNotPresent",
                 "command": [*launcher, "-m", "unbroken.workloads.mlp", "--steps", str(steps), "--checkpoint-every", "10",
                             "--step-time", "0.05"],
                 "env": [{"name": "PYTHONPATH", "value": "/opt/host-site"}],
                 "volumeMounts": [{"name": "host-site", "mountPath": "/opt/host-site", "readOnly": True}],
                 "resources": {"limits": {"nvidia.com/gpu": 1}}}
    template = {"spec": {"containers": [container],
                         "volumes": [{"name": "host-site", "hostPath": {"path": HOST_SITE, "type": "Directory"}}]}}
    template = with_rank_env(template, "training.kubeflow.org/job-name", tiers_json=tiers)
    replica = {"replicas": 1, "restartPolicy": "OnFailure", "template": template}
    # a hang timeout of its own: the automatic one (3 s here, from 0.12 s steps) took a 3.6 s stall of the Master
    # for a hang while two more nodes started beside it on 2 cores, a restart these tests are not about
    annotations = {names.AUTO_RESUME: "true", names.MAX_RETRY: "2", names.CHECKPOINT_TIERS: tiers, names.HANG_TIMEOUT: "30"}
    if spare_pods:
        annotations[names.SPARE_PODS] = str(spare_pods)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "namespace": "default", "annotations": annotations},
            "spec": {"nprocPerNode": "1", "pytorchReplicaSpecs": {"Master": copy.deepcopy(replica),
                                                                  "Worker": {**replica, "replicas": 1 + spare_pods}}}}


def test_a_pytorchjob_survives_a_killed_rank_restoring_from_the_memory_tier_through_the_containerised_agent(
        deployed: Deployed) -> None:
    deployed.wait(lambda: len(deployed.ready_pods("agent")) == len(NODES), 120, "an agent pod Ready on every node")
    deployed.plane.apply([training_job("mlp", deployed.image.ref, steps=600)])

    def log(pod: str) -> str:
        return deployed.plane.kubectl("logs", pod, "-c", "pytorch", check=False).stdout

    def pods() -> dict[str, str]:
        return {p["metadata"]["name"]: p["spec"].get("nodeName") for p in deployed.get("pods", "-n", "default")["items"]}

    deployed.wait(lambda: '"step 100 ' in log("mlp-master-0"), 180, "the job past step 100 (saves every 10 steps)")
    assert sorted(pods().values()) == sorted(NODES), "one pod a node: each GPU is one node's"
    killed = deployed.plane.kubectl("exec", "mlp-worker-0", "-c", "pytorch", "--", "python", "-c", KILL_THE_RANK).stdout
    assert killed.startswith("killed"), killed

    def events(reason: str) -> list[str]:
        return [e["message"] for e in deployed.get("events", "-n", "default", "--field-selector", f"reason={reason}")["items"]]
    deployed.wait(lambda: events("JobResumed"), 180, "unbroken's operator to restart the job and see it resume")
    # from the memory tier, which the agent (another container) serves: the node's own shard, or a peer's replica
    restored = [line for line in log("mlp-master-0").splitlines() if "restored step" in line]
    assert restored and any(f"from {source}" in restored[-1] for source in ("memory", "replica", "peer")), \
        log("mlp-master-0")[-3000:]
    assert any("mlp-worker-0" in m for m in events("JobRestarting")), events("JobRestarting")
    # unbroken job logs: each pod's container output, from the real kubelets (containerd's log files) through the API
    logs = run_cli("--kubeconfig", str(deployed.plane.admin_kubeconfig), "job", "logs", "default/mlp").stdout.splitlines()
    assert any(line.startswith("[mlp-master-0] ") and "restored step" in line for line in logs), logs[-40:]
    assert any(line.startswith("[mlp-worker-0] ") for line in logs), logs[-40:]
    deployed.wait(lambda: any(c["type"] == "Succeeded" and c["status"] == "True"
                              for c in deployed.get("pytorchjob", "mlp").get("status", {}).get("conditions", [])),
                  240, "the PyTorchJob Succeeded")
    # one fault, one restart: attempt 0's Worker, its container restarted in place by the kubelet as the restart
    # deleted it, once joined attempt 1 and broke it when its grace period ended (backend.py, _worker_phase)
    restarts = events("JobRestarting")
    assert len(restarts) == 1, f"{restarts}\n{deployed.diagnosis()}"


POOL = "unbroken.test/pool"
"""A label of the two nodes a test starts of its own, which its Workers select."""


@pytest.mark.timeout(480)  # two nodes of its own to start (~25 s each) and a job of three pods
def test_unbroken_run_in_the_pods_replaces_a_lost_nodes_pod_with_its_spare_pod_without_a_restart(
        deployed: Deployed, tmp_path: Path) -> None:
    """``unbroken run --spare-pods 1`` as the containers' command (their PID 1), on real nodes: the Master on node-a, the
    two Workers (the active one and the spare) on two nodes started for this test. The active Worker's node fails at
    once (kubelet, containerd and its containers SIGKILLed, its link down): the spare pod, warm, takes the lost pod's
    group rank from the Master's memory across the pod network; the operator restarts nothing, the two other pods keep
    their uids, and the job Succeeds. (Two nodes of its own: the scheduler places the two Workers in either order.)"""
    deployed.wait(lambda: len(deployed.ready_pods("agent")) == len(NODES), 120, "an agent pod Ready on every node")
    try:
        the_spare_pod_scenario_on_two_nodes_of_its_own(deployed, tmp_path)
    finally:
        # the two nodes are gone for good: their Nodes go too, and with them their pods (the agents', and a failed
        # test's training pods, which would otherwise wait on a dead kubelet), as a cloud's would
        deployed.plane.kubectl("delete", "node", "node-c", "node-d", "--ignore-not-found", "--wait=false")
    deployed.wait(lambda: len(deployed.pods("agent")) == len(NODES), 120, "the agent pods of node-c and node-d gone with their Nodes")


def the_spare_pod_scenario_on_two_nodes_of_its_own(deployed: Deployed, tmp_path: Path) -> None:
    with RealNode(deployed.plane, "node-c", 3, tmp_path / "nodes", images=deployed.images, gpus=1, dns=deployed.dns) as c, \
            RealNode(deployed.plane, "node-d", 4, tmp_path / "nodes", images=deployed.images, gpus=1, dns=deployed.dns) as d:
        pool = {c.name: c, d.name: d}
        for name in pool:
            deployed.plane.kubectl("label", "node", name, f"{POOL}=spare-test")
        deployed.wait(lambda: len(deployed.ready_pods("agent")) == len(NODES) + 2, 120, "an agent pod Ready on node-c and node-d")
        body = training_job("spare", deployed.image.ref, steps=600, spare_pods=1)  # ~10 steps/s; the spare takes over by ~140
        specs = body["spec"]["pytorchReplicaSpecs"]
        specs["Master"]["template"]["spec"]["nodeSelector"] = {"kubernetes.io/hostname": NODES[0]}
        specs["Worker"]["template"]["spec"]["nodeSelector"] = {POOL: "spare-test"}
        deployed.plane.apply([body])

        def log(pod: str) -> str:
            return deployed.plane.kubectl("logs", pod, "-c", "pytorch", check=False).stdout
        deployed.wait(lambda: "spare pod (node rank 2) is warm and stands by" in log("spare-master-0")
                      and '"step 100 ' in log("spare-master-0"), 150, "training past step 100 with the spare pod warm")
        placed = deployed.pod_nodes("spare")
        assert placed["spare-master-0"] == NODES[0] and {placed["spare-worker-0"], placed["spare-worker-1"]} == set(pool), placed
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in deployed.get("pods", "-n", "default")["items"]}
        pool[placed["spare-worker-0"]].fail()

        deployed.wait(lambda: re.search(r"round \d+: this spare pod takes group rank 1 of 2", log("spare-worker-1")), 60,
                      "the spare pod in the lost pod's place")
        deployed.wait(lambda: any(c["type"] == "Succeeded" and c["status"] == "True"
                                  for c in deployed.get("pytorchjob", "spare").get("status", {}).get("conditions", [])),
                      240, "the PyTorchJob Succeeded")
        restarts = deployed.get("events", "-n", "default", "--field-selector", "reason=JobRestarting")["items"]
        assert not [e for e in restarts if e["involvedObject"]["name"] == "spare"], restarts
        kept = {p["metadata"]["name"]: p["metadata"]["uid"] for p in deployed.get("pods", "-n", "default")["items"]}
        assert all(kept.get(name) == uids[name] for name in ("spare-master-0", "spare-worker-1")), (uids, kept)
        assert re.search(r"rank 1: resumed at step \d+ from live peer", log("spare-worker-1")), log("spare-worker-1")[-3000:]
        deployed.plane.kubectl("delete", "pytorchjob", "spare")


def test_the_gpu_overlay_s_agent_reads_its_node_s_kernel_log_and_an_xid_takes_that_node_out(deployed: Deployed) -> None:
    """deploy/overlays/gpu as a GPU cluster applies it: the agents, privileged now, read their node's /dev/kmsg
    through the overlay's hostPath. Each node's is its own (``KernelLog``); an Xid 79 in node-b's takes node-b out
    and leaves node-a as it was. Last in the module: it leaves node-b out."""
    deployed.wait(lambda: len(deployed.ready_pods("agent")) == len(NODES), 120, "the base's agent pod Ready on every node")
    gpu = overlay(deployed.overlay.parent / "overlay-gpu", deployed.image, REPOSITORY / "deploy" / "overlays" / "gpu")
    deployed.plane.kubectl("apply", "-k", str(gpu))

    def privileged_agents_reading_kmsg() -> list[dict[str, Any]]:
        ready = deployed.ready_pods("agent")
        reading = [p for p in ready if p["spec"]["containers"][0].get("securityContext", {}).get("privileged")
                   and '"kernel_log": "/dev/kmsg"' in deployed.logs(p["metadata"]["name"])]
        return reading if len(reading) == len(NODES) and len(deployed.pods("agent")) == len(NODES) else []
    agents = deployed.wait(privileged_agents_reading_kmsg, 180, "the gpu overlay's agents Ready on every node, reading /dev/kmsg")
    assert {a["spec"]["nodeName"] for a in agents} == set(NODES)
    assert set(deployed.node_health().values()) <= {None, "Schedulable"}, deployed.node_health()

    deployed.nodes[NODES[1]].write_kernel_log(xid_line(79))
    deployed.wait(lambda: deployed.node_health()[NODES[1]] == NodeState.PENDING_REPLACEMENT.value, 60,
                  f"{NODES[1]} {NodeState.PENDING_REPLACEMENT.value} after an Xid 79 in its kernel log")
    taints = {t["key"] for t in deployed.get("node", NODES[1])["spec"].get("taints", [])}
    assert names.NODE_HEALTH_STATUS in taints, taints
    assert deployed.node_health()[NODES[0]] in (None, "Schedulable"), "the other node's kernel log said nothing"
