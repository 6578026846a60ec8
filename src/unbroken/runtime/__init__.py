"""The composition root: the one place that builds the stores and the backend.

Every process (controller, agent, CLI) asks for a :class:`Runtime` and gets the
same four seams, whichever backend is behind them:

- ``cluster``: the :class:`~unbroken.state.store.ClusterStore` (nodes, jobs, events, leases);
- ``catalog``: the :class:`~unbroken.state.catalog.CheckpointCatalog`;
- ``backend``: the :class:`~unbroken.backends.base.Backend` (nodes and attempts);
- ``clock``: ``time.time``, or a fake one in tests of the reconcilers.

Locally the first two are the same SQLite file (``<dir>/state.db``) and the
backend runs agent processes. On Kubernetes (``open_kubernetes``) the store is
the API server and the backend works through the workloads' pods. Nothing
outside this package constructs ``SqliteStore``, ``LocalBackend``,
``KubernetesStore`` or ``KubernetesBackend``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from unbroken.backends.base import Backend
from unbroken.backends.local.backend import LocalBackend
from unbroken.checkpoint.node import credentials
from unbroken.config.cluster import ClusterConfig
from unbroken.errors import ConfigError, UsageError
from unbroken.plumbing.layout import ClusterLayout
from unbroken.state.catalog import CheckpointCatalog
from unbroken.state.sqlite import SqliteStore
from unbroken.state.store import ClusterStore
from unbroken.state.worker_table import WorkerTable

if TYPE_CHECKING:
    import kubernetes

    from unbroken.kubernetes.backend.backend import KubernetesBackend
    from unbroken.kubernetes.backend.catalog import KubernetesCatalog
    from unbroken.kubernetes.backend.store import KubernetesStore

Clock = Callable[[], float]

__all__ = ["Clock", "KubernetesRuntime", "Runtime", "create_local", "open_kubernetes", "open_local"]


@dataclass(frozen=True)
class Runtime:
    cluster: ClusterStore
    catalog: CheckpointCatalog
    backend: Backend
    config: ClusterConfig
    """The cluster file this cluster was started with (validated)."""
    layout: ClusterLayout
    """Where this cluster's files are (node folders, logs, its TLS credentials)."""
    clock: Clock = field(default=time.time)
    worker_table: WorkerTable | None = None
    """The local backend's worker rows, which local agents run; None where kubelet runs pods."""

    def local_backend(self, what: str) -> LocalBackend:
        """The backend as a :class:`LocalBackend`, for what only exists locally (pids, signals, agents)."""
        if not isinstance(self.backend, LocalBackend):
            raise UsageError(f"{what} needs a local cluster (this one runs on {type(self.backend).__name__})")
        return self.backend

    def on_kubernetes(self, what: str) -> "KubernetesRuntime":
        """This runtime as a :class:`KubernetesRuntime`, for what only exists there (pods, Secrets, the API)."""
        if not isinstance(self, KubernetesRuntime):
            raise UsageError(f"{what} needs a Kubernetes cluster (this one runs on {type(self.backend).__name__})")
        return self


@dataclass(frozen=True)
class KubernetesRuntime(Runtime):
    """``open_kubernetes``'s runtime: the same seams, typed as what they are there, so the operator, the
    node agent and the CLI's Kubernetes commands reach the API's own calls without casting."""

    cluster: KubernetesStore
    catalog: KubernetesCatalog
    backend: KubernetesBackend


def open_local(layout: ClusterLayout, *, clock: Clock = time.time) -> Runtime:
    """The runtime of the local cluster in ``layout`` (StoreError if there is none)."""
    return _local(layout, SqliteStore(layout.state_db), clock)


def create_local(layout: ClusterLayout, config: ClusterConfig, *, clock: Clock = time.time) -> Runtime:
    """A new local cluster's state in ``layout``: its TLS credentials (what its nodes prove to
    each other) and the store, holding ``config``, status Up. No process is started."""
    if not any(group.InstanceCount for group in config.InstanceGroups):
        raise ConfigError("a local cluster needs at least one node: InstanceCount is 0 in every group "
                          "(0 is for Kubernetes, where the cluster's Nodes are the nodes)")
    layout.root.mkdir(parents=True, exist_ok=True)
    credentials.create(layout.root, config.ClusterName)
    store = SqliteStore(layout.state_db, create=True)
    store.create_cluster(config.ClusterName, config.model_dump_json())
    return _local(layout, store, clock)


def _local(layout: ClusterLayout, store: SqliteStore, clock: Clock) -> Runtime:
    config = store.cluster().config()
    backend = LocalBackend(layout, store, store, config)
    return Runtime(cluster=store, catalog=store, backend=backend, config=config, layout=layout, clock=clock,
                   worker_table=store)


def open_kubernetes(api: "kubernetes.client.ApiClient", namespace: str, *, job_namespace: str | None = None,
                    state_dir: Path = Path("/var/lib/unbroken"), clock: Clock = time.time) -> KubernetesRuntime:
    """The runtime of the cluster behind ``api``: unbroken installed in ``namespace`` (its
    ConfigMap ``unbroken-cluster`` holds the cluster file); jobs in ``job_namespace`` or all."""
    from unbroken.config.cluster import Remediator
    from unbroken.kubernetes.backend.backend import CommandRemediator, ConditionRemediator, KubernetesBackend, SelfRebootRemediator
    from unbroken.kubernetes.backend.backend import Remediator as NodeRemediator
    from unbroken.kubernetes.backend.catalog import KubernetesCatalog
    from unbroken.kubernetes.backend.store import KubernetesStore

    store = KubernetesStore(api, namespace, job_namespace=job_namespace)
    config = store.cluster().config()
    settings = config.Kubernetes
    store.lease_renew_seconds = settings.LeaseRenewSeconds
    store.heartbeat_interval = config.Local.HeartbeatIntervalSeconds
    remediator: NodeRemediator
    if settings.Remediator is Remediator.COMMAND:
        remediator = CommandRemediator(store, settings.RemediationCommand)
    elif settings.Remediator is Remediator.SELF_REBOOT:
        remediator = SelfRebootRemediator(store)
    else:
        remediator = ConditionRemediator(store)
    backend = KubernetesBackend(store, remediator, force_delete_after=settings.ForceDeleteGraceSeconds,
                                stop_grace=settings.StopGraceSeconds)
    return KubernetesRuntime(cluster=store, catalog=KubernetesCatalog(api, namespace), backend=backend, config=config,
                             layout=ClusterLayout.at(state_dir), clock=clock)
