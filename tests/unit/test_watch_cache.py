"""The operator's watch caches against a real kube-apiserver (tests/controlplane): a LIST, then a WATCH, and
the store's every-pass reads served from memory (counted by the API server's own apiserver_request_total)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest

from controlplane.cluster import ControlPlane
from kube_objects import make_job
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.backend import ConditionRemediator, KubernetesBackend
from unbroken.kubernetes.backend.client import api_client
from unbroken.kubernetes.backend.store import KubernetesStore
from unbroken.kubernetes.backend.watch_cache import WatchCache
from unbroken.kubernetes.backend.workloads import PYTORCHJOB
from unbroken.state.phases import NodeState, WorkerPhase
from unbroken.state.records import Desired
from unbroken.state.updates import NodeUpdate
from unbroken.plumbing.waiting import wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def api(kubeconfig: Path) -> kubernetes.client.ApiClient:
    return api_client(kubeconfig)


@pytest.fixture
def watched(api: kubernetes.client.ApiClient, namespace: str) -> Iterator[KubernetesStore]:
    store = KubernetesStore(api, namespace, job_namespace=namespace)
    caches = store.start_watches()
    wait_until(caches.synced, 20, "the caches never listed")
    yield store
    store.stop_watches()


def make_node(api: kubernetes.client.ApiClient) -> str:
    name = f"node-{uuid.uuid4().hex[:6]}"
    kubernetes.client.CoreV1Api(api).create_node({
        "metadata": {"name": name},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    })
    return name


def test_a_cache_lists_once_then_follows_adds_changes_and_deletes(api: kubernetes.client.ApiClient) -> None:
    core = kubernetes.client.CoreV1Api(api)
    before = make_node(api)
    cache = WatchCache("nodes", kubernetes.client.CoreV1Api(api_client_copy(api)).list_node, kind="Node", api_version="v1")
    cache.start()
    try:
        assert cache.wait_synced(20)
        assert cache.get("", before) is not None, "an object that existed before is in the first list"
        assert cache.get("", before)["kind"] == "Node", "list items are typed as a GET's answer is"
        added = make_node(api)
        wait_until(lambda: cache.get("", added) is not None, 10, "an added Node never arrived")
        core.patch_node(added, {"metadata": {"labels": {"example.com/seen": "yes"}}})
        wait_until(lambda: (cache.get("", added)["metadata"].get("labels") or {}).get("example.com/seen") == "yes",
                   10, "a change never arrived")
        core.delete_node(before)
        wait_until(lambda: cache.get("", before) is None, 10, "a deleted Node stayed")
        assert cache.lists == 1, "one LIST; everything after came by watch"
    finally:
        cache.stop()


def api_client_copy(api: kubernetes.client.ApiClient) -> kubernetes.client.ApiClient:
    return kubernetes.client.ApiClient(api.configuration)


def test_the_stores_every_pass_reads_come_from_memory(k8s: ControlPlane, api: kubernetes.client.ApiClient,
                                                      watched: KubernetesStore) -> None:
    node = make_node(api)
    wait_until(lambda: any(n.name == node for n in watched.list_nodes()), 10, "the cache to catch up")
    watched.renew_lease(node, at=1_700_000_000.0)
    wait_until(lambda: node in watched._leases(), 10, "the agent's Lease never reached the cache")
    lists = {resource: k8s.requests_answered({"LIST"}, resource) for resource in ("nodes", "leases", "pytorchjobs", "pods")}
    for _ in range(20):  # twenty passes' worth of reads
        watched.list_nodes()
        watched.list_jobs()
        watched.lease_progress()
        watched.kind_pods(PYTORCHJOB)
    after = {resource: k8s.requests_answered({"LIST"}, resource) for resource in lists}
    assert after == lists, f"LIST requests during 20 passes: {lists} -> {after}"


def test_the_operators_own_write_is_read_back_at_once(api: kubernetes.client.ApiClient, watched: KubernetesStore) -> None:
    node = make_node(api)
    wait_until(lambda: any(n.name == node for n in watched.list_nodes()), 10, "the cache to catch up")
    watched.caches.nodes.stop()  # no watch to bring the write: only the write's own answer can
    watched.update_node(node, NodeUpdate(state=NodeState.UNSCHEDULABLE))
    assert next(n for n in watched.list_nodes() if n.name == node).state is NodeState.UNSCHEDULABLE


def test_an_older_version_never_replaces_a_newer_one(api: kubernetes.client.ApiClient) -> None:
    cache = WatchCache("nodes", kubernetes.client.CoreV1Api(api).list_node)
    cache.observe({"metadata": {"name": "n", "resourceVersion": "20", "labels": {"v": "new"}}})
    cache.observe({"metadata": {"name": "n", "resourceVersion": "19", "labels": {"v": "old"}}})
    assert cache.get("", "n")["metadata"]["labels"]["v"] == "new"


def test_a_write_answer_for_an_object_deleted_since_never_brings_it_back(api: kubernetes.client.ApiClient) -> None:
    """The operator's delete of a pod the kubelet removes at once: its DELETED event can come before the delete's
    answer is put into the copy. Put back, the pod would stay in the copy for good (no event removes it again)
    and hold every restart that waits for it."""
    core = kubernetes.client.CoreV1Api(api)
    name = f"node-{uuid.uuid4().hex[:6]}"
    created = json.loads(core.create_node({"metadata": {"name": name}}, _preload_content=False).data)
    cache = WatchCache("nodes", kubernetes.client.CoreV1Api(api_client_copy(api)).list_node, kind="Node", api_version="v1")
    cache.start()
    try:
        assert cache.wait_synced(20)
        wait_until(lambda: cache.get("", name) is not None, 10, "the node in the copy")
        core.delete_node(name)
        wait_until(lambda: cache.get("", name) is None, 10, "the DELETED event")
        cache.observe(created)  # the answer of a write older than the delete
        assert cache.get("", name) is None, "a deleted object came back from an older write's answer"

        cache.stop()  # no watch: only the answer of a write the copy has not read yet can bring this one
        later = f"node-{uuid.uuid4().hex[:6]}"
        cache.observe(json.loads(core.create_node({"metadata": {"name": later}}, _preload_content=False).data))
        assert cache.get("", later) is not None, "a write newer than anything the copy has read is taken"
    finally:
        cache.stop()


def test_a_relist_keeps_the_operators_writes_that_the_list_predates() -> None:
    """A list at ``resourceVersion=0`` is served from the API server's cache and may be older than a write the operator
    just put into the copy: the copy keeps that write (the watch from the list's version replays it) rather than going
    back to the listed version meanwhile. The list stands in for the API server here: only its answer's body is read."""
    listing = {"metadata": {"resourceVersion": "100"},
               "items": [{"metadata": {"name": "a", "resourceVersion": "90", "labels": {"v": "listed"}}},
                         {"metadata": {"name": "c", "resourceVersion": "95", "labels": {"v": "listed"}}}]}
    answer = type("Answer", (), {"data": json.dumps(listing).encode()})()
    cache = WatchCache("nodes", lambda *args, **kwargs: answer)
    cache.observe({"metadata": {"name": "a", "resourceVersion": "120", "labels": {"v": "written"}}})
    cache.observe({"metadata": {"name": "b", "resourceVersion": "110"}})
    cache.observe({"metadata": {"name": "c", "resourceVersion": "80", "labels": {"v": "written"}}})
    cache._list()
    assert cache.get("", "a")["metadata"]["labels"]["v"] == "written", "a write newer than the list stays"
    assert cache.get("", "b") is not None, "an object created after the list's version stays"
    assert cache.get("", "c")["metadata"]["labels"]["v"] == "listed", "the list is newer than this write"
    cache.observe({"metadata": {"name": "d", "resourceVersion": "99"}})
    assert cache.get("", "d") is None, "not in a list at 100: deleted by then"


def test_the_operators_pod_delete_is_read_back_at_once_so_a_restart_waits_for_that_pod(
        api: kubernetes.client.ApiClient, watched: KubernetesStore, namespace: str) -> None:
    """A restart deletes the attempt's pods and waits until they have stopped. A pod whose container failed and that
    the kubelet restarts in place (OnFailure) reads as stopped when it is not being deleted; read as it was before
    the delete (the watch not there yet), the next pass launched the next attempt beside the old container."""
    job = make_job(api, namespace, {names.AUTO_RESUME: "true", names.MAX_RETRY: "2"})
    pod = f"{job}-worker-0"
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": pod, "labels": {PYTORCHJOB.pod_label: job, PYTORCHJOB.replica_type_label: "worker"},
                     "annotations": {names.ATTEMPT: "0"}},
        "spec": {"nodeName": make_node(api), "containers": [{"name": "pytorch", "image": "img"}]}})
    core.patch_namespaced_pod_status(pod, namespace, {"status": {"phase": "Running", "containerStatuses": [{
        "name": "pytorch", "image": "img", "imageID": "", "ready": False, "restartCount": 1,
        "state": {"waiting": {"reason": "ContainerCreating"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}]}})
    backend = KubernetesBackend(watched, ConditionRemediator(watched))
    wait_until(lambda: [w.phase for w in backend.observe_attempt(f"{namespace}/{job}", 0)] == [WorkerPhase.FAILED], 10,
               "the failed worker in the copy")

    watched.caches.pods[PYTORCHJOB.kind].stop()  # the delete's mark can only come from its own answer
    backend.stop_attempt(f"{namespace}/{job}", 0)
    workers = backend.observe_attempt(f"{namespace}/{job}", 0)
    assert [(w.phase, w.desired) for w in workers] == [(WorkerPhase.PENDING, Desired.STOP)], workers


def test_a_resource_whose_crd_is_missing_is_empty_not_an_error(api: kubernetes.client.ApiClient) -> None:
    cache = WatchCache("widgets", kubernetes.client.CustomObjectsApi(api_client_copy(api)).list_cluster_custom_object,
                       "example.com", "v1", "widgets")
    cache.start()
    try:
        assert cache.wait_synced(20)
        assert cache.absent and cache.objects() == []
    finally:
        cache.stop()


def test_a_cache_keeps_its_copy_through_an_api_server_outage_and_catches_up(
        k8s: ControlPlane, api: kubernetes.client.ApiClient, watched: KubernetesStore) -> None:
    """Runs last in this module: it stops the module's kube-apiserver (the fixture's server is this module's own)."""
    node = make_node(api)
    wait_until(lambda: any(n.name == node for n in watched.list_nodes()), 10, "the cache to catch up")
    k8s.stop_apiserver()
    try:
        assert any(n.name == node for n in watched.list_nodes()), "the copy is kept while the server is away"
    finally:
        k8s.start_apiserver()
    later = make_node(api)
    wait_until(lambda: any(n.name == later for n in watched.list_nodes()), 30, "the watch never came back after the outage")
