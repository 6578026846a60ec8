"""The workloads unbroken restarts: how to read, stop and start each kind.

A workload's own controller owns its pods. unbroken never creates them; it
stops an attempt by suspending the workload (the controller deletes the pods),
and starts the next one by writing the attempt number into the pod template
and unsuspending (the controller creates the pods again). Templates change
only through merge patches of maps (annotations, nodeSelector) or through the
workload's own patch list, so nothing the user wrote in them is replaced.

- **PyTorchJob** (``kubeflow.org/v1``, training-operator): ``runPolicy.suspend``;
  the attempt goes into every replica's template. Read through the Kubeflow
  SDK's models (``kubeflow.training.models``).
- **TrainJob** (``trainer.kubeflow.org/v1alpha1``, Kubeflow Trainer v2): its pods
  come from a JobSet that the Trainer builds from the runtime. ``spec.suspend``;
  the attempt travels as unbroken's own entry in ``spec.runtimePatches``
  (``manager: unbroken.dev/operator``, patching the ``node`` replicated job's pod
  template); entries of other managers are kept. Stopping also deletes the
  JobSet: the Trainer builds a fresh one, so the runtime's Job failure counters
  (``backoffLimit``) start again at every attempt and only unbroken's budget,
  kept on the TrainJob, counts restarts (kubeflow/trainer#3779). Read through
  ``kubeflow_trainer_api.models``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from kubeflow.training.api_client import ApiClient as KubeflowApiClient
from kubeflow.training.models import KubeflowOrgV1PyTorchJob
from kubeflow_trainer_api import models as trainer

from unbroken.kubernetes.backend import names

_KUBEFLOW = KubeflowApiClient()

Obj = dict[str, Any]


@dataclass(frozen=True)
class Child:
    """An object the workload's controller made from it and builds again when it is deleted."""

    group: str
    version: str
    plural: str
    name: str


class WorkloadKind(Protocol):
    """What the store and the backend need to know about one kind of training workload."""

    @property
    def kind(self) -> str: ...

    @property
    def group(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def plural(self) -> str: ...

    @property
    def pod_label(self) -> str:
        """A label every pod of such a workload carries, whose value is the workload's name."""

    @property
    def api_version(self) -> str: ...

    def node_count(self, obj: Obj) -> int:
        """Pods of one attempt: each a node's worth of ranks."""

    def procs_per_node(self, obj: Obj) -> int: ...

    def fewest_pods(self, obj: Obj) -> int | None:
        """The fewest pods the workload trains on when some are lost (an elastic job's min); None: all of them."""

    def member_restarts(self, obj: Obj) -> int | None:
        """How many times the workload's pods restart an exited member in place and re-rendezvous by themselves (an
        elastic PyTorchJob's ``elasticPolicy.maxRestarts``: torchrun's agents regroup); None: a member's exit is
        the job's failure, for unbroken to restart."""

    def problems(self, obj: Obj) -> list[str]:
        """Why unbroken cannot manage this object (empty: it can)."""

    def held_by(self, obj: Obj) -> str | None:
        """Why the workload is not unbroken's to start: suspended by its owner or a queue (unbroken never
        unsuspends what it did not suspend), or managed by a controller other than the kind's own (MultiKueue
        runs it on another cluster); None if unbroken may start it."""

    def suspend_patch(self, suspend: bool) -> Obj: ...

    def launch_patch(self, obj: Obj, attempt: int, *, require_deep_health: bool) -> Obj:
        """Unsuspend, with the pods of the attempt marked as ``attempt`` (and kept on nodes whose deep
        check passed, if the job requires it)."""

    def children_to_recreate(self, name: str) -> list[Child]:
        """What to delete when an attempt stops, so that the next starts from fresh children."""

    def pods_selector(self) -> str:
        """A label selector for the training pods of every workload of this kind."""

    def pod_selector(self, name: str) -> str:
        """A label selector for the training pods of the workload ``name``."""

    def node_rank(self, pod: Obj, *, masterless: bool) -> int: ...

    def is_master(self, pod: Obj) -> bool: ...

    def rdzv_endpoint(self, name: str) -> str:
        """Where the workload's controller points its ranks' rendezvous."""


KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
OWN_MANAGERS = {"PyTorchJob": "kubeflow.org/training-operator", "TrainJob": "trainer.kubeflow.org/trainjob-controller"}
"""The ``managedBy`` value of each kind's own controller (its default); any other (Kueue's MultiKueue) runs it elsewhere."""


def queue_name(obj: Obj) -> str | None:
    """The Kueue LocalQueue the workload was submitted to (its ``kueue.x-k8s.io/queue-name`` label), None if none."""
    return ((obj.get("metadata") or {}).get("labels") or {}).get(KUEUE_QUEUE_LABEL) or None


def _held(obj: Obj, manager: str | None, own_manager: str, manager_field: str, suspended: bool, suspend_field: str) -> str | None:
    if manager and manager != own_manager:
        return f"managed by {manager} ({manager_field}), not {own_manager}: its pods run where that controller puts them"
    if not suspended:
        return None
    queue = queue_name(obj)
    if queue:
        return f"suspended until Kueue admits it from queue {queue} ({suspend_field}); unbroken starts watching it then"
    return f"suspended by its owner ({suspend_field}); unbroken starts watching it once it is unsuspended"


def _labels(pod: Obj) -> dict[str, str]:
    return pod.get("metadata", {}).get("labels") or {}


class _Body:
    """What the SDK's deserializer reads (it expects an HTTP response)."""

    def __init__(self, obj: Obj) -> None:
        self.data = json.dumps(obj)


@dataclass(frozen=True)
class PyTorchJobKind:
    kind: str = "PyTorchJob"
    group: str = "kubeflow.org"
    version: str = "v1"
    plural: str = "pytorchjobs"
    pod_label: str = "training.kubeflow.org/job-name"
    replica_type_label: str = "training.kubeflow.org/replica-type"
    replica_index_label: str = "training.kubeflow.org/replica-index"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def model(self, obj: Obj) -> KubeflowOrgV1PyTorchJob:
        """The SDK's model, for writing (render) and checks only: reading a live object through it fails on fields
        the SDK lags behind (an elasticPolicy with HPA ``metrics`` once failed every reconcile), so the store reads
        the JSON the API serves (the methods below)."""
        spec = obj.get("spec") or {}
        # training-operator's defaulting gives every job a runPolicy; the SDK's models refuse one without.
        defaulted = {**obj, "spec": {**spec, "runPolicy": spec.get("runPolicy") or {}}}
        return _KUBEFLOW.deserialize(_Body(defaulted), "KubeflowOrgV1PyTorchJob")

    @staticmethod
    def _replica_specs(obj: Obj) -> dict[str, Obj]:
        specs = (obj.get("spec") or {}).get("pytorchReplicaSpecs") or {}
        return {name: spec if isinstance(spec, dict) else {} for name, spec in specs.items()} if isinstance(specs, dict) else {}

    def node_count(self, obj: Obj) -> int:
        """Pods of every replica type (a replica spec without ``replicas`` has one, as training-operator defaults it)."""
        counts = [spec.get("replicas") for spec in self._replica_specs(obj).values()]
        return sum(count if isinstance(count, int) else 1 for count in counts)

    def procs_per_node(self, obj: Obj) -> int:
        value = (obj.get("spec") or {}).get("nprocPerNode")
        return int(value) if value is not None and str(value).isdigit() else 1

    def fewest_pods(self, obj: Obj) -> int | None:
        """``elasticPolicy.minReplicas`` (PET_NNODES' MIN: torchrun and ``unbroken run`` count every pod by it)."""
        policy = (obj.get("spec") or {}).get("elasticPolicy")
        low = policy.get("minReplicas") if isinstance(policy, dict) else None
        return low if isinstance(low, int) and not isinstance(low, bool) and low >= 1 else None

    def member_restarts(self, obj: Obj) -> int | None:
        """``elasticPolicy.maxRestarts`` (0 when absent: torchrun's own default, no member exit is absorbed)."""
        policy = (obj.get("spec") or {}).get("elasticPolicy")
        if not isinstance(policy, dict):
            return None
        budget = policy.get("maxRestarts")
        return budget if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0 else 0

    def problems(self, obj: Obj) -> list[str]:
        if not self._replica_specs(obj):
            return ["spec.pytorchReplicaSpecs names no replica type (Master, Worker): no pods to watch"]
        return []

    def replica_types(self, obj: Obj) -> list[str]:
        return sorted(self._replica_specs(obj))

    def held_by(self, obj: Obj) -> str | None:
        policy = (obj.get("spec") or {}).get("runPolicy") or {}
        return _held(obj, policy.get("managedBy"), OWN_MANAGERS[self.kind], "spec.runPolicy.managedBy",
                     bool(policy.get("suspend")), "spec.runPolicy.suspend")

    def suspend_patch(self, suspend: bool) -> Obj:
        return {"spec": {"runPolicy": {"suspend": suspend}}}

    def launch_patch(self, obj: Obj, attempt: int, *, require_deep_health: bool) -> Obj:
        template: Obj = {"metadata": {"annotations": {names.ATTEMPT: str(attempt)}}}
        if require_deep_health:
            template["spec"] = {"nodeSelector": {names.DEEP_HEALTH_CHECK_STATUS: "Passed"}}
        replicas = {replica: {"template": template} for replica in self.replica_types(obj)}
        return {"spec": {"runPolicy": {"suspend": False}, "pytorchReplicaSpecs": replicas}}

    def children_to_recreate(self, name: str) -> list[Child]:
        return []  # training-operator keeps no failure count across a suspension

    def pods_selector(self) -> str:
        return self.pod_label

    def pod_selector(self, name: str) -> str:
        return f"{self.pod_label}={name}"

    def is_master(self, pod: Obj) -> bool:
        return _labels(pod).get(self.replica_type_label, "").lower() == "master"

    def node_rank(self, pod: Obj, *, masterless: bool) -> int:
        """training-operator's RANK for the pod: master 0, worker i is i + 1; in a job without a
        master, worker i is i."""
        index = int(_labels(pod).get(self.replica_index_label, "0") or 0)
        return index if self.is_master(pod) or masterless else index + 1

    def rdzv_endpoint(self, name: str) -> str:
        return f"{name}-master-0"


TRAINER_JOB = "node"
"""The replicated job of a Trainer runtime that runs the training (Trainer's ``constants.Node``)."""
TRAINER_CONTAINER = "node"
"""Its container, the one ``spec.trainer`` (image, command, env) is written into."""


@dataclass(frozen=True)
class TrainJobKind:
    kind: str = "TrainJob"
    group: str = "trainer.kubeflow.org"
    version: str = "v1alpha1"
    plural: str = "trainjobs"
    pod_label: str = "jobset.sigs.k8s.io/jobset-name"
    replicated_job_label: str = "jobset.sigs.k8s.io/replicatedjob-name"
    completion_index_label: str = "batch.kubernetes.io/job-completion-index"
    manager: str = f"{names.PREFIX}/operator"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def model(self, obj: Obj) -> trainer.TrainerV1alpha1TrainJob:
        return trainer.TrainerV1alpha1TrainJob.from_dict(obj)

    @staticmethod
    def _trainer(obj: Obj) -> Obj:
        """``spec.trainer`` as the API serves it (read for every job on every pass: no SDK model, which lags the CRD)."""
        spec = (obj.get("spec") or {}).get("trainer")
        return spec if isinstance(spec, dict) else {}

    def node_count(self, obj: Obj) -> int:
        count = self._trainer(obj).get("numNodes")
        return count if isinstance(count, int) and count > 0 else 1

    def procs_per_node(self, obj: Obj) -> int:
        count = self._trainer(obj).get("numProcPerNode")
        return int(count) if count is not None and str(count).isdigit() and int(count) > 0 else 1

    def fewest_pods(self, obj: Obj) -> int | None:
        return None  # the Trainer has no elastic policy yet (kubeflow/trainer#2903)

    def member_restarts(self, obj: Obj) -> int | None:
        return None  # no elastic policy: a member's exit fails the TrainJob's attempt

    def problems(self, obj: Obj) -> list[str]:
        trainer_spec = self._trainer(obj)
        if not isinstance(trainer_spec.get("numNodes"), int):
            return ["spec.trainer.numNodes is not set: unbroken needs the node count on the TrainJob itself "
                    "(the runtime's mlPolicy.numNodes is not read)"]
        env = trainer_spec.get("env")
        env = env if isinstance(env, list) else []
        nnodes = next((str(e.get("value")) for e in env if isinstance(e, dict) and e.get("name") == "PET_NNODES"), "")
        problems = []
        if ":" in nnodes:
            problems.append(f'spec.trainer.env PET_NNODES "{nnodes}" is a node range: the Trainer has no elastic policy yet '
                            "(kubeflow/trainer#2903), so its pods would not regroup as an elastic job; give a fixed "
                            "numNodes, or run it as a PyTorchJob with elasticPolicy min/max under unbroken run")
        spares = ((obj.get("metadata") or {}).get("annotations") or {}).get(names.SPARE_PODS, "0").strip()
        if spares not in ("", "0"):
            problems.append(f'annotation {names.SPARE_PODS}: "{spares}" on a TrainJob: every pod of a TrainJob trains; '
                            "spare pods need a PyTorchJob (k8s render --kind PyTorchJob --spare-pods N)")
        return problems

    def held_by(self, obj: Obj) -> str | None:
        spec = obj.get("spec") or {}
        return _held(obj, spec.get("managedBy"), OWN_MANAGERS[self.kind], "spec.managedBy", bool(spec.get("suspend")),
                     "spec.suspend")

    def suspend_patch(self, suspend: bool) -> Obj:
        return {"spec": {"suspend": suspend}}

    def launch_patch(self, obj: Obj, attempt: int, *, require_deep_health: bool) -> Obj:
        """Unsuspend with unbroken's runtime patch for ``attempt``. The Trainer accepts a change of
        ``runtimePatches`` only while the TrainJob is suspended, so a running job being adopted as
        attempt 0 is only unsuspended (its pods carry no attempt, which reads as 0)."""
        spec = obj.get("spec") or {}
        if attempt == 0 and not spec.get("suspend"):
            return {"spec": {"suspend": False}}
        pod_spec = trainer.TrainerV1alpha1PodSpecPatch(
            node_selector={names.DEEP_HEALTH_CHECK_STATUS: "Passed"}) if require_deep_health else None
        ours = trainer.TrainerV1alpha1RuntimePatch(
            manager=self.manager,
            training_runtime_spec=trainer.TrainerV1alpha1TrainingRuntimeSpecPatch(
                template=trainer.TrainerV1alpha1JobSetTemplatePatch(
                    spec=trainer.TrainerV1alpha1JobSetSpecPatch(replicated_jobs=[trainer.TrainerV1alpha1ReplicatedJobPatch(
                        name=TRAINER_JOB,
                        template=trainer.TrainerV1alpha1JobTemplatePatch(spec=trainer.TrainerV1alpha1JobSpecPatch(
                            template=trainer.TrainerV1alpha1PodTemplatePatch(
                                metadata=trainer.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
                                    annotations={names.ATTEMPT: str(attempt)}),
                                spec=pod_spec))))]))))
        others = [patch for patch in spec.get("runtimePatches") or [] if isinstance(patch, dict) and patch.get("manager") != self.manager]
        # runtimePatches is a list: a merge patch replaces it whole, so the other managers' entries go back in exactly
        # as the API served them (JSON, never through the SDK's models, which would drop the fields they do not know).
        return {"spec": {"suspend": False, "runtimePatches": [*others, ours.to_dict()]}}

    def children_to_recreate(self, name: str) -> list[Child]:
        return [Child("jobset.x-k8s.io", "v1alpha2", "jobsets", name)]  # the Trainer names the JobSet after the TrainJob

    def pods_selector(self) -> str:
        return f"{self.pod_label},{self.replicated_job_label}={TRAINER_JOB}"

    def pod_selector(self, name: str) -> str:
        return f"{self.pod_label}={name},{self.replicated_job_label}={TRAINER_JOB}"

    def is_master(self, pod: Obj) -> bool:
        return self.node_rank(pod, masterless=True) == 0

    def node_rank(self, pod: Obj, *, masterless: bool) -> int:
        """The Torch runtime's ``PET_NODE_RANK``: the pod's completion index in the ``node`` Job."""
        value = _labels(pod).get(self.completion_index_label, "0")
        return int(value) if value.isdigit() else 0

    def rdzv_endpoint(self, name: str) -> str:
        return f"{name}-{TRAINER_JOB}-0-0.{name}"


PYTORCHJOB = PyTorchJobKind()
TRAINJOB = TrainJobKind()
KINDS: tuple[WorkloadKind, ...] = (PYTORCHJOB, TRAINJOB)
"""In lookup order: a job name that both kinds use in one namespace belongs to the PyTorchJob."""


def kind_of(obj: Obj) -> WorkloadKind:
    for kind in KINDS:
        if obj.get("kind") == kind.kind and str(obj.get("apiVersion", "")).startswith(kind.group + "/"):
            return kind
    raise ValueError(f"not a workload unbroken knows: {obj.get('apiVersion')} {obj.get('kind')}")


def job_of(kind: WorkloadKind, pod: Obj) -> str | None:
    """``<namespace>/<workload>`` for a training pod of ``kind``, else None."""
    workload = _labels(pod).get(kind.pod_label)
    return f"{pod['metadata']['namespace']}/{workload}" if workload else None
