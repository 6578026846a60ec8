"""The Kubeflow Trainer (TrainJob) and JobSet controllers, played for the test kubelet (tests/k8s_kubelet.py).

A real cluster runs two controllers between a TrainJob and its pods: the Trainer turns a TrainJob and its
runtime into a JobSet, and the JobSet controller turns the JobSet into batch/v1 Jobs, whose pods the Job
controller makes. ``TrainerControllers`` plays the first two, in the kubelet's loop, just before the Job
controller; so a TrainJob's pods come through the same Job controller and kubelet as every other pod.

Trainer (``trainer.kubeflow.org/v1alpha1``, Kubeflow Trainer v2), what it does here:

* Reads the TrainJob's ``runtimeRef`` (a ClusterTrainingRuntime; a missing one is a ``Created=False``
  condition, reason ``TrainingRuntimeNotFound``) and builds the JobSet ``<trainjob>`` from the runtime's
  ``template``, owned by the TrainJob, ``suspend`` as the TrainJob's.
* The ``node`` replicated job (the trainer) gets ``parallelism = completions = numNodes`` (the TrainJob's
  ``trainer.numNodes``, else the runtime's ``mlPolicy.numNodes``, else 1) and, in its container named
  ``node``: the TrainJob's image/command/args, its env after the runtime's, ``resourcesPerNode`` as the
  resources, and the Torch runtime's env: PET_NNODES, PET_NPROC_PER_NODE (``numProcPerNode``, else the
  runtime's, else 1), PET_NODE_RANK (from the completion-index annotation), PET_MASTER_ADDR,
  PET_MASTER_PORT, plus PYTHONUNBUFFERED=1. No DNS here: PET_MASTER_ADDR is 127.0.0.1 (a cluster has
  ``<trainjob>-node-0-0.<trainjob>``) and PET_MASTER_PORT a free port chosen when the JobSet is built.
* ``runtimePatches`` are applied in order: JobSet labels/annotations; per replicated job by name, the Job
  template's labels/annotations, the pod template's labels/annotations, and of its spec ``nodeSelector``
  (merged), ``tolerations`` and ``volumes`` (appended), ``affinity``, ``serviceAccountName``,
  ``terminationGracePeriodSeconds`` (set), and per container by name ``env`` and ``volumeMounts`` (appended).
* While the JobSet is suspended, a changed TrainJob (suspend, patches) is written to it; while it runs,
  only ``suspend`` is. A deleted JobSet is built again (with a new port) unless the TrainJob finished.
* TrainJob conditions follow the JobSet's: Complete (``JobSetCompleted``), Failed (``JobSetFailed``),
  Suspended. Not emulated: initializers, the webhook's validation (e.g. that ``runtimePatches`` change only
  while suspended), ``podGroupPolicy``, ``jobsStatus``, TrainingRuntime (namespaced) references, MPI.

JobSet controller (``jobset.x-k8s.io/v1alpha2``):

* For each replicated job, ``replicas`` (default 1) Jobs ``<jobset>-<name>-<i>``, owned by the JobSet, with
  the labels and annotations ``jobset.sigs.k8s.io/jobset-name``, ``replicatedjob-name``,
  ``replicatedjob-replicas``, ``job-index`` on the Job and its pod template; ``completionMode`` defaults to
  Indexed; ``suspend`` as the JobSet's. A Job owned by an earlier JobSet of the same name blocks its
  name until the garbage collector has removed it.
* Resuming a suspended Job writes the JobSet's pod template labels, annotations and nodeSelector into it
  first (as JobSet does for the scheduling directives of suspended Jobs).
* Conditions: Completed when every Job is Complete; Failed (reason ``FailedJobs``) as soon as one Job is
  Failed -- ``failurePolicy.maxRestarts`` (recreating every Job) is not emulated, so it is 0, JobSet's
  default; Suspended. No headless Service, no ``successPolicy``, ``startupPolicy``, ``network``,
  exclusive placement or ``coordinator``.

Garbage collection: Jobs whose JobSet is gone and JobSets whose TrainJob is gone are deleted (the kubelet's
own collector then removes the Jobs' pods).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from k8s_kubelet import (
    COMPLETION_INDEX,
    LOOPBACK,
    Obj,
    _controller_uid,
    _deleting,
    _free_port,
    _is_true,
    _meta,
    _owner_reference,
    _set_condition,
    _spec,
    _status_patch,
)

log = logging.getLogger("k8s-kubelet")

TRAINJOBS = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
RUNTIMES = ("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes")
JOBSETS = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
TRAINJOB_API, JOBSET_API = "trainer.kubeflow.org/v1alpha1", "jobset.x-k8s.io/v1alpha2"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
REPLICATED_JOB_REPLICAS = "jobset.sigs.k8s.io/replicatedjob-replicas"
JOB_INDEX = "jobset.sigs.k8s.io/job-index"
TRAINER_NODE = "node"


def torch_distributed_runtime() -> Obj:
    """The shape of Kubeflow Trainer's shipped ``torch-distributed`` ClusterTrainingRuntime: one replicated job
    ``node`` whose container ``node`` runs torchrun from the PET_* env (its image is ignored here)."""
    return {"apiVersion": TRAINJOB_API, "kind": "ClusterTrainingRuntime",
            "metadata": {"name": "torch-distributed"},
            "spec": {"mlPolicy": {"numNodes": 1, "torch": {"numProcPerNode": "auto"}},
                     "template": {"spec": {"replicatedJobs": [{
                         "name": TRAINER_NODE,
                         "template": {"metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                                      "spec": {"template": {"spec": {"restartPolicy": "OnFailure", "containers": [{
                                          "name": TRAINER_NODE, "image": "pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime",
                                          "command": ["torchrun"]}]}}}}}]}}}}


def _finished(obj: Obj, *kinds: str) -> bool:
    return any(_is_true((obj.get("status") or {}).get("conditions") or [], kind) for kind in kinds)


def _merged_metadata(target: Obj, patch: Obj | None) -> None:
    """Labels and annotations of ``patch`` (an ObjectMeta patch) into ``target`` (an object or template)."""
    if not patch:
        return
    meta = target.setdefault("metadata", {})
    for key in ("labels", "annotations"):
        if patch.get(key):
            meta[key] = {**(meta.get(key) or {}), **patch[key]}


def _patched_pod_spec(spec: Obj, patch: Obj) -> None:
    if patch.get("nodeSelector"):
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **patch["nodeSelector"]}
    for key in ("tolerations", "volumes"):
        if patch.get(key):
            spec[key] = [*(spec.get(key) or []), *patch[key]]
    for key in ("affinity", "serviceAccountName", "terminationGracePeriodSeconds"):
        if key in patch:
            spec[key] = patch[key]
    for container_patch in patch.get("containers") or []:
        for container in spec.get("containers") or []:
            if container.get("name") == container_patch.get("name"):
                for key in ("env", "volumeMounts"):
                    if container_patch.get(key):
                        container[key] = [*(container.get(key) or []), *container_patch[key]]


class TrainerControllers:
    """The Trainer and JobSet controllers (module docstring); ``sync`` is one round of both."""

    def __init__(self, client: kubernetes.client.ApiClient, merge_patch: Callable[[str, Obj], Obj]) -> None:
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.batch = kubernetes.client.BatchV1Api(client)
        self.merge_patch = merge_patch
        self._ports: dict[str, int] = {}  # by JobSet uid

    def _list(self, resource: tuple[str, str, str]) -> list[Obj]:
        try:
            return list(self.custom.list_cluster_custom_object(*resource)["items"])
        except ApiException as e:
            if e.status == 404:
                return []  # not served by this emulator
            raise

    def sync(self, jobs: list[Obj], guard: Callable[..., Any]) -> None:
        """One round: garbage, then every TrainJob, then every JobSet. ``jobs``: the batch/v1 Jobs listed
        this round; ``guard(what, action, *args)`` runs a step the way the kubelet runs its own."""
        trainjobs, jobsets = self._list(TRAINJOBS), self._list(JOBSETS)
        self._collect_garbage(trainjobs, jobsets, jobs)
        for trainjob in trainjobs:
            guard(f"TrainJob {_meta(trainjob)['namespace']}/{_meta(trainjob)['name']}", self._sync_trainjob, trainjob, jobsets)
        for jobset in jobsets:
            guard(f"JobSet {_meta(jobset)['namespace']}/{_meta(jobset)['name']}", self._sync_jobset, jobset, jobs)

    # ---- garbage collector ----

    def _collect_garbage(self, trainjobs: list[Obj], jobsets: list[Obj], jobs: list[Obj]) -> None:
        for children, owners, kind, delete in (
                (jobsets, trainjobs, "TrainJob", self._delete_jobset),
                (jobs, jobsets, "JobSet", self._delete_job)):
            alive = {_meta(o)["uid"] for o in owners}
            for child in children:
                ref = next((r for r in _meta(child).get("ownerReferences") or [] if r.get("controller")), None)
                if ref and ref.get("kind") == kind and ref.get("uid") not in alive and not _deleting(child):
                    log.info("garbage-collecting %s/%s (owner %s %s gone)", _meta(child)["namespace"], _meta(child)["name"], kind, ref.get("name"))
                    delete(child)
        for uid in [*self._ports]:
            if uid not in {_meta(j)["uid"] for j in jobsets}:
                del self._ports[uid]

    def _delete_jobset(self, jobset: Obj) -> None:
        group, version, plural = JOBSETS
        try:
            self.custom.delete_namespaced_custom_object(group, version, _meta(jobset)["namespace"], plural, _meta(jobset)["name"])
        except ApiException as e:
            if e.status != 404:
                raise

    def _delete_job(self, job: Obj) -> None:
        try:
            self.batch.delete_namespaced_job(_meta(job)["name"], _meta(job)["namespace"], _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    # ---- Trainer ----

    def _sync_trainjob(self, trainjob: Obj, jobsets: list[Obj]) -> None:
        meta, spec = _meta(trainjob), _spec(trainjob)
        status = copy.deepcopy(trainjob.get("status") or {})
        before = copy.deepcopy(status)
        conditions = status.get("conditions") or []
        jobset = next((j for j in jobsets if _controller_uid(j) == meta["uid"]), None)
        if not _finished(trainjob, "Complete", "Failed"):
            runtime = self._runtime(spec.get("runtimeRef") or {})
            if runtime is None:
                conditions = _set_condition(conditions, "Created", "False", "TrainingRuntimeNotFound",
                                            f"ClusterTrainingRuntime {(spec.get('runtimeRef') or {}).get('name')!r} not found")
            else:
                desired = self._desired_jobset(trainjob, runtime)
                if jobset is None:
                    self._create_jobset(trainjob, desired)
                    conditions = _set_condition(conditions, "Created", "True", "JobsCreationSucceeded", "Succeeded to create Jobs")
                elif not _deleting(jobset):
                    self._update_jobset(jobset, desired)
        if jobset is not None:
            if _finished(jobset, "Completed"):
                conditions = _set_condition(conditions, "Complete", "True", "JobSetCompleted", "JobSet completed")
            elif _finished(jobset, "Failed"):
                conditions = _set_condition(conditions, "Failed", "True", "JobSetFailed",
                                            ((jobset.get("status") or {}).get("conditions") or [{}])[-1].get("message", "JobSet failed"))
        if not _finished(trainjob, "Complete", "Failed"):
            suspended = bool(spec.get("suspend"))
            conditions = _set_condition(conditions, "Suspended", "True" if suspended else "False",
                                        "Suspended" if suspended else "Resumed",
                                        "TrainJob is suspended" if suspended else "TrainJob is resumed")
        status["conditions"] = conditions
        self._write_status(TRAINJOBS, trainjob, before, status)

    def _write_status(self, resource: tuple[str, str, str], obj: Obj, before: Obj, status: Obj) -> None:
        """Patch ``obj``'s status subresource from ``before`` to ``status`` (nothing when they are equal)."""
        if status != before:
            group, version, plural = resource
            self.custom.patch_namespaced_custom_object_status(group, version, _meta(obj)["namespace"], plural, _meta(obj)["name"],
                                                              {"status": _status_patch(before, status)})

    def _runtime(self, ref: Obj) -> Obj | None:
        if ref.get("kind", "ClusterTrainingRuntime") != "ClusterTrainingRuntime" or not ref.get("name"):
            return None
        try:
            return dict(self.custom.get_cluster_custom_object(*RUNTIMES, ref["name"]))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    @staticmethod
    def _desired_jobset(trainjob: Obj, runtime: Obj) -> Obj:
        """The JobSet's metadata patches and spec (without the master port, which ``_with_port`` adds)."""
        spec = _spec(trainjob)
        trainer = spec.get("trainer") or {}
        policy = _spec(runtime).get("mlPolicy") or {}
        template = copy.deepcopy(_spec(runtime).get("template") or {})
        jobset: Obj = {"metadata": {"labels": dict((template.get("metadata") or {}).get("labels") or {}),
                                    "annotations": dict((template.get("metadata") or {}).get("annotations") or {})},
                       "spec": {**(template.get("spec") or {}), "suspend": bool(spec.get("suspend"))}}
        nodes = int(trainer.get("numNodes") or policy.get("numNodes") or 1)
        procs = trainer.get("numProcPerNode") or (policy.get("torch") or {}).get("numProcPerNode") or 1
        for rjob in jobset["spec"].get("replicatedJobs") or []:
            if rjob.get("name") != TRAINER_NODE:
                continue
            job_spec = rjob.setdefault("template", {}).setdefault("spec", {})
            job_spec["parallelism"] = job_spec["completions"] = nodes
            pod_spec = job_spec.setdefault("template", {}).setdefault("spec", {})
            for container in pod_spec.get("containers") or []:
                if container.get("name") != TRAINER_NODE:
                    continue
                for key in ("image", "command", "args"):
                    if trainer.get(key):
                        container[key] = trainer[key]
                if trainer.get("resourcesPerNode"):
                    container["resources"] = trainer["resourcesPerNode"]
                torch_env = [{"name": "PET_NNODES", "value": str(nodes)}, {"name": "PET_NPROC_PER_NODE", "value": str(procs)},
                             {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}},
                             {"name": "PET_MASTER_ADDR", "value": LOOPBACK}, {"name": "PYTHONUNBUFFERED", "value": "1"}]
                container["env"] = [*(container.get("env") or []), *(trainer.get("env") or []), *torch_env]
        for patch in spec.get("runtimePatches") or []:
            runtime_patch = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
            _merged_metadata(jobset, runtime_patch.get("metadata"))
            for rjob_patch in (runtime_patch.get("spec") or {}).get("replicatedJobs") or []:
                for rjob in jobset["spec"].get("replicatedJobs") or []:
                    if rjob.get("name") != rjob_patch.get("name"):
                        continue
                    job_patch = rjob_patch.get("template") or {}
                    _merged_metadata(rjob.setdefault("template", {}), job_patch.get("metadata"))
                    pod_patch = (job_patch.get("spec") or {}).get("template") or {}
                    pod_template = rjob["template"].setdefault("spec", {}).setdefault("template", {})
                    _merged_metadata(pod_template, pod_patch.get("metadata"))
                    _patched_pod_spec(pod_template.setdefault("spec", {}), pod_patch.get("spec") or {})
        return jobset

    @staticmethod
    def _with_port(jobset: Obj, port: int) -> Obj:
        jobset = copy.deepcopy(jobset)
        for rjob in jobset["spec"].get("replicatedJobs") or []:
            for container in _spec(_spec(rjob.get("template") or {}).get("template") or {}).get("containers") or []:
                if any(e.get("name") == "PET_NNODES" for e in container.get("env") or []):
                    container["env"] = [*container["env"], {"name": "PET_MASTER_PORT", "value": str(port)}]
        return jobset

    def _create_jobset(self, trainjob: Obj, desired: Obj) -> None:
        meta = _meta(trainjob)
        port = _free_port()
        body = self._with_port(desired, port)
        body.update(apiVersion=JOBSET_API, kind="JobSet")
        body["metadata"].update(name=meta["name"], namespace=meta["namespace"],
                                ownerReferences=[_owner_reference(trainjob, TRAINJOB_API, "TrainJob")])
        group, version, plural = JOBSETS
        created = self.custom.create_namespaced_custom_object(group, version, meta["namespace"], plural, body)
        self._ports[_meta(created)["uid"]] = port
        log.info("TrainJob %s: created JobSet (suspend=%s)", meta["name"], body["spec"]["suspend"])

    def _update_jobset(self, jobset: Obj, desired: Obj) -> None:
        """As the Trainer's apply: everything while the JobSet is suspended, else only ``suspend``."""
        meta = _meta(jobset)
        port = self._ports.get(meta["uid"])
        if port is None:  # built before this kubelet started: keep the port it has
            port = next((int(e["value"]) for rjob in _spec(jobset).get("replicatedJobs") or []
                         for c in _spec(_spec(rjob.get("template") or {}).get("template") or {}).get("containers") or []
                         for e in c.get("env") or [] if e.get("name") == "PET_MASTER_PORT"), _free_port())
            self._ports[meta["uid"]] = port
        desired = self._with_port(desired, port)
        patch: Obj = {}
        if _spec(jobset).get("suspend"):
            if _spec(jobset).get("replicatedJobs") != desired["spec"].get("replicatedJobs"):
                patch["spec"] = {"replicatedJobs": desired["spec"].get("replicatedJobs")}
            for key in ("labels", "annotations"):
                wanted = {**(meta.get(key) or {}), **desired["metadata"][key]}
                if wanted != (meta.get(key) or {}):
                    patch.setdefault("metadata", {})[key] = wanted
        if bool(_spec(jobset).get("suspend")) != desired["spec"]["suspend"]:
            patch.setdefault("spec", {})["suspend"] = desired["spec"]["suspend"]
        if patch:
            self.merge_patch(f"/apis/{JOBSET_API}/namespaces/{meta['namespace']}/jobsets/{meta['name']}", patch)
            log.info("TrainJob %s: updated its JobSet (%s)", meta["name"], ", ".join(sorted(patch.get("spec", {}))))

    # ---- JobSet ----

    def _sync_jobset(self, jobset: Obj, jobs: list[Obj]) -> None:
        meta, spec = _meta(jobset), _spec(jobset)
        if _deleting(jobset):
            return
        status = copy.deepcopy(jobset.get("status") or {})
        before = copy.deepcopy(status)
        conditions = status.get("conditions") or []
        mine = {_meta(j)["name"]: j for j in jobs if _controller_uid(j) == meta["uid"]}
        taken = {_meta(j)["name"] for j in jobs if _controller_uid(j) != meta["uid"]}
        suspended = bool(spec.get("suspend"))
        expected = 0
        if not _finished(jobset, "Completed", "Failed"):
            for rjob in spec.get("replicatedJobs") or []:
                replicas = int(rjob.get("replicas") or 1)
                for index in range(replicas):
                    expected += 1
                    name = f"{meta['name']}-{rjob['name']}-{index}"
                    desired = self._desired_job(jobset, rjob, replicas, index)
                    job = mine.get(name)
                    if job is None and name not in taken:
                        self.batch.create_namespaced_job(meta["namespace"], desired, _preload_content=False)
                        log.info("JobSet %s: created Job %s (suspend=%s)", meta["name"], name, suspended)
                    elif job is not None and bool(_spec(job).get("suspend")) != suspended:
                        self._set_suspend(job, desired, suspended)
        finished = [j for j in mine.values() if _finished(j, "Failed")]
        if finished:
            message = f"job {_meta(finished[0])['name']} failed: " + next(
                (c.get("message", "") for c in (finished[0].get("status") or {}).get("conditions") or [] if c.get("type") == "Failed"), "")
            conditions = _set_condition(conditions, "Failed", "True", "FailedJobs", message)
        elif expected and len(mine) == expected and all(_finished(j, "Complete") for j in mine.values()):
            conditions = _set_condition(conditions, "Completed", "True", "AllJobsCompleted", "jobset completed successfully")
        if not _finished(jobset, "Completed", "Failed"):
            conditions = _set_condition(conditions, "Suspended", "True" if suspended else "False",
                                        "SuspendedJobs" if suspended else "ResumeJobs",
                                        "jobset is suspended" if suspended else "jobset is resumed")
        status["conditions"] = conditions
        self._write_status(JOBSETS, jobset, before, status)

    @staticmethod
    def _desired_job(jobset: Obj, rjob: Obj, replicas: int, index: int) -> Obj:
        meta = _meta(jobset)
        template = copy.deepcopy(rjob.get("template") or {})
        marks = {JOBSET_NAME: meta["name"], REPLICATED_JOB: rjob["name"], REPLICATED_JOB_REPLICAS: str(replicas), JOB_INDEX: str(index)}
        job_meta = template.get("metadata") or {}
        spec = template.get("spec") or {}
        spec.setdefault("completionMode", "Indexed")
        spec["suspend"] = bool(_spec(jobset).get("suspend"))
        pod_meta = spec.setdefault("template", {}).setdefault("metadata", {})
        for target in (job_meta, pod_meta):
            target["labels"] = {**(target.get("labels") or {}), **marks}
            target["annotations"] = {**(target.get("annotations") or {}), **marks}
        return {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {**job_meta, "name": f"{meta['name']}-{rjob['name']}-{index}", "namespace": meta["namespace"],
                             "ownerReferences": [_owner_reference(jobset, JOBSET_API, "JobSet")]},
                "spec": spec}

    def _set_suspend(self, job: Obj, desired: Obj, suspended: bool) -> None:
        """Suspend, or resume with the JobSet's current pod template metadata and nodeSelector."""
        patch: Obj = {"spec": {"suspend": suspended}}
        if not suspended:
            pod = _spec(desired)["template"]
            patch["spec"]["template"] = {"metadata": {"labels": (pod.get("metadata") or {}).get("labels") or {},
                                                      "annotations": (pod.get("metadata") or {}).get("annotations") or {}},
                                         "spec": {"nodeSelector": _spec(pod).get("nodeSelector")}}
        self.merge_patch(f"/apis/batch/v1/namespaces/{_meta(job)['namespace']}/jobs/{_meta(job)['name']}", patch)
        log.info("JobSet %s: %s Job %s", _meta(job)["labels"].get(JOBSET_NAME), "suspended" if suspended else "resumed", _meta(job)["name"])
