"""The workloads unbroken restarts: how to read, stop and start each kind.

A workload's own controller (Kubeflow training-operator for PyTorchJob) owns
its pods. unbroken never creates them; it stops an attempt by suspending the
workload (``runPolicy.suspend``: the controller deletes the pods), and starts
the next one by writing the attempt number into the pod template and
unsuspending (the controller creates the pods again). Templates change only
through merge patches of maps (annotations, nodeSelector), so nothing the user
wrote in them is replaced.

PyTorchJob objects are read through the Kubeflow SDK's models
(``kubeflow.training.models``). TrainJob (``trainer.kubeflow.org/v1alpha1``) is
not handled yet: its pods come from a JobSet through the runtime, and the
attempt must travel through ``runtimePatches`` (see docs/kubernetes.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubeflow.training.api_client import ApiClient as KubeflowApiClient
from kubeflow.training.models import KubeflowOrgV1PyTorchJob

from unbroken.kube import names

_KUBEFLOW = KubeflowApiClient()


class _Body:
    """What the SDK's deserializer reads (it expects an HTTP response)."""

    def __init__(self, obj: dict[str, Any]) -> None:
        self.data = json.dumps(obj)


@dataclass(frozen=True)
class PyTorchJobKind:
    kind: str = "PyTorchJob"
    group: str = "kubeflow.org"
    version: str = "v1"
    plural: str = "pytorchjobs"
    job_name_label: str = "training.kubeflow.org/job-name"
    replica_type_label: str = "training.kubeflow.org/replica-type"
    replica_index_label: str = "training.kubeflow.org/replica-index"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def model(self, obj: dict[str, Any]) -> KubeflowOrgV1PyTorchJob:
        spec = obj.get("spec") or {}
        # training-operator's defaulting gives every job a runPolicy; the SDK's models refuse one without.
        defaulted = {**obj, "spec": {**spec, "runPolicy": spec.get("runPolicy") or {}}}
        return _KUBEFLOW.deserialize(_Body(defaulted), "KubeflowOrgV1PyTorchJob")

    def node_count(self, obj: dict[str, Any]) -> int:
        """Pods of one attempt: one per replica, each a node's worth of ranks."""
        specs = self.model(obj).spec.pytorch_replica_specs or {}
        return sum(spec.replicas if spec.replicas is not None else 1 for spec in specs.values())

    def procs_per_node(self, obj: dict[str, Any]) -> int:
        value = self.model(obj).spec.nproc_per_node
        return int(value) if value and str(value).isdigit() else 1

    def suspended(self, obj: dict[str, Any]) -> bool:
        run_policy = self.model(obj).spec.run_policy
        return bool(run_policy and run_policy.suspend)

    def finished(self, obj: dict[str, Any]) -> str | None:
        """``Succeeded``/``Failed`` once the workload's controller says so, else None."""
        for condition in (obj.get("status") or {}).get("conditions") or []:
            if condition.get("type") in ("Succeeded", "Failed") and condition.get("status") == "True":
                return str(condition["type"])
        return None

    def replica_types(self, obj: dict[str, Any]) -> list[str]:
        return sorted((self.model(obj).spec.pytorch_replica_specs or {}).keys())

    def suspend_patch(self, suspend: bool) -> dict[str, Any]:
        return {"spec": {"runPolicy": {"suspend": suspend}}}

    def launch_patch(self, obj: dict[str, Any], attempt: int, *, require_deep_health: bool) -> dict[str, Any]:
        """Unsuspend, with every replica's pods marked as ``attempt`` (and kept on nodes whose deep
        check passed, if the job requires it)."""
        template: dict[str, Any] = {"metadata": {"annotations": {names.ATTEMPT: str(attempt)}}}
        if require_deep_health:
            template["spec"] = {"nodeSelector": {names.DEEP_HEALTH_CHECK_STATUS: "Passed"}}
        replicas = {replica: {"template": template} for replica in self.replica_types(obj)}
        return {"spec": {"runPolicy": {"suspend": False}, "pytorchReplicaSpecs": replicas}}

    def pod_selector(self, name: str) -> str:
        return f"{self.job_name_label}={name}"

    def is_master(self, pod: dict[str, Any]) -> bool:
        return (pod.get("metadata", {}).get("labels") or {}).get(self.replica_type_label, "").lower() == "master"

    def node_rank(self, pod: dict[str, Any], *, masterless: bool) -> int:
        """training-operator's RANK for the pod: master 0, worker i is i + 1; in a job without a
        master, worker i is i."""
        index = int((pod.get("metadata", {}).get("labels") or {}).get(self.replica_index_label, "0") or 0)
        return index if self.is_master(pod) or masterless else index + 1


PYTORCHJOB = PyTorchJobKind()
KINDS = (PYTORCHJOB,)
