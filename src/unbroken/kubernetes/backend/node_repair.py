"""What unbroken writes on a Node it remediates, and how it sees the node come back.

- **Cordon**: remediators cordon a faulty node and annotate ``unbroken.dev/cordoned``, so
  unbroken lifts only its own cordon when the node is back (an administrator's stays).
- **Reboot**: before a remediator is asked to reboot a node, the Node is annotated with
  ``unbroken.dev/reboot-from-boot-id``: the kubelet's ``status.nodeInfo.bootID`` at that
  moment. Whoever reboots the machine (external repair acting on the condition, the Command
  remediator's cloud CLI, or the node's own agent with SelfReboot), the node is back when
  it is Ready with another bootID. The same bootID is how a SelfReboot agent knows the
  request is for the boot it runs on, and not one it already rebooted out of.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.api import STRICT, call
from unbroken.kubernetes.backend.store import KubernetesStore

log = logging.getLogger("unbroken.kubernetes.backend.node_repair")


@dataclass(frozen=True)
class NodeBoot:
    """A Node's boot as its kubelet reports it, and unbroken's reboot marks on it."""

    node: str
    boot_id: str | None
    reboot_from: str | None
    """``unbroken.dev/reboot-from-boot-id``: the boot unbroken asked to end (None: no reboot asked)."""
    ready: bool
    cordoned_by_unbroken: bool

    @property
    def rebooted(self) -> bool:
        """Back from the reboot unbroken asked for: Ready, on another boot."""
        return bool(self.reboot_from and self.boot_id and self.ready and self.boot_id != self.reboot_from)

    @property
    def reboot_due_here(self) -> bool:
        """A reboot was asked for and this boot is the one to end."""
        return bool(self.reboot_from and self.boot_id == self.reboot_from)


def read_boot(store: KubernetesStore, node: str) -> NodeBoot:
    return boot_of(store.node_object(node))


def boot_of(obj: dict[str, Any]) -> NodeBoot:
    """A Node object's (JSON) boot and reboot marks."""
    annotations = obj["metadata"].get("annotations") or {}
    status = obj.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return NodeBoot(node=obj["metadata"]["name"], boot_id=(status.get("nodeInfo") or {}).get("bootID") or None,
                    reboot_from=annotations.get(names.REBOOT_FROM_BOOT) or None, ready=ready,
                    cordoned_by_unbroken=bool(annotations.get(names.CORDONED)))


def mark_reboot(store: KubernetesStore, node: str) -> str | None:
    """Record the boot a reboot must end; None (and a warning) if the kubelet reports no bootID."""
    boot = read_boot(store, node).boot_id
    if boot is None:
        log.warning("node has no status.nodeInfo.bootID: its return from the reboot cannot be seen, so it will be "
                    "replaced after RebootTimeoutSeconds", extra={"node": node})
        return None
    call(lambda: store.core.patch_node(node, {"metadata": {"annotations": {names.REBOOT_FROM_BOOT: boot}}}, field_validation=STRICT))
    return boot


def cordon(store: KubernetesStore, node: str) -> None:
    """Cordon ``node`` as unbroken's (lifted by :func:`clear_repair` when the node is back)."""
    obj = store.node_object(node)
    if (obj.get("spec") or {}).get("unschedulable") and not (obj["metadata"].get("annotations") or {}).get(names.CORDONED):
        return  # an administrator's cordon: theirs to lift
    call(lambda: store.core.patch_node(node, {"metadata": {"annotations": {names.CORDONED: "true"}},
                                              "spec": {"unschedulable": True}}, field_validation=STRICT))


def clear_repair(store: KubernetesStore, boot: NodeBoot) -> None:
    """The node is back: drop the reboot mark and lift unbroken's own cordon (the startup taint
    still keeps work off until the node passes its checks)."""
    patch: dict[str, Any] = {"metadata": {"annotations": {names.REBOOT_FROM_BOOT: None, names.CORDONED: None}}}
    if boot.cordoned_by_unbroken:
        patch["spec"] = {"unschedulable": False}
    call(lambda: store.core.patch_node(boot.node, patch, field_validation=STRICT))
