"""What every part of the Kubernetes store shares: the API clients, the watch caches, raw JSON reads,
and the read-decide-write loop that retries a write refused for a conflict."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import kubernetes

from unbroken.errors import NotFoundError, StoreUnavailable
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.api import ApiConflict, call
from unbroken.kubernetes.backend.heartbeats import HeartbeatBoard
from unbroken.kubernetes.backend.watch_cache import WatchCache, own_client
from unbroken.kubernetes.backend.workloads import KINDS, WorkloadKind
from unbroken.state.phases import check_transition
from unbroken.state.records import Job, Node
from unbroken.state.store import check_version
from unbroken.state.updates import JobUpdate, NodeUpdate

log = logging.getLogger(__name__)

T = TypeVar("T")
WRITE_RETRIES = 5
MANAGED_BY = "app.kubernetes.io/managed-by"
AGENT_LEASE_SELECTOR = f"{MANAGED_BY}={names.COMPONENT}"
"""The agents' Leases carry this label (the leader Lease does not)."""


@dataclass(frozen=True)
class StoreCaches:
    """The operator's watch caches, one per resource it reads every pass, each with its own connection."""

    nodes: WatchCache
    leases: WatchCache | None
    """None: this reader does not follow the agents' Leases (an agent: it needs no other node's heartbeat)."""
    workloads: dict[str, WatchCache]
    """By workload kind (``PyTorchJob``, ``TrainJob``)."""
    pods: dict[str, WatchCache]
    """The training pods of each workload kind, by kind (empty: not followed)."""

    @classmethod
    def open(cls, store: StoreCore, on_change: Callable[[], None] | None, *, leases: bool = True,
             pods: bool = True) -> StoreCaches:
        def client() -> kubernetes.client.ApiClient:
            return own_client(store.api)

        workloads: dict[str, WatchCache] = {}
        pod_caches: dict[str, WatchCache] = {}
        for kind in store.kinds:
            custom = kubernetes.client.CustomObjectsApi(client())
            core = kubernetes.client.CoreV1Api(client())
            # a namespaced list takes the namespace first; the cluster-wide one takes nothing in its place
            namespace: tuple[str, ...] = (store.job_namespace,) if store.job_namespace else ()
            list_workloads = custom.list_namespaced_custom_object if namespace else custom.list_cluster_custom_object
            list_pods = core.list_namespaced_pod if namespace else core.list_pod_for_all_namespaces
            workloads[kind.kind] = WatchCache(kind.plural, list_workloads, kind.group, kind.version, *namespace,
                                              kind.plural, kind=kind.kind, api_version=kind.api_version,
                                              on_change=on_change)
            if pods:
                pod_caches[kind.kind] = WatchCache(f"{kind.plural}-pods", list_pods, *namespace,
                                                   label_selector=kind.pods_selector(), on_change=on_change)
        caches = cls(
            nodes=WatchCache("nodes", kubernetes.client.CoreV1Api(client()).list_node, kind="Node", api_version="v1",
                             on_change=on_change),
            # A renewal changes nothing to decide on (silence is measured against the clock): no wake-up.
            leases=WatchCache("leases", kubernetes.client.CoordinationV1Api(client()).list_namespaced_lease,
                              store.namespace, label_selector=AGENT_LEASE_SELECTOR) if leases else None,
            workloads=workloads, pods=pod_caches,
        )
        for cache in caches.all():
            cache.start()
        return caches

    def all(self) -> list[WatchCache]:
        return [self.nodes, *([self.leases] if self.leases else []), *self.workloads.values(), *self.pods.values()]

    def synced(self) -> bool:
        return all(cache.synced for cache in self.all())

    def stop(self) -> None:
        for cache in self.all():
            cache.stop()


class StoreCore():
    """The state every part of the store reads: the clients, namespaces, watch caches and what was last
    seen of the objects' kinds and uids. ``namespace``: the operator's (leases, the cluster ConfigMap);
    ``job_namespace``: where annotated jobs are watched (None: every namespace)."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str, *, job_namespace: str | None = None,
                 kinds: Sequence[WorkloadKind] = KINDS) -> None:
        self.api = api
        self.namespace = namespace
        self.job_namespace = job_namespace
        self.kinds = tuple(kinds)
        self.core = kubernetes.client.CoreV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.coordination = kubernetes.client.CoordinationV1Api(api)
        self._uids: dict[tuple[str, str], str] = {}
        self._node_uids: dict[str, str] = {}
        self._cluster_configmap_uid = ""
        self._kinds: dict[str, WorkloadKind] = {}  # by job name, as last seen
        self.heartbeats: HeartbeatBoard | None = None
        """The operator's: what it heard from the agents by datagram (None elsewhere: the Leases alone)."""
        self.lease_renew_seconds = 10.0
        self.heartbeat_interval = 1.0
        self._datagrams_down_since: float | None = None
        """Since when most nodes' datagrams have stopped at once (``_judge_datagrams``); None while they arrive."""
        self.caches: StoreCaches | None = None
        """The operator's watch caches (:meth:`start_watches`); None elsewhere: every read asks the API server."""

    def start_watches(self, on_change: Callable[[], None] | None = None, *, leases: bool = True,
                      pods: bool = True) -> StoreCaches:
        """Keep Nodes, the workloads, and (``leases``, ``pods``) the agents' Leases and the workloads' pods in
        memory from now on (kubernetes/backend/watch_cache.py): the reads every pass makes come from there
        once each has been listed. ``on_change`` is called on every change (the operator's loop wakes on it).
        A reader without ``leases`` sees no agent's Lease (an agent: the kubelet's Ready alone vouches)."""
        self.caches = StoreCaches.open(self, on_change, leases=leases, pods=pods)
        return self.caches

    def stop_watches(self) -> None:
        if self.caches is not None:
            self.caches.stop()

    def _json(self, request: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        response = call(lambda: request(*args, _preload_content=False, **kwargs))
        return json.loads(response.data)

    def node_object(self, name: str) -> dict[str, Any]:
        """The Node as the API serves it (JSON: the client's model refuses a Node missing any nodeInfo field);
        NotFoundError naming it if there is none."""
        try:
            obj: dict[str, Any] = self._json(self.core.read_node, name)
        except NotFoundError:
            raise NotFoundError(f"node {name} not found (no Node of that name in the cluster)") from None
        return obj

    def node_objects(self) -> list[dict[str, Any]]:
        """Every Node as the API serves it (the watch cache's copy, else one list call)."""
        if self.caches is not None and self.caches.nodes.synced:
            return self.caches.nodes.objects()
        items: list[dict[str, Any]] = self._json(self.core.list_node)["items"]
        return items

    def _node_uid(self, name: str) -> str:
        """The Node's uid, as last read (one GET for a Node not read yet; "" for one that is gone)."""
        if name not in self._node_uids:
            try:
                self._node_uids[name] = self._json(self.core.read_node, name)["metadata"].get("uid", "")
            except NotFoundError:
                return ""
        return self._node_uids[name]


def opted_in(obj: dict[str, Any]) -> bool:
    return names.AUTO_RESUME in (obj["metadata"].get("annotations") or {})


def job_name_of(obj: dict[str, Any]) -> str:
    return f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"


R = TypeVar("R", Node, Job)


def updated_record(what: str, current: R, update: NodeUpdate | JobUpdate, expect_version: int | None, lifecycle_field: str,
             transitions: dict[Any, frozenset[Any]], changed_at_field: str) -> R:
    """``current`` with ``update`` applied and its version bumped, as the SQLite store does it: the
    version checked, a lifecycle change checked against its table and time-stamped."""
    check_version(what, current.version, expect_version)
    changes = update.changes()
    if lifecycle_field in changes:
        check_transition(what, transitions, getattr(current, lifecycle_field), changes[lifecycle_field])
        if changes[lifecycle_field] != getattr(current, lifecycle_field):
            changes[changed_at_field] = time.time()
    return replace(current, **changes, version=current.version + 1)


def retry_conflicts(what: str, attempt: Callable[[], T]) -> T:
    """Run a read-decide-write ``attempt`` again while the API server answers 409 (someone else —
    the kubelet, kubectl label — wrote the object since it was read)."""
    for _ in range(WRITE_RETRIES):
        try:
            return attempt()
        except ApiConflict:
            continue
    raise StoreUnavailable(f"{what}: {WRITE_RETRIES} conflicting writes in a row")
