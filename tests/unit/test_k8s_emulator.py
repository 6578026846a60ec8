"""The Kubernetes API emulator fixture (tests/k8s_emulator.py), proven over real HTTP.

Every test talks to the emulator process through the real ``kubernetes`` Python client or the real
``kubectl`` binary; nothing is mocked on the client side. What is *emulated* is the API server: an
in-memory store (kmock) behind the Kubernetes REST conventions -- no controllers, no kubelet, no scheduler.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.client.rest import ApiException

from processes import stop_process
from unbroken.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

KUBECTL = shutil.which("kubectl")
# The client's models refuse a PodSpec without containers (the emulator itself validates nothing).
CONTAINERS = [{"name": "main", "image": "busybox"}]
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not on PATH")


@pytest.fixture(scope="module")
def api(kubeconfig: Path) -> Iterator[kubernetes.client.ApiClient]:
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    with kubernetes.client.ApiClient(configuration) as client:
        yield client


def kubectl(kubeconfig: Path, *args: str, stdin: str | None = None) -> str:
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "--kubeconfig", str(kubeconfig), *args], input=stdin, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"kubectl {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


def raw_patch(api: kubernetes.client.ApiClient, path: str, body: Any, content_type: str) -> dict[str, Any]:
    """PATCH through the real client with an explicit Content-Type (its typed methods always pick strategic merge)."""
    return api.call_api(path, "PATCH", header_params={"Content-Type": content_type, "Accept": "application/json"},
                        body=body, response_type="object", auth_settings=["BearerToken"], _return_http_data_only=True)


def rv(obj: Any) -> int:
    meta = obj["metadata"] if isinstance(obj, dict) else obj.metadata
    return int(meta["resourceVersion"] if isinstance(meta, dict) else meta.resource_version)


@needs_kubectl
def test_discovery_lists_every_registered_resource_for_kubectl(kubeconfig: Path) -> None:
    """Emulated: discovery documents (/api, /apis, /apis/<g>/<v>) built from the fixture's registry."""
    names = set(kubectl(kubeconfig, "api-resources", "-o", "name").split())
    expected = {"nodes", "pods", "events", "configmaps", "namespaces", "serviceaccounts", "services", "secrets",
                "leases.coordination.k8s.io", "jobs.batch", "events.events.k8s.io", "daemonsets.apps", "deployments.apps",
                "pytorchjobs.kubeflow.org", "trainjobs.trainer.kubeflow.org", "jobsets.jobset.x-k8s.io",
                "customresourcedefinitions.apiextensions.k8s.io"}
    assert expected <= names, expected - names
    scoped = kubectl(kubeconfig, "api-resources", "--namespaced=false", "-o", "name").split()
    assert "nodes" in scoped and "namespaces" in scoped and "pods" not in scoped


def test_nodes_create_get_list_patch_delete(api: kubernetes.client.ApiClient) -> None:
    """Emulated: a cluster-scoped store for v1 Nodes; strategic-merge (typed client) and merge patches; 404 after delete."""
    core = kubernetes.client.CoreV1Api(api)
    name = f"node-{uuid.uuid4().hex[:6]}"
    created = core.create_node({"metadata": {"name": name, "labels": {"zone": "a"}}, "status": {"capacity": {"cpu": "8"}}})
    assert created.metadata.uid and created.metadata.creation_timestamp is not None
    assert created.metadata.namespace is None
    assert created.status.capacity == {"cpu": "8"}  # a real server keeps a Node's status on create too

    assert core.read_node(name).metadata.labels == {"zone": "a"}
    assert name in [n.metadata.name for n in core.list_node().items]

    patched = core.patch_node(name, {"metadata": {"labels": {"unbroken.dev/health": "bad"}}, "spec": {"unschedulable": True}})
    assert patched.metadata.labels == {"zone": "a", "unbroken.dev/health": "bad"}
    assert patched.spec.unschedulable is True

    merged = raw_patch(api, f"/api/v1/nodes/{name}", {"metadata": {"labels": {"zone": None}}}, "application/merge-patch+json")
    assert merged["metadata"]["labels"] == {"unbroken.dev/health": "bad"}

    core.delete_node(name)
    with pytest.raises(ApiException) as caught:
        core.read_node(name)
    assert caught.value.status == 404
    assert name not in [n.metadata.name for n in core.list_node().items]


@needs_kubectl
def test_node_labels_patched_by_the_client_show_in_kubectl(api: kubernetes.client.ApiClient, kubeconfig: Path) -> None:
    """Emulated: the same store read by kubectl; label columns are printed by kubectl itself (no server-side Table)."""
    core = kubernetes.client.CoreV1Api(api)
    name = f"node-{uuid.uuid4().hex[:6]}"
    core.create_node({"metadata": {"name": name}})
    core.patch_node(name, {"metadata": {"labels": {"unbroken.dev/state": "quarantined"}}})

    table = kubectl(kubeconfig, "get", "nodes", name, "-L", "unbroken.dev/state")
    header, row = table.splitlines()[:2]
    assert "STATE" in header
    assert row.split()[0] == name and row.split()[-1] == "quarantined"

    kubectl(kubeconfig, "label", "node", name, "unbroken.dev/state-")  # kubectl removes it again
    assert core.read_node(name).metadata.labels in (None, {})
    core.delete_node(name)


@needs_kubectl
def test_kubectl_create_patch_label_cordon(api: kubernetes.client.ApiClient, kubeconfig: Path, namespace: str) -> None:
    """Emulated: kubectl's own requests -- create (fieldValidation=Strict, not enforced), strategic merge patch of
    containers by name, label (merge patch), cordon/uncordon (strategic merge patch)."""
    core = kubernetes.client.CoreV1Api(api)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": namespace},
           "spec": {"containers": [{"name": "main", "image": "busybox"}]}}
    kubectl(kubeconfig, "create", "-f", "-", stdin=json.dumps(pod))
    kubectl(kubeconfig, "-n", namespace, "patch", "pod", "p", "-p",
            json.dumps({"spec": {"containers": [{"name": "main", "image": "busybox:2"}, {"name": "side", "image": "envoy"}]}}))
    kubectl(kubeconfig, "-n", namespace, "label", "pod", "p", "role=worker")
    got = core.read_namespaced_pod("p", namespace)
    assert [(c.name, c.image) for c in got.spec.containers] == [("main", "busybox:2"), ("side", "envoy")]
    assert got.metadata.labels == {"role": "worker"}
    kubectl(kubeconfig, "-n", namespace, "patch", "pod", "p", "-p", json.dumps({"spec": {"containers": [{"name": "side", "$patch": "delete"}]}}))
    assert [c.name for c in core.read_namespaced_pod("p", namespace).spec.containers] == ["main"]

    node = f"node-{uuid.uuid4().hex[:6]}"
    core.create_node({"metadata": {"name": node}})
    kubectl(kubeconfig, "cordon", node)
    assert core.read_node(node).spec.unschedulable is True
    kubectl(kubeconfig, "uncordon", node)
    assert not core.read_node(node).spec.unschedulable
    out = kubectl(kubeconfig, "get", "pods", "-n", namespace, "-o", "jsonpath={.items[*].metadata.name}")
    assert out.split() == ["p"]
    core.delete_node(node)


def test_pods_status_subresource_and_finalizers(api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Emulated: Pod create drops status (phase Pending; no kubelet ever runs it); /status patches only status,
    the main endpoint ignores status; a finalizer holds a deleted pod until it is removed."""
    core = kubernetes.client.CoreV1Api(api)
    created = core.create_namespaced_pod(namespace, {"metadata": {"name": "w"}, "spec": {"containers": [{"name": "c", "image": "i"}]},
                                                     "status": {"phase": "Running"}})
    assert created.metadata.namespace == namespace
    assert created.status.phase == "Pending"

    running = core.patch_namespaced_pod_status("w", namespace, {"status": {"phase": "Running"}, "spec": {"nodeName": "sneaky"}})
    assert running.status.phase == "Running" and running.spec.node_name is None
    ignored = core.patch_namespaced_pod("w", namespace, {"status": {"phase": "Failed"}, "metadata": {"finalizers": ["unbroken.dev/x"]}})
    assert ignored.status.phase == "Running" and ignored.metadata.finalizers == ["unbroken.dev/x"]

    core.delete_namespaced_pod("w", namespace)
    terminating = core.read_namespaced_pod("w", namespace)
    assert terminating.metadata.deletion_timestamp is not None
    core.patch_namespaced_pod("w", namespace, [{"op": "remove", "path": "/metadata/finalizers"}])  # json-patch
    with pytest.raises(ApiException) as caught:
        core.read_namespaced_pod("w", namespace)
    assert caught.value.status == 404


def test_graceful_pod_deletion_waits_for_the_kubelet(api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Emulated as a real API server's pod strategy: a bound pod deleted with a grace period only gets a
    deletionTimestamp (MODIFIED) and stays until a grace-0 DELETE confirms it; a second delete may shorten the
    grace, never extend it; unbound or finished pods, and force deletes, go at once; finalizers still hold."""
    core = kubernetes.client.CoreV1Api(api)

    def pod(name: str, **spec: Any) -> dict[str, Any]:
        return {"metadata": {"name": name}, "spec": {"containers": CONTAINERS, **spec}}

    def gone(name: str) -> bool:
        try:
            core.read_namespaced_pod(name, namespace)
        except ApiException as e:
            return e.status == 404
        return False

    core.create_namespaced_pod(namespace, pod("bound", nodeName="n1", terminationGracePeriodSeconds=5))
    since = core.list_namespaced_pod(namespace).metadata.resource_version
    core.delete_namespaced_pod("bound", namespace)
    terminating = core.read_namespaced_pod("bound", namespace)
    assert terminating.metadata.deletion_grace_period_seconds == 5
    deadline = terminating.metadata.deletion_timestamp - datetime.datetime.now(datetime.UTC)
    assert 3 < deadline.total_seconds() <= 6  # a real server sets it to now + grace
    core.delete_namespaced_pod("bound", namespace, grace_period_seconds=60)  # does not extend
    assert rv(core.read_namespaced_pod("bound", namespace)) == rv(terminating)
    core.delete_namespaced_pod("bound", namespace, body={"gracePeriodSeconds": 2})  # shortens (DeleteOptions body)
    assert core.read_namespaced_pod("bound", namespace).metadata.deletion_grace_period_seconds == 2
    core.patch_namespaced_pod_status("bound", namespace, {"status": {"phase": "Running"}})  # the kubelet still writes
    assert not gone("bound")
    core.delete_namespaced_pod("bound", namespace, grace_period_seconds=0)  # the kubelet's confirmation
    assert gone("bound")
    events = [(e["type"], e["object"].metadata.deletion_grace_period_seconds)
              for e in kubernetes.watch.Watch().stream(core.list_namespaced_pod, namespace, resource_version=since, timeout_seconds=1)]
    assert events == [("MODIFIED", 5), ("MODIFIED", 2), ("MODIFIED", 2), ("DELETED", 2)]

    core.create_namespaced_pod(namespace, pod("defaulted", nodeName="n1"))
    core.delete_namespaced_pod("defaulted", namespace)
    assert core.read_namespaced_pod("defaulted", namespace).metadata.deletion_grace_period_seconds == 30
    core.delete_namespaced_pod("defaulted", namespace, body={"gracePeriodSeconds": 0})  # force, from the body
    assert gone("defaulted")

    core.create_namespaced_pod(namespace, pod("unbound"))
    core.delete_namespaced_pod("unbound", namespace, grace_period_seconds=30)
    assert gone("unbound")
    core.create_namespaced_pod(namespace, pod("finished", nodeName="n1"))
    core.patch_namespaced_pod_status("finished", namespace, {"status": {"phase": "Succeeded"}})
    core.delete_namespaced_pod("finished", namespace)
    assert gone("finished")

    core.create_namespaced_pod(namespace, {**pod("held", nodeName="n1"), "metadata": {"name": "held", "finalizers": ["unbroken.dev/x"]}})
    core.delete_namespaced_pod("held", namespace, grace_period_seconds=10)
    core.delete_namespaced_pod("held", namespace, grace_period_seconds=0)
    held = core.read_namespaced_pod("held", namespace)
    assert held.metadata.deletion_timestamp is not None and held.metadata.deletion_grace_period_seconds == 0
    core.patch_namespaced_pod("held", namespace, [{"op": "remove", "path": "/metadata/finalizers"}])
    assert gone("held")

    core.create_namespaced_config_map(namespace, {"metadata": {"name": "cm"}})  # other resources: deleted at once
    core.delete_namespaced_config_map("cm", namespace, grace_period_seconds=30)
    assert core.list_namespaced_config_map(namespace).items == []


def test_watch_delivers_added_modified_deleted(api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Emulated: a chunked JSON-lines watch stream fed by the emulator's event log, with a label selector
    filtered server-side by the fixture; the stream ends after timeoutSeconds."""
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, {"metadata": {"name": "sentinel", "labels": {"w": "yes"}}})
    events: list[tuple[str, str, int]] = []
    started = threading.Event()
    watch = kubernetes.watch.Watch()

    def consume() -> None:
        for event in watch.stream(core.list_namespaced_pod, namespace, label_selector="w=yes", timeout_seconds=10):
            obj = event["object"]
            events.append((event["type"], obj.metadata.name, int(obj.metadata.resource_version)))
            if obj.metadata.name == "sentinel":
                started.set()
            if (event["type"], obj.metadata.name) == ("DELETED", "p"):
                watch.stop()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    assert started.wait(5), "the watch did not deliver the existing pod"
    core.create_namespaced_pod(namespace, {"metadata": {"name": "p", "labels": {"w": "yes"}}})
    core.create_namespaced_pod(namespace, {"metadata": {"name": "unlabelled"}})
    core.patch_namespaced_pod("p", namespace, {"metadata": {"annotations": {"a": "1"}}})
    core.delete_namespaced_pod("p", namespace)
    thread.join(10)
    assert not thread.is_alive()
    assert [(t, n) for t, n, _ in events] == [("ADDED", "sentinel"), ("ADDED", "p"), ("MODIFIED", "p"), ("DELETED", "p")]
    versions = [v for _, _, v in events[1:]]
    assert versions == sorted(versions) and len(set(versions)) == 3


def test_watch_resumes_from_a_resource_version_and_times_out(api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Emulated: watch?resourceVersion=N replays the events after N from the fixture's event log (no initial
    ADDED burst), as a real API server does; timeoutSeconds closes the stream server-side."""
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "old"}})
    since = core.list_namespaced_config_map(namespace).metadata.resource_version
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "new"}, "data": {"k": "1"}})
    core.patch_namespaced_config_map("new", namespace, {"data": {"k": "2"}})
    core.delete_namespaced_config_map("old", namespace)

    started = time.monotonic()
    seen = [(e["type"], e["object"].metadata.name)
            for e in kubernetes.watch.Watch().stream(core.list_namespaced_config_map, namespace, resource_version=since, timeout_seconds=1)]
    assert seen == [("ADDED", "new"), ("MODIFIED", "new"), ("DELETED", "old")]
    assert time.monotonic() - started < 5


def test_selectors_are_applied_by_the_server(api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Emulated: labelSelector/fieldSelector filtering, done by the fixture (kmock itself ignores both)."""
    core = kubernetes.client.CoreV1Api(api)
    for name, labels, node in [("a", {"app": "t", "rank": "0"}, "n1"), ("b", {"app": "t", "rank": "1"}, "n2"), ("c", {"app": "x"}, "n1")]:
        core.create_namespaced_pod(namespace, {"metadata": {"name": name, "labels": labels}, "spec": {"nodeName": node, "containers": CONTAINERS}})

    def names(**kwargs: str) -> list[str]:
        return [p.metadata.name for p in core.list_namespaced_pod(namespace, **kwargs).items]

    assert names(label_selector="app=t") == ["a", "b"]
    assert names(label_selector="app=t,rank!=0") == ["b"]
    assert names(label_selector="rank in (0,1),app notin (x)") == ["a", "b"]
    assert names(label_selector="!rank") == ["c"]
    assert names(field_selector="spec.nodeName=n1") == ["a", "c"]
    assert names(field_selector="metadata.name!=a,status.phase=Pending") == ["b", "c"]
    first = core.list_namespaced_pod(namespace, limit=2)
    assert [p.metadata.name for p in first.items] == ["a", "b"] and first.metadata._continue
    assert names(limit="2", _continue=first.metadata._continue) == ["c"]
    with pytest.raises(ApiException) as caught:
        core.list_namespaced_pod(namespace, label_selector="app in (")
    assert caught.value.status == 400


def test_pytorchjob_custom_object(api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Emulated: kubeflow.org/v1 PyTorchJob as a namespaced custom resource (no training operator behind it):
    create, merge-patch, list, /status, and the 415 a real server gives for strategic merge on a CR."""
    custom = kubernetes.client.CustomObjectsApi(api)
    gvp = ("kubeflow.org", "v1", namespace, "pytorchjobs")
    body = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "train"},
            "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 2}}}}
    created = custom.create_namespaced_custom_object(*gvp, body)
    assert created["metadata"]["generation"] == 1
    patched = custom.patch_namespaced_custom_object(*gvp, "train", {"spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 4}}}})
    assert patched["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 4
    assert patched["metadata"]["generation"] == 2 and rv(patched) > rv(created)
    status = custom.patch_namespaced_custom_object_status(*gvp, "train", {"status": {"conditions": [{"type": "Running", "status": "True"}]}})
    assert status["status"]["conditions"][0]["type"] == "Running" and status["metadata"]["generation"] == 2
    listed = custom.list_namespaced_custom_object(*gvp)
    assert [o["metadata"]["name"] for o in listed["items"]] == ["train"]
    assert custom.list_namespaced_custom_object("kubeflow.org", "v1", "default", "pytorchjobs")["items"] == []
    with pytest.raises(ApiException) as caught:
        raw_patch(api, f"/apis/kubeflow.org/v1/namespaces/{namespace}/pytorchjobs/train", {"spec": {}}, "application/strategic-merge-patch+json")
    assert caught.value.status == 415
    trainjob = custom.create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs",
                                                      {"metadata": {"name": "tj"}, "spec": {"runtimeRef": {"name": "torch"}}})
    assert trainjob["kind"] == "TrainJob" and trainjob["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    custom.delete_namespaced_custom_object(*gvp, "train")
    assert custom.list_namespaced_custom_object(*gvp)["items"] == []


def test_leases_create_patch_and_optimistic_replace(api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Emulated: coordination.k8s.io/v1 Leases with resourceVersion preconditions (409 on a stale PUT),
    which is what leader election relies on. Nothing expires a lease: holders and tests renew/patch it."""
    coordination = kubernetes.client.CoordinationV1Api(api)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease = coordination.create_namespaced_lease(namespace, {"metadata": {"name": "leader"},
                                                             "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15, "renewTime": now}})
    renewed = coordination.patch_namespaced_lease("leader", namespace, {"spec": {"leaseTransitions": 1}})
    assert renewed.spec.holder_identity == "a" and renewed.spec.lease_transitions == 1
    assert rv(renewed) > rv(lease)

    lease.spec.holder_identity = "b"  # stale: carries the creation's resourceVersion
    with pytest.raises(ApiException) as caught:
        coordination.replace_namespaced_lease("leader", namespace, lease)
    assert caught.value.status == 409
    renewed.spec.holder_identity = "b"
    replaced = coordination.replace_namespaced_lease("leader", namespace, renewed)
    assert replaced.spec.holder_identity == "b" and rv(replaced) > rv(renewed)


def test_events_core_and_events_k8s_io(api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Emulated: core/v1 Events and events.k8s.io/v1 Events as two separate stores (a real server shows
    every event in both); fieldSelector on involvedObject.name works."""
    core = kubernetes.client.CoreV1Api(api)
    for name, target in [("e1", "node-1"), ("e2", "node-2")]:
        core.create_namespaced_event(namespace, {
            "metadata": {"name": name}, "involvedObject": {"kind": "Node", "name": target}, "reason": "Quarantined",
            "message": f"{target} failed a check", "type": "Warning", "count": 1})
    listed = core.list_namespaced_event(namespace, field_selector="involvedObject.name=node-2")
    assert [(e.metadata.name, e.reason, e.type) for e in listed.items] == [("e2", "Quarantined", "Warning")]

    events = kubernetes.client.EventsV1Api(api)
    events.create_namespaced_event(namespace, {"metadata": {"generateName": "ev-"}, "eventTime": "2026-01-01T00:00:00.000000Z",
                                               "reason": "Restarted", "action": "Restart", "reportingController": "unbroken",
                                               "reportingInstance": "x", "regarding": {"kind": "Pod", "name": "p"}, "type": "Normal"})
    new_style = events.list_namespaced_event(namespace).items
    assert len(new_style) == 1 and new_style[0].metadata.name.startswith("ev-") and new_style[0].reason == "Restarted"
    assert len(core.list_namespaced_event(namespace).items) == 2  # not mirrored into core/v1


def test_resource_version_uid_generate_name_and_conflicts(api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Emulated by the fixture (kmock assigns none of these): resourceVersion grows on every write and not on
    a no-op patch; uid/creationTimestamp are set and immutable; generateName; 409 on duplicates; 404 for a
    missing namespace."""
    core = kubernetes.client.CoreV1Api(api)
    created = core.create_namespaced_config_map(namespace, {"metadata": {"generateName": "cfg-"}, "data": {"a": "1"}})
    name = created.metadata.name
    assert name.startswith("cfg-") and len(name) == len("cfg-") + 5
    assert created.metadata.uid and created.metadata.creation_timestamp is not None

    versions = [rv(created)]
    for value in ("2", "3"):
        versions.append(rv(core.patch_namespaced_config_map(name, namespace, {"data": {"a": value}})))
    noop = core.patch_namespaced_config_map(name, namespace, {"data": {"a": "3"}})
    sneaky = core.patch_namespaced_config_map(name, namespace, {"metadata": {"uid": "forged", "labels": {"x": "y"}}})
    versions.append(rv(sneaky))
    assert versions == sorted(versions) and len(set(versions)) == 4
    assert rv(noop) == versions[2]
    assert sneaky.metadata.uid == created.metadata.uid
    assert int(core.list_namespaced_config_map(namespace).metadata.resource_version) >= versions[-1]

    with pytest.raises(ApiException) as duplicate:
        core.create_namespaced_config_map(namespace, {"metadata": {"name": name}})
    assert duplicate.value.status == 409
    with pytest.raises(ApiException) as stale:
        core.patch_namespaced_config_map(name, namespace, {"metadata": {"resourceVersion": str(versions[0])}, "data": {"a": "4"}})
    assert stale.value.status == 409
    with pytest.raises(ApiException) as missing:
        core.create_namespaced_config_map("no-such-namespace", {"metadata": {"name": "x"}})
    assert missing.value.status == 404


def test_batch_job_jobset_and_namespace_deletion(api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Emulated: batch/v1 Jobs and jobset.x-k8s.io JobSets are stored (no controller creates pods for them);
    deleting a namespace deletes what is in it; deletecollection with a label selector."""
    batch = kubernetes.client.BatchV1Api(api)
    batch.create_namespaced_job(namespace, {"metadata": {"name": "j", "labels": {"k": "v"}}, "spec": {"template": {"spec": {"containers": CONTAINERS}}}})
    batch.create_namespaced_job(namespace, {"metadata": {"name": "keep"}, "spec": {"template": {"spec": {"containers": CONTAINERS}}}})
    custom = kubernetes.client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", {"metadata": {"name": "js"}, "spec": {}})
    assert kubernetes.client.CoreV1Api(api).list_namespaced_pod(namespace).items == []

    batch.delete_collection_namespaced_job(namespace, label_selector="k=v")
    assert [j.metadata.name for j in batch.list_namespaced_job(namespace).items] == ["keep"]

    kubernetes.client.CoreV1Api(api).delete_namespace(namespace)
    assert batch.list_namespaced_job(namespace).items == []
    assert custom.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets")["items"] == []


@needs_kubectl
def test_a_created_crd_becomes_a_served_resource(api: kubernetes.client.ApiClient, kubeconfig: Path, namespace: str) -> None:
    """Emulated: creating a CustomResourceDefinition registers its resource for discovery and storage
    (no schema validation, no conversion)."""
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": "widgets.example.dev"},
           "spec": {"group": "example.dev", "scope": "Namespaced",
                    "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"]},
                    "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                                  "schema": {"openAPIV3Schema": {"type": "object"}}}]}}
    kubectl(kubeconfig, "apply", "-f", "-", stdin=json.dumps(crd))
    kubectl(kubeconfig, "apply", "-n", namespace, "-f", "-",
            stdin=json.dumps({"apiVersion": "example.dev/v1", "kind": "Widget", "metadata": {"name": "w1"}, "spec": {"size": 1}}))
    kubectl(kubeconfig, "apply", "-n", namespace, "-f", "-",
            stdin=json.dumps({"apiVersion": "example.dev/v1", "kind": "Widget", "metadata": {"name": "w1"}, "spec": {"size": 2}}))
    assert kubectl(kubeconfig, "get", "wd", "-n", namespace, "-o", "jsonpath={.items[0].spec.size}") == "2"
    got = kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object("example.dev", "v1", namespace, "widgets", "w1")
    assert got["metadata"]["generation"] == 2


KOPF_OPERATOR = '''
import kopf

@kopf.on.create("pods")
def seen(patch, **_):
    patch.metadata.annotations["seen-by"] = "kopf"
    patch.status["note"] = "hello"

@kopf.on.delete("pods")
def gone(**_):
    pass  # its existence makes kopf put a finalizer on every pod it serves

@kopf.on.field("nodes", field="metadata.labels", labels={"kopf-test": "yes"})
def labels(new, patch, **_):
    patch.metadata.annotations["labels-seen"] = ",".join(sorted(new or {}))
'''


def test_kopf_operator_watches_and_patches(api: kubernetes.client.ApiClient, kubeconfig: Path, namespace: str, tmp_path: Path) -> None:
    """Emulated: the API server only. A real ``kopf run --standalone -n NS`` process discovers resources, lists
    and watches pods (namespaced) and nodes (cluster-scoped, served even by a namespaced operator), patches
    metadata and /status, adds its finalizer and removes it on deletion -- all through the emulator."""
    core = kubernetes.client.CoreV1Api(api)
    (tmp_path / "operator.py").write_text(KOPF_OPERATOR)
    node = f"node-{uuid.uuid4().hex[:6]}"
    log = tmp_path / "kopf.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kopf", "run", "--standalone", "-n", namespace, str(tmp_path / "operator.py")],
                                env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=out, stderr=subprocess.STDOUT)
    try:
        core.create_namespaced_pod(namespace, {"metadata": {"name": "p"}, "spec": {"containers": CONTAINERS}})
        core.create_node({"metadata": {"name": node, "labels": {"kopf-test": "yes"}}})
        pod = wait_until(lambda: (p := core.read_namespaced_pod("p", namespace)).metadata.annotations and p, 20, "kopf to annotate the pod")
        assert pod.metadata.annotations["seen-by"] == "kopf"
        assert pod.metadata.finalizers == ["kopf.zalando.org/KopfFinalizerMarker"]
        assert pod.status.phase == "Pending"  # kopf wrote status through /status, which kept the phase
        assert core.read_namespaced_pod_status("p", namespace).to_dict()["status"]["phase"] == "Pending"
        core.patch_node(node, {"metadata": {"labels": {"b": "2"}}})
        wait_until(lambda: (core.read_node(node).metadata.annotations or {}).get("labels-seen") == "b,kopf-test", 20, "kopf to see the node's labels")

        core.delete_namespaced_pod("p", namespace)  # kopf's finalizer holds it until kopf's on.delete ran

        def gone() -> bool:
            try:
                core.read_namespaced_pod("p", namespace)
            except ApiException as e:
                return e.status == 404
            return False

        wait_until(gone, 20, "kopf to release its finalizer")
    finally:
        stop_process(proc)
        core.delete_node(node)
    assert "Traceback" not in log.read_text(), log.read_text()
