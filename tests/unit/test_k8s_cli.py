"""The CLI on a Kubernetes cluster: ``unbroken k8s render|start`` and ``--kubeconfig`` for node and job commands.

Real: the CLI process, the Kubernetes client, kubectl-style kubeconfig handling, the Kubeflow SDK's models, and
kube-apiserver with the Kubeflow CRDs (tests/controlplane): admission, the CRDs' schema validation and
defaulting apply to what the CLI creates. No Kubeflow controller runs: these tests look at the objects only.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import kubernetes
import kubernetes_validate
import pytest

from unbroken.kubernetes.pod_launcher import arguments
import yaml

from helpers import run_cli
from test_deploy_manifests import schema_version
from unbroken.config.job import JobSpec
from unbroken.errors import UsageError
from unbroken.kubernetes.backend import annotations as job_annotations
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.client import api_client
from unbroken.kubernetes.backend.render import CLI_MANAGER, Placement, parse_label_selector, render_pytorchjob, render_trainjob
from unbroken.kubernetes.backend.workloads import PYTORCHJOB, TRAINJOB

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "k8s-job.yaml"


def spec(**fields: Any) -> JobSpec:
    """A job whose script is in its image (not on this machine)."""
    return JobSpec.model_validate({"name": "llama", "nodes": 3, "procs_per_node": 8, "command": ["train.py", "--lr", "3e-4"],
                                   "resilience": {"auto_resume": True, "max_retry": 5, "hang_timeout": 600}, **fields},
                                  context={"in_image": True})


def test_the_rendered_job_is_what_the_operator_and_training_operator_read() -> None:
    body = render_pytorchjob(spec(), Placement(image="ghcr.io/me/train:1", namespace="ml", gpus_per_node=8,
                                               node_selector={"node.kubernetes.io/instance-type": "p5.48xlarge"}))
    model = PYTORCHJOB.model(body)  # the Kubeflow SDK reads it back
    assert (model.spec.nproc_per_node, PYTORCHJOB.node_count(body)) == ("8", 3)
    assert {k: v.restart_policy for k, v in model.spec.pytorch_replica_specs.items()} == {"Master": "OnFailure", "Worker": "OnFailure"}
    settings = job_annotations.parse(body["metadata"]["annotations"])  # the operator's own parser
    assert (settings.max_retry, settings.hang_timeout, settings.require_deep_health_passed) == (5, 600.0, False)
    assert settings.startup_timeout == 600.0, "the job file's default startup_timeout"
    template = body["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": template["spec"]}
    assert kubernetes_validate.validate(pod, schema_version(), strict=True)
    container = template["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["command"] == ["python", "-m", "torch.distributed.run", "train.py", "--lr", "3e-4"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "8"}}
    assert template["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert {"UNBROKEN_JOB", "UNBROKEN_AGENT_SOCKET", "UNBROKEN_CHECKPOINT_DIR"} <= {e["name"] for e in container["env"]}


def test_deep_checks_are_required_only_when_asked() -> None:
    def required(s: JobSpec, flag: bool | None) -> str:
        return render_pytorchjob(s, Placement(image="i", deep_health_only=flag))["metadata"]["annotations"][names.REQUIRE_DEEP_HEALTH]
    assert required(spec(), None) == "false", "not written in the job file: any Schedulable node"
    assert required(spec(resilience={"require_deep_health_passed": True}), None) == "true"
    assert required(spec(resilience={"require_deep_health_passed": True}), False) == "false", "the flag wins"
    assert required(spec(), True) == "true"


def command_of(body: dict) -> list[str]:
    return body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]


def test_a_module_command_runs_under_torchrun_and_in_process_restarts_and_warm_spares_under_unbroken_run() -> None:
    body = render_pytorchjob(spec(command=["-m", "pkg.train"], nodes=1), Placement(image="i"))
    assert list(body["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    assert command_of(body) == ["python", "-m", "torch.distributed.run", "--module", "pkg.train"]
    inplace = render_pytorchjob(spec(command=["-m", "pkg.train"], resilience={"in_process_restart": True, "warm_spares": 1,
                                                                              "hang_timeout": 120}), Placement(image="i"))
    assert command_of(inplace) == ["python", "-m", "unbroken", "run", "--hang-timeout", "120", "--warm-spares", "1",
                                   "--abort-timeout", "10", "--collective-timeout", "120", "--module", "pkg.train"]
    # and what it renders is what unbroken run reads: torchrun's options, PET_* from training-operator
    run = arguments.parse(command_of(inplace)[4:], {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "23456"})
    assert (run.command, run.warm_spare, run.collective_timeout, run.nnodes, run.hang_in_place, run.hang_timeout) == \
        (["-m", "pkg.train"], True, 120.0, 2, True, 120.0)
    # no hang timeout set: the launchers time hangs from the ranks' steps (unbroken run's default, auto)
    assert command_of(render_pytorchjob(spec(resilience={"in_process_restart": True}), Placement(image="i")))[4:6] == ["--warm-spares", "0"]
    with pytest.raises(UsageError, match="must be an absolute path in the container"):
        render_pytorchjob(spec(checkpoint={"dir": "ckpt"}), Placement(image="i"))
    assert parse_label_selector(["a=1,b=2", "c=3"]) == {"a": "1", "b": "2", "c": "3"}
    with pytest.raises(UsageError, match="expected key=value"):
        parse_label_selector(["nope"])


def test_spare_pods_and_an_elastic_size_render_as_extra_replicas_and_an_elastic_policy_under_unbroken_run() -> None:
    body = render_pytorchjob(spec(), Placement(image="i", spare_pods=1))
    assert PYTORCHJOB.node_count(body) == 4 and body["metadata"]["annotations"][names.SPARE_PODS] == "1"
    assert command_of(body)[:10] == ["python", "-m", "unbroken", "run", "--spare-pods", "1", "--hang-timeout", "600", "--warm-spares", "1"]
    assert job_annotations.parse(body["metadata"]["annotations"]).spare_pods == 1  # what the operator reads
    # training-operator sets PET_NNODES to every replica: the last one stands by
    run = arguments.parse(command_of(body)[4:], {"PET_NNODES": "4", "PET_NODE_RANK": "3", "PET_MASTER_ADDR": "m"})
    assert (run.nnodes, run.fewest, run.node_rank) == (3, 3, 3)

    elastic = render_pytorchjob(spec(nodes="2:3"), Placement(image="i"))
    assert elastic["spec"]["elasticPolicy"] == {"minReplicas": 2, "maxReplicas": 3}
    assert {k: v["replicas"] for k, v in elastic["spec"]["pytorchReplicaSpecs"].items()} == {"Master": 1, "Worker": 2}
    assert PYTORCHJOB.fewest_pods(elastic) == 2 and PYTORCHJOB.model(elastic).spec.elastic_policy.min_replicas == 2
    assert command_of(elastic)[:4] == ["python", "-m", "unbroken", "run"] and "--spare-pods" not in command_of(elastic)
    run = arguments.parse(command_of(elastic)[4:], {"PET_NNODES": "2:3", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m"})
    assert (run.fewest, run.nnodes, run.spare_pods) == (2, 3, 0)
    with pytest.raises(UsageError, match=r"nodes 2-3 \(elastic\) needs a PyTorchJob \(--kind PyTorchJob\): the Trainer has no "
                                         r"elastic policy yet \(kubeflow/trainer#2903\)"):
        render_trainjob(spec(nodes="2:3"), Placement(image="i"))


def test_the_tiered_checkpoint_is_an_annotation_for_the_agents_and_env_and_mounts_for_the_ranks() -> None:
    body = render_pytorchjob(spec(checkpoint={"memory": {"every_steps": 10, "replicas": 1},
                                              "persistent": {"uri": "s3://bucket/llama", "every_steps": 100}}), Placement(image="i"))
    settings = job_annotations.parse(body["metadata"]["annotations"])  # what the operator and agents read
    assert settings.checkpoint_tiers is not None
    assert (settings.checkpoint_tiers.memory.every_steps, settings.checkpoint_tiers.persistent.uri) == (10, "s3://bucket/llama")
    template = body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    container = template["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["UNBROKEN_CHECKPOINT_TIERS"] == body["metadata"]["annotations"][names.CHECKPOINT_TIERS]
    assert (env["UNBROKEN_CLUSTER_DIR"], env["UNBROKEN_SHM_BASE"]) == ("/var/run/unbroken/cluster", "/dev/shm/unbroken")
    assert {(m["name"], m["mountPath"]) for m in container["volumeMounts"]} == {
        ("unbroken-agent", "/var/run/unbroken"), ("unbroken-shm", "/dev/shm/unbroken")}
    assert {v["name"]: v["hostPath"]["path"] for v in template["spec"]["volumes"]} == {
        "unbroken-agent": "/var/run/unbroken", "unbroken-shm": "/dev/shm/unbroken"}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": template["spec"]}
    assert kubernetes_validate.validate(pod, schema_version(), strict=True)
    plain = render_pytorchjob(spec(), Placement(image="i"))
    assert names.CHECKPOINT_TIERS not in plain["metadata"]["annotations"], "no tiers: file checkpoints only, no shm mount"
    assert "unbroken-shm" not in {v["name"] for v in plain["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]}


def test_a_trainjob_carries_the_same_job_where_the_trainer_takes_it(kubeconfig: Path, namespace: str) -> None:
    """--kind TrainJob: size, image, command and every env entry in spec.trainer (the Trainer refuses env in a
    patch of the ``node`` container), the agent's hostPath and the claim in the CLI's own runtime patch; the
    API server accepts it."""
    body = render_trainjob(spec(checkpoint={"dir": "/ckpt/llama", "memory": {"every_steps": 10}}),
                           Placement(image="ghcr.io/me/train:1", namespace="ml", gpus_per_node=8, checkpoint_claim="ckpt",
                                     node_selector={"node.kubernetes.io/instance-type": "p5.48xlarge"}, runtime="torch-2"))
    model = TRAINJOB.model(body)  # the Trainer SDK reads it back
    assert model.spec.runtime_ref.name == "torch-2" and not TRAINJOB.problems(body)
    assert (TRAINJOB.node_count(body), TRAINJOB.procs_per_node(body)) == (3, 8)
    assert model.spec.trainer.image == "ghcr.io/me/train:1"
    assert body["spec"]["trainer"]["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": "8"}}
    settings = job_annotations.parse(body["metadata"]["annotations"])
    assert (settings.max_retry, settings.hang_timeout) == (5, 600.0) and settings.checkpoint_tiers is not None
    trainer_env = {e["name"] for e in body["spec"]["trainer"]["env"]}
    assert {"UNBROKEN_JOB", "UNBROKEN_AGENT_SOCKET", "UNBROKEN_CHECKPOINT_DIR", "UNBROKEN_CHECKPOINT_TIERS"} <= trainer_env
    [patch] = body["spec"]["runtimePatches"]
    assert patch["manager"] == CLI_MANAGER
    [node_job] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert all("env" not in c for c in node_job["template"]["spec"]["template"]["spec"]["containers"])

    # the API server takes it as it is: the TrainJob CRD's schema, strict field validation (a dry run; the pods the
    # real Trainer builds from it are checked end to end in tests/integration/test_kubernetes.py)
    kubernetes.client.CustomObjectsApi(api_client(kubeconfig)).create_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs", {**body, "metadata": {**body["metadata"], "namespace": namespace}},
        dry_run="All", field_validation="Strict")

    # the operator's restart writes its own entry and keeps the CLI's
    launch = TRAINJOB.launch_patch({**body, "spec": {**body["spec"], "suspend": True}}, 1, require_deep_health=False)
    assert [p["manager"] for p in launch["spec"]["runtimePatches"]] == [CLI_MANAGER, f"{names.PREFIX}/operator"]


def test_a_bad_tier_policy_annotation_names_the_field_and_what_is_valid() -> None:
    with pytest.raises(job_annotations.AnnotationError) as error:
        job_annotations.parse({names.AUTO_RESUME: "true", names.CHECKPOINT_TIERS: '{"memory": {"keep": 0}}'})
    message = str(error.value)
    assert names.CHECKPOINT_TIERS in message and "memory.keep" in message and "every_steps" in message
    with pytest.raises(job_annotations.AnnotationError, match=f'{names.STARTUP_TIMEOUT}: "soon" is not a number of seconds'):
        job_annotations.parse({names.AUTO_RESUME: "true", names.STARTUP_TIMEOUT: "soon"})
    with pytest.raises(job_annotations.AnnotationError, match="not a tier policy"):
        job_annotations.parse({names.AUTO_RESUME: "true", names.CHECKPOINT_TIERS: "fast please"})


@pytest.fixture(scope="module")
def installed(kubeconfig: Path) -> kubernetes.client.ApiClient:
    """unbroken 'installed': its namespace and cluster ConfigMap, as `kubectl apply -k deploy/` leaves them."""
    api = api_client(kubeconfig)
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": "unbroken-system"}})
    core.create_namespaced_config_map("unbroken-system", {"metadata": {"name": names.CLUSTER_CONFIGMAP}, "data": {
        "cluster.yaml": yaml.safe_dump({"ClusterName": "k8s", "InstanceGroups": [
            {"InstanceGroupName": "gpu", "InstanceType": "cpu-dev", "InstanceCount": 0}]})}})
    return api


def test_start_creates_the_job_the_cli_then_lists_and_a_second_start_is_refused(kubeconfig: Path, installed: Any,
                                                                                namespace: str) -> None:
    rendered = yaml.safe_load(run_cli("k8s", "render", "-f", str(EXAMPLE), "--image", "img:1", "-n", namespace).stdout)
    out = run_cli("--kubeconfig", str(kubeconfig), "k8s", "start", "-f", str(EXAMPLE), "--image", "img:1", "-n", namespace).stdout
    assert f"PyTorchJob {namespace}/mlp created (2 x 2)" in out
    created = kubernetes.client.CustomObjectsApi(installed).get_namespaced_custom_object(
        "kubeflow.org", "v1", namespace, "pytorchjobs", "mlp")
    # as rendered, plus what the CRD's schema defaults
    rendered["spec"]["runPolicy"].setdefault("suspend", False)
    assert created["spec"] == rendered["spec"] and created["metadata"]["annotations"] == rendered["metadata"]["annotations"]

    jobs = json.loads(run_cli("--kubeconfig", str(kubeconfig), "job", "list", "-o", "json").stdout)
    assert f"{namespace}/mlp" in [j["name"] for j in jobs]
    logs = run_cli("--kubeconfig", str(kubeconfig), "job", "logs", f"{namespace}/mlp", "-f", check=False)
    assert logs.returncode != 0 and "Traceback" not in logs.stderr
    assert f"kubectl logs -n {namespace} -l training.kubeflow.org/job-name=mlp --prefix --tail=-1 --follow" in logs.stderr
    no_pods = run_cli("--kubeconfig", str(kubeconfig), "job", "logs", f"{namespace}/mlp", check=False)
    assert no_pods.returncode == 2 and f"job {namespace}/mlp has no pods now" in no_pods.stderr, no_pods.stderr
    by_rank = run_cli("--kubeconfig", str(kubeconfig), "job", "logs", f"{namespace}/mlp", "--rank", "1", check=False)
    assert by_rank.returncode == 2 and "a pod's ranks share its container's log" in by_rank.stderr, by_rank.stderr

    again = run_cli("--kubeconfig", str(kubeconfig), "k8s", "start", "-f", str(EXAMPLE), "--image", "img:1", "-n", namespace, check=False)
    assert again.returncode != 0 and f"PyTorchJob {namespace}/mlp already exists" in again.stderr and "Traceback" not in again.stderr


def test_job_start_on_a_cluster_is_k8s_start_and_takes_hyperpods_flags(kubeconfig: Path, installed: Any, namespace: str) -> None:
    """``--kubeconfig ... job start`` renders and creates the job as ``k8s start`` does, here a TrainJob with
    HyperPod start-job's flags; without --kubeconfig those flags are refused, naming them."""
    out = run_cli("--kubeconfig", str(kubeconfig), "job", "start", "-f", str(EXAMPLE), "--image", "img:2", "-n", namespace,
                  "--kind", "TrainJob", "--name", "tj", "--node-count", "3", "--tasks-per-node", "4", "--max-retry", "7",
                  "--entry-script", "/opt/app/train.py", "--label-selector", "pool=h100",
                  "--deep-health-check-passed-nodes-only").stdout
    assert f"TrainJob {namespace}/tj created (3 x 4)" in out
    created = kubernetes.client.CustomObjectsApi(installed).get_namespaced_custom_object(
        TRAINJOB.group, TRAINJOB.version, namespace, TRAINJOB.plural, "tj")
    settings = job_annotations.parse(created["metadata"]["annotations"])
    assert (settings.max_retry, settings.require_deep_health_passed) == (7, True)
    assert created["spec"]["trainer"]["command"][3:5] == ["/opt/app/train.py", "--steps"], created["spec"]["trainer"]["command"]
    jobs = {j["name"]: j for j in json.loads(run_cli("--kubeconfig", str(kubeconfig), "job", "list", "-o", "json").stdout)}
    assert f"{namespace}/tj" in jobs

    without_image = run_cli("--kubeconfig", str(kubeconfig), "job", "start", "-f", str(EXAMPLE), "-n", namespace, check=False)
    assert without_image.returncode == 2 and "--image is required on Kubernetes" in without_image.stderr
    local = run_cli("job", "start", "-f", str(EXAMPLE), "--image", "img:2", "--kind", "TrainJob", check=False)
    assert local.returncode == 2 and "--image, --kind: for a Kubernetes cluster" in local.stderr, local.stderr
    bad_kind = run_cli("k8s", "render", "-f", str(EXAMPLE), "--image", "i", "--kind", "MPIJob", check=False)
    assert bad_kind.returncode == 2 and "--kind 'MPIJob' is not a workload unbroken runs: use one of PyTorchJob, TrainJob" in bad_kind.stderr


def test_node_list_reads_the_clusters_nodes_and_their_labels(kubeconfig: Path, installed: Any) -> None:
    name = f"gpu-{uuid.uuid4().hex[:6]}"
    kubernetes.client.CoreV1Api(installed).create_node({
        "metadata": {"name": name, "labels": {names.DEEP_HEALTH_CHECK_STATUS: "Passed"}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    nodes = {n["name"]: n for n in json.loads(run_cli("--kubeconfig", str(kubeconfig), "node", "list", "-o", "json").stdout)}
    assert (nodes[name]["health_status"], nodes[name]["deep_health_check_status"]) == ("Schedulable", "Passed")
    table = run_cli("--kubeconfig", str(kubeconfig), "node", "list").stdout
    assert name in table and "Passed" in table


def test_a_missing_kubeconfig_or_a_dir_with_it_is_a_clear_error(tmp_path: Path) -> None:
    missing = run_cli("--kubeconfig", str(tmp_path / "nope"), "node", "list", check=False)
    assert missing.returncode != 0 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    both = run_cli("--kubeconfig", str(tmp_path / "nope"), "node", "list", "--dir", str(tmp_path), check=False)
    assert both.returncode != 0 and "--dir names a local cluster" in both.stderr
