"""A job file (the same format as on a local cluster) rendered as an annotated Kubeflow PyTorchJob.

``unbroken k8s render`` prints it, ``unbroken k8s start`` creates it. The object
is built with the Kubeflow SDK's models and the Kubernetes client's, so what is
printed is what the SDK would send:

* one Master and ``nodes - 1`` Workers, ``nprocPerNode`` = ``procs_per_node``,
  ``restartPolicy: OnFailure`` (with ``Never`` training-operator fails the whole
  job at the first failed pod, and a failed PyTorchJob cannot be resumed);
* the container runs ``python -m torch.distributed.run`` with the job's
  command: torchrun reads training-operator's ``PET_*`` environment, so the
  job's rendezvous needs no flags;
* ``resilience`` becomes the annotations (``enable-job-auto-resume``,
  ``job-max-retry-count``, ``hang-timeout-seconds``,
  ``require-deep-health-passed``), and the pods get the node agent's socket
  and their identity (``rank_env``) so hangs are seen;
* ``checkpoint.dir`` (default ``/checkpoints``) is ``UNBROKEN_CHECKPOINT_DIR``,
  on a PersistentVolumeClaim every pod mounts when ``checkpoint_claim`` is given;
* ``checkpoint.memory`` (and ``persistent``), the tiered checkpoint, becomes the
  annotation ``unbroken.dev/checkpoint-tiers`` (for the node agents, which keep
  the replicas and drain to the persistent tier: use ``s3://`` there, or a
  ``file://`` path every agent mounts) and the ranks' env and the node's memory
  tier mount (``rank_env.with_rank_env``).

Deep checks: on Kubernetes a job waits for nodes whose deep check ``Passed``
only when asked (HyperPod's ``--deep-health-check-passed-nodes-only``, or
``require_deep_health_passed`` written in the job file): nodes that were in the
cluster before unbroken are never deep-checked, so requiring it by default
would leave such a cluster's jobs Pending.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
from kubeflow.training.models import KubeflowOrgV1PyTorchJob, KubeflowOrgV1PyTorchJobSpec, KubeflowOrgV1ReplicaSpec, KubeflowOrgV1RunPolicy

from unbroken import launch_env
from unbroken.config.job import JobSpec
from unbroken.errors import UsageError
from unbroken.kube import names
from unbroken.kube.rank_env import with_rank_env
from unbroken.kube.workloads import PYTORCHJOB

DEFAULT_CHECKPOINT_DIR = Path("/checkpoints")
CONTAINER = "pytorch"
"""training-operator puts its env into the container of this name."""


@dataclass(frozen=True)
class Placement:
    """What a job file does not say and a cluster needs: where, from which image, on what hardware."""

    image: str
    namespace: str = "default"
    gpus_per_node: int = 0
    node_selector: dict[str, str] = field(default_factory=dict)
    deep_health_only: bool | None = None
    """None: the job file's ``require_deep_health_passed`` if written there, else False."""
    checkpoint_claim: str | None = None
    termination_grace_seconds: int = 30


def parse_label_selector(items: list[str]) -> dict[str, str]:
    """HyperPod's ``--label-selector key=value`` (repeatable, or comma-separated) as a nodeSelector."""
    selector: dict[str, str] = {}
    for item in (part.strip() for text in items for part in text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--label-selector {item!r}: expected key=value, e.g. node.kubernetes.io/instance-type=p5.48xlarge")
        selector[key.strip()] = value.strip()
    return selector


def torchrun_command(spec: JobSpec) -> list[str]:
    command = list(spec.command)
    script = ["--module", *command[1:]] if command[0] == "-m" else command
    return ["python", "-m", "torch.distributed.run", *script]


def job_annotations(spec: JobSpec, placement: Placement) -> dict[str, str]:
    resilience = spec.resilience
    if placement.deep_health_only is not None:
        deep = placement.deep_health_only
    else:
        deep = "require_deep_health_passed" in resilience.model_fields_set and resilience.require_deep_health_passed
    annotations = {
        names.AUTO_RESUME: "true" if resilience.auto_resume else "false",
        names.MAX_RETRY: str(resilience.max_retry),
        names.HANG_TIMEOUT: f"{resilience.hang_timeout:g}",
        names.STARTUP_TIMEOUT: f"{resilience.startup_timeout:g}",
        names.REQUIRE_DEEP_HEALTH: "true" if deep else "false",
    }
    if (tiers := tiers_json(spec)) is not None:
        annotations[names.CHECKPOINT_TIERS] = tiers
    return annotations


def tiers_json(spec: JobSpec) -> str | None:
    """The job's tier policy as the annotation and the ranks' env carry it; None without tiers."""
    tiers = spec.checkpoint.tiers
    return None if tiers is None else tiers.model_dump_json(exclude_none=True)


def render_pytorchjob(spec: JobSpec, placement: Placement) -> dict[str, Any]:
    if spec.elastic:
        raise UsageError(f"job {spec.name}: nodes {spec.fewest_nodes}-{spec.nodes} (elastic) runs on the local backend only in "
                         f"this version; on Kubernetes give a fixed size (nodes: {spec.nodes})")
    if spec.resilience.warm_spares:
        raise UsageError(f"job {spec.name}: resilience.warm_spares {spec.resilience.warm_spares} needs a node agent that "
                         "launches the ranks (the local backend); on Kubernetes the pod's container starts them: "
                         "remove warm_spares")
    if spec.resilience.in_process_restart:
        raise UsageError(f"job {spec.name}: resilience.in_process_restart needs a node agent that holds the ranks between "
                         "attempts (the local backend); on Kubernetes a restart recreates the pods: remove in_process_restart")
    client = kubernetes.client
    checkpoint_dir = spec.checkpoint.dir or DEFAULT_CHECKPOINT_DIR
    if not checkpoint_dir.is_absolute():
        raise UsageError(f"job {spec.name}: checkpoint.dir {str(checkpoint_dir)!r} must be an absolute path in the container "
                         f"(e.g. {DEFAULT_CHECKPOINT_DIR / spec.name})")
    env = [client.V1EnvVar(name=k, value=v) for k, v in sorted(spec.env.items())]
    env += [client.V1EnvVar(name=launch_env.CHECKPOINT_DIR, value=str(checkpoint_dir)),
            client.V1EnvVar(name=launch_env.CHECKPOINT_KEEP, value=str(spec.checkpoint.keep))]
    mounts, volumes = [], []
    if placement.checkpoint_claim:
        mounts.append(client.V1VolumeMount(name="checkpoints", mount_path=str(checkpoint_dir)))
        volumes.append(client.V1Volume(name="checkpoints", persistent_volume_claim=client.V1PersistentVolumeClaimVolumeSource(
            claim_name=placement.checkpoint_claim)))
    resources = (client.V1ResourceRequirements(limits={"nvidia.com/gpu": str(placement.gpus_per_node)})
                 if placement.gpus_per_node else None)
    container = client.V1Container(
        name=CONTAINER, image=placement.image, command=torchrun_command(spec), env=env,
        volume_mounts=mounts or None, resources=resources,  # the working directory is the image's
    )
    pod = client.V1PodSpec(containers=[container], volumes=volumes or None, node_selector=placement.node_selector or None,
                           termination_grace_period_seconds=placement.termination_grace_seconds)
    serializer = client.ApiClient()  # only its model-to-JSON conversion: it never connects
    template = with_rank_env(serializer.sanitize_for_serialization(client.V1PodTemplateSpec(spec=pod)),
                             PYTORCHJOB.pod_label, tiers_json=tiers_json(spec))
    replicas = {"Master": KubeflowOrgV1ReplicaSpec(replicas=1, restart_policy="OnFailure", template=template)}
    if spec.nodes > 1:
        replicas["Worker"] = KubeflowOrgV1ReplicaSpec(replicas=spec.nodes - 1, restart_policy="OnFailure", template=template)
    job = KubeflowOrgV1PyTorchJob(
        api_version=PYTORCHJOB.api_version, kind=PYTORCHJOB.kind,
        metadata=client.V1ObjectMeta(name=spec.name, namespace=placement.namespace, annotations=job_annotations(spec, placement),
                                     labels={"app.kubernetes.io/managed-by": "unbroken-cli"}),
        spec=KubeflowOrgV1PyTorchJobSpec(nproc_per_node=str(spec.procs_per_node), pytorch_replica_specs=replicas,
                                         run_policy=KubeflowOrgV1RunPolicy(clean_pod_policy="None")),
    )
    rendered: dict[str, Any] = serializer.sanitize_for_serialization(job)
    return rendered
