"""What one node's agent token may change, on the real API server: deploy/'s RBAC and its admission policy
(deploy/admission/agent-policy.yaml), as ``kubectl apply -k deploy/`` installs them.

The token is what the agent's DaemonSet pod on node ``gpu-1`` holds: a token of ServiceAccount
unbroken-system/unbroken-agent bound to that node (a pod-bound token names its node the same way). Every write a
compromised node could use against the others or against the operator is refused; what the agent does on its own
node (the store's fault write: labels, taint, annotations, condition; its Lease; the checkpoint catalog) passes.

Real: kube-apiserver (RBAC, NodeRestriction, ValidatingAdmissionPolicy) and etcd; kubectl's kustomize renders
deploy/; the agent's writes go through unbroken's own KubernetesStore and KubernetesCatalog.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from controlplane.cluster import ControlPlane
from controlplane.unbroken_cluster import SYSTEM, install_unbroken, service_account_kubeconfig
from unbroken.kubernetes import node_agent
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.catalog import KubernetesCatalog
from unbroken.kubernetes.backend.client import api_client
from unbroken.kubernetes.backend.store import KubernetesStore
from unbroken.state.phases import NodeState
from unbroken.state.records import CheckpointStep, CheckpointTier, StepStatus
from unbroken.state.updates import NodeUpdate

pytestmark = pytest.mark.timeout(120)

OWN, OTHER = "gpu-1", "gpu-2"
EVIL = ["sh", "-c", "touch /tmp/owned"]


@pytest.fixture(scope="module")
def installed(k8s: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> ControlPlane:
    install_unbroken(k8s, tmp_path_factory.mktemp("remediations") / "log")
    core = kubernetes.client.CoreV1Api(api_client(k8s.kubeconfig))
    for node in (OWN, OTHER):
        core.create_node({"metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}},
                          "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                                     "message": "ready"}]}})
    return k8s


@pytest.fixture(scope="module")
def agent(installed: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> kubernetes.client.ApiClient:
    """gpu-1's agent token."""
    core = kubernetes.client.CoreV1Api(api_client(installed.kubeconfig))
    path = service_account_kubeconfig(installed, core, "unbroken-agent", tmp_path_factory.mktemp("agent") / "kubeconfig",
                                      node=OWN)
    return api_client(path)


@pytest.fixture(scope="module")
def admin(installed: ControlPlane) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(api_client(installed.kubeconfig))


def refusal(call: Callable[[], Any]) -> str | None:
    """The API server's refusal of ``call`` (403, and why), None if it was allowed."""
    try:
        call()
    except kubernetes.client.ApiException as exc:
        assert exc.status == 403, f"refused with {exc.status}, not 403: {exc.body}"
        return str(exc.body)
    return None


def condition(kind: str, status: str) -> dict[str, Any]:
    return {"status": {"conditions": [{"type": kind, "status": status, "reason": "Compromised", "message": "x"}]}}


def lease(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"holderIdentity": "intruder", "leaseDurationSeconds": 3600}}


REFUSED: dict[str, Callable[[kubernetes.client.ApiClient], Any]] = {
    # another node
    "label another node": lambda a: kubernetes.client.CoreV1Api(a).patch_node(
        OTHER, {"metadata": {"labels": {names.NODE_HEALTH_STATUS: "UnschedulablePendingReplacement"}}}),
    "taint another node NoSchedule": lambda a: kubernetes.client.CoreV1Api(a).patch_node(
        OTHER, {"spec": {"taints": [{"key": names.TAINT_KEY, "value": "x", "effect": "NoSchedule"}]}}),
    "taint another node NoExecute": lambda a: kubernetes.client.CoreV1Api(a).patch_node(
        OTHER, {"spec": {"taints": [{"key": names.TAINT_KEY, "value": "x", "effect": "NoExecute"}]}}),
    "cordon another node": lambda a: kubernetes.client.CoreV1Api(a).patch_node(OTHER, {"spec": {"unschedulable": True}}),
    "set another node Ready=False": lambda a: kubernetes.client.CoreV1Api(a).patch_node_status(OTHER, condition("Ready", "False")),
    "set another node UnbrokenHealthy=False": lambda a: kubernetes.client.CoreV1Api(a).patch_node_status(
        OTHER, condition(names.CONDITION_TYPE, "False")),
    "mark another node's deep check Passed": lambda a: kubernetes.client.CoreV1Api(a).patch_node(
        OTHER, {"metadata": {"labels": {names.DEEP_HEALTH_CHECK_STATUS: "Passed"}}}),
    # the operator's configuration
    "rewrite the remediation command": lambda a: kubernetes.client.CoreV1Api(a).patch_namespaced_config_map(
        names.CLUSTER_CONFIGMAP, SYSTEM, {"data": {"cluster.yaml": f"Kubernetes: {{RemediationCommand: {EVIL}}}"}}),
    "delete the cluster ConfigMap": lambda a: kubernetes.client.CoreV1Api(a).delete_namespaced_config_map(
        names.CLUSTER_CONFIGMAP, SYSTEM),
    "patch the health ConfigMap": lambda a: kubernetes.client.CoreV1Api(a).patch_namespaced_config_map(
        "unbroken-health", SYSTEM, {"data": {"xid.yaml": "79: None"}}),
    "delete the health ConfigMap": lambda a: kubernetes.client.CoreV1Api(a).delete_namespaced_config_map("unbroken-health", SYSTEM),
    "create a ConfigMap outside the catalog": lambda a: kubernetes.client.CoreV1Api(a).create_namespaced_config_map(
        SYSTEM, {"metadata": {"name": "unbroken-extra"}, "data": {"a": "b"}}),
    # Leases
    "take the operator's leader Lease": lambda a: kubernetes.client.CoordinationV1Api(a).create_namespaced_lease(
        SYSTEM, lease(names.LEADER_LEASE)),
    "renew another node's agent Lease": lambda a: kubernetes.client.CoordinationV1Api(a).create_namespaced_lease(
        SYSTEM, lease(names.LEASE_PREFIX + OTHER)),
    # Secrets
    "create a Secret": lambda a: kubernetes.client.CoreV1Api(a).create_namespaced_secret(
        SYSTEM, {"metadata": {"name": "stolen"}, "stringData": {"a": "b"}}),
    "replace the heartbeat key": lambda a: kubernetes.client.CoreV1Api(a).create_namespaced_secret(
        SYSTEM, {"metadata": {"name": "unbroken-heartbeat-key"}, "stringData": {"key": "x"}}),
    "read the heartbeat master key": lambda a: kubernetes.client.CoreV1Api(a).read_namespaced_secret(
        "unbroken-heartbeat-key", SYSTEM),
    "read the cluster's CA key": lambda a: kubernetes.client.CoreV1Api(a).read_namespaced_secret(names.CLUSTER_TLS_SECRET, SYSTEM),
    "list Secrets": lambda a: kubernetes.client.CoreV1Api(a).list_namespaced_secret(SYSTEM),
    # its own node, beyond unbroken's own fields
    "cordon its own node": lambda a: kubernetes.client.CoreV1Api(a).patch_node(OWN, {"spec": {"unschedulable": True}}),
    "set its own node Ready=False": lambda a: kubernetes.client.CoreV1Api(a).patch_node_status(OWN, condition("Ready", "False")),
    "label its own node outside unbroken.dev": lambda a: kubernetes.client.CoreV1Api(a).patch_node(
        OWN, {"metadata": {"labels": {"nvidia.com/gpu.present": "false"}}}),
    "taint its own node outside unbroken.dev": lambda a: kubernetes.client.CoreV1Api(a).patch_node(
        OWN, {"spec": {"taints": [{"key": "node.kubernetes.io/out-of-service", "value": "x", "effect": "NoExecute"}]}}),
    "delete its own node": lambda a: kubernetes.client.CoreV1Api(a).delete_node(OWN),
}


def what_an_agent_could_touch(admin: kubernetes.client.CoreV1Api, node: str) -> dict[str, Any]:
    """The parts of a Node the attempts above aim at. Not the whole object: with no kubelet here, Kubernetes' own
    node lifecycle and TTL controllers mark these Nodes unreachable (a condition, ``node.kubernetes.io/*`` taints,
    an annotation) at their own time."""
    obj = admin.read_node(node)
    return {"labels": obj.metadata.labels, "unschedulable": obj.spec.unschedulable,
            "annotations": {k: v for k, v in (obj.metadata.annotations or {}).items() if not k.startswith("node.alpha.kubernetes.io/")},
            "taints": [t.to_dict() for t in obj.spec.taints or [] if not t.key.startswith("node.kubernetes.io/")],
            "conditions": [c.to_dict() for c in obj.status.conditions or [] if c.reason == "Compromised" or c.type == names.CONDITION_TYPE]}


@pytest.mark.parametrize("what", list(REFUSED))
def test_the_agent_token_is_refused(what: str, agent: kubernetes.client.ApiClient, admin: kubernetes.client.CoreV1Api) -> None:
    before = {n: what_an_agent_could_touch(admin, n) for n in (OWN, OTHER)}
    assert refusal(lambda: REFUSED[what](agent)) is not None, f"the agent token may {what}"
    after = {n: what_an_agent_could_touch(admin, n) for n in (OWN, OTHER)}
    assert after == before, "a refused write changed nothing"


def test_a_refusal_says_what_the_agent_may_do(agent: kubernetes.client.ApiClient) -> None:
    why = refusal(lambda: REFUSED["label another node"](agent))
    assert why is not None and f"the agent of node {OWN} may change only its own Node, not UPDATE {OTHER}" in why, why
    why = refusal(lambda: REFUSED["rewrite the remediation command"](agent))
    assert why is not None and "only the checkpoint catalog" in why, why


def test_a_token_bound_to_no_node_may_change_nothing(installed: ControlPlane, admin: kubernetes.client.CoreV1Api,
                                                    tmp_path: Path) -> None:
    """A token the policy cannot tie to a node (a TokenRequest bound to nothing, a legacy Secret token) is refused even
    its own Lease: the policy never guesses the node."""
    unbound = api_client(service_account_kubeconfig(installed, admin, "unbroken-agent", tmp_path / "kubeconfig"))
    why = refusal(lambda: kubernetes.client.CoordinationV1Api(unbound).create_namespaced_lease(SYSTEM, lease(names.LEASE_PREFIX + OWN)))
    assert why is not None and "names no node" in why, why


def test_a_refused_lease_renewal_is_logged_and_retried_not_the_agents_end(
        installed: ControlPlane, admin: kubernetes.client.CoreV1Api, agent: kubernetes.client.ApiClient, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """The agent's renewal step on a real refusal (a token bound to no node: 403 even for its own Lease, as every
    request is for a moment after an API server restarts): False and a warning naming the status, no exception (one
    ended the agent in CI, and its node was lost). With the node's own token the same step renews."""
    unbound = api_client(service_account_kubeconfig(installed, admin, "unbroken-agent", tmp_path / "kubeconfig"))
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        assert node_agent.renew_lease(KubernetesStore(unbound, SYSTEM), OWN, ()) is False
    refused = [r for r in caplog.records if r.getMessage().startswith("lease renewal refused")]
    assert refused and getattr(refused[0], "status", None) == 403, caplog.text
    assert node_agent.renew_lease(KubernetesStore(agent, SYSTEM), OWN, ()) is True


def test_the_agents_own_work_passes(agent: kubernetes.client.ApiClient, admin: kubernetes.client.CoreV1Api) -> None:
    """What the agent does on its node, through unbroken's own store and catalog: a fault (labels, taint, the node's
    record, its condition), its Lease and the catalog's ConfigMaps; events. The other node is untouched."""
    other_before = what_an_agent_could_touch(admin, OTHER)
    store = KubernetesStore(agent, SYSTEM)
    store.update_node(OWN, NodeUpdate(state=NodeState.PENDING_REPLACEMENT, fault_type="FaultyInstance", fault_reason="Xid 79"))
    store.renew_lease(OWN, at=time.time())
    store.add_event("Node", OWN, "FaultyInstance", "Xid 79")
    node = admin.read_node(OWN)
    assert node.metadata.labels[names.FAULT_TYPES] == "FaultyInstance"
    assert any(t.key == names.TAINT_KEY for t in node.spec.taints or [])
    assert any(c.type == names.CONDITION_TYPE and c.status == "False" for c in node.status.conditions)
    catalog = KubernetesCatalog(agent, SYSTEM)
    record = CheckpointStep(job="training/j", step=10, tier=CheckpointTier.MEMORY, attempt=0, world_size=1,
                            status=StepStatus.COMMITTED, size=1, updated_at=time.time())
    assert catalog.put_checkpoint_step(record, only_if_absent=True)
    catalog.delete_checkpoint_step("training/j", 10, CheckpointTier.MEMORY)
    assert what_an_agent_could_touch(admin, OTHER) == other_before
