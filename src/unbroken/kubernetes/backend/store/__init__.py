"""``ClusterStore`` on a Kubernetes API: every method is one object read or write. One class, one
module per concern: ``core`` (clients, caches, the conflict-retrying write), ``cluster_record``,
``liveness`` (datagrams, Leases, Ready), ``nodes``, ``jobs``, ``events``.

| unbroken | Kubernetes |
|---|---|
| node | the Node: labels ``unbroken.dev/node-health-status``, ``deep-health-check-status``, ``fault-types``, ``fault-reasons``; annotations ``fault-details`` and ``node-state`` (the full record); the taint ``unbroken.dev/node-health-status=Unschedulable:NoSchedule`` while not Schedulable; the condition ``UnbrokenHealthy`` |
| node heartbeat | the signed datagrams the operator hears (``heartbeats``, kubernetes/backend/heartbeats.py), and the Lease ``unbroken-node-<node>`` in the operator's namespace, renewed by the node agent every ``LeaseRenewSeconds`` (``_heartbeat`` says how they combine with the kubelet's ``Ready``) |
| job | an annotated PyTorchJob or TrainJob (kubernetes/backend/workloads.py): ``unbroken.dev/job-state`` (phase, attempt, reason, times, version), mirrored for people in ``unbroken.dev/phase`` and ``unbroken.dev/restart-count`` |
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

from unbroken.kubernetes.backend.store.cluster_record import ClusterRecordStore
from unbroken.kubernetes.backend.store.core import StoreCaches
from unbroken.kubernetes.backend.store.events import EventStore
from unbroken.kubernetes.backend.store.jobs import InvalidJob, JobStore
from unbroken.kubernetes.backend.store.nodes import NodeStore, condition_reason


class KubernetesStore(NodeStore, JobStore, EventStore, ClusterRecordStore):
    """The cluster's state in the API server. ``namespace``: the operator's (leases, the cluster
    ConfigMap); ``job_namespace``: where annotated jobs are watched (None: every namespace)."""


__all__ = ["InvalidJob", "KubernetesStore", "StoreCaches", "condition_reason"]
