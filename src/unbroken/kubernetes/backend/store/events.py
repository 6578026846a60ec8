"""Events: core/v1 Events on the Node, the workload or the cluster's ConfigMap, found again by their
``unbroken.dev/object`` annotation."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any


from unbroken.errors import NotFoundError
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.api import STRICT, call, format_time
from unbroken.state.records import Event, EventType

log = logging.getLogger(__name__)

from unbroken.kubernetes.backend.store.core import StoreCore


class EventStore(StoreCore):
    """Events on the objects they are about."""

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
