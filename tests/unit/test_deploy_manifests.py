"""The Kubernetes install (deploy/): what `kubectl apply -k deploy/` and the GPU overlay would create.

Rendered by the real kubectl (its built-in kustomize, offline), every object validated against the
Kubernetes 1.33 OpenAPI schemas in strict mode (kubernetes-validate: unknown fields fail), then held
to the contract with the code: the commands, ports, labels, mounts, RBAC and security settings the
operator and the agent are written against. No cluster is involved: nothing here is applied.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
GPU = DEPLOY / "overlays" / "gpu"
NAMESPACE = "unbroken-system"
IMAGE = "ghcr.io/unbroken-dev/unbroken"
TAG = "0.1.0"
K8S_VERSION = "1.33"

OPERATOR_COMMAND = ["unbroken", "operator", "--namespace", "$(POD_NAMESPACE)", "--metrics-port", "9400"]
AGENT_COMMAND = ["unbroken", "agent", "--kubernetes", "--node", "$(NODE_NAME)", "--metrics-port", "9401", "--shard-server-port", "9402"]

Obj = dict[str, Any]

EXPECTED_OBJECTS = {
    ("Namespace", "unbroken-system"),
    ("ResourceQuota", "unbroken-critical-pods"),
    ("ServiceAccount", "unbroken-operator"),
    ("ServiceAccount", "unbroken-agent"),
    ("ClusterRole", "unbroken-operator"),
    ("ClusterRole", "unbroken-agent"),
    ("ClusterRoleBinding", "unbroken-operator"),
    ("ClusterRoleBinding", "unbroken-agent"),
    ("Role", "unbroken-operator"),
    ("Role", "unbroken-agent"),
    ("RoleBinding", "unbroken-operator"),
    ("RoleBinding", "unbroken-agent"),
    ("ConfigMap", "unbroken-cluster"),
    ("ConfigMap", "unbroken-health"),
    ("Service", "unbroken-operator-metrics"),
    ("Deployment", "unbroken-operator"),
    ("DaemonSet", "unbroken-agent"),
    ("ValidatingAdmissionPolicy", "unbroken-agent"),
    ("ValidatingAdmissionPolicyBinding", "unbroken-agent"),
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}

AGENT_HOST_PATHS = {  # host path -> mount path, all DirectoryOrCreate
    "/var/run/unbroken": "/var/run/unbroken",
    "/dev/shm/unbroken": "/dev/shm/unbroken",
    "/var/lib/unbroken": "/var/lib/unbroken",
}
BASE_AGENT_TOLERATIONS = [
    {"key": "unbroken.dev/node-health-status", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"},
    {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"},
]
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
GPU_ENV = {"UNBROKEN_KERNEL_LOG": "/dev/kmsg", "NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "utility"}


def rules(*entries: tuple[str, str, str]) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, "verb verb ...") -> one (group, resource, verb) per verb."""
    return {(group, resource, verb) for group, resource, verbs in entries for verb in verbs.split()}


OPERATOR_CLUSTER_RULES = rules(
    ("", "nodes", "get list watch patch"),
    ("", "nodes/status", "patch"),
    ("", "pods", "get list watch delete"),
    ("", "pods/eviction", "create"),
    ("", "events", "create patch get list"),  # list: the restart a JobRestartCause follows
    ("events.k8s.io", "events", "create patch"),
    ("coordination.k8s.io", "leases", "get list watch"),
    ("kubeflow.org", "pytorchjobs", "get list watch patch"),
    ("kubeflow.org", "pytorchjobs/status", "get"),
    ("trainer.kubeflow.org", "trainjobs", "get list watch patch"),
    ("jobset.x-k8s.io", "jobsets", "get list watch delete"),
    ("kueue.x-k8s.io", "workloads", "list patch"),  # a queued job stopped for good: its Workload deactivated
    ("authentication.k8s.io", "tokenreviews", "create"),  # which node an agent asking for its credentials is on
)
OPERATOR_NAMESPACE_RULES = rules(
    ("coordination.k8s.io", "leases", "get list watch create update patch"),
    ("batch", "jobs", "create get list watch delete"),
    ("", "configmaps", "get list watch"),  # never write: its configuration is the administrators'
    ("", "secrets", "create get"),  # it makes its two Secrets (create cannot be limited to names); get by name
)
AGENT_CLUSTER_RULES = rules(
    ("", "nodes", "get list watch patch"),
    ("", "nodes/status", "patch"),
    ("", "events", "create patch"),
    ("events.k8s.io", "events", "create patch"),
    ("", "pods", "get list watch"),
    ("kubeflow.org", "pytorchjobs", "get list watch"),  # the jobs whose checkpoints its node keeps
    ("trainer.kubeflow.org", "trainjobs", "get list watch"),
)
AGENT_NAMESPACE_RULES = rules(
    ("coordination.k8s.io", "leases", "get create update patch"),
    ("", "configmaps", "get list watch create patch delete"),  # the checkpoint catalog (kubernetes/backend/catalog.py)
)  # no Secret: its node's credentials come from the operator (kubernetes/backend/node_credentials.py)


# --- rendering -------------------------------------------------------------------------------


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not installed: the manifests are rendered by kubectl's built-in kustomize")
    return path


@functools.cache
def _render(directory: Path) -> str:
    result = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return result.stdout


def render(directory: Path) -> list[Obj]:
    """A fresh copy of the objects `kubectl kustomize directory` renders (tests may mutate it)."""
    return [obj for obj in yaml.safe_load_all(_render(directory)) if obj]


def one(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def container(objects: list[Obj], kind: str, name: str, container_name: str) -> Obj:
    containers = one(objects, kind, name)["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == [container_name]
    return containers[0]


def env_of(c: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def workloads(objects: list[Obj]) -> list[Obj]:
    return [o for o in objects if o["kind"] in {"Deployment", "DaemonSet"}]


def rbac_rules(role: Obj) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in role.get("rules", [])
            for group in rule.get("apiGroups", []) for resource in rule.get("resources", [])
            for verb in rule.get("verbs", [])}


@pytest.fixture(scope="module", params=["base", "gpu"])
def rendered(request: pytest.FixtureRequest) -> list[Obj]:
    return render(DEPLOY if request.param == "base" else GPU)


# --- rendering and schema validation -----------------------------------------------------------


def test_root_kustomization_installs_the_base_and_the_admission_policy() -> None:
    root = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert root["resources"] == ["base", "admission"], "deploy/grafana and deploy/prometheus are not manifests to apply"
    gpu = yaml.safe_load((GPU / "kustomization.yaml").read_text())
    assert gpu["resources"] == ["../../base", "../../admission"], "the GPU install holds its agents to their nodes too"


def test_base_and_gpu_overlay_render_the_expected_objects(rendered: list[Obj]) -> None:
    names = [(o["kind"], o["metadata"]["name"]) for o in rendered]
    assert len(names) == len(set(names)), f"duplicates: {names}"
    assert set(names) == EXPECTED_OBJECTS
    for obj in rendered:
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"], obj["metadata"]
        else:
            assert obj["metadata"].get("namespace") == NAMESPACE, (obj["kind"], obj["metadata"])


def schema_version() -> str:
    """1.33, or the oldest schema kubernetes-validate ships that is newer (it refuses versions it lacks)."""
    available = sorted({tuple(int(p) for p in v.split(".")[:2]) for v in kubernetes_validate.utils.all_versions()})
    newer = [v for v in available if v >= (1, 33)]
    assert newer, f"kubernetes-validate has no schema for {K8S_VERSION} or newer: {available}"
    return "%d.%d" % newer[0]


def test_every_object_passes_strict_schema_validation(rendered: list[Obj]) -> None:
    version = schema_version()
    for obj in rendered:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            validated = kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{name}: no schema for {obj['apiVersion']} in Kubernetes {version}: not a built-in kind")
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name} does not validate against Kubernetes {exc.version}: {path}: {exc.message}")
        assert validated == version


def test_strict_validation_catches_an_unknown_field() -> None:
    """The validator is not a no-op: a misspelt field in the agent fails."""
    agent = one(render(DEPLOY), "DaemonSet", "unbroken-agent")
    broken = copy.deepcopy(agent)
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/healthz", "port": 9401}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, schema_version(), strict=True)


def test_no_container_is_privileged_without_escalation(rendered: list[Obj]) -> None:
    """The API server rejects privileged: true with allowPrivilegeEscalation: false; the schema does not."""
    for workload in workloads(rendered):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            sc = c.get("securityContext", {})
            if sc.get("privileged"):
                assert sc.get("allowPrivilegeEscalation") is not False, (workload["metadata"]["name"], sc)
                assert sc.get("capabilities", {}).get("add") is None


# --- the operator ----------------------------------------------------------------------------


def test_operator_deployment(rendered: list[Obj]) -> None:
    deployment = one(rendered, "Deployment", "unbroken-operator")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "unbroken-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}

    c = container(rendered, "Deployment", "unbroken-operator", "operator")
    assert c["image"] == f"{IMAGE}:{TAG}"
    assert c["command"] == OPERATOR_COMMAND
    assert "args" not in c
    env = env_of(c)
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}  # published in the leader Lease for the agents
    assert c["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"},
                          {"name": "heartbeats", "containerPort": 9403, "protocol": "UDP"},  # Kubernetes.HeartbeatPort
                          {"name": "credentials", "containerPort": 9403, "protocol": "TCP"}]  # the agents' certification
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": 9400}, probe
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert not sc.get("privileged")

    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/etc/unbroken"]["readOnly"] is True
    assert config_files(pod, mounts["/etc/unbroken"]["name"]) == {
        "cluster.yaml": ("unbroken-cluster", "cluster.yaml"),
        "health/xid.yaml": ("unbroken-health", "xid.yaml"),
        "health/npd-rules.json": ("unbroken-health", "npd-rules.json"),
    }


def config_files(pod: Obj, volume_name: str) -> dict[str, tuple[str, str]]:
    """Path under the mount -> (ConfigMap, key) of a projected volume of ConfigMaps."""
    volume = next(v for v in pod["volumes"] if v["name"] == volume_name)
    return {item["path"]: (source["configMap"]["name"], item["key"])
            for source in volume["projected"]["sources"] for item in source["configMap"]["items"]}


def test_operator_metrics_service_selects_the_operator() -> None:
    objects = render(DEPLOY)
    service = one(objects, "Service", "unbroken-operator-metrics")
    pod_labels = one(objects, "Deployment", "unbroken-operator")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9400, "targetPort": "metrics", "protocol": "TCP"}]


# --- the agent -------------------------------------------------------------------------------


def test_agent_daemonset(rendered: list[Obj]) -> None:
    daemonset = one(rendered, "DaemonSet", "unbroken-agent")
    spec = daemonset["spec"]
    assert spec["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "10%"}}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "unbroken-agent"
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod.get("hostNetwork") is False
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for toleration in BASE_AGENT_TOLERATIONS:
        assert toleration in pod["tolerations"]

    c = container(rendered, "DaemonSet", "unbroken-agent", "agent")
    assert c["image"] == f"{IMAGE}:{TAG}"
    assert c["command"] == AGENT_COMMAND
    assert "args" not in c
    env = env_of(c)
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["UNBROKEN_AGENT_SOCKET"] == "/var/run/unbroken/agent.sock"
    assert c["ports"] == [
        {"name": "metrics", "containerPort": 9401, "protocol": "TCP"},
        {"name": "shards", "containerPort": 9402, "protocol": "TCP"},
    ]
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": 9401}
    assert c["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}
    assert c["securityContext"].get("capabilities", {}).get("add") is None

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    host_mounts = {volumes[name]["hostPath"]["path"]: mount["mountPath"]
                   for name, mount in mounts.items() if "hostPath" in volumes[name]}
    for host_path, mount_path in AGENT_HOST_PATHS.items():
        assert host_mounts.get(host_path) == mount_path, host_path
        volume = next(v for v in volumes.values() if v.get("hostPath", {}).get("path") == host_path)
        assert volume["hostPath"]["type"] == "DirectoryOrCreate"


def test_agent_is_not_privileged_in_the_base() -> None:
    objects = render(DEPLOY)
    pod = one(objects, "DaemonSet", "unbroken-agent")["spec"]["template"]["spec"]
    c = container(objects, "DaemonSet", "unbroken-agent", "agent")
    assert not c["securityContext"].get("privileged")
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert "nodeSelector" not in pod, "the base agent runs on every node"
    assert pod["tolerations"] == BASE_AGENT_TOLERATIONS
    assert "/dev/kmsg" not in {m["mountPath"] for m in c["volumeMounts"]}
    assert not GPU_ENV.keys() & env_of(c).keys()
    for workload in workloads(objects):
        for each in workload["spec"]["template"]["spec"]["containers"]:
            assert not each.get("securityContext", {}).get("privileged"), workload["metadata"]["name"]


def test_gpu_overlay_makes_only_the_agent_privileged_and_adds_kmsg() -> None:
    base, gpu = render(DEPLOY), render(GPU)
    pod = one(gpu, "DaemonSet", "unbroken-agent")["spec"]["template"]["spec"]
    c = container(gpu, "DaemonSet", "unbroken-agent", "agent")
    assert c["securityContext"]["privileged"] is True
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [BASE_AGENT_TOLERATIONS[0], GPU_TOLERATION, *BASE_AGENT_TOLERATIONS[1:]]
    kmsg = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/kmsg")
    assert kmsg["readOnly"] is True
    assert next(v for v in pod["volumes"] if v["name"] == kmsg["name"])["hostPath"]["path"] == "/dev/kmsg"
    assert GPU_ENV.items() <= env_of(c).items()

    # everything else is the base's: the operator untouched, the agent only patched
    for obj in base:
        if (obj["kind"], obj["metadata"]["name"]) != ("DaemonSet", "unbroken-agent"):
            assert obj in gpu, f"{obj['kind']}/{obj['metadata']['name']} differs in the gpu overlay"
    assert c["command"] == AGENT_COMMAND
    for workload in workloads(gpu):
        for each in workload["spec"]["template"]["spec"]["containers"]:
            if each is not c:
                assert not each.get("securityContext", {}).get("privileged"), workload["metadata"]["name"]


# --- Prometheus ------------------------------------------------------------------------------


def test_pods_match_the_podmonitor_and_their_scrape_annotations(rendered: list[Obj]) -> None:
    monitor = yaml.safe_load((DEPLOY / "prometheus" / "podmonitor.yaml").read_text())
    selector = monitor["spec"]["selector"]["matchLabels"]
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    expected = {"unbroken-operator": ("operator", 9400), "unbroken-agent": ("agent", 9401)}
    for workload in workloads(rendered):
        component, port = expected[workload["metadata"]["name"]]
        template = workload["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert selector.items() <= labels.items(), (workload["metadata"]["name"], labels)
        assert labels["app.kubernetes.io/name"] == "unbroken"
        assert labels["app.kubernetes.io/part-of"] == "unbroken"
        assert labels["app.kubernetes.io/component"] == component
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        for endpoint in endpoints:
            assert ports.get(endpoint["port"]) == port, (workload["metadata"]["name"], endpoint["port"], ports)
            assert template["metadata"]["annotations"] == {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(port),
                "prometheus.io/path": endpoint["path"],
            }


# --- RBAC ------------------------------------------------------------------------------------


def test_rbac_is_exactly_the_contract() -> None:
    objects = render(DEPLOY)
    assert rbac_rules(one(objects, "ClusterRole", "unbroken-operator")) == OPERATOR_CLUSTER_RULES
    assert rbac_rules(one(objects, "Role", "unbroken-operator")) == OPERATOR_NAMESPACE_RULES
    assert rbac_rules(one(objects, "ClusterRole", "unbroken-agent")) == AGENT_CLUSTER_RULES
    assert rbac_rules(one(objects, "Role", "unbroken-agent")) == AGENT_NAMESPACE_RULES


def test_rbac_has_no_wildcards_no_secrets_and_no_cluster_wide_writes_of_leases_or_jobs() -> None:
    """Secrets: only the operator's Role in unbroken's namespace creates (the cluster's CA and the heartbeat master
    key) and reads those two by name; nothing can list or watch secrets, and the agent has no Secret right at all."""
    objects = render(DEPLOY)
    for role in (o for o in objects if o["kind"] in {"ClusterRole", "Role"}):
        name = f"{role['kind']}/{role['metadata']['name']}"
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(field, []), f"{name}: wildcard in {field}: {rule}"
            if "secrets" in rule["resources"]:
                assert name == "Role/unbroken-operator" and rule["resources"] == ["secrets"], f"{name}: {rule}"
                readable = {"unbroken-cluster-tls", "unbroken-heartbeat-key"}
                assert (rule["verbs"] == ["create"] and name == "Role/unbroken-operator") or (
                    rule["verbs"] == ["get"] and set(rule.get("resourceNames") or ()) == readable), f"{name}: {rule}"
            assert "nonResourceURLs" not in rule, f"{name}: {rule}"
            assert "resourceNames" not in rule or rule["resourceNames"], f"{name}: {rule}"
        assert "aggregationRule" not in role, name
        if role["kind"] == "ClusterRole":
            resources = {(group, resource) for group, resource, _ in rbac_rules(role)}
            job_verbs = {verb for group, resource, verb in rbac_rules(role) if (group, resource) == ("batch", "jobs")}
            assert job_verbs <= {"list", "watch"}, f"{name}: deep-check Jobs are written only in {NAMESPACE}"
            assert ("", "configmaps") not in resources, name
            lease_verbs = {verb for group, resource, verb in rbac_rules(role) if resource == "leases"}
            assert lease_verbs <= {"get", "list", "watch"}, f"{name}: lease writes only in {NAMESPACE}"


def test_bindings_grant_each_role_to_its_own_service_account() -> None:
    objects = render(DEPLOY)
    roles = {(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] in {"ClusterRole", "Role"}}
    for binding in (o for o in objects if o["kind"] in {"ClusterRoleBinding", "RoleBinding"}):
        name = binding["metadata"]["name"]
        ref = binding["roleRef"]
        assert (ref["kind"], ref["name"]) in roles, name
        assert ref["kind"] == ("ClusterRole" if binding["kind"] == "ClusterRoleBinding" else "Role"), name
        assert ref["name"] == name
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]


# --- image and configuration -----------------------------------------------------------------


def test_image_is_set_through_kustomize_images() -> None:
    base = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text())
    assert base["images"] == [{"name": IMAGE, "newTag": TAG}]
    sources = [obj for name in ("operator.yaml", "agent.yaml") for obj in yaml.safe_load_all((DEPLOY / "base" / name).read_text())]
    for workload in workloads(sources):
        for c in workload["spec"]["template"]["spec"]["containers"]:
            assert c["image"] == IMAGE, f"{workload['metadata']['name']}: the tag comes from kustomization.yaml's images"


def configmap_data(name: str) -> dict[str, str]:
    return one(render(DEPLOY), "ConfigMap", name)["data"]


CLUSTER_FILE = {
    "ClusterName": "k8s",
    "NodeRecovery": "Automatic",
    "InstanceGroups": [{"InstanceGroupName": "gpu", "InstanceType": "p5.48xlarge", "InstanceCount": 0,
                        "OnStartDeepHealthChecks": ["InstanceStress", "InstanceConnectivity"]}],
    "Kubernetes": {"Remediator": "Condition", "RemediationCommand": [], "ForceDeleteGraceSeconds": 60,
                   "DeepCheckImage": "ghcr.io/unbroken-dev/unbroken", "DeepCheckStartSeconds": 300},
}


def test_cluster_configmap() -> None:
    text = configmap_data("unbroken-cluster")["cluster.yaml"]
    assert yaml.safe_load(text) == CLUSTER_FILE


def test_cluster_file_loads_with_the_cluster_schema() -> None:
    from unbroken.config.cluster import ClusterConfig

    ClusterConfig.model_validate(yaml.safe_load(configmap_data("unbroken-cluster")["cluster.yaml"]))


def test_health_configmap_holds_empty_overrides() -> None:
    from unbroken.health.kernel_log.rules import parse

    data = configmap_data("unbroken-health")
    assert set(data) == {"xid.yaml", "npd-rules.json"}
    assert yaml.safe_load(data["xid.yaml"]) is None, "comments only: the shipped Xid table applies"
    rules_file = parse(json.loads(data["npd-rules.json"]), "npd-rules.json")
    assert rules_file.rules == [] and rules_file.conditions == []
