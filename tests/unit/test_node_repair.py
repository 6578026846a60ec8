"""How a Node's boot and unbroken's reboot marks are read (kubernetes/backend/node_repair.py), on Node JSON as the API serves it."""

from __future__ import annotations

from typing import Any

import pytest

from unbroken.config.cluster import ClusterConfig
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.node_repair import boot_of


def node(boot: str | None, *, mark: str | None = None, ready: str = "True", cordoned: bool = False) -> dict[str, Any]:
    annotations = {names.REBOOT_FROM_BOOT: mark} if mark else {}
    if cordoned:
        annotations[names.CORDONED] = "true"
    info = {"bootID": boot} if boot is not None else {}
    return {"metadata": {"name": "gpu-a", "annotations": annotations},
            "status": {"nodeInfo": info, "conditions": [{"type": "Ready", "status": ready}]}}


def test_a_node_is_back_from_a_reboot_only_when_ready_on_another_boot() -> None:
    assert boot_of(node("b2", mark="b1")).rebooted
    assert not boot_of(node("b1", mark="b1")).rebooted, "the same boot: not rebooted yet"
    assert not boot_of(node("b2", mark="b1", ready="Unknown")).rebooted, "a new boot that is not Ready is not back"
    assert not boot_of(node("b2")).rebooted, "no reboot was asked for"
    assert not boot_of(node(None, mark="b1")).rebooted, "a kubelet that reports no bootID proves nothing"


def test_a_reboot_is_due_only_on_the_boot_it_was_asked_of() -> None:
    assert boot_of(node("b1", mark="b1")).reboot_due_here
    assert not boot_of(node("b2", mark="b1")).reboot_due_here, "the agent on the next boot must not reboot again"
    assert not boot_of(node("b1")).reboot_due_here


def test_the_cordon_mark_is_read() -> None:
    assert boot_of(node("b1", cordoned=True)).cordoned_by_unbroken
    assert not boot_of(node("b1")).cordoned_by_unbroken


def cluster(kubernetes: dict[str, Any]) -> dict[str, Any]:
    return {"ClusterName": "c", "InstanceGroups": [{"InstanceGroupName": "g", "InstanceType": "cpu-dev", "InstanceCount": 0}],
            "Kubernetes": kubernetes}


def test_self_reboot_needs_no_remediation_command_and_has_a_host_reboot_by_default() -> None:
    settings = ClusterConfig.model_validate(cluster({"Remediator": "SelfReboot"})).Kubernetes
    assert settings.SelfRebootCommand[-2:] == ["systemctl", "reboot"]
    with pytest.raises(ValueError, match="SelfRebootCommand"):
        ClusterConfig.model_validate(cluster({"Remediator": "SelfReboot", "SelfRebootCommand": []}))
