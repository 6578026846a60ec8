"""Nodes: a Node's labels, annotations, taint and ``UnbrokenHealthy`` condition as unbroken's node record."""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict
from typing import Any


from unbroken.errors import StoreUnavailable, UsageError
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.api import STRICT, ApiConflict, call, format_time, parse_time
from unbroken.state.phases import NODE_TRANSITIONS, DeepHealthStatus, NodeState
from unbroken.state.records import Node
from unbroken.state.updates import NodeUpdate

log = logging.getLogger(__name__)

from unbroken.kubernetes.backend.store.core import retry_conflicts, updated_record
from unbroken.kubernetes.backend.store.liveness import LivenessStore

FAULT_HISTORY = 10


class NodeStore(LivenessStore):
    """Nodes, read with their liveness."""

    def add_node(self, node: Node) -> None:
        raise UsageError("on Kubernetes, nodes join the cluster through the kubelet; unbroken does not create Node objects")

    def get_node(self, name: str) -> Node:
        return self._node(self.node_object(name), self._lease(name))

    def list_nodes(self) -> list[Node]:
        leases = self._leases()
        items = self.node_objects()
        self._judge_datagrams([obj["metadata"]["name"] for obj in items])
        return sorted((self._node(obj, leases.get(obj["metadata"]["name"])) for obj in items), key=lambda n: n.name)

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
            new = updated_record(f"node {name}", current, update, expect_version, "state", NODE_TRANSITIONS, "state_changed_at")
            written = self._json(self.core.patch_node, name, self._node_patch(obj, current, new), field_validation=STRICT)
            if self.caches is not None:
                self.caches.nodes.observe(written)
            return new

        new = retry_conflicts(f"node {name}", attempt)
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
