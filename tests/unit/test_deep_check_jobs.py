"""Deep-check Jobs on join: the Job's shape (validated offline against the Kubernetes schema, and by a
real kube-apiserver in a dry run), its name, which group a node belongs to, and the verdict a pod leaves.
The end-to-end run (real checks in pods on the process kubelet's nodes) is tests/integration/test_kubernetes.py."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import kubernetes
import kubernetes_validate
import pytest

from test_deploy_manifests import schema_version
from unbroken.config.cluster import ClusterConfig, InstanceGroup
from unbroken.health.pod import VERDICT_MARK, parse_verdict, verdict_record
from unbroken.health.result import CheckResult, FaultAction, Status, Suite
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.client import api_client
from unbroken.kubernetes.operator.deep_checks import group_of, job_manifest, job_name
from unbroken.state.phases import DeepHealthStatus, NodeState
from unbroken.state.records import Node
from unbroken.plumbing.waiting import wait_until

CLUSTER = ClusterConfig(
    ClusterName="k8s",
    InstanceGroups=[
        InstanceGroup(InstanceGroupName="gpu", InstanceType="p5.48xlarge", InstanceCount=0,
                      OnStartDeepHealthChecks=["InstanceStress", "InstanceConnectivity"]),
        InstanceGroup(InstanceGroupName="cpu", InstanceType="cpu-dev", InstanceCount=0),
    ],
)


def node(name: str = "ip-10-0-1-17.ec2.internal", *, group: str = "default", instance_type: str = "p5.48xlarge", reboots: int = 0) -> Node:
    return Node(name=name, group=group, instance_type=instance_type, state=NodeState.JOINING,
                deep_health=DeepHealthStatus.NOT_RUN, registered_at=1_700_000_000.0, reboots=reboots)


def test_a_node_belongs_to_its_labelled_group_else_to_the_group_of_its_instance_type() -> None:
    assert group_of(CLUSTER, node(group="cpu")).InstanceGroupName == "cpu"  # type: ignore[union-attr]
    assert group_of(CLUSTER, node(instance_type="p5.48xlarge")).InstanceGroupName == "gpu"  # type: ignore[union-attr]
    assert group_of(CLUSTER, node(instance_type="m7i.large")) is None


def test_job_names_fit_a_label_and_change_with_each_round_and_incarnation() -> None:
    long = node("a" * 200 + ".compute.internal")
    assert len(job_name(long, Suite.INSTANCE_CONNECTIVITY)) <= 63
    first = job_name(node(), Suite.INSTANCE_STRESS)
    assert first.startswith("unbroken-check-stress-ip-10-0-1-17.ec2.internal-")
    assert job_name(node(reboots=1), Suite.INSTANCE_STRESS) != first  # back from a reboot: checked again
    assert job_name(node(), Suite.INSTANCE_CONNECTIVITY) != first


def test_the_job_is_pinned_tolerant_single_shot_and_valid_for_kubernetes() -> None:
    body = job_manifest("unbroken-system", CLUSTER, CLUSTER.group("gpu"), node(), Suite.INSTANCE_STRESS, "unbroken-check-stress-x-1234abcd")
    assert kubernetes_validate.validate(body, schema_version(), strict=True)
    spec = body["spec"]
    assert spec["backoffLimit"] == 0
    # the suite's check timeouts (devices 2 x 30, stress 2 x 120, storage 60) + the start allowance
    # the stress suite's timeouts: devices 30 + 30, matmul, membw and the known answer 120 each, storage 60
    assert spec["activeDeadlineSeconds"] == 480 + int(CLUSTER.Kubernetes.DeepCheckStartSeconds)
    pod = spec["template"]["spec"]
    assert pod["tolerations"] == [{"key": names.TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["ip-10-0-1-17.ec2.internal"]}]}]
    container = pod["containers"][0]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "8"}}  # a p5 profile: every GPU of the node
    env = {e["name"]: e.get("value") for e in container["env"]}
    context = json.loads(env["UNBROKEN_CHECK_CONTEXT"])
    assert (context["node"], context["instance_type"], env["UNBROKEN_CHECK_SUITE"]) == (
        "ip-10-0-1-17.ec2.internal", "p5.48xlarge", "InstanceStress")


def test_the_cross_node_sweep_is_an_indexed_job_one_pod_per_node_in_the_hosts_network(kubeconfig: Path, namespace: str) -> None:
    from dataclasses import replace

    from unbroken.health.context import Peer

    joining = replace(node(), address="10.0.1.17")
    peers = (Peer("ip-10-0-1-20.ec2.internal", "10.0.1.20"),)
    name = "unbroken-check-connectivity-x-1234abcd"
    body = job_manifest("unbroken-system", CLUSTER, CLUSTER.group("gpu"), joining, Suite.INSTANCE_CONNECTIVITY, name, peers)
    assert kubernetes_validate.validate(body, schema_version(), strict=True)
    spec = body["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == ("Indexed", 2, 2, 0)
    pod = spec["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # one term per node (ORed): the API server refuses several values in a metadata.name field selector
    assert [t["matchFields"][0]["values"] for t in terms] == [["ip-10-0-1-17.ec2.internal"], ["ip-10-0-1-20.ec2.internal"]]
    # and the real API server accepts the Job as it is (a dry run: its validation is more than the schema's)
    batch = kubernetes.client.BatchV1Api(api_client(kubeconfig))
    batch.create_namespaced_job(namespace, {**body, "metadata": {**body["metadata"], "namespace": namespace}},
                                dry_run="All", field_validation="Strict")
    (apart,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert apart["topologyKey"] == "kubernetes.io/hostname"
    assert spec["template"]["metadata"]["labels"].items() >= apart["labelSelector"]["matchLabels"].items()
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    context = json.loads(env["UNBROKEN_CHECK_CONTEXT"])
    # rank 0 on the joining node, at its InternalIP, on the configured port
    assert [(p["name"], p["address"]) for p in context["peers"]] == [("ip-10-0-1-17.ec2.internal", "10.0.1.17"),
                                                                       ("ip-10-0-1-20.ec2.internal", "10.0.1.20")]
    assert context["params"] == {"port": CLUSTER.Kubernetes.ConnectivityPort}
    alone = job_manifest("unbroken-system", CLUSTER, CLUSTER.group("gpu"), joining, Suite.INSTANCE_CONNECTIVITY, name)
    assert "completionMode" not in alone["spec"] and "hostNetwork" not in alone["spec"]["template"]["spec"]


def result(check: str, status: Status, *, action: FaultAction = FaultAction.REPLACE, faulty: tuple[str, ...] = ()) -> CheckResult:
    return CheckResult(check, Suite.INSTANCE_STRESS, status, f"{check} said so", action=action, node="n1", faulty_nodes=faulty)


def test_the_verdict_blames_the_node_unless_a_check_named_only_others() -> None:
    passed = verdict_record("n1", [result("stress.matmul", Status.PASS), result("collective.allreduce", Status.FAIL, faulty=("n2",))])
    assert (passed["passed"], passed["blamed"]) == (True, ["n2"])
    failed = verdict_record("n1", [result("stress.matmul", Status.FAIL), result("devices.errors", Status.FAIL, action=FaultAction.REBOOT)])
    assert (failed["passed"], failed["fault_type"]) == (False, "FaultyInstance")
    assert failed["reason"] == "stress.matmul: stress.matmul said so; devices.errors: devices.errors said so"


@pytest.mark.parametrize("text", ["", "Traceback (most recent call last):\n  killed", VERDICT_MARK + "{not json", VERDICT_MARK + "[1, 2]"])
def test_a_pod_that_died_before_its_verdict_has_none(text: str) -> None:
    assert parse_verdict(text) is None


def test_the_verdict_is_the_last_marked_line_of_the_log_tail() -> None:
    tail = "noise\n" + VERDICT_MARK + json.dumps({"passed": False, "reason": "x"}) + "\n"
    assert parse_verdict(tail) == {"passed": False, "reason": "x"}


def test_a_peer_the_cross_node_sweep_blames_is_taken_out_and_the_joining_node_passes(kubeconfig: Path, namespace: str) -> None:
    """The operator's side of a sweep that named a peer as the slow node (a slow link cannot be made between
    the process kubelet's nodes, which share one loopback): the real API server and controllers, no kubelet.
    The Job's completion and the joining node's pod, with its verdict in the termination message, are
    written here as the Job controller and the kubelet would."""
    import kubernetes

    from unbroken.kubernetes.backend.client import api_client
    from unbroken.kubernetes.backend.store import KubernetesStore
    from unbroken.kubernetes.operator.deep_checks import DeepCheckJobs

    api = api_client(kubeconfig)
    core, batch = kubernetes.client.CoreV1Api(api), kubernetes.client.BatchV1Api(api)
    joining, slow = f"join-{namespace}", f"peer-{namespace}"
    ready = {"conditions": [{"type": "Ready", "status": "True"}], "addresses": [{"type": "InternalIP", "address": "10.0.0.9"}]}
    core.create_node({"metadata": {"name": joining, "labels": {f"{names.PREFIX}/instance-group": "conn"}},
                      "spec": {"taints": [{"key": names.TAINT_KEY, "value": "Unschedulable", "effect": "NoSchedule"}]},
                      "status": ready})
    core.create_node({"metadata": {"name": slow, "labels": {names.DEEP_HEALTH_CHECK_STATUS: "Passed"}}, "status": ready})
    cluster = ClusterConfig(ClusterName="k8s", InstanceGroups=[InstanceGroup(
        InstanceGroupName="conn", InstanceType="cpu-dev", InstanceCount=0, OnStartDeepHealthChecks=["InstanceConnectivity"])])
    store = KubernetesStore(api, namespace)
    checks = DeepCheckJobs(api, namespace, store)

    checks.reconcile(cluster)
    (job,) = [j for j in batch.list_namespaced_job(namespace).items if j.metadata.annotations[f"{names.PREFIX}/check-node"] == joining]
    assert job.spec.completion_mode == "Indexed" and job.spec.completions >= 2
    verdict = {"passed": True, "reason": "1 checks passed", "fault_type": None, "blamed": [slow], "results": []}
    pod = core.create_namespaced_pod(namespace, {
        "metadata": {"name": f"{job.metadata.name}-0-abcde", "labels": {"job-name": job.metadata.name}},
        "spec": {"nodeName": joining, "containers": [{"name": "check", "image": "x"}]}})
    core.patch_namespaced_pod_status(pod.metadata.name, namespace, {"status": {"phase": "Succeeded", "containerStatuses": [
        {"name": "check", "image": "x", "imageID": "", "ready": False, "restartCount": 0,
         "state": {"terminated": {"exitCode": 0, "message": VERDICT_MARK + json.dumps(verdict)}}}]}})
    # what the Job controller writes when every index succeeded (the API server checks that it is consistent)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    def completed() -> bool:
        # The real Job controller writes this Job's status too (it sees the pod): a write that races
        # it is refused (409, or 422 when the two disagree on startTime), and tried again.
        try:
            # the controller's own startTime once it wrote one: another is refused (422) at every try
            started = batch.read_namespaced_job_status(job.metadata.name, namespace).status.start_time
            start = started.strftime("%Y-%m-%dT%H:%M:%SZ") if started else now
            batch.patch_namespaced_job_status(job.metadata.name, namespace, {"status": {
                "startTime": start, "completionTime": max(start, now), "succeeded": job.spec.completions, "active": 0,
                "completedIndexes": f"0-{job.spec.completions - 1}",
                "conditions": [{"type": "SuccessCriteriaMet", "status": "True", "lastTransitionTime": now},
                               {"type": "Complete", "status": "True", "lastTransitionTime": now}]}})
        except kubernetes.client.ApiException as exc:
            if exc.status not in (409, 422):
                raise
            return False
        return True
    wait_until(completed, 10, "the Job's status to be written")

    checks.reconcile(cluster)
    assert store.get_node(joining).deep_health is DeepHealthStatus.PASSED
    blamed = store.get_node(slow)
    assert blamed.state is NodeState.PENDING_REPLACEMENT and blamed.fault_type == "FaultyInstance", blamed
    assert f"InstanceConnectivity of {joining}" in (blamed.fault_reason or "") and "slow node of the sweep" in (blamed.fault_reason or "")
