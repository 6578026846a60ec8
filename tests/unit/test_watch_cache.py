"""The operator's watch caches against a real kube-apiserver (tests/controlplane): a LIST, then a WATCH, and
the store's every-pass reads served from memory (counted by the API server's own apiserver_request_total)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import kubernetes
import pytest

from controlplane.cluster import ControlPlane
from unbroken.kubernetes.backend.client import api_client
from unbroken.kubernetes.backend.store import KubernetesStore
from unbroken.kubernetes.backend.watch_cache import WatchCache
from unbroken.kubernetes.backend.workloads import PYTORCHJOB
from unbroken.state.phases import NodeState
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
