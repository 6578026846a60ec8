"""Jobs: an annotated PyTorchJob or TrainJob as unbroken's job record (its annotations read by
``annotations.py``), its pods, and the Kueue Workload a queued job has."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import asdict, dataclass
from typing import Any


from unbroken.errors import NotFoundError, UsageError
from unbroken.kubernetes.backend import annotations as job_annotations
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.api import STRICT, call, parse_time
from unbroken.kubernetes.backend.annotations import AnnotationError
from unbroken.kubernetes.backend.workloads import WorkloadKind, kind_of
from unbroken.state.phases import JOB_TRANSITIONS, JobPhase
from unbroken.state.records import Job
from unbroken.state.updates import JobUpdate

log = logging.getLogger(__name__)

from unbroken.kubernetes.backend.store.core import StoreCore, job_name_of, opted_in, retry_conflicts, updated_record

KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
"""On the Kueue Workload of a job: the job's uid."""


@dataclass(frozen=True)
class InvalidJob:
    """A job that opted in with annotations that do not parse: left alone, warned about."""

    name: str
    problems: tuple[str, ...]
    object_kind: str = "Job"
    """Whose Events to warn on: ``Job``, or the workload's own kind (``TrainJob``) when the job of
    that name is another object."""


class JobStore(StoreCore):
    """Jobs: workloads that opted in, their pods, their state annotation."""

    def _workloads(self) -> list[dict[str, Any]]:
        """Every workload of every kind, the first kind's first: where two kinds use one name, the later
        object is a duplicate (see ``_duplicate``)."""
        items = []
        kinds: dict[str, WorkloadKind] = {}
        for kind in self.kinds:
            cache = self.caches.workloads.get(kind.kind) if self.caches is not None else None
            if cache is not None and cache.synced:
                items.extend(cache.objects())
                continue
            try:
                if self.job_namespace:
                    listing = self._json(self.custom.list_namespaced_custom_object, kind.group, kind.version,
                                         self.job_namespace, kind.plural)
                else:
                    listing = self._json(self.custom.list_cluster_custom_object, kind.group, kind.version, kind.plural)
            except NotFoundError:
                continue  # its CRD is not installed: no such jobs
            for obj in listing["items"]:
                obj.setdefault("apiVersion", kind.api_version)
                obj.setdefault("kind", kind.kind)
                items.append(obj)
        # A name belongs to the first kind whose object opted in, else to the first kind that has it.
        for obj in sorted(items, key=lambda o: not opted_in(o)):
            if kinds.setdefault(job_name_of(obj), kind_of(obj)) is kind_of(obj):
                self._uids[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj["metadata"].get("uid", "")
        self._kinds = kinds
        return items

    def job_pods(self, name: str) -> list[dict[str, Any]]:
        """The training pods of the job ``name`` (``<namespace>/<name>``), as the API serves them."""
        namespace, _, short = name.partition("/")
        kind = self.kind_of(name)
        cache = self.caches.pods.get(kind.kind) if self.caches is not None else None
        if cache is not None and cache.synced:
            return [pod for pod in cache.objects() if pod["metadata"].get("namespace") == namespace
                    and (pod["metadata"].get("labels") or {}).get(kind.pod_label) == short]
        pods: list[dict[str, Any]] = self._json(self.core.list_namespaced_pod, namespace,
                                                label_selector=kind.pod_selector(short))["items"]
        return pods

    def kind_pods(self, kind: WorkloadKind, *, node: str | None = None) -> list[dict[str, Any]]:
        """The training pods of every workload of ``kind`` (on ``node`` only, if given), as the API serves them."""
        cache = self.caches.pods.get(kind.kind) if self.caches is not None else None
        if cache is not None and cache.synced:
            return [pod for pod in cache.objects() if node is None or (pod.get("spec") or {}).get("nodeName") == node]
        selectors = {"label_selector": kind.pods_selector()}
        if node is not None:
            selectors["field_selector"] = f"spec.nodeName={node}"
        listing = (self._json(self.core.list_namespaced_pod, self.job_namespace, **selectors) if self.job_namespace
                   else self._json(self.core.list_pod_for_all_namespaces, **selectors))
        return list(listing["items"])

    def delete_pod(self, kind: WorkloadKind, pod: dict[str, Any], *, grace: int | None) -> None:
        """Delete a training pod (``grace``: seconds to its SIGKILL; None: the pod's own); already gone is done.
        The answer (the pod marked for deletion) goes into the watch cache: until the watch brings the mark, the next
        pass would read the pod as it was, and one whose container had failed as stopped, while the kubelet may have
        started that container again (a restart then launched beside it; see backend._worker_phase)."""
        meta = pod["metadata"]
        try:
            answer: dict[str, Any] = self._json(self.core.delete_namespaced_pod, meta["name"], meta["namespace"],
                                                grace_period_seconds=grace)
        except NotFoundError:
            return
        cache = self.caches.pods.get(kind.kind) if self.caches is not None else None
        if cache is not None and answer.get("kind") == "Pod":  # not a Status: the pod, as marked (or removed) by this delete
            cache.observe(answer)

    def patch_workload(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """Merge-patch the job's workload (strict fields); the answer goes into the watch cache, so the next
        pass reads this write even before the watch brings it."""
        namespace, _, short = name.partition("/")
        kind = self.kind_of(name)
        obj: dict[str, Any] = self._json(self.custom.patch_namespaced_custom_object, kind.group, kind.version, namespace,
                                         kind.plural, short, patch, field_validation=STRICT)
        obj.setdefault("apiVersion", kind.api_version)
        obj.setdefault("kind", kind.kind)
        cache = self.caches.workloads.get(kind.kind) if self.caches is not None else None
        if cache is not None:
            cache.observe(obj)
        return obj

    def deactivate_queued_workload(self, name: str, obj: dict[str, Any]) -> bool:
        """Deactivate the Kueue Workload of the job's workload (``spec.active: false``: Kueue evicts it, suspends the
        job and frees its quota); False if it has none (Kueue is not installed, or has made none for it yet)."""
        namespace = obj["metadata"]["namespace"]
        selector = f"{KUEUE_JOB_UID_LABEL}={obj['metadata'].get('uid', '')}"
        try:
            listing = self._json(self.custom.list_namespaced_custom_object, "kueue.x-k8s.io", "v1beta2", namespace,
                                 "workloads", label_selector=selector)
        except NotFoundError:
            return False  # Kueue's CRDs are not installed
        for workload in listing["items"]:
            call(functools.partial(self.custom.patch_namespaced_custom_object, "kueue.x-k8s.io", "v1beta2", namespace,
                                   "workloads", workload["metadata"]["name"], {"spec": {"active": False}},
                                   field_validation=STRICT))
        return bool(listing["items"])

    def kind_of(self, name: str) -> WorkloadKind:
        """The kind of the workload that is the job ``name``."""
        if name not in self._kinds:
            self._workload(name)
        return self._kinds[name]

    def _workload(self, name: str) -> dict[str, Any]:
        namespace, _, short = name.partition("/")
        known = self._kinds.get(name)
        found = []
        for kind in [known] if known else self.kinds:
            try:
                obj = self._json(self.custom.get_namespaced_custom_object, kind.group, kind.version, namespace, kind.plural, short)
            except NotFoundError:
                continue
            obj.setdefault("apiVersion", kind.api_version)
            obj.setdefault("kind", kind.kind)
            found.append(obj)
        if not found and known:
            self._kinds.pop(name)
            return self._workload(name)  # it was deleted; one of another kind may have the name now
        if not found:
            raise NotFoundError(f"job {name}: no {' or '.join(k.kind for k in self.kinds)} of that name")
        obj = next((o for o in found if opted_in(o)), found[0])
        self._kinds[name] = kind_of(obj)
        self._uids[(namespace, short)] = obj["metadata"].get("uid", "")
        return obj

    def _duplicate(self, obj: dict[str, Any]) -> bool:
        """A workload whose name the job of another kind has (it is not the job)."""
        return self._kinds.get(job_name_of(obj)) is not kind_of(obj)

    def add_job(self, job: Job) -> None:
        raise UsageError("on Kubernetes a job is a PyTorchJob or TrainJob with the unbroken.dev/enable-job-auto-resume "
                         "annotation: kubectl apply it (unbroken k8s render prints a PyTorchJob)")

    def get_job(self, name: str) -> Job:
        obj = self._workload(name)
        job = self._job(obj)
        if job is None:
            raise NotFoundError(f"job {name} is not managed by unbroken (no {names.AUTO_RESUME}: \"true\")")
        return job

    def list_jobs(self) -> list[Job]:
        jobs = []
        for obj in self._workloads():
            if self._duplicate(obj):
                continue
            try:
                job = self._job(obj)
            except (AnnotationError, ValueError, TypeError, KeyError):
                continue  # one object unbroken cannot read never stops the others; invalid_jobs() reports it
            if job is not None:
                jobs.append(job)
        return sorted(jobs, key=lambda j: (j.created_at, j.name))

    def invalid_jobs(self) -> list[InvalidJob]:
        """Jobs that opted in but cannot be managed: annotations that do not parse, a workload unbroken
        cannot read its size from, a name the job of another kind already has."""
        invalid = []
        for obj in self._workloads():
            try:
                if job_annotations.parse(obj["metadata"].get("annotations")) is None:
                    continue
            except AnnotationError as exc:
                invalid.append(InvalidJob(job_name_of(obj), tuple(exc.problems)))
                continue
            kind = kind_of(obj)
            problems = kind.problems(obj)
            if not problems:
                try:
                    self._job(obj)
                except (ValueError, TypeError, KeyError) as exc:  # e.g. a job-state annotation edited by hand
                    problems = [f"cannot be read: {type(exc).__name__}: {exc}"]
                except AnnotationError:
                    pass  # reported above
            duplicate = self._duplicate(obj)
            if duplicate:
                problems = [f"the {self._kinds[job_name_of(obj)].kind} {job_name_of(obj)} is already the job of that name; "
                            f"rename this {kind.kind}", *problems]
            if problems:
                invalid.append(InvalidJob(job_name_of(obj), tuple(problems), kind.kind if duplicate else "Job"))
        return invalid

    def workload_object(self, name: str) -> dict[str, Any]:
        """The job's workload object as the API server has it (for the backend)."""
        return self._workload(name)

    def cached_workload(self, name: str) -> dict[str, Any]:
        """The job's workload object from the watch cache where one is kept and synced (no request), else as the
        API server has it; for what the backend reads every pass of every job (a GET each would be a request per
        job per second). NotFoundError if there is none."""
        kind = self._kinds.get(name)
        cache = self.caches.workloads.get(kind.kind) if kind is not None and self.caches is not None else None
        if cache is not None and cache.synced:
            namespace, _, short = name.partition("/")
            found = cache.get(namespace, short)
            if found is not None:
                return found
        return self._workload(name)

    def _job(self, obj: dict[str, Any]) -> Job | None:
        meta = obj["metadata"]
        settings = job_annotations.parse(meta.get("annotations"))
        if settings is None:
            return None
        kind = kind_of(obj)
        if problems := kind.problems(obj):
            raise AnnotationError(problems)  # left alone like a bad annotation; invalid_jobs() reports it
        spec = job_annotations.job_spec(settings, name=meta["name"], command=f"{kind.kind} {meta['namespace']}/{meta['name']}",
                                         pods=max(1, kind.node_count(obj)), procs_per_node=kind.procs_per_node(obj),
                                         fewest_pods=kind.fewest_pods(obj))
        saved = json.loads((meta.get("annotations") or {}).get(names.JOB_STATE, "{}") or "{}")
        created = parse_time(meta.get("creationTimestamp")) or 0.0
        return Job(
            name=job_name_of(obj), spec_json=spec.model_dump_json(),
            phase=JobPhase(saved.get("phase", JobPhase.PENDING.value)),
            attempt=saved.get("attempt", 0), reason=saved.get("reason"), created_at=created,
            started_at=saved.get("started_at"), ended_at=saved.get("ended_at"),
            phase_changed_at=saved.get("phase_changed_at", created),
            cancel_requested=saved.get("cancel_requested", False),
            nodes=tuple(saved.get("nodes", ())), resizes=saved.get("resizes", 0), version=saved.get("version", 0),
        )

    def update_job(self, name: str, update: JobUpdate, *, expect_version: int | None = None) -> Job:
        def attempt() -> Job:
            obj = self._workload(name)
            current = self._job(obj)
            if current is None:
                raise NotFoundError(f"job {name} is no longer managed by unbroken")
            new = updated_record(f"job {name}", current, update, expect_version, "phase", JOB_TRANSITIONS, "phase_changed_at")
            state = {k: v for k, v in asdict(new).items() if k not in ("name", "spec_json", "created_at")}
            patch = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"], "annotations": {
                names.JOB_STATE: json.dumps(state, sort_keys=True),
                names.JOB_PHASE: new.phase.value,
                names.RESTART_COUNT: str(new.attempt),
            }}}
            self.patch_workload(name, patch)  # the kind _workload just recorded
            return new

        return retry_conflicts(f"job {name}", attempt)
