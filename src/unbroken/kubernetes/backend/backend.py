"""``Backend`` on Kubernetes: attempts are a workload's pods, node recovery is a ``Remediator``.

A job is a PyTorchJob or a TrainJob; kubernetes/backend/workloads.py says how each is suspended and patched.

- launch attempt N: one merge patch of the workload: the pod templates get
  ``unbroken.dev/attempt: N`` (and, for jobs that require it, a nodeSelector on
  ``deep-health-check-status: Passed``), and the workload is unsuspended; the
  workload's controller creates the pods, the scheduler places them, and nodes
  that are not Schedulable carry unbroken's NoSchedule taint, so faulty nodes stay out.
- stop attempt N: suspend the workload, delete the children its controller builds
  again (a TrainJob's JobSet), and delete its pods of attempt N with a grace period of
  ``StopGraceSeconds`` (3 s), not the pod's own (30 s unless it says): a hung rank ignores
  SIGTERM, and its pod's name stays taken until SIGKILL.
- observe attempt N: its pods that are bound to a node, one worker each (node rank
  from the replica type and index); a container that terminated non-zero (with
  ``restartPolicy: OnFailure`` the kubelet restarts it in place, so ``lastState``
  is read too) is a failed worker with the exit code and the log tail the kubelet
  kept as the termination message.
- release the workers of a lost node: its pods of unbroken's jobs are deleted,
  and force-deleted once they have been Terminating for ``ForceDeleteGraceSeconds``
  (a dead kubelet never confirms a deletion, and the workload's controller cannot
  recreate a pod whose name is still taken: kubeflow/trainer#2072).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import time
from dataclasses import replace
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from unbroken.errors import BackendError, NotFoundError
from unbroken.backends.base import AttemptWait
from unbroken.kubernetes.backend import names, node_repair
from unbroken.kubernetes.backend.api import call, parse_time
from unbroken.kubernetes.backend.store import KubernetesStore
from unbroken.kubernetes.backend.workloads import PYTORCHJOB, Child, WorkloadKind, job_of, queue_name
from unbroken.state.phases import WorkerPhase
from unbroken.state.records import Desired, EventType, Job, Node, Worker, WorkerProgress

log = logging.getLogger("unbroken.kubernetes.backend.backend")

_SIGNALS = {6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}
_CANNOT_START = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                           "CreateContainerError", "RunContainerError"})
"""A container waiting for one of these does not start by waiting longer."""


class Remediator(Protocol):
    """Carries out a node's reboot or replacement on a cluster unbroken does not provision."""

    def remediate(self, node: Node, action: str) -> None:
        """``action``: ``Reboot`` or ``Replace``."""


class ConditionRemediator:
    """The default: the node's ``UnbrokenHealthy=False`` condition (written with its state) is the
    request; cordon the node (the backend has evicted unbroken's pods); external repair (EKS node
    auto repair, Cluster API MachineHealthCheck, medik8s) reboots or replaces the machine."""

    def __init__(self, store: KubernetesStore) -> None:
        self.store = store

    def remediate(self, node: Node, action: str) -> None:
        node_repair.cordon(self.store, node.name)


class SelfRebootRemediator:
    """Reboots are the node's own agent's (``Kubernetes.SelfRebootCommand``): the operator cordons
    the node, and the agent running on the boot named by ``unbroken.dev/reboot-from-boot-id``
    (written by the backend before this is called) runs the command. A replacement is left to
    external repair through the condition, as with :class:`ConditionRemediator`: a machine cannot
    replace itself."""

    def __init__(self, store: KubernetesStore) -> None:
        self.store = store

    def remediate(self, node: Node, action: str) -> None:
        node_repair.cordon(self.store, node.name)
        if action != "Reboot":
            log.warning("SelfReboot cannot %s a node: the condition %s=False is the request for external repair",
                        action.lower(), names.CONDITION_TYPE, extra={"node": node.name, "action": action})


class CommandRemediator:
    """Runs ``command + [action, node]`` (e.g. a script calling a cloud CLI), environment
    ``UNBROKEN_NODE`` and ``UNBROKEN_ACTION``; a failure or timeout is a BackendError."""

    def __init__(self, store: KubernetesStore, command: Sequence[str], timeout: float = 300.0) -> None:
        self.store = store
        self.command = list(command)
        self.timeout = timeout

    def remediate(self, node: Node, action: str) -> None:
        ConditionRemediator(self.store).remediate(node, action)
        argv = [*self.command, action, node.name]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout,
                                  env={**os.environ, "UNBROKEN_NODE": node.name, "UNBROKEN_ACTION": action})
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BackendError(f"remediation command {argv}: {exc}") from None
        if done.returncode != 0:
            raise BackendError(f"remediation command {argv} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        log.info("remediation command ran", extra={"node": node.name, "action": action, "stdout": done.stdout[-500:]})


class KubernetesBackend:
    places_workers = True
    """kube-scheduler places the pods (backends/base.py): a node with another job's pods on it may fit this job's too."""

    def __init__(self, store: KubernetesStore, remediator: Remediator, *, force_delete_after: float = 30.0,
                 stop_grace: int | None = 3) -> None:
        self.store = store
        self.remediator = remediator
        self.force_delete_after = force_delete_after
        self.stop_grace = stop_grace
        """Seconds an attempt's pods get between SIGTERM and SIGKILL when it is stopped (None: the pod's own)."""

    # -- nodes ----------------------------------------------------------------------------

    def reboot_node(self, node: Node) -> None:
        self._evict(node)
        node_repair.mark_reboot(self.store, node.name)  # the boot to end: a later one is the node back
        self.remediator.remediate(node, "Reboot")

    def replace_node(self, node: Node) -> str | None:
        self._evict(node)
        self.remediator.remediate(node, "Replace")
        return None  # capacity comes back through whatever repairs or scales the node group

    def _evict(self, node: Node) -> None:
        for job, pod in self._training_pods(node=node.name):
            if not pod["metadata"].get("deletionTimestamp"):
                self.store.delete_pod(self.store.kind_of(job), pod, grace=None)

    # -- attempts -------------------------------------------------------------------------

    def held(self, job: str) -> str | None:
        """Read from the watch cache where there is one: every pending job is asked every pass."""
        try:
            return self.store.kind_of(job).held_by(self.store.cached_workload(job))
        except NotFoundError:
            return None  # deleted: the next pass forgets it

    def attempt_waits_for(self, job: str, attempt: int) -> AttemptWait | None:
        """No pod of the attempt (its controller has not created them: nudged), a pod the scheduler has not placed
        (its own message: "0/3 nodes are available: ..."), or a container that cannot start (image, config)."""
        try:
            kind = self.store.kind_of(job)
        except NotFoundError:
            return None
        pods = [p for p in self.store.job_pods(job) if _attempt(p) == attempt and not p["metadata"].get("deletionTimestamp")]
        if not pods:
            return AttemptWait(f"no pod of attempt {attempt} exists: the {kind.kind}'s controller has not created them",
                               nudge=True)
        for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
            status, name = pod.get("status") or {}, pod["metadata"]["name"]
            scheduled = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), None)
            if not (pod.get("spec") or {}).get("nodeName"):
                why = (scheduled or {}).get("message") or "the scheduler has not placed it yet"
                return AttemptWait(f"pod {name} is not scheduled: {why}")
            for container in status.get("containerStatuses") or []:
                waiting = (container.get("state") or {}).get("waiting") or {}
                if waiting.get("reason") in _CANNOT_START:
                    return AttemptWait(f"pod {name} on {pod['spec']['nodeName']}: container {container.get('name')} "
                                       f"{waiting['reason']}: {waiting.get('message') or ''}".rstrip(": "))
        return None

    def nudge_attempt(self, job: str, attempt: int) -> None:
        """Suspend and launch again: the workload's controller, seeing both, creates the attempt's pods anew."""
        try:
            kind = self.store.kind_of(job)
            self.store.patch_workload(job, kind.suspend_patch(True))
            self._relaunch(self.store.get_job(job), kind, self.store.workload_object(job), attempt)
        except NotFoundError:
            return

    def launch_attempt(self, job: Job, attempt: int, placement: Sequence[Node]) -> str:
        short = job.name.partition("/")[2]
        kind = self.store.kind_of(job.name)
        self._relaunch(job, kind, self.store.workload_object(job.name), attempt)
        return f"{kind.rdzv_endpoint(short)} (the workload's controller sets the rendezvous address)"

    def stop_attempt(self, job: str, attempt: int, *, hold: Collection[str] = ()) -> None:
        # ``hold`` is never asked of this backend: k8s render refuses resilience.in_process_restart
        namespace, _, short = job.partition("/")
        try:
            kind = self.store.kind_of(job)
            obj = self.store.workload_object(job)
            if kind is PYTORCHJOB and queue_name(obj) is not None:
                self._stop_queued(job, kind, obj, attempt)
            else:
                self.store.patch_workload(job, kind.suspend_patch(True))
        except NotFoundError:
            return  # the job was deleted: its pods go with it
        for child in kind.children_to_recreate(short):
            self._delete_child(namespace, child)
        for pod in self.store.job_pods(job):
            if _attempt(pod) == attempt and not pod["metadata"].get("deletionTimestamp"):
                self.store.delete_pod(kind, pod, grace=self.stop_grace)

    def _relaunch(self, job: Job, kind: WorkloadKind, obj: dict[str, Any], attempt: int) -> None:
        """The workload unsuspended with its pod templates marked as ``attempt`` (the launch, and its repeats)."""
        self.store.patch_workload(job.name, kind.launch_patch(
            obj, attempt, require_deep_health=job.spec().resilience.require_deep_health_passed))

    def _stop_queued(self, job: str, kind: WorkloadKind, obj: dict[str, Any], attempt: int) -> None:
        """A job Kueue admitted: Kueue unsuspends what its queue admitted at once, so suspending it stops nothing.
        A restart keeps the admission (and the quota: no wait behind other jobs in the queue): the pod templates
        are marked with the next attempt first, then the pods are deleted (by the caller) and the workload's
        controller recreates them as the next attempt. A job stopped for good (failed, cancelled) is taken
        off its queue as Kueue stops jobs: its Workload deactivated (``spec.active: false``), which suspends it."""
        record = self.store.get_job(job)
        if not record.phase.is_terminal:
            self._relaunch(record, kind, obj, attempt + 1)
            return
        if not self.store.deactivate_queued_workload(job, obj):
            self.store.patch_workload(job, kind.suspend_patch(True))  # no Kueue Workload: nothing unsuspends it

    def observe_attempt(self, job: str, attempt: int) -> list[Worker]:
        return [w for w in self._workers(job, self.store.job_pods(job)) if w.attempt == attempt]

    def active_workers(self) -> list[Worker]:
        by_job: dict[str, list[dict[str, Any]]] = {}
        for job, pod in self._training_pods():
            by_job.setdefault(job, []).append(pod)
        progress = self.store.lease_progress() if by_job else {}
        return [w for job, pods in by_job.items() for w in self._workers(job, pods, progress) if not w.phase.is_terminal]

    def worker_history(self, job: str) -> list[Worker]:
        """The pods that still exist (the API server keeps no deleted pods; the job's Events tell the rest)."""
        return sorted(self._workers(job, self.store.job_pods(job)), key=lambda w: (w.attempt, w.node_rank))

    def progress_history(self, job: str) -> list[tuple[int, float, int]]:
        return []  # ranks' progress is not sampled on Kubernetes yet (docs/kubernetes.md)

    def release_workers(self, node: Node, reason: str) -> None:
        now = time.time()
        for job, pod in self._training_pods(node=node.name):
            meta = pod["metadata"]
            deleting = parse_time(meta.get("deletionTimestamp"))
            if deleting is None:
                self.store.delete_pod(self.store.kind_of(job), pod, grace=None)
            elif now - deleting >= self.force_delete_after:
                self.store.delete_pod(self.store.kind_of(job), pod, grace=0)
                self.store.add_event("Job", job, "PodForceDeleted",
                                     f"pod {meta['name']} on {node.name} was Terminating for {now - deleting:.0f} s "
                                     f"(ForceDeleteGraceSeconds {self.force_delete_after:g}); node {reason}",
                                     type=EventType.WARNING)

    # -- pods -----------------------------------------------------------------------------

    def _training_pods(self, *, node: str | None = None) -> list[tuple[str, dict[str, Any]]]:
        """(job, pod) for every training pod of a job unbroken manages (never another workload's)."""
        managed = {j.name for j in self.store.list_jobs()}
        found = []
        for kind in self.store.kinds:
            for pod in self.store.kind_pods(kind, node=node):
                job = job_of(kind, pod)
                if job in managed and self.store.kind_of(job) is kind:
                    found.append((job, pod))
        return found

    def _delete_child(self, namespace: str, child: Child) -> None:
        try:
            call(lambda: self.store.custom.delete_namespaced_custom_object(
                child.group, child.version, namespace, child.plural, child.name, propagation_policy="Background"))
        except NotFoundError:
            pass

    def _workers(self, job: str, pods: list[dict[str, Any]],
                 progress: dict[tuple[str, int, str], WorkerProgress] | None = None) -> list[Worker]:
        """One worker per pod of ``job`` bound to a node (a pod not yet scheduled is on no node to watch),
        with the progress its node's agent reported for the job's ranks there (hang detection)."""
        kind = self.store.kind_of(job)
        masterless = not any(kind.is_master(pod) for pod in pods)
        bound = [pod for pod in pods if (pod.get("spec") or {}).get("nodeName")]
        if progress is None:
            progress = self.store.lease_progress() if bound else {}
        workers = []
        try:
            obj = self.store.cached_workload(job)
        except NotFoundError:
            obj = {}  # deleted meanwhile: its pods go with it
        budget, fewest = kind.member_restarts(obj), kind.fewest_pods(obj)
        for pod in bound:
            worker = self._worker(kind, job, pod, masterless)
            report = progress.get((job, worker.attempt, worker.node))
            if report is not None:
                worker = replace(worker, ranks=report.ranks, first_step=report.first_step,
                                 first_progress_at=report.first_progress_at, last_step=report.last_step,
                                 last_progress_at=report.last_progress_at, restored_step=report.restored_step,
                                 checkpoint_stall_s=report.checkpoint_stall_s, saved_step=report.saved_step,
                                 step_timing=report.step_timing, divergence=report.divergence,
                                 finished_at=report.finished_at)
            workers.append(worker)
        if budget is not None:
            by_attempt: dict[int, list[tuple[Worker, dict[str, Any]]]] = {}
            for worker, pod in zip(workers, bound, strict=True):
                by_attempt.setdefault(worker.attempt, []).append((worker, pod))
            workers = [w for members in by_attempt.values() for w in absorb_member_exits(members, fewest or 1, budget)]
        return workers

    def _worker(self, kind: WorkloadKind, job: str, pod: dict[str, Any], masterless: bool) -> Worker:
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        phase, exit_code, message, ended = _worker_phase(pod)
        return Worker(
            job=job, attempt=_attempt(pod), node=spec["nodeName"], node_rank=kind.node_rank(pod, masterless=masterless),
            desired=Desired.STOP if meta.get("deletionTimestamp") else Desired.RUN, phase=phase,
            rdzv_endpoint=kind.rdzv_endpoint(job.partition("/")[2]),
            created_at=parse_time(meta.get("creationTimestamp")) or 0.0, started_at=_container_started(status),
            ended_at=ended, exit_code=exit_code, message=f"pod {meta['name']}: {message}" if message else None,
        )


def absorb_member_exits(members: list[tuple[Worker, dict[str, Any]]], fewest: int, budget: int) -> list[Worker]:
    """An elastic job's workers of one attempt, its members' exits left to its own rendezvous where it can cope.

    A member whose container exited non-zero is restarted in place by the kubelet (``restartPolicy: OnFailure``)
    and rejoins; torchrun's agents in the other pods regroup without it meanwhile. That is no failure of the job
    while at least ``fewest`` members (``elasticPolicy.minReplicas``) are up and the pods' container restarts,
    together, stay within ``budget`` (``elasticPolicy.maxRestarts``): such a member reads as what its pod is doing
    now (running again, waiting to restart, or done). Past either bound it stays a failed worker, its message
    saying which bound, and unbroken restarts the job as usual."""
    restarts = sum(_restart_count(pod) for _, pod in members)
    up = sum(1 for _, pod in members if _container_running(pod))
    rejoining = [w.phase is WorkerPhase.FAILED and _restarts_in_place(pod) for w, pod in members]
    if not any(rejoining):
        return [w for w, _ in members]
    if restarts <= budget and up >= fewest:
        return [_rejoining(w, pod) if again else w for (w, pod), again in zip(members, rejoining, strict=True)]
    why = (f"elastic: {restarts} member restarts, over elasticPolicy.maxRestarts {budget}" if restarts > budget
           else f"elastic: {up} members up, below elasticPolicy.minReplicas {fewest}")
    return [replace(w, message=f"{w.message}; {why}") if again else w for (w, _), again in zip(members, rejoining, strict=True)]


def _restarts_in_place(pod: dict[str, Any]) -> bool:
    """The kubelet restarts the pod's container after a failure: not being deleted, not Failed for good."""
    return not pod["metadata"].get("deletionTimestamp") and (pod.get("status") or {}).get("phase") != "Failed" \
        and (pod.get("spec") or {}).get("restartPolicy", "Always") in ("Always", "OnFailure")


def _rejoining(worker: Worker, pod: dict[str, Any]) -> Worker:
    """The worker as its restarted container stands now: running again, done, or waiting to start."""
    status = pod.get("status") or {}
    state = next((c.get("state") or {} for c in status.get("containerStatuses") or []), {})
    if status.get("phase") == "Succeeded" or ((state.get("terminated") or {}).get("exitCode", 1) == 0):
        return replace(worker, phase=WorkerPhase.SUCCEEDED, exit_code=0, message=None)
    phase = WorkerPhase.RUNNING if "running" in state else WorkerPhase.PENDING
    return replace(worker, phase=phase, exit_code=None, ended_at=None, message=None, started_at=_container_started(status))


def _restart_count(pod: dict[str, Any]) -> int:
    return sum(int(c.get("restartCount") or 0) for c in (pod.get("status") or {}).get("containerStatuses") or [])


def _container_running(pod: dict[str, Any]) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and any(
        "running" in (c.get("state") or {}) for c in (pod.get("status") or {}).get("containerStatuses") or [])


def _container_started(status: dict[str, Any]) -> float | None:
    """When the pod's first container started running (after its image was pulled: startup_timeout
    counts from here); before that, the pod's own start time."""
    for container in status.get("containerStatuses") or []:
        started = parse_time(((container.get("state") or {}).get("running") or {}).get("startedAt"))
        if started is not None:
            return started
    return parse_time(status.get("startTime"))


def _attempt(pod: dict[str, Any]) -> int:
    """Pods created before unbroken adopted the job carry no attempt: they are attempt 0."""
    value = (pod["metadata"].get("annotations") or {}).get(names.ATTEMPT, "0")
    return int(value) if value.isdigit() else 0


_ROOT_CAUSE = re.compile(r"(Signal \d+ \(\w+\) received by PID \d+|exitcode\s*:\s*-?\d+.*|\w+(Error|Exception): .+)")


def _what_failed(log_tail: str) -> str:
    """The telling line of the log tail the kubelet kept: torchrun's root cause ("Signal 9 (SIGKILL)
    received by PID 812"), else the last exception, else the last lines."""
    lines = [line.strip() for line in log_tail.splitlines() if line.strip() and not set(line.strip()) <= set("=-_ ")]
    for line in reversed(lines):
        if (found := _ROOT_CAUSE.search(line)) is not None and "Signal" in found.group(0):
            return found.group(0)
    for line in reversed(lines):
        if (found := _ROOT_CAUSE.search(line)) is not None:
            return found.group(0)[:300]
    return " | ".join(lines[-2:])[:300]


def _worker_phase(pod: dict[str, Any]) -> tuple[WorkerPhase, int | None, str | None, float | None]:
    """``_pod_phase``, except that a pod being deleted has not stopped until it is gone or its phase is final.

    With ``restartPolicy: OnFailure`` the kubelet restarts a failed container in place, and it may do so after the pod
    was deleted; a container's PID 1 drops a SIGTERM it has no handler for yet, so the new one can run out the 30 s
    grace period. Read as failed (its ``lastState``), such a pod let a restart go on as if it had stopped: on real
    nodes attempt 0's Worker, restarted so, joined attempt 1's Master, trained beside it, and its SIGKILL at the end of
    the grace period broke attempt 1: a second restart for one fault. Until the kubelet has removed it (it does once
    every container has ended), a pod being deleted reads as running (a container runs) or pending (one may start), and
    a restart waits for it as for any pod still running; a pod whose phase is Succeeded or Failed starts nothing more.
    The operator's own delete is read from its answer (``store.delete_pod``), not only once the watch brings it."""
    status = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp") and status.get("phase") not in ("Succeeded", "Failed"):
        running = any("running" in (c.get("state") or {}) for c in status.get("containerStatuses") or [])
        return (WorkerPhase.RUNNING if running else WorkerPhase.PENDING), None, None, None
    return _pod_phase(status)


def _pod_phase(status: dict[str, Any]) -> tuple[WorkerPhase, int | None, str | None, float | None]:
    """(phase, exit code, message, ended) of a pod's main container. Exit codes the kubelet reports
    as 128 + N for a signal are returned as -N, as the local backend reports a signal."""
    pod_phase = status.get("phase", "Pending")
    for container in status.get("containerStatuses") or []:
        for state in (container.get("state") or {}, container.get("lastState") or {}):
            terminated = state.get("terminated")
            if terminated and terminated.get("exitCode", 0) != 0:
                code = int(terminated["exitCode"])
                signal = code - 128 if code > 128 else None
                what = (f"killed by {_SIGNALS.get(signal, f'signal {signal}')} (exit code {code})" if signal
                        else f"exited with code {code}")
                detail = _what_failed(terminated.get("message") or "")
                return (WorkerPhase.FAILED, -signal if signal else code, what + (f": {detail}" if detail else ""),
                        parse_time(terminated.get("finishedAt")))
    if pod_phase == "Succeeded":
        return WorkerPhase.SUCCEEDED, 0, None, None
    if pod_phase == "Failed":
        return WorkerPhase.FAILED, None, status.get("message") or status.get("reason") or "pod failed", None
    if pod_phase == "Running":
        return WorkerPhase.RUNNING, None, None, None
    return WorkerPhase.PENDING, None, None, None
