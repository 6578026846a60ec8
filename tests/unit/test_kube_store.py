"""The Kubernetes store, leader lease and annotations against a real kube-apiserver (tests/controlplane).

Real: etcd, kube-apiserver, the controller-manager (its node lifecycle controller taints these kubelet-less
Nodes ``node.kubernetes.io/not-ready``: the tests leave that taint alone, as unbroken must); the store talks to
it with the real ``kubernetes`` client, and ``kubectl`` (the real binary) reads what it wrote.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from pathlib import Path

import kubernetes
import pytest

from kube_objects import make_job

from unbroken.errors import ConfigError, NotFoundError
from unbroken.kubernetes.backend import annotations, names
from unbroken.kubernetes.backend.annotations import AnnotationError
from unbroken.config.job import StragglerPolicy
from unbroken.kubernetes.backend.client import api_client
from unbroken.kubernetes.backend.leader import LeaderLease
from unbroken.kubernetes.backend.store import KubernetesStore, condition_reason
from unbroken.state.phases import DeepHealthStatus, IllegalTransition, JobPhase, NodeState
from unbroken.state.records import EventType, RankInfo, WorkerProgress
from unbroken.state.store import StaleUpdate
from unbroken.state.updates import JobUpdate, NodeUpdate

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "unbroken-system"


@pytest.fixture(scope="module")
def api(kubeconfig: Path) -> kubernetes.client.ApiClient:
    client = api_client(kubeconfig)
    core = kubernetes.client.CoreV1Api(client)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    cluster_yaml = (ROOT / "deploy/base/config/cluster.yaml").read_text()
    core.create_namespaced_config_map(NAMESPACE, {"metadata": {"name": names.CLUSTER_CONFIGMAP},
                                                  "data": {"cluster.yaml": cluster_yaml}})
    return client


@pytest.fixture
def store(api: kubernetes.client.ApiClient) -> KubernetesStore:
    return KubernetesStore(api, NAMESPACE)


def make_node(api: kubernetes.client.ApiClient, ready: str = "True", *, startup_taint: bool = False) -> str:
    name = f"node-{uuid.uuid4().hex[:6]}"
    taints = [{"key": "other.io/keep", "value": "x", "effect": "NoSchedule"}]
    if startup_taint:
        taints.append({"key": names.TAINT_KEY, "value": names.TAINT_VALUE, "effect": names.TAINT_EFFECT})
    kubernetes.client.CoreV1Api(api).create_node({
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "spec": {"taints": taints},
        "status": {"conditions": [{"type": "Ready", "status": ready}], "addresses": [{"type": "InternalIP", "address": "10.0.0.7"}]},
    })
    return name


def test_a_fresh_node_reads_schedulable_never_checked_and_alive(api: kubernetes.client.ApiClient, store: KubernetesStore) -> None:
    name = make_node(api)
    node = store.get_node(name)
    assert (node.state, node.deep_health, node.address, node.version) == (NodeState.SCHEDULABLE, DeepHealthStatus.NOT_RUN, "10.0.0.7", 0)
    assert node.heartbeat_at is not None and node.heartbeat_at > 1e9  # the kubelet vouches (Ready True, no agent lease)
    lost = store.get_node(make_node(api, ready="Unknown"))
    assert lost.heartbeat_at == 0.0  # NotReady: its lease reads as lapsed long ago


def not_lifecycle(keys: list[str]) -> list[str]:
    """Taint keys but the node lifecycle controller's (``node.kubernetes.io/not-ready``: these Nodes have no kubelet)."""
    return [k for k in keys if not k.startswith("node.kubernetes.io/")]


def test_a_node_registered_with_the_startup_taint_is_joining_until_unbroken_admits_it(
        api: kubernetes.client.ApiClient, store: KubernetesStore) -> None:
    name = make_node(api, startup_taint=True)
    assert store.get_node(name).state is NodeState.JOINING
    store.update_node(name, NodeUpdate(deep_health=DeepHealthStatus.PASSED))
    admitted = store.update_node(name, NodeUpdate(state=NodeState.SCHEDULABLE))
    assert admitted.state is NodeState.SCHEDULABLE
    taints = kubernetes.client.CoreV1Api(api).read_node(name).spec.taints
    assert not_lifecycle([t.key for t in taints]) == ["other.io/keep"]  # the startup taint is ours to remove; others stay


def test_a_fault_writes_labels_taint_condition_and_details_and_kubectl_shows_them(
        api: kubernetes.client.ApiClient, store: KubernetesStore, kubeconfig: Path) -> None:
    name = make_node(api)
    updated = store.update_node(name, NodeUpdate(state=NodeState.PENDING_REPLACEMENT, fault_type="Xid79",
                                                 fault_reason="GPU has fallen off the bus: NVRM: Xid 79"), expect_version=0)
    assert updated.version == 1
    obj = kubernetes.client.CoreV1Api(api).read_node(name)
    labels = obj.metadata.labels
    assert labels[names.NODE_HEALTH_STATUS] == "UnschedulablePendingReplacement"
    assert labels[names.FAULT_TYPES] == "Xid79"
    assert labels[names.FAULT_REASONS] == "GPU_has_fallen_off_the_bus_NVRM_Xid_79"
    assert names.DEEP_HEALTH_CHECK_STATUS not in labels
    taints = {(t.key, t.value, t.effect) for t in obj.spec.taints if not_lifecycle([t.key])}
    assert taints == {("other.io/keep", "x", "NoSchedule"), (names.TAINT_KEY, "Unschedulable", "NoSchedule")}
    condition = next(c for c in obj.status.conditions if c.type == names.CONDITION_TYPE)
    assert (condition.status, condition.reason) == ("False", "NvidiaXID79Error")
    assert [c.type for c in obj.status.conditions].count("Ready") == 1  # merged by type, not replaced
    details = json.loads(obj.metadata.annotations[names.FAULT_DETAILS])
    assert details[-1]["type"] == "Xid79" and "fallen off the bus" in details[-1]["message"]
    kubectl = shutil.which("kubectl")
    assert kubectl, "this test reads the labels with the real kubectl (1.32 on the development machines); it is not on PATH"
    out = subprocess.run([kubectl, "--kubeconfig", str(kubeconfig), "get", "nodes", name, "-L", names.NODE_HEALTH_STATUS,
                          "-L", names.FAULT_TYPES], capture_output=True, text=True, timeout=30, check=True).stdout
    assert "UnschedulablePendingReplacement" in out and "Xid79" in out, out
    # Retired keeps the label value of a replacement; an illegal move is refused and writes nothing.
    with pytest.raises(IllegalTransition):
        store.update_node(name, NodeUpdate(state=NodeState.SCHEDULABLE))
    assert store.get_node(name).version == 1


def test_back_to_schedulable_removes_only_our_taint_and_fault_labels(api: kubernetes.client.ApiClient, store: KubernetesStore) -> None:
    name = make_node(api)
    store.update_node(name, NodeUpdate(state=NodeState.UNSCHEDULABLE, deep_health=DeepHealthStatus.IN_PROGRESS))
    store.update_node(name, NodeUpdate(state=NodeState.SCHEDULABLE, deep_health=DeepHealthStatus.PASSED))
    obj = kubernetes.client.CoreV1Api(api).read_node(name)
    assert not_lifecycle([t.key for t in obj.spec.taints]) == ["other.io/keep"]
    assert obj.metadata.labels[names.DEEP_HEALTH_CHECK_STATUS] == "Passed"
    assert names.FAULT_TYPES not in obj.metadata.labels
    assert next(c for c in obj.status.conditions if c.type == names.CONDITION_TYPE).status == "True"


def test_a_stale_version_writes_nothing_but_a_foreign_write_is_not_stale(api: kubernetes.client.ApiClient, store: KubernetesStore) -> None:
    name = make_node(api)
    node = store.get_node(name)
    kubernetes.client.CoreV1Api(api).patch_node(name, {"metadata": {"labels": {"someone": "else"}}})  # bumps resourceVersion only
    store.update_node(name, NodeUpdate(state=NodeState.UNSCHEDULABLE), expect_version=node.version)
    with pytest.raises(StaleUpdate):
        store.update_node(name, NodeUpdate(state=NodeState.SCHEDULABLE), expect_version=node.version)
    assert store.get_node(name).state is NodeState.UNSCHEDULABLE


def test_lease_renewal_is_the_heartbeat(api: kubernetes.client.ApiClient, store: KubernetesStore) -> None:
    name = make_node(api)
    store.renew_lease(name, at=1_700_000_000.5)
    assert store.get_node(name).heartbeat_at == pytest.approx(1_700_000_000.5)
    store.renew_lease(name, at=1_700_000_003.25)
    assert store.get_node(name).heartbeat_at == pytest.approx(1_700_000_003.25)


def test_the_ranks_progress_travels_in_the_agents_lease(api: kubernetes.client.ApiClient, store: KubernetesStore) -> None:
    name = make_node(api)
    report = WorkerProgress(job="ns/llama", attempt=2, ranks=(RankInfo(rank=0, local_rank=0, pid=7),), first_step=1,
                            first_progress_at=10.0, last_step=40, last_progress_at=50.5)
    store.renew_lease(name, at=1_700_000_000.0, progress=[report])
    assert store.lease_progress()[("ns/llama", 2, name)] == report
    store.renew_lease(name, at=1_700_000_001.0, progress=[])
    assert ("ns/llama", 2, name) not in store.lease_progress()


def test_an_unreadable_progress_annotation_loses_only_that_nodes_report(api: kubernetes.client.ApiClient, store: KubernetesStore) -> None:
    good, bad = make_node(api), make_node(api)
    store.renew_lease(good, at=1_700_000_000.0, progress=[WorkerProgress(job="ns/a", attempt=0, last_step=3)])
    store.renew_lease(bad, at=1_700_000_000.0)
    kubernetes.client.CoordinationV1Api(api).patch_namespaced_lease(
        f"{names.LEASE_PREFIX}{bad}", NAMESPACE, {"metadata": {"annotations": {names.LEASE_PROGRESS: "[{\"job\": 1"}}})
    progress = store.lease_progress()
    assert progress[("ns/a", 0, good)].last_step == 3
    assert not any(node == bad for _, _, node in progress)
    assert store.get_node(bad).heartbeat_at == pytest.approx(1_700_000_000.0), "the heartbeat is still read"


def test_only_annotated_jobs_are_jobs_and_their_state_lives_on_the_object(
        api: kubernetes.client.ApiClient, store: KubernetesStore, namespace: str) -> None:
    plain = make_job(api, namespace, None)
    managed = make_job(api, namespace, {names.AUTO_RESUME: "true", names.MAX_RETRY: "2", names.HANG_TIMEOUT: "90"})
    jobs = {j.name: j for j in store.list_jobs()}
    assert f"{namespace}/{plain}" not in jobs
    job = jobs[f"{namespace}/{managed}"]
    spec = job.spec()
    assert (job.phase, job.attempt, spec.nodes, spec.procs_per_node) == (JobPhase.PENDING, 0, 3, 2)
    assert (spec.resilience.max_retry, spec.resilience.hang_timeout, spec.resilience.require_deep_health_passed) == (2, 90.0, False)
    with pytest.raises(NotFoundError):
        store.get_job(f"{namespace}/{plain}")

    running = store.update_job(job.name, JobUpdate(phase=JobPhase.RUNNING, nodes=("a", "b", "c")), expect_version=0)
    restarting = store.update_job(job.name, JobUpdate(phase=JobPhase.RESTARTING), expect_version=running.version)
    store.update_job(job.name, JobUpdate(phase=JobPhase.RUNNING, attempt=1), expect_version=restarting.version)
    with pytest.raises(StaleUpdate):
        store.update_job(job.name, JobUpdate(phase=JobPhase.FAILED), expect_version=running.version)
    obj = kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", managed)
    assert obj["metadata"]["annotations"][names.RESTART_COUNT] == "1"
    assert obj["metadata"]["annotations"][names.JOB_PHASE] == "Running"
    again = store.get_job(job.name)
    assert (again.attempt, again.nodes, again.version) == (1, ("a", "b", "c"), 3)
    untouched = kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", plain)
    assert set(untouched["metadata"].get("annotations") or {}) == set()


def test_events_land_on_the_job_object_in_order(api: kubernetes.client.ApiClient, store: KubernetesStore, namespace: str) -> None:
    managed = make_job(api, namespace, {names.AUTO_RESUME: "true"})
    name = f"{namespace}/{managed}"
    store.list_jobs()  # learns the uid
    store.add_event("Job", name, "JobRestarting", "worker on n1: killed by SIGKILL", type=EventType.WARNING)
    store.add_event("Job", name, "JobScheduled", "attempt 1")
    assert [e.reason for e in store.list_events(object_kind="Job", object_name=name)] == ["JobRestarting", "JobScheduled"]
    core_events = kubernetes.client.CoreV1Api(api).list_namespaced_event(namespace).items
    involved = {(e.involved_object.kind, e.involved_object.name, e.reason, e.type) for e in core_events}
    assert ("PyTorchJob", managed, "JobRestarting", "Warning") in involved


def test_bad_annotations_make_an_invalid_job_not_a_job(api: kubernetes.client.ApiClient, store: KubernetesStore, namespace: str) -> None:
    bad = make_job(api, namespace, {names.AUTO_RESUME: "true", names.MAX_RETRY: "many"})
    assert f"{namespace}/{bad}" not in {j.name for j in store.list_jobs()}
    invalid = {i.name: i for i in store.invalid_jobs()}[f"{namespace}/{bad}"]
    assert invalid.problems == (f'annotation {names.MAX_RETRY}: "many" is not a whole number (valid: 0 to 1000)',)


def test_annotation_parsing() -> None:
    assert annotations.parse(None) is None
    assert annotations.parse({names.AUTO_RESUME: "false", names.MAX_RETRY: "many"}) is None
    parsed = annotations.parse({names.AUTO_RESUME: "true", names.REQUIRE_DEEP_HEALTH: "true"})
    assert parsed is not None and (parsed.max_retry, parsed.hang_timeout, parsed.require_deep_health_passed) == (3, None, True)
    with pytest.raises(AnnotationError) as caught:
        annotations.parse({names.AUTO_RESUME: "ja", names.MAX_RETRY: "-1", names.HANG_TIMEOUT: "soon"})
    assert len(caught.value.problems) == 3
    assert isinstance(caught.value, ConfigError)
    assert 'enable-job-auto-resume: "ja" is not a boolean' in str(caught.value)
    assert '"-1" is out of range (valid: 0 to 1000)' in str(caught.value)
    assert annotations.parse({names.AUTO_RESUME: "true"}).straggler_policy is StragglerPolicy.REPORT  # type: ignore[union-attr]
    chosen = annotations.parse({names.AUTO_RESUME: "true", names.STRAGGLER_POLICY: "replace"})
    assert chosen is not None and chosen.straggler_policy is StragglerPolicy.REPLACE
    with pytest.raises(AnnotationError, match=r'straggler-policy: "evict" is not a straggler policy \(valid: report, shadow, replace, off\)'):
        annotations.parse({names.AUTO_RESUME: "true", names.STRAGGLER_POLICY: "evict"})


def test_condition_reasons() -> None:
    assert condition_reason("Xid79") == "NvidiaXID79Error"
    assert condition_reason("FaultyInstance", "kernel_log.xid: NVRM: Xid (PCI:0000:b9:00): 79, pid=1, GPU has fallen off the bus") \
        == "NvidiaXID79Error"
    assert condition_reason("FaultyInstance", "join checks failed: gpu.stress below threshold") == "DeepHealthCheckFailed"
    assert condition_reason("DeepHealthCheckFailed") == "DeepHealthCheckFailed"
    assert condition_reason("NodeLost") == "NodeLost"
    assert condition_reason("kernel deadlock") == "KernelDeadlock"
    assert condition_reason(None) == "Unhealthy"


def test_leader_lease_one_holder_then_takeover_after_expiry(api: kubernetes.client.ApiClient) -> None:
    lease = f"leader-{uuid.uuid4().hex[:6]}"
    first = LeaderLease(api, NAMESPACE, lease, "first", duration=10)
    second = LeaderLease(api, NAMESPACE, lease, "second", duration=10)
    assert first.hold(1000.0) and not second.hold(1001.0)
    assert first.hold(1005.0) and not second.hold(1014.0)   # renewed at 1005: valid until 1015
    assert second.hold(1016.0) and not first.hold(1016.5)    # expired: taken over
    second.release()
    assert first.hold(1017.0)  # released: no need to wait for expiry
