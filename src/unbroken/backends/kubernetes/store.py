"""``ClusterStore`` on a Kubernetes API: every method is one object read or write.

| unbroken | Kubernetes |
|---|---|
| node | the Node: labels ``unbroken.dev/node-health-status``, ``deep-health-check-status``, ``fault-types``, ``fault-reasons``; annotations ``fault-details`` and ``node-state`` (the full record); the taint ``unbroken.dev/node-health-status=Unschedulable:NoSchedule`` while not Schedulable; the condition ``UnbrokenHealthy`` |
| node heartbeat | the signed datagrams the operator hears (``heartbeats``, backends/kubernetes/heartbeats.py), and the Lease ``unbroken-node-<node>`` in the operator's namespace, renewed by the node agent every ``LeaseRenewSeconds`` (``_heartbeat`` says how they combine with the kubelet's ``Ready``) |
| job | an annotated PyTorchJob or TrainJob (backends/kubernetes/workloads.py): ``unbroken.dev/job-state`` (phase, attempt, reason, times, version), mirrored for people in ``unbroken.dev/phase`` and ``unbroken.dev/restart-count`` |
| event | a core/v1 Event on the node or the workload (``reportingComponent: unbroken.dev/operator``) |
| cluster record | ConfigMap ``unbroken-cluster`` (key ``cluster.yaml``; status in ``status``) |

Job names are ``<namespace>/<name>``; where a PyTorchJob and a TrainJob share one,
the PyTorchJob is the job and the TrainJob is reported invalid. A workload kind
whose CRD is not installed has no jobs. Versions: each record keeps its own
counter in its annotation; a conditional write re-reads the object and sends
its ``resourceVersion`` with the patch, so a write that raced another is refused
by the API server (409) and retried against the fresh object, and only a
change of unbroken's own counter is a :class:`StaleUpdate`. Kubelet status
updates and label edits by others therefore never make the reconcilers' writes stale.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

import kubernetes
import yaml

from unbroken.config.cluster import ClusterConfig
from unbroken.backends.crowd import most_silent_at_once
from unbroken.config.job import JobSpec, ResilienceSpec, RestartPolicy
from unbroken.errors import ConfigError, NotFoundError, StoreUnavailable, UsageError
from unbroken.backends.kubernetes import annotations as job_annotations
from unbroken.backends.kubernetes import heartbeats, names
from unbroken.backends.kubernetes.api import STRICT, ApiConflict, call, format_time, parse_time
from unbroken.backends.kubernetes.heartbeats import HeartbeatBoard, progress_from_json, progress_to_json
from unbroken.backends.kubernetes.annotations import AnnotationError
from unbroken.backends.kubernetes.watch_cache import WatchCache, own_client
from unbroken.backends.kubernetes.workloads import KINDS, WorkloadKind, kind_of
from unbroken.state.phases import JOB_TRANSITIONS, NODE_TRANSITIONS, DeepHealthStatus, JobPhase, NodeState, check_transition
from unbroken.state.records import ClusterRecord, ClusterStatus, Event, EventType, Job, Node, WorkerProgress
from unbroken.state.store import check_version
from unbroken.state.updates import JobUpdate, NodeUpdate

log = logging.getLogger("unbroken.backends.kubernetes.store")

T = TypeVar("T")
NO_HANG_TIMEOUT = 10.0 ** 9
"""A job without ``hang-timeout-seconds`` has no hang detection (its ranks may not report progress)."""
WRITE_RETRIES = 5
FAULT_HISTORY = 10
DATAGRAMS_SILENT_AFTER_SECONDS = 2.0
"""A node unheard this long counts towards "most datagrams stopped at once" (agents beat every second)."""
LEASE_FALLBACK_RENEWALS = 2
"""How many Lease renewal periods of stopped datagrams before the Leases are the evidence for every node:
long enough that every live agent renewed in between, longer than an agent restart or a short stall."""
MANAGED_BY = "app.kubernetes.io/managed-by"
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
"""On the Kueue Workload of a job: the job's uid."""
AGENT_LEASE_SELECTOR = f"{MANAGED_BY}={names.COMPONENT}"
"""The agents' Leases carry this label (the leader Lease does not)."""


@dataclass(frozen=True)
class InvalidJob:
    """A job that opted in with annotations that do not parse: left alone, warned about."""

    name: str
    problems: tuple[str, ...]
    object_kind: str = "Job"
    """Whose Events to warn on: ``Job``, or the workload's own kind (``TrainJob``) when the job of
    that name is another object."""


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
    def open(cls, store: KubernetesStore, on_change: Callable[[], None] | None, *, leases: bool = True,
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


class KubernetesStore:
    """The cluster's state in the API server. ``namespace``: the operator's (leases, the cluster
    ConfigMap); ``job_namespace``: where annotated jobs are watched (None: every namespace)."""

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
        memory from now on (backends/kubernetes/watch_cache.py): the reads every pass makes come from there
        once each has been listed. ``on_change`` is called on every change (the operator's loop wakes on it).
        A reader without ``leases`` sees no agent's Lease (an agent: the kubelet's Ready alone vouches)."""
        self.caches = StoreCaches.open(self, on_change, leases=leases, pods=pods)
        return self.caches

    def stop_watches(self) -> None:
        if self.caches is not None:
            self.caches.stop()

    # -- raw JSON access (dicts, not the client's models: records read annotations by key) ----

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

    # -- the cluster object -------------------------------------------------------------

    def cluster(self) -> ClusterRecord:
        try:
            cm = self._json(self.core.read_namespaced_config_map, names.CLUSTER_CONFIGMAP, self.namespace)
        except NotFoundError:
            raise UsageError(f"ConfigMap {self.namespace}/{names.CLUSTER_CONFIGMAP} not found: is unbroken installed "
                             "(kubectl apply -k deploy/)?") from None
        data = cm.get("data") or {}
        try:
            config = ClusterConfig.model_validate(yaml.safe_load(data.get("cluster.yaml", "")) or {})
        except (ValueError, yaml.YAMLError) as exc:
            raise ConfigError(f"ConfigMap {self.namespace}/{names.CLUSTER_CONFIGMAP} key cluster.yaml: {exc}") from None
        return ClusterRecord(
            name=config.ClusterName, config_json=config.model_dump_json(),
            status=ClusterStatus(data.get("status", ClusterStatus.UP.value)),
            created_at=parse_time(cm["metadata"].get("creationTimestamp")) or 0.0,
            controller_metrics=data.get("controller-metrics") or None,
        )

    def _patch_cluster(self, data: dict[str, str | None]) -> None:
        call(lambda: self.core.patch_namespaced_config_map(names.CLUSTER_CONFIGMAP, self.namespace, {"data": data}, field_validation=STRICT))

    def set_cluster_status(self, status: ClusterStatus) -> None:
        self._patch_cluster({"status": status.value})

    def set_controller_metrics(self, address: str | None) -> None:
        self._patch_cluster({"controller-metrics": address})

    # -- nodes --------------------------------------------------------------------------

    def add_node(self, node: Node) -> None:
        raise UsageError("on Kubernetes, nodes join the cluster through the kubelet; unbroken does not create Node objects")

    def get_node(self, name: str) -> Node:
        return self._node(self.node_object(name), self._lease(name))

    def list_nodes(self) -> list[Node]:
        leases = self._leases()
        items = self.node_objects()
        self._judge_datagrams([obj["metadata"]["name"] for obj in items])
        return sorted((self._node(obj, leases.get(obj["metadata"]["name"])) for obj in items), key=lambda n: n.name)

    def _judge_datagrams(self, nodes: Sequence[str]) -> None:
        """Whether the datagrams get through (``_datagrams_down_since``): not while most of the nodes heard from
        (crowd.py, the disruption guard's rule) have been unheard for ``DATAGRAMS_SILENT_AFTER_SECONDS`` at once."""
        if self.heartbeats is None:
            return
        now = time.time()
        heard = [beat for node in nodes if (beat := self.heartbeats.heard(node)) is not None and not beat.leaving]
        unheard = sum(1 for beat in heard if now - beat.at > DATAGRAMS_SILENT_AFTER_SECONDS)
        if most_silent_at_once(unheard, len(heard)):
            if self._datagrams_down_since is None:
                self._datagrams_down_since = now
                log.warning("most nodes' heartbeat datagrams stopped at once", extra={"unheard": unheard, "heard": len(heard)})
        elif self._datagrams_down_since is not None:
            log.info("heartbeat datagrams are back", extra={"down_s": round(now - self._datagrams_down_since, 1)})
            self._datagrams_down_since = None

    def _lease_fallback(self) -> bool:
        """Datagrams have not been getting through to most nodes for ``LEASE_FALLBACK_RENEWALS`` renewals: the
        Leases are the evidence now (each agent has renewed since, if it lives)."""
        return (self._datagrams_down_since is not None
                and time.time() - self._datagrams_down_since >= LEASE_FALLBACK_RENEWALS * self.lease_renew_seconds)

    def _heartbeat(self, node: str, lease: float | None, *, ready: bool) -> float | None:
        """When the node was last known alive, from the datagrams the operator heard, the agent's Lease
        (``lease``: its renewTime) and the kubelet's ``Ready`` condition:

        - the datagrams, while they arrive, whatever ``Ready`` says: the node lifecycle controller writes
          NotReady for every node whose kubelet it could not see (e.g. after an API-server outage longer
          than its grace period) while the machines run on, and a dead machine's beats stop too;
        - while most nodes' datagrams have stopped at once (``_judge_datagrams``), the last datagram alone,
          Leases or not: the disruption guard sees the crowd silent and holds (a Lease renewed meanwhile
          would make the nodes that renewed first look alive and leave the last to renew judged alone);
          after ``LEASE_FALLBACK_RENEWALS`` renewals of that, the Lease vouches for every node as below,
          datagrams being what does not get through;
        - otherwise not ``Ready``: lost (0.0);
        - an agent that said it is leaving (SIGTERM: a rolling update) vouches for its node for
          ``AGENT_RESTART_GRACE_SECONDS``, until its successor's beats replace that;
        - a Lease renewed after the last datagram (a new leader not yet heard from, datagrams that do
          not get through) vouches until its next renewal is due: such a node is lost
          ``LeaseRenewSeconds`` later than one that is heard;
        - no Lease, no agent yet: the kubelet vouches (now); a reader that hears no datagrams (the CLI):
          the Lease as written."""
        heard = self.heartbeats.heard(node) if self.heartbeats is not None else None
        if heard is not None and not heard.leaving and not self._lease_fallback() and (
                lease is None or lease <= heard.at + self.heartbeat_interval or self._datagrams_down_since is not None):
            return heard.at
        if not ready:
            return 0.0
        if heard is not None and heard.leaving:
            return min(time.time(), heard.at + heartbeats.AGENT_RESTART_GRACE_SECONDS)
        if lease is None:
            return time.time()
        if self.heartbeats is None:
            return lease
        backstop = min(time.time(), lease + self.lease_renew_seconds)
        return max(backstop, heard.at) if heard is not None and not heard.leaving else backstop

    def _lease(self, node: str) -> float | None:
        """When ``node``'s agent last renewed its Lease (None: no agent has run there)."""
        try:
            lease = self._json(self.coordination.read_namespaced_lease, names.LEASE_PREFIX + node, self.namespace)
        except NotFoundError:
            return None
        return parse_time((lease.get("spec") or {}).get("renewTime"))

    def lease_annotations(self, name: str) -> dict[str, str]:
        """The annotations of the Lease ``name`` in unbroken's namespace (NotFoundError if there is none)."""
        lease = self._json(self.coordination.read_namespaced_lease, name, self.namespace)
        return dict(lease["metadata"].get("annotations") or {})

    def _agent_leases(self) -> dict[str, dict[str, Any]]:
        """The node agents' Leases, by node (other Leases in the namespace, the leader's, are not theirs)."""
        cache = self.caches.leases if self.caches is not None else None
        items: list[dict[str, Any]]
        if self.caches is not None and cache is None:
            items = []  # this reader does not follow them (start_watches)
        elif cache is not None and cache.synced:
            items = cache.objects()
        else:
            items = self._json(self.coordination.list_namespaced_lease, self.namespace,
                               label_selector=AGENT_LEASE_SELECTOR)["items"]
        return {lease["metadata"]["name"].removeprefix(names.LEASE_PREFIX): lease for lease in items
                if lease["metadata"]["name"].startswith(names.LEASE_PREFIX)}

    def _leases(self) -> dict[str, float]:
        renewed = {node: parse_time((lease.get("spec") or {}).get("renewTime")) for node, lease in self._agent_leases().items()}
        return {node: at for node, at in renewed.items() if at is not None}

    def lease_progress(self) -> dict[tuple[str, int, str], WorkerProgress]:
        """What the node agents last reported of the ranks on their nodes, by (job, attempt, node):
        each agent writes its jobs' latest attempts into its Lease every renewal and sends them with
        every heartbeat datagram; a node's datagram, where one was heard, is the newer."""
        found = self._lease_progress()
        heard = self.heartbeats.everything() if self.heartbeats is not None else {}
        for node, beat in heard.items():
            for key in [k for k in found if k[2] == node]:
                del found[key]
            for report in beat.progress:
                found[(report.job, report.attempt, node)] = report
        return found

    def _lease_progress(self) -> dict[tuple[str, int, str], WorkerProgress]:
        found: dict[tuple[str, int, str], WorkerProgress] = {}
        for node, lease in self._agent_leases().items():
            text = (lease["metadata"].get("annotations") or {}).get(names.LEASE_PROGRESS)
            if not text:
                continue
            try:
                reports = [progress_from_json(entry) for entry in json.loads(text)]
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("Lease %s%s: unreadable %s annotation: %s", names.LEASE_PREFIX, node, names.LEASE_PROGRESS, exc)
                continue
            for report in reports:
                found[(report.job, report.attempt, node)] = report
        return found

    def _node_uid(self, name: str) -> str:
        """The Node's uid, as last read (one GET for a Node not read yet; "" for one that is gone)."""
        if name not in self._node_uids:
            try:
                self._node_uids[name] = self._json(self.core.read_node, name)["metadata"].get("uid", "")
            except NotFoundError:
                return ""
        return self._node_uids[name]

    def _node(self, obj: dict[str, Any], lease: float | None) -> Node:
        """``lease``: when the node's agent last renewed its Lease (None: no agent has run there)."""
        self._node_uids[obj["metadata"]["name"]] = obj["metadata"].get("uid", "")
        meta = obj["metadata"]
        labels = meta.get("labels") or {}
        saved = json.loads((meta.get("annotations") or {}).get(names.NODE_STATE, "{}") or "{}")
        ready: dict[str, Any] = next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})
        heartbeat = self._heartbeat(meta["name"], lease, ready=ready.get("status") == "True")
        address = next((a["address"] for a in (obj.get("status") or {}).get("addresses") or [] if a.get("type") == "InternalIP"),
                       meta["name"])
        spec = obj.get("spec") or {}
        if any(t.get("key") == names.TAINT_KEY for t in spec.get("taints") or []):
            default_state = NodeState.JOINING  # registered with unbroken's startup taint: check it before it takes work
        elif spec.get("unschedulable"):
            default_state = NodeState.UNSCHEDULABLE
        else:
            default_state = NodeState.SCHEDULABLE
        return Node(
            name=meta["name"],
            group=labels.get(f"{names.PREFIX}/instance-group", "default"),
            instance_type=labels.get("node.kubernetes.io/instance-type", "unknown"),
            state=NodeState(saved.get("state", default_state.value)),
            deep_health=DeepHealthStatus(saved.get("deep_health", labels.get(names.DEEP_HEALTH_CHECK_STATUS,
                                                                               DeepHealthStatus.NOT_RUN.value))),
            address=address,
            fault_type=saved.get("fault_type"),
            fault_reason=saved.get("fault_reason"),
            heartbeat_at=heartbeat,
            registered_at=saved.get("registered_at") or parse_time(meta.get("creationTimestamp")),
            state_changed_at=saved.get("state_changed_at") or parse_time(meta.get("creationTimestamp")) or 0.0,
            reboots=saved.get("reboots", 0),
            replaced_by=saved.get("replaced_by"),
            recovery_requested=saved.get("recovery_requested", False),
            metrics_address=saved.get("metrics_address"),
            version=saved.get("version", 0),
        )

    def update_node(self, name: str, update: NodeUpdate, *, expect_version: int | None = None) -> Node:
        lease = self._lease(name)  # not part of the write; read once for the record returned

        def attempt() -> Node:
            obj = self.node_object(name)
            current = self._node(obj, lease)
            new = _updated(f"node {name}", current, update, expect_version, "state", NODE_TRANSITIONS, "state_changed_at")
            written = self._json(self.core.patch_node, name, self._node_patch(obj, current, new), field_validation=STRICT)
            if self.caches is not None:
                self.caches.nodes.observe(written)
            return new

        new = _retry_conflicts(f"node {name}", attempt)
        self._set_condition(name, new)
        return new

    def _node_patch(self, obj: dict[str, Any], current: Node, new: Node) -> dict[str, Any]:
        meta = obj["metadata"]
        record = {k: v for k, v in asdict(new).items() if k not in ("name", "heartbeat_at", "address", "group", "instance_type")}
        annotations_patch: dict[str, str | None] = {names.NODE_STATE: json.dumps(record, sort_keys=True)}
        if new.fault_type and (new.fault_type, new.fault_reason) != (current.fault_type, current.fault_reason):
            history = json.loads((meta.get("annotations") or {}).get(names.FAULT_DETAILS, "[]") or "[]")
            history.append({"time": format_time(time.time()), "type": new.fault_type, "message": new.fault_reason or ""})
            annotations_patch[names.FAULT_DETAILS] = json.dumps(history[-FAULT_HISTORY:])
        faulty = new.state not in (NodeState.SCHEDULABLE, NodeState.UNSCHEDULABLE, NodeState.JOINING)
        labels: dict[str, str | None] = {
            names.NODE_HEALTH_STATUS: new.state.health_status_label,
            names.DEEP_HEALTH_CHECK_STATUS: None if new.deep_health is DeepHealthStatus.NOT_RUN else new.deep_health.value,
            names.FAULT_TYPES: names.label_value(new.fault_type) or None if faulty else None,
            names.FAULT_REASONS: names.label_value(new.fault_reason) or None if faulty else None,
        }
        others = [t for t in (obj.get("spec") or {}).get("taints") or [] if t.get("key") != names.TAINT_KEY]
        ours = [] if new.state is NodeState.SCHEDULABLE else [
            {"key": names.TAINT_KEY, "value": names.TAINT_VALUE, "effect": names.TAINT_EFFECT}]
        return {
            "metadata": {"labels": labels, "annotations": annotations_patch, "resourceVersion": meta["resourceVersion"]},
            "spec": {"taints": others + ours},
        }

    def _set_condition(self, name: str, node: Node) -> None:
        """``UnbrokenHealthy``: what external repair acts on. A separate write (nodes/status);
        re-applied on the node's next change if it fails."""
        healthy = node.state in (NodeState.SCHEDULABLE, NodeState.UNSCHEDULABLE, NodeState.JOINING)
        now = format_time(time.time())
        condition = {
            "type": names.CONDITION_TYPE, "status": "True" if healthy else "False",
            "reason": "Healthy" if healthy else condition_reason(node.fault_type, node.fault_reason),
            "message": (node.fault_reason or node.state.value)[:1024],
            "lastHeartbeatTime": now, "lastTransitionTime": now,
        }
        try:
            call(lambda: self.core.patch_node_status(name, {"status": {"conditions": [condition]}}, field_validation=STRICT))
        except (ApiConflict, StoreUnavailable) as exc:
            log.warning("node %s: condition %s not written: %s", name, names.CONDITION_TYPE, exc)

    def renew_lease(self, node: str, *, at: float, progress: Sequence[WorkerProgress] = ()) -> None:
        """One write: the Lease's renewTime, and the ranks' progress in its annotation."""
        stamp = format_time(at, micro=True)
        body = {
            "metadata": {"name": names.LEASE_PREFIX + node, "namespace": self.namespace,
                         "labels": {MANAGED_BY: names.COMPONENT},
                         "annotations": {names.LEASE_PROGRESS: json.dumps([progress_to_json(p) for p in progress])}},
            "spec": {"holderIdentity": node, "leaseDurationSeconds": int(4 * self.lease_renew_seconds), "renewTime": stamp},
        }
        try:
            call(lambda: self.coordination.patch_namespaced_lease(names.LEASE_PREFIX + node, self.namespace, body, field_validation=STRICT))
        except NotFoundError:
            call(lambda: self.coordination.create_namespaced_lease(self.namespace, body, field_validation=STRICT))

    # -- jobs ---------------------------------------------------------------------------

    def _workloads(self) -> list[dict[str, Any]]:
        """Every workload of every kind, the first kind's first: where two kinds use one name, the later
        object is a duplicate (see ``_duplicate``)."""
        items = []
        kinds: dict[str, WorkloadKind] = {}
        for kind in self.kinds:
            cache = self.caches.workloads.get(kind.kind) if self.caches is not None else None
            if cache is not None and cache.synced:
                items.extend(cache.objects())
                continue
            try:
                if self.job_namespace:
                    listing = self._json(self.custom.list_namespaced_custom_object, kind.group, kind.version,
                                         self.job_namespace, kind.plural)
                else:
                    listing = self._json(self.custom.list_cluster_custom_object, kind.group, kind.version, kind.plural)
            except NotFoundError:
                continue  # its CRD is not installed: no such jobs
            for obj in listing["items"]:
                obj.setdefault("apiVersion", kind.api_version)
                obj.setdefault("kind", kind.kind)
                items.append(obj)
        # A name belongs to the first kind whose object opted in, else to the first kind that has it.
        for obj in sorted(items, key=lambda o: not _opted_in(o)):
            if kinds.setdefault(_job_name(obj), kind_of(obj)) is kind_of(obj):
                self._uids[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj["metadata"].get("uid", "")
        self._kinds = kinds
        return items

    def job_pods(self, name: str) -> list[dict[str, Any]]:
        """The training pods of the job ``name`` (``<namespace>/<name>``), as the API serves them."""
        namespace, _, short = name.partition("/")
        kind = self.kind_of(name)
        cache = self.caches.pods.get(kind.kind) if self.caches is not None else None
        if cache is not None and cache.synced:
            return [pod for pod in cache.objects() if pod["metadata"].get("namespace") == namespace
                    and (pod["metadata"].get("labels") or {}).get(kind.pod_label) == short]
        pods: list[dict[str, Any]] = self._json(self.core.list_namespaced_pod, namespace,
                                                label_selector=kind.pod_selector(short))["items"]
        return pods

    def kind_pods(self, kind: WorkloadKind, *, node: str | None = None) -> list[dict[str, Any]]:
        """The training pods of every workload of ``kind`` (on ``node`` only, if given), as the API serves them."""
        cache = self.caches.pods.get(kind.kind) if self.caches is not None else None
        if cache is not None and cache.synced:
            return [pod for pod in cache.objects() if node is None or (pod.get("spec") or {}).get("nodeName") == node]
        selectors = {"label_selector": kind.pods_selector()}
        if node is not None:
            selectors["field_selector"] = f"spec.nodeName={node}"
        listing = (self._json(self.core.list_namespaced_pod, self.job_namespace, **selectors) if self.job_namespace
                   else self._json(self.core.list_pod_for_all_namespaces, **selectors))
        return list(listing["items"])

    def patch_workload(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch the job's workload (strict fields); the answer goes into the watch cache, so the next
        pass reads this write even before the watch brings it."""
        namespace, _, short = name.partition("/")
        kind = self.kind_of(name)
        obj: dict[str, Any] = self._json(self.custom.patch_namespaced_custom_object, kind.group, kind.version, namespace,
                                         kind.plural, short, patch, field_validation=STRICT)
        obj.setdefault("apiVersion", kind.api_version)
        obj.setdefault("kind", kind.kind)
        cache = self.caches.workloads.get(kind.kind) if self.caches is not None else None
        if cache is not None:
            cache.observe(obj)
        return obj

    def deactivate_queued_workload(self, name: str, obj: dict[str, Any]) -> bool:
        """Deactivate the Kueue Workload of the job's workload (``spec.active: false``: Kueue evicts it, suspends the
        job and frees its quota); False if it has none (Kueue is not installed, or has made none for it yet)."""
        namespace = obj["metadata"]["namespace"]
        selector = f"{KUEUE_JOB_UID_LABEL}={obj['metadata'].get('uid', '')}"
        try:
            listing = self._json(self.custom.list_namespaced_custom_object, "kueue.x-k8s.io", "v1beta2", namespace,
                                 "workloads", label_selector=selector)
        except NotFoundError:
            return False  # Kueue's CRDs are not installed
        for workload in listing["items"]:
            call(functools.partial(self.custom.patch_namespaced_custom_object, "kueue.x-k8s.io", "v1beta2", namespace,
                                   "workloads", workload["metadata"]["name"], {"spec": {"active": False}},
                                   field_validation=STRICT))
        return bool(listing["items"])

    def kind_of(self, name: str) -> WorkloadKind:
        """The kind of the workload that is the job ``name``."""
        if name not in self._kinds:
            self._workload(name)
        return self._kinds[name]

    def _workload(self, name: str) -> dict[str, Any]:
        namespace, _, short = name.partition("/")
        known = self._kinds.get(name)
        found = []
        for kind in [known] if known else self.kinds:
            try:
                obj = self._json(self.custom.get_namespaced_custom_object, kind.group, kind.version, namespace, kind.plural, short)
            except NotFoundError:
                continue
            obj.setdefault("apiVersion", kind.api_version)
            obj.setdefault("kind", kind.kind)
            found.append(obj)
        if not found and known:
            self._kinds.pop(name)
            return self._workload(name)  # it was deleted; one of another kind may have the name now
        if not found:
            raise NotFoundError(f"job {name}: no {' or '.join(k.kind for k in self.kinds)} of that name")
        obj = next((o for o in found if _opted_in(o)), found[0])
        self._kinds[name] = kind_of(obj)
        self._uids[(namespace, short)] = obj["metadata"].get("uid", "")
        return obj

    def _duplicate(self, obj: dict[str, Any]) -> bool:
        """A workload whose name the job of another kind has (it is not the job)."""
        return self._kinds.get(_job_name(obj)) is not kind_of(obj)

    def add_job(self, job: Job) -> None:
        raise UsageError("on Kubernetes a job is a PyTorchJob or TrainJob with the unbroken.dev/enable-job-auto-resume "
                         "annotation: kubectl apply it (unbroken k8s render prints a PyTorchJob)")

    def get_job(self, name: str) -> Job:
        obj = self._workload(name)
        job = self._job(obj)
        if job is None:
            raise NotFoundError(f"job {name} is not managed by unbroken (no {names.AUTO_RESUME}: \"true\")")
        return job

    def list_jobs(self) -> list[Job]:
        jobs = []
        for obj in self._workloads():
            if self._duplicate(obj):
                continue
            try:
                job = self._job(obj)
            except (AnnotationError, ValueError, TypeError, KeyError):
                continue  # one object unbroken cannot read never stops the others; invalid_jobs() reports it
            if job is not None:
                jobs.append(job)
        return sorted(jobs, key=lambda j: (j.created_at, j.name))

    def invalid_jobs(self) -> list[InvalidJob]:
        """Jobs that opted in but cannot be managed: annotations that do not parse, a workload unbroken
        cannot read its size from, a name the job of another kind already has."""
        invalid = []
        for obj in self._workloads():
            try:
                if job_annotations.parse(obj["metadata"].get("annotations")) is None:
                    continue
            except AnnotationError as exc:
                invalid.append(InvalidJob(_job_name(obj), tuple(exc.problems)))
                continue
            kind = kind_of(obj)
            problems = kind.problems(obj)
            if not problems:
                try:
                    self._job(obj)
                except (ValueError, TypeError, KeyError) as exc:  # e.g. a job-state annotation edited by hand
                    problems = [f"cannot be read: {type(exc).__name__}: {exc}"]
                except AnnotationError:
                    pass  # reported above
            duplicate = self._duplicate(obj)
            if duplicate:
                problems = [f"the {self._kinds[_job_name(obj)].kind} {_job_name(obj)} is already the job of that name; "
                            f"rename this {kind.kind}", *problems]
            if problems:
                invalid.append(InvalidJob(_job_name(obj), tuple(problems), kind.kind if duplicate else "Job"))
        return invalid

    def workload_object(self, name: str) -> dict[str, Any]:
        """The job's workload object as the API server has it (for the backend)."""
        return self._workload(name)

    def cached_workload(self, name: str) -> dict[str, Any]:
        """The job's workload object from the watch cache where one is kept and synced (no request), else as the
        API server has it; for what the backend reads every pass of every job (a GET each would be a request per
        job per second). NotFoundError if there is none."""
        kind = self._kinds.get(name)
        cache = self.caches.workloads.get(kind.kind) if kind is not None and self.caches is not None else None
        if cache is not None and cache.synced:
            namespace, _, short = name.partition("/")
            found = cache.get(namespace, short)
            if found is not None:
                return found
        return self._workload(name)

    def _job(self, obj: dict[str, Any]) -> Job | None:
        meta = obj["metadata"]
        settings = job_annotations.parse(meta.get("annotations"))
        if settings is None:
            return None
        kind = kind_of(obj)
        if problems := kind.problems(obj):
            raise AnnotationError(problems)  # left alone like a bad annotation; invalid_jobs() reports it
        pods = max(1, kind.node_count(obj))
        fewest = kind.fewest_pods(obj)
        losable = pods - fewest if fewest is not None else settings.spare_pods
        spec = JobSpec.model_validate({
            "name": meta["name"],
            "nodes": pods,
            "procs_per_node": kind.procs_per_node(obj),
            "command": [f"{kind.kind} {meta['namespace']}/{meta['name']}"],
            "resilience": ResilienceSpec(
                auto_resume=True, max_retry=settings.max_retry, restart_policy=RestartPolicy.ON_FAILURE,
                hang_timeout=settings.hang_timeout,
                startup_timeout=settings.startup_timeout or NO_HANG_TIMEOUT,
                require_deep_health_passed=settings.require_deep_health_passed, straggler_policy=settings.straggler_policy,
                straggler_restart_cost=settings.straggler_restart_cost,
                node_losses_in_place=min(max(0, losable), pods - 1),
            ).model_dump(),
            "checkpoint": ({} if settings.checkpoint_tiers is None else
                           settings.checkpoint_tiers.model_dump(exclude_none=True)),
        }, context={"trusted": True})
        saved = json.loads((meta.get("annotations") or {}).get(names.JOB_STATE, "{}") or "{}")
        created = parse_time(meta.get("creationTimestamp")) or 0.0
        return Job(
            name=_job_name(obj), spec_json=spec.model_dump_json(),
            phase=JobPhase(saved.get("phase", JobPhase.PENDING.value)),
            attempt=saved.get("attempt", 0), reason=saved.get("reason"), created_at=created,
            started_at=saved.get("started_at"), ended_at=saved.get("ended_at"),
            phase_changed_at=saved.get("phase_changed_at", created),
            cancel_requested=saved.get("cancel_requested", False),
            nodes=tuple(saved.get("nodes", ())), resizes=saved.get("resizes", 0), version=saved.get("version", 0),
        )

    def update_job(self, name: str, update: JobUpdate, *, expect_version: int | None = None) -> Job:
        def attempt() -> Job:
            obj = self._workload(name)
            current = self._job(obj)
            if current is None:
                raise NotFoundError(f"job {name} is no longer managed by unbroken")
            new = _updated(f"job {name}", current, update, expect_version, "phase", JOB_TRANSITIONS, "phase_changed_at")
            state = {k: v for k, v in asdict(new).items() if k not in ("name", "spec_json", "created_at")}
            patch = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"], "annotations": {
                names.JOB_STATE: json.dumps(state, sort_keys=True),
                names.JOB_PHASE: new.phase.value,
                names.RESTART_COUNT: str(new.attempt),
            }}}
            self.patch_workload(name, patch)  # the kind _workload just recorded
            return new

        return _retry_conflicts(f"job {name}", attempt)

    # -- events -------------------------------------------------------------------------

    def _involved(self, object_kind: str, object_name: str) -> tuple[str, dict[str, Any]]:
        named = next((k for k in self.kinds if k.kind == object_kind), None)
        if object_kind == "Job" or named is not None:
            # "Job": whichever object is the job of that name; a workload kind: that very object
            namespace, _, short = object_name.partition("/")
            kind = named or self._kinds.get(object_name) or self.kinds[0]
            uid = self._uids.get((namespace, short), "") if kind is self._kinds.get(object_name) else ""
            return namespace, {"apiVersion": kind.api_version, "kind": kind.kind,
                               "name": short, "namespace": namespace, "uid": uid}
        if object_kind == "Node":
            # With the Node's uid: `kubectl describe node` shows the Events whose involvedObject names its uid.
            return "default", {"apiVersion": "v1", "kind": "Node", "name": object_name, "uid": self._node_uid(object_name)}
        if object_kind == "Cluster":  # cluster-wide Events (the disruption guard's) go on the cluster's ConfigMap
            return self.namespace, {"apiVersion": "v1", "kind": "ConfigMap", "name": names.CLUSTER_CONFIGMAP,
                                    "namespace": self.namespace, "uid": self._cluster_uid()}
        return self.namespace, {"kind": object_kind, "name": object_name, "namespace": self.namespace}

    def _cluster_uid(self) -> str:
        if not self._cluster_configmap_uid:
            try:
                cm = self._json(self.core.read_namespaced_config_map, names.CLUSTER_CONFIGMAP, self.namespace)
            except NotFoundError:
                return ""
            self._cluster_configmap_uid = cm["metadata"].get("uid", "")
        return self._cluster_configmap_uid

    def add_event(self, object_kind: str, object_name: str, reason: str, message: str, *,
                  type: EventType = EventType.NORMAL) -> Event:
        ts = time.time()
        namespace, involved = self._involved(object_kind, object_name)
        stamp = format_time(ts)
        body = {
            "metadata": {"name": f"{involved['name']}.{uuid.uuid4().hex[:16]}", "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": names.COMPONENT},
                         "annotations": {f"{names.PREFIX}/time": repr(ts), f"{names.PREFIX}/object": f"{object_kind}/{object_name}"}},
            "involvedObject": involved, "reason": reason, "message": message[:1024], "type": type.value,
            "source": {"component": names.COMPONENT}, "reportingComponent": f"{names.PREFIX}/operator",
            "reportingInstance": names.COMPONENT, "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1,
        }
        call(lambda: self.core.create_namespaced_event(namespace, body, field_validation=STRICT))
        return Event(ts=ts, object_kind=object_kind, object_name=object_name, type=type, reason=reason, message=message)

    def list_events(self, *, object_kind: str | None = None, object_name: str | None = None,
                    reason: str | None = None) -> list[Event]:
        selector = f"app.kubernetes.io/managed-by={names.COMPONENT}"
        if object_kind and object_name:
            # The reconcilers ask for one object's events several times a pass: let the server filter.
            namespace, involved = self._involved(object_kind, object_name)
            items = self._json(self.core.list_namespaced_event, namespace, label_selector=selector,
                               field_selector=f"involvedObject.name={involved['name']}")["items"]
        else:
            items = self._json(self.core.list_event_for_all_namespaces, label_selector=selector)["items"]
        events = []
        for item in items:
            annotations_ = item["metadata"].get("annotations") or {}
            kind, _, name = annotations_.get(f"{names.PREFIX}/object", "/").partition("/")
            if (object_kind and kind != object_kind) or (object_name and name != object_name) or (reason and item.get("reason") != reason):
                continue
            events.append(Event(ts=float(annotations_.get(f"{names.PREFIX}/time", 0.0)), object_kind=kind, object_name=name,
                                type=EventType(item.get("type", "Normal")), reason=item.get("reason", ""),
                                message=item.get("message", "")))
        return sorted(events, key=lambda e: e.ts)


def _opted_in(obj: dict[str, Any]) -> bool:
    return names.AUTO_RESUME in (obj["metadata"].get("annotations") or {})


def _job_name(obj: dict[str, Any]) -> str:
    return f"{obj['metadata']['namespace']}/{obj['metadata']['name']}"


R = TypeVar("R", Node, Job)


def _updated(what: str, current: R, update: NodeUpdate | JobUpdate, expect_version: int | None, lifecycle_field: str,
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


def _retry_conflicts(what: str, attempt: Callable[[], T]) -> T:
    """Run a read-decide-write ``attempt`` again while the API server answers 409 (someone else —
    the kubelet, kubectl label — wrote the object since it was read)."""
    for _ in range(WRITE_RETRIES):
        try:
            return attempt()
        except ApiConflict:
            continue
    raise StoreUnavailable(f"{what}: {WRITE_RETRIES} conflicting writes in a row")


_XID = re.compile(r"\bXid\s*\(?(?:PCI:[0-9a-fA-F:.]+\)?:?)?\s*(\d+)", re.IGNORECASE)


def condition_reason(fault_type: str | None, fault_reason: str | None = None) -> str:
    """A CamelCase reason for the node condition: ``NvidiaXID79Error`` for an Xid (whatever fault type
    it was filed under), ``DeepHealthCheckFailed`` for failed join checks, ``NodeLost``, else the type."""
    text = f"{fault_type or ''} {fault_reason or ''}"
    if (xid := _XID.search(text)) is not None:
        return f"NvidiaXID{xid.group(1)}Error"
    if (fault_reason or "").startswith("join checks failed"):
        return "DeepHealthCheckFailed"
    if not fault_type:
        return "Unhealthy"
    cleaned = "".join(part[:1].upper() + part[1:] for part in names.label_value(fault_type).replace(".", "_").split("_") if part)
    return cleaned or "Unhealthy"


__all__ = ["InvalidJob", "KubernetesStore", "condition_reason"]
