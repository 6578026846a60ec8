"""The process kubelet (tests/controlplane/kubelet.py) under the real control plane: what the Kubernetes tests
rely on it for. The scheduler binds the pods; the kubelet runs them as processes and reports them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from controlplane.cluster import ControlPlane
from controlplane.kubelet import ProcessKubelet, pod_processes
from unbroken.plumbing.waiting import wait_until


@pytest.fixture
def kubelet(k8s: ControlPlane, tmp_path: Path) -> Iterator[ProcessKubelet]:
    with ProcessKubelet(k8s.kubeconfig, tmp_path, k8s.kubelet_serving) as running:
        yield running
    assert not running.errors, running.errors


@pytest.fixture
def core(kubeconfig: Path) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(config_file=str(kubeconfig)))


def pod(name: str, command: list[str], *, policy: str = "Never", node: str, init: list[str] | None = None,
        grace: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"restartPolicy": policy, "nodeSelector": {"kubernetes.io/hostname": node},
                            "containers": [{"name": "main", "image": "x", "command": command}]}
    if init:
        spec["initContainers"] = [{"name": "init", "image": "busybox", "command": init}]
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return {"metadata": {"name": name}, "spec": spec}


def logged(kubelet: ProcessKubelet, namespace: str, name: str, text: str) -> bool:
    try:
        return text in kubelet.log_path(namespace, name).read_text()
    except KeyError:  # not started yet
        return False


def status(core: kubernetes.client.CoreV1Api, namespace: str, name: str) -> Any:
    return core.read_namespaced_pod(name, namespace).status


def test_init_containers_run_first_and_the_exit_code_is_the_pods_verdict(
        kubelet: ProcessKubelet, core: kubernetes.client.CoreV1Api, k8s: ControlPlane, namespace: str) -> None:
    node = f"n-{uuid.uuid4().hex[:6]}"
    kubelet.add_node(node)
    core.create_namespaced_pod(namespace, pod("p", ["sh", "-c", "cat marker && echo main ran && exit 3"], node=node,
                                              init=["sh", "-c", "echo init > marker"]))
    done = wait_until(lambda: (s := status(core, namespace, "p")).phase == "Failed" and s, 60, "the pod to fail")
    assert done.init_container_statuses[0].state.terminated.exit_code == 0
    assert done.container_statuses[0].state.terminated.exit_code == 3
    logs = k8s.kubectl("logs", "-n", namespace, "p").stdout  # through the API server, from the kubelet
    assert logs.splitlines() == ["init", "main ran"]


def test_on_failure_restarts_in_place_and_a_graceful_delete_sends_sigterm_first(
        kubelet: ProcessKubelet, core: kubernetes.client.CoreV1Api, namespace: str) -> None:
    node = f"n-{uuid.uuid4().hex[:6]}"
    kubelet.add_node(node)
    core.create_namespaced_pod(namespace, pod("crash", ["sh", "-c", "exit 1"], policy="OnFailure", node=node))
    wait_until(lambda: (status(core, namespace, "crash").container_statuses or [None])[0] is not None
               and status(core, namespace, "crash").container_statuses[0].restart_count >= 1, 60, "a restart in place")
    script = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(7)); print('up', flush=True); time.sleep(600)"
    core.create_namespaced_pod(namespace, pod("term", ["python", "-c", script], node=node, grace=20))
    wait_until(lambda: logged(kubelet, namespace, "term", "up"), 60, "the pod's process to start")
    uid = core.read_namespaced_pod("term", namespace).metadata.uid
    assert pod_processes(uid)
    core.delete_namespaced_pod("term", namespace)
    wait_until(lambda: not [p for p in core.list_namespaced_pod(namespace).items if p.metadata.name == "term"], 30,
               "the deletion confirmed once the process ended")
    assert not pod_processes(uid)


def test_a_failed_node_is_marked_by_the_node_lifecycle_controller_and_its_processes_die(
        kubelet: ProcessKubelet, core: kubernetes.client.CoreV1Api, namespace: str) -> None:
    node = f"n-{uuid.uuid4().hex[:6]}"
    kubelet.add_node(node)
    core.create_namespaced_pod(namespace, pod("sleeper", ["sleep", "600"], node=node))
    uid = wait_until(lambda: (p := core.read_namespaced_pod("sleeper", namespace)).status.phase == "Running"
                     and p.metadata.uid, 60, "the pod to run")
    kubelet.fail_node(node)
    assert not pod_processes(uid), "power loss: the node's processes are gone at once"
    ready = wait_until(lambda: next((c for c in core.read_node(node).status.conditions if c.type == "Ready"
                                     and c.status == "Unknown"), None), 30, "Kubernetes to mark the node's status unknown")
    assert ready.reason == "NodeStatusUnknown"
