"""A job file (the same format as on a local cluster) rendered as an annotated Kubeflow PyTorchJob
or TrainJob.

``unbroken k8s render`` prints it, ``unbroken k8s start`` (and ``job start`` on a
cluster) creates it. The workload is built with the Kubeflow SDKs' models and
serialized by the Kubernetes client, so what is printed is what the SDK would
send; the pod template inside a PyTorchJob is the JSON that ``rank_env`` edits
(the tests validate it against the Kubernetes Pod schema). A PyTorchJob:

* one Master and ``nodes - 1`` Workers (plus ``--spare-pods``), ``nprocPerNode`` = ``procs_per_node``,
  ``restartPolicy: OnFailure`` (with ``Never`` training-operator fails the whole
  job at the first failed pod, and a failed PyTorchJob cannot be resumed);
* the container runs ``python -m torch.distributed.run`` with the job's
  command: torchrun reads training-operator's ``PET_*`` environment, so the
  job's rendezvous needs no flags; a job with ``in_process_restart``,
  ``warm_spares``, spare pods or an elastic size runs ``python -m unbroken run``
  instead (kubernetes/pod_launcher/, the same arguments and environment), which restarts
  failed ranks in the pods, gives a lost pod's place to a spare pod and
  regroups an elastic job;
* an elastic job (``nodes: "2:4"``) gets ``elasticPolicy`` min/max replicas
  (training-operator's PET_NNODES ``2:4``) and keeps its Master: node rank 0
  hosts ``unbroken run``'s coordinator;
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

A TrainJob (Kubeflow Trainer v2) names a runtime (``torch-distributed`` by
default, the Trainer's shipped ClusterTrainingRuntime) and carries the same
things where the Trainer takes them: image, command, node count, ranks per
node, GPUs and every env entry in ``spec.trainer`` (the Trainer refuses env in
a runtime patch of the ``node`` container: only ``trainer.env`` sets it), and
the hostPath and claim volumes, their mounts, the nodeSelector and the grace
period in a runtime patch of its own (``manager: unbroken.dev/cli``) on the
``node`` replicated job. The operator adds its own entry at each restart and
keeps this one.

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
from kubeflow.training.models import (
    KubeflowOrgV1ElasticPolicy, KubeflowOrgV1PyTorchJob, KubeflowOrgV1PyTorchJobSpec, KubeflowOrgV1ReplicaSpec, KubeflowOrgV1RunPolicy,
)
from kubeflow_trainer_api import models as trainer

from unbroken.rank import env as launch_env
from unbroken.config.job import HANG_TIMEOUT_FALLBACK_S, JobSpec
from unbroken.kubernetes.backend import annotations as job_annotations_module
from unbroken.errors import UsageError
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend import rank_env
from unbroken.kubernetes.backend.workloads import PYTORCHJOB, TRAINER_CONTAINER, TRAINER_JOB, TRAINJOB, WorkloadKind

DEFAULT_CHECKPOINT_DIR = Path("/checkpoints")
CONTAINER = "pytorch"
"""training-operator puts its env into the container of this name."""
CLI_MANAGER = f"{names.PREFIX}/cli"
"""The TrainJob runtime patch written at render time (the operator's own entry is ``.../operator``)."""
KINDS: dict[str, WorkloadKind] = {PYTORCHJOB.kind: PYTORCHJOB, TRAINJOB.kind: TRAINJOB}


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
    runtime: str = names.TRAINJOB_DEFAULT_RUNTIME
    """A TrainJob's ClusterTrainingRuntime (a PyTorchJob has none)."""
    spare_pods: int = 0
    """Pods past the job's size that stand by warm (``unbroken run --spare-pods``; an elastic job's are past its max)."""


def parse_label_selector(items: list[str]) -> dict[str, str]:
    """HyperPod's ``--label-selector key=value`` (repeatable, or comma-separated) as a nodeSelector."""
    selector: dict[str, str] = {}
    for item in (part.strip() for text in items for part in text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--label-selector {item!r}: expected key=value, e.g. node.kubernetes.io/instance-type=p5.48xlarge")
        selector[key.strip()] = value.strip()
    return selector


def torchrun_command(spec: JobSpec, spare_pods: int = 0) -> list[str]:
    """torchrun, or ``unbroken run`` (kubernetes/pod_launcher/) for a job with in-process restarts, warm spares, spare pods or an
    elastic size: the pods then restart failed ranks in place, from a spare with torch imported, give a lost pod's
    place to a spare pod, and regroup an elastic job, instead of being recreated."""
    command = list(spec.command)
    script = ["--module", *command[1:]] if command[0] == "-m" else command
    resilience = spec.resilience
    if not (resilience.in_process_restart or resilience.warm_spares or spare_pods or spec.elastic):
        return ["python", "-m", "torch.distributed.run", *script]
    spares = ["--spare-pods", str(spare_pods)] if spare_pods and not spec.elastic else []
    # the job's own hang timeout, if it sets one, is the launchers' too (they act at half of it); else step times
    hang = ["--hang-timeout", f"{resilience.hang_timeout:g}"] if resilience.hang_timeout is not None else []
    return ["python", "-m", "unbroken", "run", *spares, *hang, "--warm-spares", "1" if resilience.warm_spares or spare_pods else "0",
            "--abort-timeout", f"{resilience.in_process_abort_timeout:g}",
            "--collective-timeout", f"{resilience.hang_timeout or HANG_TIMEOUT_FALLBACK_S:g}", *script]


def job_annotations(spec: JobSpec, placement: Placement) -> dict[str, str]:
    """The job's ``unbroken.dev/*`` annotations (``annotations.write``), with what the placement adds."""
    if placement.deep_health_only is not None:
        deep = placement.deep_health_only
    else:
        deep = "require_deep_health_passed" in spec.resilience.model_fields_set and spec.resilience.require_deep_health_passed
    return job_annotations_module.write(spec, deep_health=deep, spare_pods=0 if spec.elastic else placement.spare_pods)


def render(spec: JobSpec, placement: Placement, kind: WorkloadKind = PYTORCHJOB) -> dict[str, Any]:
    """``spec`` as an annotated workload of ``kind`` (a PyTorchJob or a TrainJob)."""
    return render_trainjob(spec, placement) if kind is TRAINJOB else render_pytorchjob(spec, placement)


def _checkpoint_dir(spec: JobSpec) -> Path:
    """The checkpoint directory in the container."""
    checkpoint_dir = spec.checkpoint.dir or DEFAULT_CHECKPOINT_DIR
    if not checkpoint_dir.is_absolute():
        raise UsageError(f"job {spec.name}: checkpoint.dir {str(checkpoint_dir)!r} must be an absolute path in the container "
                         f"(e.g. {DEFAULT_CHECKPOINT_DIR / spec.name})")
    return checkpoint_dir


def _job_env(spec: JobSpec, checkpoint_dir: Path) -> list[dict[str, str]]:
    """The job file's env, then where the file checkpointer writes."""
    return [*({"name": k, "value": v} for k, v in sorted(spec.env.items())),
            {"name": launch_env.CHECKPOINT_DIR, "value": str(checkpoint_dir)},
            {"name": launch_env.CHECKPOINT_KEEP, "value": str(spec.checkpoint.keep)}]


def _claim(placement: Placement, checkpoint_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The mount and the volume of ``--checkpoint-claim`` (none without one)."""
    if not placement.checkpoint_claim:
        return [], []
    return ([{"name": "checkpoints", "mountPath": str(checkpoint_dir)}],
            [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": placement.checkpoint_claim}}])


def _gpu_limits(placement: Placement) -> dict[str, Any] | None:
    return {"limits": {"nvidia.com/gpu": str(placement.gpus_per_node)}} if placement.gpus_per_node else None


def _metadata(spec: JobSpec, placement: Placement) -> dict[str, Any]:
    return {"name": spec.name, "namespace": placement.namespace, "annotations": job_annotations(spec, placement),
            "labels": {"app.kubernetes.io/managed-by": "unbroken-cli"}}


def render_pytorchjob(spec: JobSpec, placement: Placement) -> dict[str, Any]:
    checkpoint_dir = _checkpoint_dir(spec)
    mounts, claim = _claim(placement, checkpoint_dir)
    container = {"name": CONTAINER, "image": placement.image, "command": torchrun_command(spec, placement.spare_pods),  # the working directory is the image's
                 "env": _job_env(spec, checkpoint_dir), "volumeMounts": mounts or None, "resources": _gpu_limits(placement)}
    pod = {"containers": [container], "volumes": claim or None, "nodeSelector": placement.node_selector or None,
           "terminationGracePeriodSeconds": placement.termination_grace_seconds}
    template = rank_env.with_rank_env(_plain({"spec": pod}), PYTORCHJOB.pod_label, tiers_json=job_annotations_module.tiers_json(spec))
    replicas = {"Master": KubeflowOrgV1ReplicaSpec(replicas=1, restart_policy="OnFailure", template=template)}
    workers = spec.nodes - 1 + placement.spare_pods
    if workers or spec.elastic:  # training-operator refuses an elasticPolicy without Workers
        replicas["Worker"] = KubeflowOrgV1ReplicaSpec(replicas=workers, restart_policy="OnFailure", template=template)
    # min/max count every pod, the Master too (PET_NNODES, which torchrun and unbroken run read)
    elastic = KubeflowOrgV1ElasticPolicy(min_replicas=spec.fewest_nodes, max_replicas=spec.nodes) if spec.elastic else None
    job = KubeflowOrgV1PyTorchJob(
        api_version=PYTORCHJOB.api_version, kind=PYTORCHJOB.kind, metadata=_metadata(spec, placement),
        spec=KubeflowOrgV1PyTorchJobSpec(nproc_per_node=str(spec.procs_per_node), pytorch_replica_specs=replicas,
                                         elastic_policy=elastic, run_policy=KubeflowOrgV1RunPolicy(clean_pod_policy="None")),
    )
    return _plain(job)


def render_trainjob(spec: JobSpec, placement: Placement) -> dict[str, Any]:
    if spec.elastic or placement.spare_pods:
        what = f"nodes {spec.fewest_nodes}-{spec.nodes} (elastic)" if spec.elastic else f"--spare-pods {placement.spare_pods}"
        raise UsageError(f"job {spec.name}: {what} needs a PyTorchJob (--kind PyTorchJob): the Trainer has no elastic "
                         f"policy yet (kubeflow/trainer#2903) and a TrainJob's pods all train; or give a fixed size "
                         f"(nodes: {spec.nodes})")
    checkpoint_dir = _checkpoint_dir(spec)
    tiers = job_annotations_module.tiers_json(spec)
    env = [*_job_env(spec, checkpoint_dir), *rank_env.all_env(TRAINJOB.pod_label, tiers_json=tiers)]
    paths = rank_env.host_paths(memory_tier=tiers is not None)
    mounts, claim = _claim(placement, checkpoint_dir)
    pod = trainer.TrainerV1alpha1PodSpecPatch.from_dict({
        "containers": [{"name": TRAINER_CONTAINER, "volumeMounts": [*mounts, *rank_env.volume_mounts(paths)]}],
        "volumes": [*claim, *rank_env.volumes(paths)],
        "nodeSelector": placement.node_selector or None,
        "terminationGracePeriodSeconds": placement.termination_grace_seconds,
    })
    ours = trainer.TrainerV1alpha1RuntimePatch(
        manager=CLI_MANAGER,
        training_runtime_spec=trainer.TrainerV1alpha1TrainingRuntimeSpecPatch(
            template=trainer.TrainerV1alpha1JobSetTemplatePatch(spec=trainer.TrainerV1alpha1JobSetSpecPatch(replicated_jobs=[
                trainer.TrainerV1alpha1ReplicatedJobPatch(name=TRAINER_JOB, template=trainer.TrainerV1alpha1JobTemplatePatch(
                    spec=trainer.TrainerV1alpha1JobSpecPatch(template=trainer.TrainerV1alpha1PodTemplatePatch(spec=pod))))]))))
    job = trainer.TrainerV1alpha1TrainJob.from_dict({
        "apiVersion": TRAINJOB.api_version, "kind": TRAINJOB.kind, "metadata": _metadata(spec, placement),
        "spec": {"runtimeRef": {"name": placement.runtime},
                 "trainer": {"numNodes": spec.nodes, "numProcPerNode": spec.procs_per_node, "image": placement.image,
                             "command": torchrun_command(spec), "env": env, "resourcesPerNode": _gpu_limits(placement)},
                 "runtimePatches": [ours.to_dict()]},
    })
    assert job is not None  # from_dict returns None only for None
    return _plain(job.to_dict())


def _plain(obj: Any) -> Any:
    """A model (or a dict holding some) as the JSON the API takes, without the unset (None) fields."""
    serialized = _SERIALIZER.sanitize_for_serialization(obj)
    return _without_none(serialized)


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


_SERIALIZER = kubernetes.client.ApiClient()
"""Only its model-to-JSON conversion: it never connects."""
