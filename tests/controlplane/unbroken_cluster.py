"""unbroken installed on a real control plane, for the end-to-end tests and the benchmarks that run there.

``unbroken_cluster`` brings up the control plane (tests/controlplane/cluster.py), applies ``deploy/`` as
``kubectl apply -k`` does (less the operator's Deployment and the agents' DaemonSet: no image runs here; they
run as processes with the same ServiceAccounts' tokens), and registers three GPU nodes of the process kubelet
(tests/controlplane/kubelet.py), which runs the pods as local processes. The helpers write PyTorchJobs as a user
does, find a pod's rank process and read its log, and start the node agents.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import re
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import psutil
import yaml

from controlplane.cluster import ControlPlane
from controlplane.kubelet import ProcessKubelet, pod_processes
from processes import stop_process
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.client import api_client
from unbroken.kubernetes.backend.rank_env import AGENT_DIR, SHM_DIR, with_rank_env
from unbroken.plumbing.ports import free_port
from unbroken.plumbing.waiting import WaitTimeout, wait_until

SYSTEM = "unbroken-system"
JOBS = "training"
NODES = ("gpu-a", "gpu-b", "gpu-c")
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNBROKENS = f"app.kubernetes.io/managed-by={names.COMPONENT}"
"""unbroken's Events (Kubernetes' controllers write theirs on the same objects)."""


@dataclass
class Cluster:
    plane: ControlPlane
    kubeconfig: Path
    """The admin's: what the test itself and the CLI (a user) use."""
    operator_kubeconfig: Path
    """ServiceAccount unbroken-system/unbroken-operator's token, under deploy/'s RBAC."""
    agent_kubeconfigs: dict[str, Path]
    """Per node: a token of ServiceAccount unbroken-system/unbroken-agent bound to that Node, under deploy/'s RBAC and
    admission policy: what the agent's DaemonSet pod on the node holds (a pod-bound token names the node the same way)."""
    api: kubernetes.client.ApiClient
    kubelet: ProcessKubelet
    workdir: Path
    remediations: Path
    operator: subprocess.Popen[bytes] | None = None

    @property
    def core(self) -> kubernetes.client.CoreV1Api:
        return kubernetes.client.CoreV1Api(self.api)

    @property
    def custom(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.api)

    def agent_kubeconfig(self, node: str) -> Path:
        return self.agent_kubeconfigs[node]

    def start_operator(self, heartbeat_host: str = "127.0.0.1") -> subprocess.Popen[bytes]:
        log = open(self.workdir / "operator.log", "ab")
        self.operator = subprocess.Popen(
            [sys.executable, "-m", "unbroken.kubernetes.operator", "--kubeconfig", str(self.operator_kubeconfig), "--namespace", SYSTEM,
             "--metrics-port", "0", "--metrics-host", "127.0.0.1", "--identity", f"operator-{uuid.uuid4().hex[:4]}",
             "--heartbeat-host", heartbeat_host, "--heartbeat-port", "0", "--heartbeat-address", heartbeat_host],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "KUBECONFIG": str(self.operator_kubeconfig)})
        return self.operator

    def stop_operator(self, sig: int = signal.SIGTERM) -> None:
        if self.operator is not None:
            stop_process(self.operator, sig=sig, timeout=15)
        self.operator = None

    def job(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object("kubeflow.org", "v1", JOBS, "pytorchjobs", name)

    def annotations(self, name: str) -> dict[str, str]:
        return self.job(name)["metadata"].get("annotations") or {}

    def events(self, name: str) -> list[tuple[str, str, str]]:
        """(type, reason, message) of unbroken's Events on the job, oldest first (by unbroken's own time stamp)."""
        items = self.core.list_namespaced_event(JOBS, label_selector=UNBROKENS).items  # not training-operator's
        mine = [e for e in items if e.involved_object.name == name]
        mine.sort(key=lambda e: float((e.metadata.annotations or {}).get(f"{names.PREFIX}/time", 0)))
        return [(e.type, e.reason, e.message) for e in mine]

    def reasons(self, name: str) -> list[str]:
        return [reason for _, reason, _ in self.events(name)]

    def pods(self, name: str) -> list[Any]:
        return self.core.list_namespaced_pod(JOBS, label_selector=f"training.kubeflow.org/job-name={name}").items

    def operator_log(self) -> str:
        return (self.workdir / "operator.log").read_text(errors="replace")

    def assert_clean(self) -> None:
        """No kubelet error, and nothing in the operator's log of a failed pass or a refused request."""
        assert not self.kubelet.errors, self.kubelet.errors
        log = self.operator_log() if (self.workdir / "operator.log").exists() else ""
        assert "reconcile pass failed" not in log and "Logging error" not in log, log[-3000:]
        # 403 as a word: a port such as 40362 in a log line is not a refusal (CI once failed a teardown on one)
        refused = [line for line in log.splitlines() if (_STATUS_403.search(line) or "Forbidden" in line)
                   and not self._while_the_api_server_restarted(line)]
        assert not refused, f"the operator was refused something: {refused[:5]}\n{log[-3000:]}"

    def _while_the_api_server_restarted(self, line: str) -> bool:
        """``line`` was logged from the API server's restart (``start_apiserver``) to 10 s after it was ready: a
        server just started refuses requests (403) until its authorizer's caches have loaded, and the operator,
        retrying every second, meets that; it is not a gap in deploy/'s RBAC."""
        restarted = self.plane.restarted
        if restarted is None:
            return False
        try:
            at = datetime.datetime.fromisoformat(json.loads(line)["ts"]).timestamp()
        except (ValueError, KeyError, TypeError):
            return False
        return restarted[0] <= at <= restarted[1] + 10


_STATUS_403 = re.compile(r"\b403\b")


def cluster_file(remediations: Path) -> str:
    """Automatic recovery through the Command remediator: a script that appends "<action> <node>"
    to ``remediations`` (argv ends with [action, node]); force-delete after 2 s, not 60."""
    script = "import sys; open(sys.argv[1], 'a').write(sys.argv[2] + ' ' + sys.argv[3] + chr(10))"
    return yaml.safe_dump({
        "ClusterName": "k8s-test", "NodeRecovery": "Automatic",
        "InstanceGroups": [
            {"InstanceGroupName": "gpu", "InstanceType": "cpu-dev", "InstanceCount": 0},
            # for joining nodes: a healthy group, and one whose profile no CPU meets (the real matmul fails it)
            {"InstanceGroupName": "checked", "InstanceType": "cpu-dev", "InstanceCount": 0,
             "OnStartDeepHealthChecks": ["InstanceStress", "InstanceConnectivity"]},
            {"InstanceGroupName": "slow", "InstanceType": "cpu-slow", "InstanceCount": 0, "OnStartDeepHealthChecks": ["InstanceStress"]},
        ],
        "Health": {"Profiles": {"cpu-slow": {"MatmulFloor": 1e9, "MemoryBandwidthFloorGBps": 0.5, "BusBwFloorGBps": 0.1}}},
        "Kubernetes": {"Remediator": "Command", "RemediationCommand": [sys.executable, "-c", script, str(remediations)],
                       "ForceDeleteGraceSeconds": 2,
                       # the deep-check Jobs' pods run this machine's Python (the process kubelet ignores images)
                       "DeepCheckCommand": [sys.executable, "-m", "unbroken.health.pod"], "DeepCheckStartSeconds": 30,
                       # the cross-node sweep's rank 0 listens here (every test node's address is 127.0.0.1)
                       "ConnectivityPort": free_port()},
    })


def install_unbroken(plane: ControlPlane, remediations: Path) -> None:
    """deploy/ as ``kubectl apply -k deploy/`` installs it, less the operator's Deployment and the agent's
    DaemonSet (no image can run here: the test starts both as processes, with the same accounts), and with
    the test's cluster file in the ConfigMap."""
    rendered = plane.kubectl("kustomize", str(DEPLOY)).stdout
    objects = [o for o in yaml.safe_load_all(rendered) if o and o["kind"] not in ("Deployment", "DaemonSet")]
    for obj in objects:
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == names.CLUSTER_CONFIGMAP:
            obj["data"] = {"cluster.yaml": cluster_file(remediations)}
    plane.apply(objects)
    wait_until(lambda: _agent_policy_enforced(plane), 30, "the agent's admission policy to be enforced")


def _agent_policy_enforced(plane: ControlPlane) -> bool:
    """The API server refuses the agent a write RBAC grants it (a dry run): deploy/admission/agent-policy.yaml is in force
    (the API server loads a new policy a moment after it is created)."""
    result = plane.kubectl("patch", "configmap", names.CLUSTER_CONFIGMAP, "-n", SYSTEM, "--dry-run=server", "-p", '{"data":{}}',
                           f"--as=system:serviceaccount:{SYSTEM}:unbroken-agent", check=False)
    return result.returncode != 0 and "ValidatingAdmissionPolicy" in result.stderr


def service_account_kubeconfig(plane: ControlPlane, core: kubernetes.client.CoreV1Api, account: str, path: Path, *,
                               node: str | None = None) -> Path:
    """A kubeconfig with a token the API server issued for ``unbroken-system/<account>`` (a TokenRequest), bound to the
    Node ``node`` if given (the token then names the node: ``authentication.kubernetes.io/node-name``)."""
    wait_until(lambda: core.read_namespaced_service_account(account, SYSTEM), 30, f"ServiceAccount {account}")
    spec: dict[str, Any] = {"expirationSeconds": 24 * 3600}
    if node is not None:
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": core.read_node(node).metadata.uid}
    token = core.create_namespaced_service_account_token(account, SYSTEM, {"spec": spec})
    return plane.token_kubeconfig(path, token.status.token, f"system:serviceaccount:{SYSTEM}:{account}")


@contextlib.contextmanager
def unbroken_cluster(workdir: Path, *, trainer: bool = False, kueue: bool = False) -> Iterator[Cluster]:
    """The control plane (with JobSet and the Trainer if ``trainer``, Kueue if ``kueue``), deploy/ installed, three GPU
    nodes of the process kubelet; the operator stopped when it ends, and then no pod process left."""
    remediations = workdir / "remediations.log"
    remediations.touch()
    # A short directory: a node's hostPath /var/run/unbroken/agent.sock must fit in a socket address (107 bytes).
    with tempfile.TemporaryDirectory(prefix="k8s-", dir="/tmp") as nodes_root, \
            ControlPlane(workdir / "plane", trainer=trainer, kueue=kueue,
                         while_starting=lambda plane: install_unbroken(plane, remediations)) as plane:
        api = api_client(plane.kubeconfig)
        core = kubernetes.client.CoreV1Api(api)
        plane.create_namespace(JOBS)
        operator = service_account_kubeconfig(plane, core, "unbroken-operator", workdir / "operator.kubeconfig")
        try:
            with ProcessKubelet(plane.kubeconfig, Path(nodes_root), plane.kubelet_serving) as kubelet:
                for node in NODES:
                    kubelet.add_node(node, allocatable={"nvidia.com/gpu": "1"})
                agents = {node: service_account_kubeconfig(plane, core, "unbroken-agent", workdir / f"agent-{node}.kubeconfig",
                                                           node=node) for node in NODES}
                result = Cluster(plane, plane.kubeconfig, operator, agents, api, kubelet, workdir, remediations)
                try:
                    yield result
                finally:
                    result.stop_operator()
        except BaseException:
            print(plane.logs_tail(15))  # shown with the failure
            raise
        # every process of every pod died with this kubelet (a SIGSTOPped rank torchrun left behind once outlived it)
        # (30 s: CI once saw a pod process outlive 10 s on a loaded machine; it was gone when the test ran alone)
        wait_until(lambda: not pod_processes(kubelet=Path(nodes_root)), 30, "every pod process to be gone")


TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
LAUNCHER = (sys.executable, "-m", "unbroken", "run")
"""``unbroken run``, the launcher that restarts ranks in place (kubernetes/pod_launcher/), in place of torchrun."""


def pytorchjob(name: str, checkpoints: Path, *, steps: int, step_time: float = 0.05, annotations: dict[str, str] | None = None,
               nodes: int = 2, report_progress: bool = False, tiers_json: str | None = None,
               launcher: tuple[str, ...] = TORCHRUN, workload_args: tuple[str, ...] = (), checkpoint_every: int = 10,
               spare_pods: int = 0, elastic: tuple[int, int] | None = None) -> dict[str, Any]:
    """A PyTorchJob as a user writes it: Master + Workers, torchrun (or ``launcher``) reading training-operator's PET_* env;
    ``spare_pods`` more Workers that ``unbroken run --spare-pods`` keeps standing by (the annotation tells the operator);
    ``elastic`` (min, max): an elasticPolicy, ``nodes`` being max;
    with ``report_progress``, its pods mount the node agent's socket and name their job (kubernetes/backend/rank_env.py);
    with ``tiers_json`` they checkpoint through the tiered checkpoint (the node's memory tier, peer replicas)."""
    if spare_pods:
        launcher = (*launcher, "--spare-pods", str(spare_pods))
        annotations = {**(annotations or {}), names.SPARE_PODS: str(spare_pods)}
    container = {
        "name": "pytorch", "image": "unbroken:dev",
        "command": [*launcher, "-m", "unbroken.workloads.mlp",
                    "--steps", str(steps), "--checkpoint-every", str(checkpoint_every), "--step-time", str(step_time), *workload_args],
        "env": [{"name": "UNBROKEN_CHECKPOINT_DIR", "value": str(checkpoints)}],
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        # training-operator's MASTER_PORT; every pod shares 127.0.0.1, so each job gets a port of its own
        "ports": [{"name": "pytorchjob-port", "containerPort": free_port()}],
    }
    template: dict[str, Any] = {"spec": {"containers": [container]}}
    if report_progress or tiers_json is not None:
        template = with_rank_env(template, "training.kubeflow.org/job-name", tiers_json=tiers_json)
    if tiers_json is not None:
        annotations = {**(annotations or {}), names.CHECKPOINT_TIERS: tiers_json}
    replica = {"replicas": 1, "restartPolicy": "OnFailure", "template": template}
    specs = {"Master": replica}
    if nodes + spare_pods > 1:
        specs["Worker"] = {**replica, "replicas": nodes - 1 + spare_pods}
    spec: dict[str, Any] = {"nprocPerNode": "1", "pytorchReplicaSpecs": specs}
    if elastic is not None:
        spec["elasticPolicy"] = {"minReplicas": elastic[0], "maxReplicas": elastic[1]}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "namespace": JOBS, "annotations": annotations or {}}, "spec": spec}


def without_gpus(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` (a ``pytorchjob``) asking for no GPU: the scheduler then fits several jobs' pods on one node."""
    for replica in body["spec"]["pytorchReplicaSpecs"].values():
        replica["template"]["spec"]["containers"][0].pop("resources", None)  # Master and Worker share one template
    return body


def one_pod_per_node(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` (a ``pytorchjob``) whose pods never share a node (required pod anti-affinity on the hostname)."""
    name = body["metadata"]["name"]
    body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["affinity"] = {"podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "kubernetes.io/hostname", "labelSelector": {
            "matchLabels": {"training.kubeflow.org/job-name": name}}}]}}  # Master and Worker share one template
    return body


def auto_resume(retries: int) -> dict[str, str]:
    return {names.AUTO_RESUME: "true", names.MAX_RETRY: str(retries)}


def submit(cluster: Cluster, body: dict[str, Any]) -> str:
    cluster.custom.create_namespaced_custom_object("kubeflow.org", "v1", JOBS, "pytorchjobs", body)
    return str(body["metadata"]["name"])


def rank_process(cluster: Cluster, pod: str) -> psutil.Process:
    """A rank of the pod (``rank_pids``), once there is one."""
    return psutil.Process(wait_until(lambda: next(iter(rank_pids(cluster, pod)), None), 60, f"a rank process in pod {pod}"))


_RUN_DIR = re.compile(r'"run_dir": "([^"]+)"')
_START_LINE = re.compile(r"resumed at step|restor|first step|no checkpoint|attempt")


def rank_pids(cluster: Cluster, pod: str) -> list[int]:
    """The pod's live rank processes, under torchrun (LOCAL_RANK in their environment) or ``unbroken run``, whose
    ranks may be forks of a warm spare and say who they are in the launcher's rejoin folders (rank/registry.py)."""
    pid = cluster.kubelet.pid_of(JOBS, pod)
    if pid is None:
        return []
    dirs = _RUN_DIR.findall(rank_log(cluster, pod))
    registered = {int(p.stem) for p in Path(dirs[-1]).glob("round-*/rejoin/*.json")} if dirs else set()
    found = []
    try:
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.pid in registered or ("LOCAL_RANK" in child.environ() and "unbroken.workloads.mlp" in " ".join(child.cmdline())):
                    found.append(child.pid)
    except psutil.Error:
        return []
    return found


def checkpoint_steps(checkpoints: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in checkpoints.glob("step-*") if p.name.split("-")[1].isdigit()) \
        if checkpoints.exists() else []


def rank_log(cluster: Cluster, pod: str) -> str:
    try:
        path = cluster.kubelet.log_path(JOBS, pod)
    except KeyError:  # not started yet
        return ""
    return path.read_text(errors="replace") if path.exists() else ""


def running_with_a_checkpoint(cluster: Cluster, body: dict[str, Any], checkpoints: Path, step: int = 10) -> str:
    """Submit ``body``; return its name once the operator adopted it and its ranks saved ``step``."""
    name = submit(cluster, body)
    wait_until(lambda: cluster.annotations(name).get(names.JOB_PHASE) == "Running", 60, "the operator to adopt the job")
    wait_until(lambda: any(s >= step for s in checkpoint_steps(checkpoints)), 120, f"a checkpoint at step {step}")
    return name


def job_state(cluster: Cluster, name: str) -> str:
    """What a wait that timed out needs said: the job's pods (node, phase, attempt, MASTER_PORT, container states), its Events,
    the last lines of its ranks' logs, of the operator's and of training-operator's."""
    pods = [(p.metadata.name, p.spec.node_name, p.status.phase, (p.metadata.annotations or {}).get(names.ATTEMPT),
             "deleting" if p.metadata.deletion_timestamp else "",
             [e.value for c in p.spec.containers for e in c.env or [] if e.name == "MASTER_PORT"],
             [(c.state.to_dict(), c.restart_count) for c in p.status.container_statuses or []]) for p in cluster.pods(name)]
    logs = {pod: rank_log(cluster, f"{name}-{pod}") for pod in ("master-0", "worker-0")}
    # where each attempt started from: a resume that never came is read from these, which the tails no longer hold
    starts = {pod: [line[-300:] for line in log.splitlines() if _START_LINE.search(line)][-6:] for pod, log in logs.items()}
    tails = {pod: log[-1200:] for pod, log in logs.items()}
    operator = cluster.operator_log()[-2500:] if (cluster.workdir / "operator.log").exists() else ""
    training_operator = cluster.plane.processes.get("training-operator")
    return (f"pods {pods}; events {cluster.events(name)[-8:]}; starts {starts}; logs {tails}; operator {operator}; "
            f"training-operator {training_operator.tail(15) if training_operator else None}")


def wait_for_job(cluster: Cluster, name: str, predicate: Callable[[], object], timeout: float, what: str) -> None:
    """``wait_until``, and on a timeout an AssertionError with the job's state (``job_state``): a restart that never
    comes is hard to read from a timeout alone."""
    try:
        wait_until(predicate, timeout, what)
    except WaitTimeout as exc:
        raise AssertionError(f"{exc}; {job_state(cluster, name)}") from None


def wait_resumed_off(cluster: Cluster, name: str, node: str) -> None:
    """Attempt 1 runs on two nodes other than ``node`` and has resumed from the checkpoint."""
    def moved() -> bool:
        pods = cluster.pods(name)
        return len(pods) == 2 and all(p.spec.node_name and p.spec.node_name != node for p in pods) \
            and all((p.metadata.annotations or {}).get(names.ATTEMPT) == "1" for p in pods)
    wait_for_job(cluster, name, moved, 60, f"attempt 1 on nodes other than {node}")
    wait_for_job(cluster, name, lambda: "resumed at step" in rank_log(cluster, f"{name}-master-0"), 120,
                 "the resume from the checkpoint")


def start_agent(cluster: Cluster, node: str, *, kernel_log: str | None = None) -> subprocess.Popen[bytes]:
    """``unbroken agent --kubernetes`` for ``node`` (its DaemonSet pod), tailing the node's kernel log
    file (``/dev/kmsg`` on a real node; ``kernel_log="none"``: none, as the base DaemonSet) and renewing its Lease."""
    node_dir = cluster.kubelet.node_dir(node)
    (node_dir / "kmsg.log").touch()
    kernel_log = kernel_log or str(node_dir / "kmsg.log")
    log = open(cluster.workdir / f"agent-{node}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "unbroken.kubernetes.node_agent", "--kubernetes", "--node", node, "--kubeconfig", str(cluster.agent_kubeconfig(node)),
         "--namespace", SYSTEM, "--kernel-log", kernel_log, "--socket-dir", str(node_dir / AGENT_DIR.lstrip("/")),
         "--state-dir", str(node_dir / "state")],
        # the memory tier's hostPath (/dev/shm/unbroken), as the pods' mount of it is rewritten
        env={**os.environ, "UNBROKEN_SHM_BASE": str(node_shm(cluster, node))},
        stdout=log, stderr=subprocess.STDOUT)


def node_shm(cluster: Cluster, node: str) -> Path:
    """The node's memory tier (hostPath ``/dev/shm/unbroken``) in its test-kubelet directory."""
    return cluster.kubelet.node_dir(node) / SHM_DIR.lstrip("/")


def start_agents(cluster: Cluster) -> dict[str, subprocess.Popen[bytes]]:
    """One agent per node, each with its Lease renewed once."""
    agents = {node: start_agent(cluster, node) for node in NODES}
    leases = kubernetes.client.CoordinationV1Api(cluster.api)
    wait_until(lambda: {f"{names.LEASE_PREFIX}{n}" for n in NODES} <= {l.metadata.name for l in leases.list_namespaced_lease(SYSTEM).items},
             30, "every agent's Lease")
    return agents


Agents = dict[str, subprocess.Popen[bytes]]
