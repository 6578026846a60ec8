"""The workload kinds unbroken restarts (kubernetes/backend/workloads.py), and the store over both of them.

Patches are checked by reading them back through the Kubeflow SDK's models; the store runs against a real
kube-apiserver with the Kubeflow CRDs (tests/controlplane), no Kubeflow controller.
"""

from __future__ import annotations

import copy
import time
import dataclasses
import uuid
from typing import Any

import kubernetes
import pytest
from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob


from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.store import KubernetesStore
from unbroken.kubernetes.backend.workloads import PYTORCHJOB, TRAINJOB, kind_of
from unbroken.state.phases import JobPhase
from unbroken.state.records import EventType
from unbroken.state.updates import JobUpdate
from unbroken.plumbing.waiting import wait_until

pytestmark = pytest.mark.timeout(60)
NAMESPACE = "unbroken-system"
QUEUE_PATCH = {"manager": "example.com/queue", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
    {"name": "node", "template": {"spec": {"template": {"metadata": {"labels": {"example.com/queue": "a"}}}}}}]}}}}


def train_job(name: str = "tj", *, suspend: bool | None = None, nodes: int | None = 2,
              annotations: dict[str, str] | None = None, patches: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    trainer: dict[str, Any] = {"numProcPerNode": 4, "command": ["torchrun", "train.py"]}
    if nodes is not None:
        trainer["numNodes"] = nodes
    spec: dict[str, Any] = {"runtimeRef": {"name": "torch-distributed"}, "trainer": trainer,
                            "runtimePatches": copy.deepcopy(patches if patches is not None else [QUEUE_PATCH])}
    if suspend is not None:
        spec["suspend"] = suspend
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": name, "annotations": annotations or {}}, "spec": spec}


def our_patch(obj: dict[str, Any]) -> dict[str, Any]:
    return next(p for p in obj["spec"]["runtimePatches"] if p["manager"] == f"{names.PREFIX}/operator")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: what the API server does with unbroken's patches."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    merged = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def test_a_restart_writes_unbrokens_own_runtime_patch_and_keeps_the_other_managers() -> None:
    job = train_job(suspend=True)
    after = merge_patch(job, TRAINJOB.launch_patch(job, 3, require_deep_health=True))
    model = TrainerV1alpha1TrainJob.from_dict(after)  # the Trainer's own model reads it
    assert model.spec.suspend is False
    assert [p.manager for p in model.spec.runtime_patches] == ["example.com/queue", f"{names.PREFIX}/operator"]
    replicated = our_patch(after)["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert [r["name"] for r in replicated] == ["node"]
    pod = replicated[0]["template"]["spec"]["template"]
    assert pod["metadata"]["annotations"] == {names.ATTEMPT: "3"}
    assert pod["spec"]["nodeSelector"] == {names.DEEP_HEALTH_CHECK_STATUS: "Passed"}

    # the next attempt replaces unbroken's entry instead of adding a second
    again = merge_patch(after, TRAINJOB.launch_patch(merge_patch(after, TRAINJOB.suspend_patch(True)), 4, require_deep_health=False))
    assert [p["manager"] for p in again["spec"]["runtimePatches"]] == ["example.com/queue", f"{names.PREFIX}/operator"]
    pod = our_patch(again)["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pod["metadata"]["annotations"] == {names.ATTEMPT: "4"} and "spec" not in pod
    assert again["spec"]["runtimePatches"][0] == QUEUE_PATCH


def test_adopting_a_running_trainjob_only_unsuspends_it() -> None:
    """The Trainer refuses a runtimePatches change on a running TrainJob; its pods carry no attempt, read as 0."""
    running = train_job()
    assert TRAINJOB.launch_patch(running, 0, require_deep_health=True) == {"spec": {"suspend": False}}
    created_suspended = train_job(suspend=True)
    assert "runtimePatches" in TRAINJOB.launch_patch(created_suspended, 0, require_deep_health=False)["spec"]


def test_pods_of_each_kind_give_their_node_rank_and_rendezvous() -> None:
    trainer_pod = {"metadata": {"namespace": "ns", "labels": {TRAINJOB.pod_label: "tj", "jobset.sigs.k8s.io/replicatedjob-name": "node",
                                                               "batch.kubernetes.io/job-completion-index": "2"}}}
    assert (TRAINJOB.node_rank(trainer_pod, masterless=True), TRAINJOB.is_master(trainer_pod)) == (2, False)
    assert TRAINJOB.rdzv_endpoint("tj") == "tj-node-0-0.tj"
    assert TRAINJOB.pod_selector("tj") == "jobset.sigs.k8s.io/jobset-name=tj,jobset.sigs.k8s.io/replicatedjob-name=node"
    worker = {"metadata": {"labels": {PYTORCHJOB.pod_label: "pj", "training.kubeflow.org/replica-type": "worker",
                                      "training.kubeflow.org/replica-index": "0"}}}
    assert (PYTORCHJOB.node_rank(worker, masterless=False), PYTORCHJOB.node_rank(worker, masterless=True)) == (1, 0)
    assert kind_of(train_job()) is TRAINJOB
    with pytest.raises(ValueError, match="not a workload"):
        kind_of({"apiVersion": "batch/v1", "kind": "Job"})


@pytest.fixture
def api(kubeconfig: Any) -> kubernetes.client.ApiClient:
    from unbroken.kubernetes.backend.client import api_client
    return api_client(kubeconfig)


def create(api: kubernetes.client.ApiClient, namespace: str, body: dict[str, Any]) -> None:
    custom = kubernetes.client.CustomObjectsApi(api)
    if body["kind"] == "TrainJob":
        custom.create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs", body)
    else:
        custom.create_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", body)


def pytorch_job(name: str, annotations: dict[str, str]) -> dict[str, Any]:
    replica = {"replicas": 1, "template": {"spec": {"containers": [{"name": "pytorch", "image": "img"}]}}}
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name, "annotations": annotations},
            "spec": {"pytorchReplicaSpecs": {"Master": replica}}}


def test_an_annotated_trainjob_is_a_job_whose_state_and_events_live_on_it(api: kubernetes.client.ApiClient, namespace: str) -> None:
    store = KubernetesStore(api, NAMESPACE, job_namespace=namespace)
    create(api, namespace, train_job("managed", annotations={names.AUTO_RESUME: "true", names.MAX_RETRY: "3"}))
    create(api, namespace, train_job("plain"))
    jobs = {j.name: j for j in store.list_jobs()}
    assert set(jobs) == {f"{namespace}/managed"}
    spec = jobs[f"{namespace}/managed"].spec()
    assert (spec.nodes, spec.procs_per_node, spec.resilience.max_retry, spec.command) == (2, 4, 3, [f"TrainJob {namespace}/managed"])

    store.update_job(f"{namespace}/managed", JobUpdate(phase=JobPhase.RUNNING, nodes=("a", "b")), expect_version=0)
    store.add_event("Job", f"{namespace}/managed", "JobRestarting", "a rank died", type=EventType.WARNING)
    obj = kubernetes.client.CustomObjectsApi(api).get_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs", "managed")
    assert obj["metadata"]["annotations"][names.JOB_PHASE] == "Running"
    event = kubernetes.client.CoreV1Api(api).list_namespaced_event(namespace).items[0]
    assert (event.involved_object.kind, event.involved_object.api_version, event.involved_object.name) == \
        ("TrainJob", "trainer.kubeflow.org/v1alpha1", "managed")


def test_a_trainjob_without_a_node_count_or_with_a_taken_name_is_invalid_not_a_job(
        api: kubernetes.client.ApiClient, namespace: str) -> None:
    store = KubernetesStore(api, NAMESPACE, job_namespace=namespace)
    opted = {names.AUTO_RESUME: "true"}
    create(api, namespace, train_job("sizeless", nodes=None, annotations=opted))
    create(api, namespace, pytorch_job("twin", opted))
    create(api, namespace, train_job("twin", annotations=opted))
    create(api, namespace, pytorch_job("quiet", {}))  # not opted in: the name stays free for the TrainJob
    create(api, namespace, train_job("quiet", annotations=opted))

    jobs = {j.name: j for j in store.list_jobs()}
    assert set(jobs) == {f"{namespace}/twin", f"{namespace}/quiet"}
    assert jobs[f"{namespace}/twin"].spec().command == [f"PyTorchJob {namespace}/twin"]
    assert jobs[f"{namespace}/quiet"].spec().command == [f"TrainJob {namespace}/quiet"]
    found = {i.name: i for i in store.invalid_jobs()}
    invalid = {name: i.problems for name, i in found.items()}
    assert set(invalid) == {f"{namespace}/sizeless", f"{namespace}/twin"}
    assert "spec.trainer.numNodes is not set" in invalid[f"{namespace}/sizeless"][0]
    assert invalid[f"{namespace}/twin"][0].startswith(f"the PyTorchJob {namespace}/twin is already the job of that name")
    # the warning goes on the TrainJob that is left alone, not on the PyTorchJob that is the job
    twin = found[f"{namespace}/twin"]
    assert (twin.object_kind, found[f"{namespace}/sizeless"].object_kind) == ("TrainJob", "Job")
    store.add_event(twin.object_kind, twin.name, "InvalidAnnotation", twin.problems[0], type=EventType.WARNING)
    [event] = kubernetes.client.CoreV1Api(api).list_namespaced_event(namespace).items
    assert (event.involved_object.kind, event.involved_object.name) == ("TrainJob", "twin")
    assert [e.reason for e in store.list_events(object_kind="TrainJob", object_name=twin.name)] == ["InvalidAnnotation"]
    assert store.list_events(object_kind="Job", object_name=twin.name) == []
    assert store.kind_of(f"{namespace}/quiet") is TRAINJOB
    # a fresh store (an operator after a restart) finds the same kinds without a listing first
    fresh = KubernetesStore(api, NAMESPACE, job_namespace=namespace)
    assert fresh.get_job(f"{namespace}/quiet").spec().command == [f"TrainJob {namespace}/quiet"]


def test_a_trainjob_with_a_node_range_or_spare_pods_gets_a_warning_naming_what_to_do_instead(
        api: kubernetes.client.ApiClient, namespace: str) -> None:
    store = KubernetesStore(api, NAMESPACE, job_namespace=namespace)
    ranged = train_job("ranged", annotations={names.AUTO_RESUME: "true"})
    ranged["spec"]["trainer"]["env"] = [{"name": "PET_NNODES", "value": "2:4"}]
    create(api, namespace, ranged)
    create(api, namespace, train_job("spared", annotations={names.AUTO_RESUME: "true", names.SPARE_PODS: "1"}))
    create(api, namespace, train_job("fixed", annotations={names.AUTO_RESUME: "true", names.SPARE_PODS: "0"}))

    invalid = {i.name: i.problems for i in store.invalid_jobs()}
    assert set(invalid) == {f"{namespace}/ranged", f"{namespace}/spared"}
    assert invalid[f"{namespace}/ranged"] == ('spec.trainer.env PET_NNODES "2:4" is a node range: the Trainer has no elastic '
                                              "policy yet (kubeflow/trainer#2903), so its pods would not regroup as an "
                                              "elastic job; give a fixed numNodes, or run it as a PyTorchJob with "
                                              "elasticPolicy min/max under unbroken run",)
    assert "spare pods need a PyTorchJob" in invalid[f"{namespace}/spared"][0]
    assert [j.name for j in store.list_jobs()] == [f"{namespace}/fixed"]


def test_a_kind_whose_crd_is_not_installed_has_no_jobs(api: kubernetes.client.ApiClient, namespace: str) -> None:
    absent = dataclasses.replace(TRAINJOB, group=f"absent-{uuid.uuid4().hex[:4]}.example.com")
    store = KubernetesStore(api, NAMESPACE, job_namespace=namespace, kinds=(PYTORCHJOB, absent))
    create(api, namespace, pytorch_job("pj", {names.AUTO_RESUME: "true"}))
    assert [j.name for j in store.list_jobs()] == [f"{namespace}/pj"]


def test_a_job_a_queue_holds_or_another_controller_manages_is_never_started_by_unbroken(
        api: kubernetes.client.ApiClient, namespace: str) -> None:
    """Kueue creates its jobs suspended and unsuspends them when it admits them; MultiKueue's (``managedBy``) run on
    another cluster. unbroken's reconciler leaves both as they are, Pending with the reason (and a JobHeld Event), and
    starts watching a queued job once the queue has unsuspended it. (unbroken once unsuspended Kueue's jobs itself.)"""
    from unbroken.kubernetes.backend.backend import ConditionRemediator, KubernetesBackend
    from unbroken.controller.job_reconciler import JobReconciler

    store = KubernetesStore(api, NAMESPACE, job_namespace=namespace)
    reconciler = JobReconciler(store, KubernetesBackend(store, ConditionRemediator(store)), silent_after=2.0)
    opted_in = {names.AUTO_RESUME: "true", names.MAX_RETRY: "3"}
    queued = pytorch_job("queued", opted_in)
    queued["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-a"}
    queued["spec"]["runPolicy"] = {"suspend": True}
    create(api, namespace, queued)
    elsewhere = train_job("elsewhere", annotations=opted_in)
    elsewhere["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"
    create(api, namespace, elsewhere)
    custom = kubernetes.client.CustomObjectsApi(api)

    def pytorchjob() -> dict[str, Any]:
        return custom.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", "queued")

    for _ in range(2):
        reconciler.reconcile_all(time.time())
    assert pytorchjob()["spec"]["runPolicy"]["suspend"] is True, "unbroken unsuspended a job Kueue holds"
    job = store.get_job(f"{namespace}/queued")
    assert job.phase is JobPhase.PENDING
    assert job.reason == "suspended until Kueue admits it from queue team-a (spec.runPolicy.suspend); unbroken starts " \
                         "watching it then"
    remote = store.get_job(f"{namespace}/elsewhere")
    assert remote.phase is JobPhase.PENDING and remote.reason is not None and "managed by kueue.x-k8s.io/multikueue" in remote.reason
    trainjob = custom.get_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs", "elsewhere")
    assert "runtimePatches" not in trainjob["spec"] or all(
        p.get("manager") != "unbroken.dev/operator" for p in trainjob["spec"]["runtimePatches"]), "untouched"
    held = [e for e in kubernetes.client.CoreV1Api(api).list_namespaced_event(namespace).items if e.reason == "JobHeld"]
    assert sorted(e.involved_object.name for e in held) == ["elsewhere", "queued"], "one Event each, not one per pass"

    # Kueue admits it: it unsuspends the job, which is unbroken's to keep alive from then on
    custom.patch_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", "queued",
                                          {"spec": {"runPolicy": {"suspend": False}}})
    reconciler.reconcile_all(time.time())
    admitted = store.get_job(f"{namespace}/queued")
    assert "suspended" not in (admitted.reason or ""), admitted.reason  # placed, or waiting for a node like any job


def test_a_launch_whose_pods_never_come_is_said_and_sent_once_more_and_an_unschedulable_pod_is_named(
        api: kubernetes.client.ApiClient, namespace: str) -> None:
    """No training-operator runs here, so a launched PyTorchJob's pods never appear: 20 s after the launch unbroken
    says so in an AttemptWaiting Event and launches it once more (suspend, unsuspend), once. A pod of the attempt
    that the real kube-scheduler cannot place is then named with the scheduler's own message."""
    from unbroken.kubernetes.backend.backend import ConditionRemediator, KubernetesBackend
    from unbroken.controller.job_reconciler import LAUNCH_FOLLOW_SECONDS, JobReconciler

    core = kubernetes.client.CoreV1Api(api)
    node = f"n-{uuid.uuid4().hex[:6]}"
    core.create_node({"metadata": {"name": node}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    store = KubernetesStore(api, NAMESPACE, job_namespace=namespace)
    reconciler = JobReconciler(store, KubernetesBackend(store, ConditionRemediator(store)), silent_after=2.0)
    create(api, namespace, pytorch_job("late", {names.AUTO_RESUME: "true", names.MAX_RETRY: "3"}))
    name = f"{namespace}/late"
    now = time.time()
    reconciler.reconcile_all(now)
    assert store.get_job(name).phase is JobPhase.RUNNING

    def waits() -> list[str]:
        return [e.message for e in core.list_namespaced_event(namespace).items if e.reason == "AttemptWaiting"]

    reconciler.reconcile_all(now + LAUNCH_FOLLOW_SECONDS / 2)
    assert waits() == [], "too early to say anything"
    custom = kubernetes.client.CustomObjectsApi(api)
    version = custom.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", "late")["metadata"]["resourceVersion"]
    reconciler.reconcile_all(now + LAUNCH_FOLLOW_SECONDS + 1)
    reconciler.reconcile_all(now + LAUNCH_FOLLOW_SECONDS + 2)
    assert len(waits()) == 1 and "no pod of attempt 0 exists: the PyTorchJob's controller has not created them; " \
                                  "launching it once more" in waits()[0], waits()
    after = custom.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", "late")
    assert int(after["metadata"]["resourceVersion"]) > int(version) and after["spec"]["runPolicy"]["suspend"] is False

    # the controller creates a pod, and the scheduler cannot place it
    core.create_namespaced_pod(namespace, {
        "metadata": {"name": "late-master-0", "labels": {PYTORCHJOB.pod_label: "late", PYTORCHJOB.replica_type_label: "master",
                                                         PYTORCHJOB.replica_index_label: "0"},
                     "annotations": {names.ATTEMPT: "0"}},
        "spec": {"nodeSelector": {"no-such-label": "x"}, "containers": [{"name": "pytorch", "image": "img"}]}})

    def unschedulable() -> list[str]:
        reconciler.reconcile_all(time.time() + LAUNCH_FOLLOW_SECONDS)
        return [m for m in waits() if "pod late-master-0 is not scheduled: 0/" in m]
    found = wait_until(unschedulable, 30, "the scheduler's verdict named")
    assert "didn't match Pod's node affinity/selector" in found[0], found
