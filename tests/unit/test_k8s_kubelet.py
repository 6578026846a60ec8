"""The test kubelet (tests/k8s_kubelet.py) against the emulator: scheduling, pods as local processes, the
PyTorchJob and Job controllers, graceful deletion and node failure -- all observed through the real client.

Each test gets its own emulator (a quarter of a second to start) and kubelet, so nothing leaks between tests;
the fixture also proves the kubelet logged no unexpected error and left no process behind. Pods run
``python -c`` snippets, never torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import kubernetes
import psutil
import pytest
from kubernetes.client.rest import ApiException

from k8s_emulator import kubernetes_emulator
from k8s_kubelet import TestKubelet, pod_processes
from unbroken.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

NS = "default"
T = TypeVar("T")

# A process that outlives the test; closing the kubelet SIGKILLs it.
SLEEP = "import time; time.sleep(60)"


@dataclass
class Cluster:
    kubelet: TestKubelet
    core: kubernetes.client.CoreV1Api
    batch: kubernetes.client.BatchV1Api
    custom: kubernetes.client.CustomObjectsApi
    tmp: Path


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """An emulator and a kubelet (no nodes yet); afterwards: no error in the kubelet's loop, no process left."""
    before = set(live_children())  # e.g. servers of session-wide fixtures
    with kubernetes_emulator(tmp_path / "k8s") as k8s:
        kubeconfig = k8s.write_kubeconfig(tmp_path / "kubeconfig")
        api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        with TestKubelet(kubeconfig, tmp_path / "kubelet") as kubelet:
            yield Cluster(kubelet, kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api),
                          kubernetes.client.CustomObjectsApi(api), tmp_path)
        api.close()
        assert kubelet.errors == []
    left = {pid: cmdline for pid, cmdline in live_children().items() if pid not in before}
    assert not left, f"processes left behind: {left}"


def live_children() -> dict[int, list[str]]:
    """This process's descendants that are still running (not zombies): pid -> command line."""
    found = {}
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if child.status() != psutil.STATUS_ZOMBIE:
                found[child.pid] = child.cmdline()
    return found


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def container(code: str, name: str = "pytorch", **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "python:3.11", "command": python(code), **extra}


def gpu(count: int = 1) -> dict[str, Any]:
    return {"resources": {"limits": {"nvidia.com/gpu": str(count)}}}


def pod_or_none(cluster: Cluster, name: str) -> Any:
    try:
        return cluster.core.read_namespaced_pod(name, NS)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def phase(cluster: Cluster, name: str) -> str | None:
    pod = pod_or_none(cluster, name)
    return pod.status.phase if pod else None


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pytorchjob(name: str, *, master: dict[str, Any] | None, workers: int = 0, worker: dict[str, Any] | None = None,
               policy: str = "Never", **spec: Any) -> dict[str, Any]:
    replicas = {}
    if master is not None:
        replicas["Master"] = {"replicas": 1, "restartPolicy": policy,
                              "template": {"metadata": {"labels": {"app": name}, "annotations": {"note": "copied"}},
                                           "spec": {"containers": [master]}}}
    if workers:
        replicas["Worker"] = {"replicas": workers, "restartPolicy": policy, "template": {"spec": {"containers": [worker or master]}}}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name}, "spec": {"pytorchReplicaSpecs": replicas, **spec}}


def create_pytorchjob(cluster: Cluster, body: dict[str, Any]) -> None:
    cluster.custom.create_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", body)


def job_status(cluster: Cluster, name: str) -> dict[str, Any]:
    return cluster.custom.get_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", name).get("status") or {}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    """The condition ``kind`` of a PyTorchJob's status ({} when it has none)."""
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def has_condition(status: dict[str, Any], kind: str, value: str = "True") -> bool:
    return condition(status, kind).get("status") == value


def job_with(cluster: Cluster, name: str, kind: str) -> dict[str, Any] | None:
    """The PyTorchJob's status once its condition ``kind`` is True."""
    status = job_status(cluster, name)
    return status if has_condition(status, kind) else None


def events_since(cluster: Cluster, resource_version: str) -> list[tuple[str, Any]]:
    """Every pod event after ``resource_version``, replayed from the emulator's event log."""
    stream = kubernetes.watch.Watch().stream(cluster.core.list_namespaced_pod, NS, resource_version=resource_version, timeout_seconds=1)
    return [(e["type"], e["object"]) for e in stream]


# --------------------------------------------------------------------------------------------------
# Scheduler
# --------------------------------------------------------------------------------------------------


def test_scheduler_honours_taints_affinity_selectors_and_gpu_capacity(cluster: Cluster) -> None:
    kubelet, core = cluster.kubelet, cluster.core
    kubelet.add_node("node-a")
    kubelet.add_node("node-b", labels={"zone": "z1"})
    kubelet.add_node("node-c", allocatable={"nvidia.com/gpu": "1"})
    core.patch_node("node-a", {"spec": {"taints": [{"key": "dedicated", "value": "infer", "effect": "NoSchedule"}]}})

    def pod(name: str, **spec: Any) -> None:
        main = {**container(SLEEP, "main"), **spec.pop("main", {})}
        core.create_namespaced_pod(NS, {"metadata": {"name": name}, "spec": {"containers": [main], **spec}})

    on_a = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-a"]}]}]}}}
    pod("tolerant", affinity=on_a, tolerations=[{"key": "dedicated", "operator": "Equal", "value": "infer", "effect": "NoSchedule"}])
    pod("intolerant", affinity=on_a)
    pod("tolerates-all", nodeSelector={"kubernetes.io/hostname": "node-a"}, tolerations=[{"operator": "Exists"}])
    pod("wrong-value", affinity=on_a, tolerations=[{"key": "dedicated", "operator": "Equal", "value": "train"}])
    pod("zoned", nodeSelector={"zone": "z1"})
    pod("terms-ored", affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["0"]}]},  # no node has the label
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-c"]}]}]}}})
    pod("anywhere")
    pod("gpu-1", main=gpu())
    pod("gpu-2", main=gpu())

    def node_of(name: str) -> str | None:
        return (pod_or_none(cluster, name).spec.node_name) or None

    schedulable = ("tolerant", "tolerates-all", "zoned", "terms-ored", "anywhere")
    wait_until(lambda: all(node_of(n) for n in schedulable) and (node_of("gpu-1") or node_of("gpu-2")), 15, "the schedulable pods to be bound")
    assert {n: node_of(n) for n in schedulable} == {"tolerant": "node-a", "tolerates-all": "node-a", "zoned": "node-b", "terms-ored": "node-c",
                      "anywhere": "node-b"}  # the first node by name that fits: node-a is tainted

    def unschedulable(name: str) -> str:
        pod = pod_or_none(cluster, name)
        scheduled = next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)
        assert pod.spec.node_name is None and pod.status.phase == "Pending"
        assert scheduled is not None and scheduled.status == "False" and scheduled.reason == "Unschedulable", scheduled
        return scheduled.message

    wait_until(lambda: all(pod_or_none(cluster, n).status.conditions for n in ("intolerant", "wrong-value")), 10, "PodScheduled=False")
    assert "1 node(s) had untolerated taint {dedicated: infer}" in unschedulable("intolerant")
    assert "2 node(s) didn't match Pod's node affinity/selector" in unschedulable("intolerant")
    assert "untolerated taint" in unschedulable("wrong-value")

    gpu_pods = {"gpu-1": node_of("gpu-1"), "gpu-2": node_of("gpu-2")}
    assert set(gpu_pods.values()) == {"node-c", None}
    waiting = next(n for n, node in gpu_pods.items() if node is None)
    wait_until(lambda: pod_or_none(cluster, waiting).status.conditions, 10, "PodScheduled=False on the second GPU pod")
    assert "Insufficient nvidia.com/gpu" in unschedulable(waiting)
    assert kubelet.pods_on("node-c") == sorted(["terms-ored", next(n for n, node in gpu_pods.items() if node)])

    running = next(n for n, node in gpu_pods.items() if node)  # the GPU is freed once its pod is gone
    core.delete_namespaced_pod(running, NS, grace_period_seconds=0)
    assert wait_until(lambda: node_of(waiting), 10, "the waiting GPU pod to get the freed GPU") == "node-c"


# --------------------------------------------------------------------------------------------------
# PyTorchJob controller and kubelet
# --------------------------------------------------------------------------------------------------

# Writes its environment to $OUT/<RANK>.json, then waits for $OUT/go (so that all ranks run at once).
REPORT_ENV = """
import json, os, pathlib, time
out = pathlib.Path(os.environ["OUT"])
(out / "tmp").mkdir(exist_ok=True)
(out / "tmp" / os.environ["RANK"]).write_text(json.dumps(dict(os.environ)))
(out / "tmp" / os.environ["RANK"]).rename(out / (os.environ["RANK"] + ".json"))  # atomically, for the test reading it
while not (out / "go").exists():
    time.sleep(0.05)
"""


def test_pytorchjob_master_and_workers_get_ranks_and_succeed(cluster: Cluster) -> None:
    for name in ("node-a", "node-b", "node-c"):
        cluster.kubelet.add_node(name, allocatable={"nvidia.com/gpu": "1"})
    out = cluster.tmp / "out"
    out.mkdir()
    main = container(REPORT_ENV, env=[{"name": "OUT", "value": str(out)}, {"name": "MASTER_PORT", "value": "23456"}], **gpu(),
                     ports=[{"name": "pytorchjob-port", "containerPort": 23456}])
    create_pytorchjob(cluster, pytorchjob("train", master=main, workers=2, nprocPerNode="auto"))

    status = wait_until(lambda: job_with(cluster, "train", "Running"), 20, "the job to run")
    assert has_condition(status, "Created") and status["startTime"]
    assert status["replicaStatuses"] == {"Master": {"active": 1, "succeeded": 0, "failed": 0},
                                         "Worker": {"active": 2, "succeeded": 0, "failed": 0}}
    pods = {p.metadata.name: p for p in cluster.core.list_namespaced_pod(NS).items}
    assert sorted(pods) == ["train-master-0", "train-worker-0", "train-worker-1"]
    assert sorted(p.spec.node_name for p in pods.values()) == ["node-a", "node-b", "node-c"]  # one GPU each
    master = pods["train-master-0"]
    assert master.metadata.labels == {"app": "train", "training.kubeflow.org/job-name": "train",
                                      "training.kubeflow.org/operator-name": "pytorchjob-controller",
                                      "training.kubeflow.org/replica-type": "master", "training.kubeflow.org/replica-index": "0",
                                      "training.kubeflow.org/job-role": "master"}
    assert master.metadata.annotations == {"note": "copied"}
    assert pods["train-worker-1"].metadata.labels["training.kubeflow.org/replica-index"] == "1"
    assert "training.kubeflow.org/job-role" not in pods["train-worker-1"].metadata.labels
    owner = master.metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.controller) == ("PyTorchJob", "train", True)
    assert master.spec.restart_policy == "Never"
    assert master.status.pod_ip == "127.0.0.1" and master.status.container_statuses[0].state.running is not None

    def reports() -> dict[int, dict[str, str]] | None:
        files = list(out.glob("*.json"))
        return {int(f.stem): json.loads(f.read_text()) for f in files} if len(files) == 3 else None

    envs = wait_until(reports, 10, "every rank to report its environment")
    ports = {env["MASTER_PORT"] for env in envs.values()}
    assert len(ports) == 1 and ports != {"23456"}, ports  # one free port chosen by the kubelet, not the template's
    for rank, env in envs.items():
        assert env["RANK"] == env["PET_NODE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["PET_NNODES"] == "3"
        assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == "127.0.0.1"
        assert env["PET_MASTER_PORT"] == env["MASTER_PORT"]
        assert env["PET_NPROC_PER_NODE"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    # the test's own environment is inherited, with its Python first on PATH (`python` is the image's, with torch)
    assert envs[0]["PATH"] == f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"

    (out / "go").touch()
    status = wait_until(lambda: job_with(cluster, "train", "Succeeded"), 20, "the job to succeed")
    assert condition(status, "Succeeded")["reason"] == "PyTorchJobSucceeded"
    assert has_condition(status, "Running", "False") and status["completionTime"]
    wait_until(lambda: job_status(cluster, "train")["replicaStatuses"] == {"Master": {"active": 0, "succeeded": 1, "failed": 0},
                                                                          "Worker": {"active": 0, "succeeded": 2, "failed": 0}},
             10, "every replica to be counted as succeeded")
    assert {phase(cluster, n) for n in pods} == {"Succeeded"}
    terminated = cluster.core.read_namespaced_pod("train-worker-0", NS).status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason, terminated.message) == (0, "Completed", None)


def test_a_failing_worker_fails_the_job_with_its_exit_code_and_log(cluster: Cluster) -> None:
    cluster.kubelet.add_node("node-a")
    worker = container("import sys; print('loading shard 7'); print('boom: shard 7 is corrupt', file=sys.stderr); sys.exit(3)")
    create_pytorchjob(cluster, pytorchjob("bad", master=container(SLEEP), workers=1, worker=worker))

    wait_until(lambda: phase(cluster, "bad-worker-0") == "Failed", 15, "the worker pod to fail")
    terminated = cluster.core.read_namespaced_pod("bad-worker-0", NS).status.container_statuses[0].state.terminated
    assert terminated.exit_code == 3 and terminated.reason == "Error"
    assert "boom: shard 7 is corrupt" in terminated.message and "loading shard 7" in terminated.message
    status = wait_until(lambda: job_with(cluster, "bad", "Failed"), 10, "the job to fail")
    failed = condition(status, "Failed")
    assert failed["reason"] == "PyTorchJobFailed" and "bad-worker-0" in failed["message"] and "exit code 3" in failed["message"]
    assert status["replicaStatuses"]["Worker"]["failed"] == 1 and status["completionTime"]
    assert "boom" in cluster.kubelet.log_path(NS, "bad-worker-0").read_text()

    cluster.core.delete_namespaced_pod("bad-worker-0", NS)  # a finished pod goes at once; a failed job recreates nothing
    wait_until(lambda: pod_or_none(cluster, "bad-worker-0") is None, 5, "the failed pod to go")
    wait_until(lambda: job_status(cluster, "bad")["replicaStatuses"]["Worker"]["failed"] == 0, 5, "the job's counts to follow")
    assert pod_or_none(cluster, "bad-worker-0") is None


def test_on_failure_restarts_a_killed_process_after_a_back_off(cluster: Cluster) -> None:
    kubelet = cluster.kubelet
    kubelet.add_node("node-a")
    create_pytorchjob(cluster, pytorchjob("resilient", master=container(SLEEP), policy="OnFailure"))
    first = wait_until(lambda: kubelet.pid_of(NS, "resilient-master-0"), 15, "the master's process")
    wait_until(lambda: has_condition(job_status(cluster, "resilient"), "Running"), 10, "the job to run")

    os.kill(first, signal.SIGKILL)
    second = wait_until(lambda: (pid := kubelet.pid_of(NS, "resilient-master-0")) != first and pid, 10, "a restarted process")
    assert alive(second) and not alive(first)

    def restarted() -> Any:
        status = cluster.core.read_namespaced_pod("resilient-master-0", NS).status.container_statuses[0]
        return status if status.restart_count == 1 and status.state.running else None

    status = wait_until(restarted, 10, "the pod status to show the restart")
    assert status.last_state.terminated.exit_code == 137 and status.container_id == f"emulated://{second}"
    pod = cluster.core.read_namespaced_pod("resilient-master-0", NS)
    assert pod.status.phase == "Running"
    job = job_status(cluster, "resilient")
    assert has_condition(job, "Running") and not has_condition(job, "Failed")


def test_exit_code_policy_recreates_a_pod_killed_by_a_signal_and_fails_on_an_error(cluster: Cluster) -> None:
    """restartPolicy ExitCode: exit codes >= 128 (signals) are retried with a new pod, 1-127 fail the job."""
    kubelet = cluster.kubelet
    kubelet.add_node("node-a")
    killed, second = cluster.tmp / "killed-once", cluster.tmp / "second-run"
    flaky = (f"import os, pathlib, signal, time\nif not pathlib.Path({str(killed)!r}).exists():\n"
             f"    pathlib.Path({str(killed)!r}).touch(); os.kill(os.getpid(), signal.SIGKILL)\n"
             f"pathlib.Path({str(second)!r}).touch(); time.sleep(60)")
    since = cluster.core.list_namespaced_pod(NS).metadata.resource_version
    create_pytorchjob(cluster, pytorchjob("flaky", master=container(flaky), policy="ExitCode"))
    create_pytorchjob(cluster, pytorchjob("broken", master=container("import sys; sys.exit(1)"), policy="ExitCode"))

    wait_until(lambda: second.exists() and job_with(cluster, "flaky", "Running"), 15, "the recreated pod to run")
    assert cluster.core.read_namespaced_pod("flaky-master-0", NS).spec.restart_policy == "Never"  # the operator's mapping
    broken = wait_until(lambda: job_with(cluster, "broken", "Failed"), 15, "the broken job to fail")
    assert "exit code 1" in condition(broken, "Failed")["message"]
    history: dict[str, list[Any]] = {}
    for _, pod in events_since(cluster, since):
        history.setdefault(pod.metadata.name, [])
        if pod.metadata.uid not in [p.metadata.uid for p in history[pod.metadata.name]]:
            history[pod.metadata.name].append(pod)
    assert len(history["flaky-master-0"]) == 2  # the first pod was replaced by a second one
    assert len(history["broken-master-0"]) == 1  # a plain error is not retried
    first = [obj for _, obj in events_since(cluster, since) if obj.metadata.uid == history["flaky-master-0"][0].metadata.uid][-1]
    assert first.status.phase == "Failed" and first.status.container_statuses[0].state.terminated.exit_code == 137


def test_an_error_in_the_loop_is_recorded_once_and_the_loop_goes_on(cluster: Cluster) -> None:
    kubelet = cluster.kubelet
    kubelet.add_node("node-a")
    template = {"spec": {"restartPolicy": "Always", "containers": [container(SLEEP, "main")]}}  # a real server refuses this Job
    cluster.batch.create_namespaced_job(NS, {"metadata": {"name": "invalid"}, "spec": {"template": template}})
    wait_until(lambda: kubelet.errors, 10, "the error to be recorded")
    cluster.core.create_namespaced_pod(NS, {"metadata": {"name": "after"}, "spec": {"restartPolicy": "Never",
                                                                                  "containers": [container("pass", "main")]}})
    wait_until(lambda: phase(cluster, "after") == "Succeeded", 15, "a pod to run after the error")
    assert len(kubelet.errors) == 1 and "restartPolicy must be Never or OnFailure" in kubelet.errors[0], kubelet.errors
    assert cluster.core.list_namespaced_pod(NS, label_selector="job-name=invalid").items == []
    kubelet.errors.clear()  # expected here; the fixture asserts that there are none left


def test_suspend_terminates_the_pods_and_resume_recreates_them(cluster: Cluster) -> None:
    kubelet = cluster.kubelet
    kubelet.add_node("node-a")
    create_pytorchjob(cluster, pytorchjob("pausable", master=container(SLEEP), workers=1, policy="OnFailure"))
    wait_until(lambda: has_condition(job_status(cluster, "pausable"), "Running"), 15, "the job to run")
    names = ["pausable-master-0", "pausable-worker-0"]
    pids = [kubelet.pid_of(NS, n) for n in names]
    uids = {cluster.core.read_namespaced_pod(n, NS).metadata.uid for n in names}
    since = cluster.core.list_namespaced_pod(NS).metadata.resource_version

    patch = {"spec": {"runPolicy": {"suspend": True}}}
    cluster.custom.patch_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", "pausable", patch)
    wait_until(lambda: cluster.core.list_namespaced_pod(NS).items == [], 15, "the pods to be gone")
    assert not any(alive(pid) for pid in pids if pid)
    events = events_since(cluster, since)
    for name in names:
        mine = [(kind, obj) for kind, obj in events if obj.metadata.name == name]
        first_deleting = next(i for i, (_, obj) in enumerate(mine) if obj.metadata.deletion_timestamp)
        assert mine[first_deleting][0] == "MODIFIED" and mine[-1][0] == "DELETED"  # Terminating, then gone
        assert mine[-1][1].status.container_statuses[0].state.terminated.exit_code == 143  # SIGTERM
    status = wait_until(lambda: job_with(cluster, "pausable", "Suspended"), 10, "Suspended")
    assert has_condition(status, "Running", "False") and "startTime" not in status

    patch = {"spec": {"runPolicy": {"suspend": False}}}
    cluster.custom.patch_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", "pausable", patch)
    status = wait_until(lambda: job_with(cluster, "pausable", "Running"), 15, "the job to run again")
    assert condition(status, "Suspended")["status"] == "False" and condition(status, "Suspended")["reason"] == "PyTorchJobResumed"
    assert status["startTime"]
    new_uids = {cluster.core.read_namespaced_pod(n, NS).metadata.uid for n in names}
    assert not new_uids & uids
    new_pids = [kubelet.pid_of(NS, n) for n in names]
    assert all(new_pids) and not set(new_pids) & set(pids)


def test_graceful_deletion_sigkills_a_process_that_ignores_sigterm(cluster: Cluster) -> None:
    kubelet = cluster.kubelet
    kubelet.add_node("node-a")
    ready = cluster.tmp / "ignoring"
    stubborn = (f"import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    cluster.core.create_namespaced_pod(NS, {"metadata": {"name": "stubborn"},
                                            "spec": {"terminationGracePeriodSeconds": 1, "containers": [container(stubborn, "main")]}})
    cluster.core.create_namespaced_pod(NS, {"metadata": {"name": "forced"}, "spec": {"containers": [container(SLEEP, "main")]}})
    pid = wait_until(lambda: ready.exists() and kubelet.pid_of(NS, "stubborn"), 15, "the SIGTERM-ignoring process")
    forced = wait_until(lambda: kubelet.pid_of(NS, "forced"), 15, "the other process")
    since = cluster.core.list_namespaced_pod(NS).metadata.resource_version

    started = time.monotonic()
    cluster.core.delete_namespaced_pod("stubborn", NS)
    assert cluster.core.read_namespaced_pod("stubborn", NS).metadata.deletion_timestamp is not None  # Terminating
    wait_until(lambda: pod_or_none(cluster, "stubborn") is None, 10, "the pod to be gone")
    assert time.monotonic() - started >= 1.0  # it took the grace period, not less
    assert not alive(pid)
    last = [obj for kind, obj in events_since(cluster, since) if obj.metadata.name == "stubborn"][-1]
    assert last.status.container_statuses[0].state.terminated.exit_code == 137 and last.status.phase == "Failed"

    cluster.core.delete_namespaced_pod("forced", NS, grace_period_seconds=0)  # gone from the API at once
    wait_until(lambda: not alive(forced), 10, "the force-deleted pod's process to be killed")


def test_a_deleted_pod_takes_the_processes_it_started_in_other_sessions_along_as_a_cgroup_kill_does(cluster: Cluster) -> None:
    """torchrun starts its ranks in sessions of their own: a rank stopped with SIGSTOP ignores torchrun's SIGTERM
    and outlived a pod whose process group alone was killed. Every process of the pod carries its marker."""
    kubelet = cluster.kubelet
    kubelet.add_node("node-a")
    child_pid = cluster.tmp / "child.pid"
    parent = (f"import pathlib, signal, subprocess, sys, time; "
              f"c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
              f"c.send_signal(signal.SIGSTOP); pathlib.Path({str(child_pid)!r}).write_text(str(c.pid)); time.sleep(60)")
    cluster.core.create_namespaced_pod(NS, {"metadata": {"name": "launcher"},
                                            "spec": {"terminationGracePeriodSeconds": 1, "containers": [container(parent, "main")]}})
    pid = int(wait_until(lambda: child_pid.exists() and child_pid.read_text(), 15, "the stopped child"))
    assert os.getpgid(pid) != os.getpgid(kubelet.pid_of(NS, "launcher") or 0), "the child left the pod's process group"
    assert [p.pid for p in pod_processes(cluster.core.read_namespaced_pod("launcher", NS).metadata.uid)] != []

    cluster.core.delete_namespaced_pod("launcher", NS)
    wait_until(lambda: pod_or_none(cluster, "launcher") is None, 10, "the pod to be gone")
    wait_until(lambda: not alive(pid), 10, "the stopped child in its own session to be killed with the pod")


def test_a_failed_node_keeps_its_pods_terminating_until_force_deleted(cluster: Cluster) -> None:
    kubelet, core = cluster.kubelet, cluster.core
    for name in ("node-a", "node-b", "node-c"):
        kubelet.add_node(name, allocatable={"nvidia.com/gpu": "1"})
    main = container(SLEEP, **gpu())
    create_pytorchjob(cluster, pytorchjob("sturdy", master=main, workers=1, policy="OnFailure"))
    wait_until(lambda: has_condition(job_status(cluster, "sturdy"), "Running"), 15, "the job to run")
    assert kubelet.pods_on("node-b") == ["sturdy-worker-0"]
    master_pid, worker_pid = kubelet.pid_of(NS, "sturdy-master-0"), kubelet.pid_of(NS, "sturdy-worker-0")
    assert worker_pid

    kubelet.fail_node("node-b")
    assert not alive(worker_pid)
    node = core.read_node("node-b")
    ready = next(c for c in node.status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("Unknown", "NodeStatusUnknown")
    assert {(t.key, t.effect) for t in node.spec.taints} == {("node.kubernetes.io/unreachable", "NoSchedule"),
                                                             ("node.kubernetes.io/unreachable", "NoExecute")}

    core.delete_namespaced_pod("sturdy-worker-0", NS, grace_period_seconds=1)
    held_until = time.monotonic() + 2.5  # a bounded wait, since what is asserted is that nothing happens
    while time.monotonic() < held_until:
        pod = core.read_namespaced_pod("sturdy-worker-0", NS)
        assert pod.metadata.deletion_timestamp is not None and pod.status.phase == "Running"  # nobody confirms, nobody writes
        time.sleep(0.1)

    core.delete_namespaced_pod("sturdy-worker-0", NS, grace_period_seconds=0)  # force
    replacement = wait_until(lambda: (p := pod_or_none(cluster, "sturdy-worker-0")) and p.spec.node_name and p, 10, "a replacement worker")
    assert replacement.spec.node_name == "node-c"  # not the failed node; node-a's GPU is taken
    wait_until(lambda: kubelet.pid_of(NS, "sturdy-worker-0"), 10, "the replacement's process")
    assert kubelet.pid_of(NS, "sturdy-master-0") == master_pid  # the master never noticed
    job = job_status(cluster, "sturdy")
    assert has_condition(job, "Running") and not has_condition(job, "Failed")


# --------------------------------------------------------------------------------------------------
# batch/v1 Job controller
# --------------------------------------------------------------------------------------------------


def test_batch_jobs_complete_exhaust_their_backoff_and_time_out(cluster: Cluster) -> None:
    cluster.kubelet.add_node("node-a")
    out = cluster.tmp / "indexes"
    out.mkdir()
    report = f"import os, pathlib; pathlib.Path({str(out)!r}, os.environ['JOB_COMPLETION_INDEX']).touch()"

    def job(name: str, code: str, **spec: Any) -> None:
        template = {"spec": {"restartPolicy": "Never", "containers": [container(code, "main")]}}
        cluster.batch.create_namespaced_job(NS, {"metadata": {"name": name}, "spec": {"template": template, **spec}})

    job("indexed", report, completionMode="Indexed", completions=2, parallelism=2)
    job("doomed", "import sys; sys.exit(1)", backoffLimit=0)
    job("slow", SLEEP, activeDeadlineSeconds=1)
    slow_pid = wait_until(lambda: next((cluster.kubelet.pid_of(NS, p.metadata.name) for p in cluster.core.list_namespaced_pod(
        NS, label_selector="job-name=slow").items), None), 15, "the slow job's process")

    def finished(name: str, kind: str) -> Any:
        status = cluster.batch.read_namespaced_job_status(name, NS).status
        return status if any(c.type == kind and c.status == "True" for c in status.conditions or []) else None

    indexed = wait_until(lambda: finished("indexed", "Complete"), 15, "the indexed job to complete")
    assert (indexed.succeeded, indexed.failed, indexed.active, indexed.completed_indexes) == (2, 0, 0, "0-1")
    assert indexed.completion_time is not None
    assert sorted(p.name for p in out.iterdir()) == ["0", "1"]
    pods = cluster.core.list_namespaced_pod(NS, label_selector="batch.kubernetes.io/job-name=indexed").items
    assert sorted(p.metadata.annotations["batch.kubernetes.io/job-completion-index"] for p in pods) == ["0", "1"]
    for pod in pods:
        index = pod.metadata.labels["batch.kubernetes.io/job-completion-index"]
        assert pod.metadata.name.startswith(f"indexed-{index}-") and len(pod.metadata.name) == len("indexed-0-") + 5
        assert pod.metadata.labels["job-name"] == "indexed" and pod.metadata.owner_references[0].kind == "Job"

    doomed = wait_until(lambda: finished("doomed", "Failed"), 15, "the job to run out of retries")
    reason = next(c.reason for c in doomed.conditions if c.type == "Failed")
    assert reason == "BackoffLimitExceeded" and doomed.failed == 1
    assert len(cluster.core.list_namespaced_pod(NS, label_selector="job-name=doomed").items) == 1  # no retry

    slow = wait_until(lambda: finished("slow", "Failed"), 15, "the job to run out of time")
    assert next(c.reason for c in slow.conditions if c.type == "Failed") == "DeadlineExceeded"
    wait_until(lambda: not alive(slow_pid), 10, "the slow job's process to be killed")
    wait_until(lambda: cluster.core.list_namespaced_pod(NS, label_selector="job-name=slow").items == [], 10, "its pod to go")


# --------------------------------------------------------------------------------------------------
# hostPath emulation and the container environment
# --------------------------------------------------------------------------------------------------


def test_host_path_mounts_are_rewritten_into_the_node_directory(cluster: Cluster) -> None:
    kubelet = cluster.kubelet
    kubelet.add_node("node-a")
    kubelet.add_node("node-b")
    report = ("import json, os, sys; json.dump({'env': dict(os.environ), 'cwd': os.getcwd()}, open(sys.argv[1], 'w'))")
    main = {**container(report, "agent"), "args": ["/var/run/unbroken/report.json"], "workingDir": "/var/run/unbroken",
            "volumeMounts": [{"name": "run", "mountPath": "/var/run/unbroken"}],
            "env": [{"name": "UNBROKEN_AGENT_SOCKET", "value": "/var/run/unbroken/agent.sock"},
                    {"name": "SOCKET_DIR", "value": "$(UNBROKEN_AGENT_SOCKET)/.."},
                    {"name": "NEIGHBOUR", "value": "/var/run/unbrokenness"},
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]}
    cluster.core.create_namespaced_pod(NS, {"metadata": {"name": "agent"}, "spec": {
        "restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": "node-b"}, "containers": [main],
        "volumes": [{"name": "run", "hostPath": {"path": "/var/run/unbroken", "type": "DirectoryOrCreate"}}]}})

    wait_until(lambda: phase(cluster, "agent") == "Succeeded", 15, "the agent pod to finish")
    host_dir = kubelet.node_dir("node-b") / "var/run/unbroken"
    assert host_dir.is_dir()
    report = json.loads((host_dir / "report.json").read_text())  # argv rewritten too
    env = report["env"]
    assert env["UNBROKEN_AGENT_SOCKET"] == str(host_dir / "agent.sock")
    assert env["SOCKET_DIR"] == str(host_dir / "agent.sock/..")
    assert env["NEIGHBOUR"] == "/var/run/unbrokenness"  # not under the mount: left alone
    assert (env["POD_NAME"], env["NODE_NAME"], env["POD_IP"]) == ("agent", "node-b", "127.0.0.1")
    assert Path(report["cwd"]) == host_dir
    assert not (kubelet.node_dir("node-a") / "var").exists()
