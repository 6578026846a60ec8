"""The cluster record: the ConfigMap ``unbroken-cluster`` (its cluster file, status and the
controller's metrics address)."""

from __future__ import annotations

import logging

import yaml

from unbroken.config.cluster import ClusterConfig
from unbroken.errors import ConfigError, NotFoundError, UsageError
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.api import STRICT, call, parse_time
from unbroken.state.records import ClusterRecord, ClusterStatus

log = logging.getLogger(__name__)

from unbroken.kubernetes.backend.store.core import StoreCore


class ClusterRecordStore(StoreCore):
    """The cluster record in ``unbroken-cluster``."""

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
