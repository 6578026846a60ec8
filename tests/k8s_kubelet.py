"""A test kubelet: the parts of a Kubernetes cluster that tests/k8s_emulator.py does not have, played locally.

The emulator is an API server only: nothing schedules, runs or finishes a pod there. ``TestKubelet`` plays,
against it and through the official ``kubernetes`` client, the scheduler, a kubelet on every node it adds,
the batch/v1 Job controller, the Kubeflow PyTorchJob controller (training-operator v1), the Trainer's
TrainJob and the JobSet controllers (tests/k8s_trainer.py) and the garbage collector for their pods -- so that an end-to-end test can submit a real PyTorchJob and get real local
processes as its pods::

    with kubernetes_emulator(tmp_path) as k8s, TestKubelet(k8s.write_kubeconfig(tmp_path / "kubeconfig"), tmp_path) as kubelet:
        kubelet.add_node("node-a", allocatable={"nvidia.com/gpu": "1"})
        ...                                  # create a PyTorchJob; its pods run as processes
        kubelet.fail_node("node-a")          # the node loses power

It is one background thread that polls the API (list calls every ``poll_seconds``) and reconciles: no
watches, no informers, no work queues -- simple and robust rather than fast. An exception inside the loop
is logged and kept in ``errors`` (404/409 answers from races with the test are only logged) and the loop
goes on. ``close()`` (the context exit; also run at interpreter exit) stops the thread and SIGKILLs every
process group it started.

For tests: ``add_node(name, labels=, allocatable=, taints=)``, ``fail_node(name)``, ``node_dir(name)``,
``pid_of(namespace, pod)`` (the running process, else None), ``log_path(namespace, pod)``,
``pods_on(node)`` (pod names bound to it), ``errors``, ``close()``.

How it differs from a real cluster
----------------------------------
Everything runs on this one machine, as the test's user, with the test's environment:

* Nodes are Node objects made by ``add_node`` (labels ``kubernetes.io/hostname``, ``kubernetes.io/os``,
  ``kubernetes.io/arch``; Ready=True; allocatable = capacity = 2 cpu, 8Gi, 110 pods plus what the test gives,
  e.g. ``nvidia.com/gpu``; InternalIP 127.0.0.1) and a Lease in ``kube-node-lease`` renewed every 10 s.
  Node status is never re-posted (no heartbeats beyond the Lease). Each node has a directory,
  ``node_dir(name)`` = ``workdir/nodes/<name>``, which plays its root filesystem for hostPath volumes.
* ``fail_node`` is a power loss: the node's processes get SIGKILL, its kubelet stops (no more pod status
  writes; graceful deletions of its pods are never confirmed, so they stay Terminating until someone
  force-deletes them; its Lease is no longer renewed) and the Node is marked as the node-lifecycle
  controller marks it: every condition ``Unknown`` with reason ``NodeStatusUnknown``, and the taints
  ``node.kubernetes.io/unreachable`` NoSchedule and NoExecute. A real controller does that ~40 s after the
  last heartbeat; here it is immediate. Taint-based eviction (deleting the pods after their 300 s
  toleration) is not emulated, nor is marking the pods not Ready. A failed node stays failed.
* Scheduler: binds a pod by merge-patching ``spec.nodeName`` (the emulator has no ``binding``
  subresource). Filters: node Ready=True and managed by this kubelet (not failed); ``spec.unschedulable``
  (as the taint ``node.kubernetes.io/unschedulable:NoSchedule``, so it can be tolerated); NoSchedule and
  NoExecute taints against the pod's tolerations; ``nodeSelector``; required node affinity
  (``nodeSelectorTerms`` ORed, expressions ANDed, In/NotIn/Exists/DoesNotExist/Gt/Lt, ``matchFields`` on
  ``metadata.name``); extended resources (e.g. ``nvidia.com/gpu``: the requests, else limits, of the
  non-terminal pods on the node must fit its allocatable). cpu and memory always fit. Among the nodes that
  fit, the first by name wins: no scoring, spreading, preferred affinity, pod affinity, topology spread or
  preemption; required pod anti-affinity is emulated on ``kubernetes.io/hostname`` with ``matchLabels``
  (one pod of a cross-node sweep per node). A pod that fits nowhere stays Pending with
  ``PodScheduled=False``, reason ``Unschedulable`` and a message in the scheduler's style.
* Kubelet: runs the *first* container's ``command + args`` as a local process (``start_new_session``, so
  one process group per pod) with cwd = ``workingDir`` if it exists here, else the node directory; init and
  sidecar containers are not run, images are ignored (a container without a command cannot run: it waits
  with ``CreateContainerError``), there is no isolation (namespaces, cgroups, limits) and no probes (a
  running container is Ready). Environment = the test process's ``os.environ``, with the test's Python's
  directory first on ``PATH`` (so ``python`` in a command is an interpreter with torch and unbroken, as
  in a training image), overlaid with the container's ``env``: values (with ``$(VAR)`` expansion, also in command/args), and ``fieldRef`` to
  ``metadata.name|namespace|uid|labels['k']|annotations['k']``, ``spec.nodeName``,
  ``spec.serviceAccountName``, ``status.podIP``/``status.hostIP`` (both 127.0.0.1); any other
  ``valueFrom`` or ``envFrom`` is not supported (``CreateContainerConfigError``). Pods get no in-cluster
  API credentials: put ``KUBECONFIG`` into the container's env if they must talk to the emulator.
  hostPath volumes: for each ``volumeMount`` of a hostPath volume H at M, an env value, a command/args
  element or the workingDir that is M or under M is rewritten to ``node_dir(node)/H`` + the rest, and that
  directory is created -- so ``/var/run/unbroken/agent.sock`` reaches that node's own directory. Other
  volumes are ignored. stdout+stderr go to ``workdir/logs/<namespace>_<pod>_<container>.log``, appended
  across restarts and across pods of the same name (a real kubelet keeps one file per pod uid and
  restart); ``<that>.start`` names the current run's pod uid and byte offset, from which the emulator
  serves ``pods/<name>/log`` (``kubernetes_emulator(pod_logs=workdir / "logs")``).
  Pod status follows the kubelet's: Running with ``hostIP``/``podIP`` 127.0.0.1, conditions and
  ``containerStatuses`` (``containerID`` ``emulated://<pid>``); on exit, ``terminated`` with the exit code in
  Kubernetes' convention (killed by signal N -> 128+N), reason ``Completed``/``Error`` (never
  ``OOMKilled``) and, when non-zero, the last 2048 bytes of the log as the message (what
  ``terminationMessagePolicy: FallbackToLogsOnError`` gives, applied to every pod). ``restartPolicy``
  Never -> Succeeded/Failed; OnFailure/Always -> ``restartCount`` +1, ``lastState.terminated``, waiting in
  ``CrashLoopBackOff`` and a restart after a back-off of 1 s, doubling, capped at 10 s, reset after 20 s of
  running (a real kubelet: 10 s doubling to 5 min, reset after 10 min).
  Graceful deletion: on ``deletionTimestamp``, SIGTERM to the process group, SIGKILL after
  ``deletionGracePeriodSeconds`` (at most 30 s), the terminal status written, then the deletion confirmed
  with a grace-0 DELETE. A pod gone from the API whose process still runs gets SIGKILL. A SIGKILL, and a
  container's exit, reach every process of the pod, as a cgroup kill does: each carries the pod's uid in
  ``UNBROKEN_TEST_KUBELET_POD`` (``POD_MARKER``), so ranks torchrun started in sessions of their own die too.
* PyTorchJob controller (kubeflow.org/v1, the training operator's behaviour where it matters): pods
  ``<job>-master-0`` and ``<job>-worker-<i>`` with the operator's labels, the template's annotations, an
  owner reference to the job, ``restartPolicy`` from the replica spec (ExitCode -> Never), and env in the
  container named ``pytorch`` (else the first): MASTER_ADDR, MASTER_PORT, WORLD_SIZE (number of pods),
  RANK, PET_MASTER_ADDR, PET_MASTER_PORT, PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE
  (``spec.nprocPerNode``; unset or ``auto`` -> 1), PYTHONUNBUFFERED=1. There is no pod network, no DNS and
  no Service: MASTER_ADDR is 127.0.0.1, and since every pod shares one loopback, MASTER_PORT is a free TCP
  port chosen when the rank-0 pod is created (the template's port is ignored); a recreated rank-0 pod gets
  the port its live worker pods were given (a real cluster keeps the port and its Service follows the new
  pod), else the job's previous port when it is free, else a new one.
  A missing pod is recreated. Conditions Created, Running (all pods Running), Restarting, Succeeded (the
  master Succeeded; all pods if there is no master), Failed (reason ``PyTorchJobFailed``, naming the pod),
  Suspended; ``replicaStatuses`` (counted as the operator counts), ``startTime``, ``completionTime``.
  A Failed pod fails the job, except under ``restartPolicy: ExitCode`` with an exit code >= 128, where the
  pod is deleted and recreated (Restarting). Difference: the real operator also counts a *Terminating*
  Running pod as failed, which fails a job that is not ExitCode; here a pod being deleted is not judged,
  it is just replaced once gone -- so a lost node's pods come back once they are force-deleted. After
  Succeeded/Failed nothing is recreated; ``runPolicy.cleanPodPolicy`` (None by default, Running, All) is
  applied. ``runPolicy.suspend`` deletes the pods (Suspended=True, Running=False, no startTime); resuming
  recreates them (Suspended=False, a new startTime). Not emulated: elasticPolicy (but nProcPerNode),
  runPolicy backoffLimit/activeDeadlineSeconds/ttlSecondsAfterFinished, gang scheduling, Services, events.
* Job controller (batch/v1): pods ``<job>-<random5>`` (Indexed: ``<job>-<index>-<random5>`` with the
  ``batch.kubernetes.io/job-completion-index`` annotation and label, and JOB_COMPLETION_INDEX from that
  annotation in every container), labels ``batch.kubernetes.io/job-name``, ``job-name``,
  ``batch.kubernetes.io/controller-uid``, ``controller-uid``; parallelism and completions (default 1),
  NonIndexed or Indexed; ``backoffLimit`` (default 6; failed pods + restarts of OnFailure pods beyond it ->
  Failed ``BackoffLimitExceeded``), ``activeDeadlineSeconds`` (counted from the moment this controller set
  ``status.startTime``, which itself has whole seconds only -> Failed ``DeadlineExceeded``), ``suspend``; on Failed the remaining pods are deleted; status active, ready,
  succeeded, failed, completedIndexes, startTime, completionTime, conditions Complete/Failed/Suspended. A
  pod that is deleted before it finished counts as failed and is replaced at once. Not emulated:
  SuccessCriteriaMet/FailureTarget, podFailurePolicy, successPolicy, backoffLimitPerIndex, the delay
  between replacements, ttlSecondsAfterFinished; the counts live in this process's memory (a real
  controller keeps them with pod finalizers).
* TrainJob (Kubeflow Trainer v2) and JobSet controllers: tests/k8s_trainer.py, called from this loop; a
  TrainJob's pods come from Jobs that its JobSet made, through the Job controller above.
* Garbage collector: pods whose controller (a Job or a PyTorchJob) is gone are deleted gracefully,
  whatever ``propagationPolicy`` the owner's deletion asked for (Jobs and JobSets: tests/k8s_trainer.py).
* Nothing plays Deployments, DaemonSets or Services.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import datetime
import json
import logging
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import kubernetes
import psutil
from kubernetes.client.rest import ApiException

log = logging.getLogger("k8s-kubelet")

Obj = dict[str, Any]

LOOPBACK = "127.0.0.1"
GRACE_CAP_S = 30
BACKOFF_FIRST_S = 1.0
BACKOFF_CAP_S = 10.0
BACKOFF_RESET_S = 20.0
LEASE_RENEW_S = 10.0
LOG_TAIL_BYTES = 2048
DEFAULT_ALLOCATABLE = {"cpu": "2", "memory": "8Gi", "pods": "110"}
PYTORCHJOBS = ("kubeflow.org", "v1", "pytorchjobs")
TERMINAL = ("Succeeded", "Failed")
UNREACHABLE = "node.kubernetes.io/unreachable"
UNSCHEDULABLE = "node.kubernetes.io/unschedulable"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
PYTORCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NNODES",
               "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PYTHONUNBUFFERED")
OWNERS = {("batch/v1", "Job"), ("kubeflow.org/v1", "PyTorchJob")}  # whose pods the garbage collector deletes

# --------------------------------------------------------------------------------------------------
# Small pure helpers.
# --------------------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    """A MicroTime, as Leases want."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _seconds_since(timestamp: str) -> float:
    moment = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    return (datetime.datetime.now(datetime.UTC) - moment).total_seconds()


def _meta(obj: Obj) -> Obj:
    return obj.get("metadata") or {}


def _spec(obj: Obj) -> Obj:
    return obj.get("spec") or {}


def _phase(pod: Obj) -> str:
    return (pod.get("status") or {}).get("phase") or "Pending"


def _deleting(obj: Obj) -> bool:
    return bool(_meta(obj).get("deletionTimestamp"))


def _active(pod: Obj) -> bool:
    """Neither finished nor on its way out: what a controller counts as active."""
    return _phase(pod) not in TERMINAL and not _deleting(pod)


def _controller_ref(pod: Obj) -> Obj | None:
    return next((r for r in _meta(pod).get("ownerReferences") or [] if r.get("controller")), None)


def _controller_uid(pod: Obj) -> str | None:
    ref = _controller_ref(pod)
    return ref.get("uid") if ref else None


def _owner_reference(owner: Obj, api_version: str, kind: str) -> Obj:
    """A controller reference (list items of a real API server carry no apiVersion/kind, hence the arguments)."""
    meta = _meta(owner)
    return {"apiVersion": api_version, "kind": kind, "name": meta["name"], "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


def _is_true(conditions: list[Obj], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def _set_condition(conditions: list[Obj], kind: str, status: str, reason: str = "", message: str = "",
                   *, stamps: tuple[str, ...] = ()) -> list[Obj]:
    """``conditions`` with ``kind`` set; unchanged (same list) when nothing differs, so that nothing is rewritten.

    ``lastTransitionTime`` moves only when the status changes; the ``stamps`` keys (e.g. ``lastUpdateTime``)
    move on every change.
    """
    old = next((c for c in conditions if c.get("type") == kind), None)
    if old is not None and (old.get("status"), old.get("reason", ""), old.get("message", "")) == (status, reason, message):
        return conditions
    now = _now()
    new: Obj = {"type": kind, "status": status}
    if reason:
        new["reason"] = reason
    if message:
        new["message"] = message
    new["lastTransitionTime"] = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    for key in stamps:
        new[key] = now
    return [new if c is old else c for c in conditions] if old is not None else [*conditions, new]


def _set_job_condition(conditions: list[Obj], kind: str, status: str, reason: str, message: str) -> list[Obj]:
    """The training operator's condition rules: Running and Restarting replace each other; Succeeded/Failed
    turn Running False."""
    if status == "True" and kind in ("Running", "Restarting"):
        other = "Restarting" if kind == "Running" else "Running"
        conditions = [c for c in conditions if c.get("type") != other]
    if status == "True" and kind in ("Succeeded", "Failed"):
        running = next((c for c in conditions if c.get("type") == "Running"), None)
        if running is not None and running.get("status") == "True":
            conditions = _set_condition(conditions, "Running", "False", running.get("reason", ""), running.get("message", ""),
                                        stamps=("lastUpdateTime",))
    return _set_condition(conditions, kind, status, reason, message, stamps=("lastUpdateTime",))


def _status_patch(before: Obj, after: Obj) -> Obj:
    """A merge patch turning ``before`` into ``after`` at the top level (removed keys become null)."""
    return {**after, **{key: None for key in before if key not in after}}


_QUANTITY = re.compile(r"^([0-9.]+)([a-zA-Z]*)$")
_SUFFIXES = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def _quantity(value: Any) -> float:
    """A Kubernetes quantity ("1", "500m", "8Gi") as a number."""
    m = _QUANTITY.match(str(value).strip())
    if not m or m.group(2) not in _SUFFIXES:
        raise ValueError(f"not a quantity: {value!r}")
    return float(m.group(1)) * _SUFFIXES[m.group(2)]


def _extended(resource: str) -> bool:
    return resource not in ("cpu", "memory", "ephemeral-storage", "pods") and not resource.startswith("hugepages-")


def _extended_requests(pod: Obj) -> dict[str, float]:
    """The pod's extended-resource requests (else limits), as the scheduler sums them (init containers: the max)."""

    def of(container: Obj) -> dict[str, float]:
        resources = container.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        return {r: _quantity(requests.get(r, limits.get(r))) for r in {*requests, *limits} if _extended(r)}

    total: dict[str, float] = {}
    for container in _spec(pod).get("containers") or []:
        for resource, amount in of(container).items():
            total[resource] = total.get(resource, 0) + amount
    for container in _spec(pod).get("initContainers") or []:
        for resource, amount in of(container).items():
            total[resource] = max(total.get(resource, 0), amount)
    return total


def _tolerates(toleration: Obj, taint: Obj) -> bool:
    """Kubernetes' ToleratesTaint: an empty key with Exists tolerates every taint."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    if toleration.get("operator") == "Exists":
        return True
    return toleration.get("operator", "Equal") == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def _requirement_holds(expression: Obj, values_of: dict[str, str]) -> bool:
    key, operator, values = str(expression.get("key")), expression.get("operator"), expression.get("values") or []
    present = key in values_of
    if operator == "In":
        return present and values_of[key] in values
    if operator == "NotIn":
        return not present or values_of[key] not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and len(values) == 1:
        try:
            mine, theirs = int(values_of[key]), int(values[0])
        except ValueError:
            return False
        return mine > theirs if operator == "Gt" else mine < theirs
    return False


def _term_matches(term: Obj, node: Obj) -> bool:
    """One nodeSelectorTerm: its expressions ANDed; an empty term matches nothing (as in Kubernetes)."""
    expressions, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not expressions and not fields:
        return False
    labels = _meta(node).get("labels") or {}
    node_fields = {"metadata.name": _meta(node)["name"]}
    return all(_requirement_holds(e, labels) for e in expressions) and all(_requirement_holds(f, node_fields) for f in fields)


def _node_selected(pod: Obj, node: Obj) -> bool:
    """``nodeSelector`` and required node affinity (terms ORed)."""
    labels = _meta(node).get("labels") or {}
    if any(labels.get(k) != v for k, v in (_spec(pod).get("nodeSelector") or {}).items()):
        return False
    affinity = ((_spec(pod).get("affinity") or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if affinity is None:
        return True
    return any(_term_matches(term, node) for term in affinity.get("nodeSelectorTerms") or [])


def _repelled(pod: Obj, residents: list[Obj]) -> bool:
    """Required pod anti-affinity with ``topologyKey: kubernetes.io/hostname`` (one node is one domain):
    a pod of the same namespace on the node matches a term's ``matchLabels``. Other topology keys,
    ``matchExpressions`` and ``namespaceSelector`` are not emulated (refused, so no test relies on them)."""
    terms = ((_spec(pod).get("affinity") or {}).get("podAntiAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or []
    for term in terms:
        selector = term.get("labelSelector") or {}
        if term.get("topologyKey") != "kubernetes.io/hostname" or set(selector) - {"matchLabels"} or term.get("namespaceSelector"):
            raise ValueError(f"pod anti-affinity term not emulated: {term}")
        wanted = selector.get("matchLabels") or {}
        for other in residents:
            labels = _meta(other).get("labels") or {}
            if _meta(other)["namespace"] == _meta(pod)["namespace"] and all(labels.get(k) == v for k, v in wanted.items()):
                return True
    return False


def _node_ready(node: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in (node.get("status") or {}).get("conditions") or [])


def _exit_code(returncode: int) -> int:
    """Popen's -N (killed by signal N) in Kubernetes' convention, 128+N."""
    return 128 - returncode if returncode < 0 else returncode


_REFERENCE = re.compile(r"\$(\$|\(([A-Za-z_][A-Za-z0-9_.-]*)\))")


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known names replaced, unknown ones kept, ``$$`` escapes a ``$``."""

    def replace(m: re.Match[str]) -> str:
        if m.group(1) == "$":
            return "$"
        return env.get(m.group(2), m.group(0))

    return _REFERENCE.sub(replace, text)


def _rewrite(value: str, mounts: list[tuple[str, Path]]) -> str:
    """A path inside a hostPath mount, as the same path inside the node's directory."""
    for mount_path, host in mounts:
        if value == mount_path or value.startswith(mount_path + "/"):
            return str(host) + value[len(mount_path):]
    return value


def _port_free(port: int) -> bool:
    """Whether a server may bind ``port`` now (as torch's TCPStore does: SO_REUSEADDR, so TIME_WAIT is no obstacle)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def _index_ranges(indexes: list[int]) -> str:
    """A Job's completedIndexes: "0-2,4"."""
    parts: list[str] = []
    for i in sorted(set(indexes)):
        if parts and (last := parts[-1].split("-"))[-1] == str(i - 1):
            parts[-1] = f"{last[0]}-{i}"
        else:
            parts.append(str(i))
    return ",".join(parts)


def _arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


class _ConfigError(Exception):
    """A container this kubelet cannot start; ``reason`` is the waiting reason it reports."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# --------------------------------------------------------------------------------------------------
# The API calls, on raw JSON.
# --------------------------------------------------------------------------------------------------


class _Api:
    """The calls the kubelet makes, through the official client but on raw JSON: no model conversion, so
    unknown fields survive and names stay camelCase. Writes are resourceVersion-free merge patches."""

    def __init__(self, kubeconfig: Path) -> None:
        self.client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.batch = kubernetes.client.BatchV1Api(self.client)
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.coordination = kubernetes.client.CoordinationV1Api(self.client)

    @staticmethod
    def _json(response: Any) -> Any:
        return json.loads(response.data)

    def pods(self, **selectors: str) -> list[Obj]:
        return self._json(self.core.list_pod_for_all_namespaces(_preload_content=False, **selectors))["items"]

    def nodes(self) -> list[Obj]:
        return self._json(self.core.list_node(_preload_content=False))["items"]

    def jobs(self) -> list[Obj]:
        return self._json(self.batch.list_job_for_all_namespaces(_preload_content=False))["items"]

    def pytorchjobs(self) -> list[Obj]:
        try:
            return self.custom.list_cluster_custom_object(*PYTORCHJOBS)["items"]
        except ApiException as e:
            if e.status == 404:
                return []  # not served by this emulator
            raise

    def merge_patch(self, path: str, body: Obj) -> Obj:
        return self.client.call_api(path, "PATCH", header_params={"Content-Type": "application/merge-patch+json", "Accept": "application/json"},
                                    body=body, response_type="object", auth_settings=["BearerToken"], _return_http_data_only=True)

    @staticmethod
    def _pod_path(pod: Obj) -> str:
        return f"/api/v1/namespaces/{_meta(pod)['namespace']}/pods/{_meta(pod)['name']}"

    def patch_pod(self, pod: Obj, body: Obj) -> Obj:
        return self.merge_patch(self._pod_path(pod), body)

    def patch_pod_status(self, pod: Obj, status: Obj) -> Obj:
        return self.merge_patch(self._pod_path(pod) + "/status", {"status": status})

    def create_pod(self, namespace: str, body: Obj) -> Obj:
        return self._json(self.core.create_namespaced_pod(namespace, body, _preload_content=False))

    def delete_pod(self, pod: Obj, grace: int | None = None) -> None:
        """Delete this very pod (uid precondition: never a successor with the same name); gone already is fine."""
        meta = _meta(pod)
        body: Obj = {"preconditions": {"uid": meta["uid"]}}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        try:
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], body=body, grace_period_seconds=grace, _preload_content=False)
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def patch_job_status(self, job: Obj, patch: Obj) -> None:
        self.merge_patch(f"/apis/batch/v1/namespaces/{_meta(job)['namespace']}/jobs/{_meta(job)['name']}/status", {"status": patch})

    def patch_pytorchjob_status(self, job: Obj, patch: Obj) -> None:
        group, version, plural = PYTORCHJOBS
        self.custom.patch_namespaced_custom_object_status(group, version, _meta(job)["namespace"], plural, _meta(job)["name"], {"status": patch})

    def create_node(self, body: Obj) -> Obj:
        return self._json(self.core.create_node(body, _preload_content=False))

    def read_node(self, name: str) -> Obj:
        return self._json(self.core.read_node(name, _preload_content=False))

    def create_lease(self, node: Obj) -> None:
        """The node's heartbeat Lease in kube-node-lease, owned by the Node (as a real kubelet makes it)."""
        name = _meta(node)["name"]
        owner = {"apiVersion": "v1", "kind": "Node", "name": name, "uid": _meta(node)["uid"]}
        body = {"metadata": {"name": name, "ownerReferences": [owner]},
                "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": _micro_now()}}
        self.coordination.create_namespaced_lease("kube-node-lease", body, _preload_content=False)

    def renew_lease(self, node: str) -> None:
        self.merge_patch(f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}", {"spec": {"renewTime": _micro_now()}})

    def close(self) -> None:
        self.client.close()


# --------------------------------------------------------------------------------------------------
# What the kubelet remembers.
# --------------------------------------------------------------------------------------------------


@dataclass
class _Node:
    name: str
    failed: bool = False
    lease_renewed: float = 0.0  # time.monotonic()


POD_MARKER = "UNBROKEN_TEST_KUBELET_POD"
"""In every container's environment: its pod's uid. The test kubelet's stand-in for the pod's cgroup."""


def pod_processes(uid: str | None = None) -> list[psutil.Process]:
    """The live processes of the pod ``uid`` (None: of any pod a test kubelet started)."""
    found = []
    for process in psutil.process_iter(["environ", "status"]):
        marker = (process.info.get("environ") or {}).get(POD_MARKER)
        if marker is not None and (uid is None or marker == uid) and process.info.get("status") != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def _kill_pod_processes(uid: str) -> None:
    """SIGKILL every process of the pod, wherever it went: torchrun starts its ranks in sessions of their
    own, outside the container's process group, and a rank stopped with SIGSTOP outlives a torchrun killed
    before it could kill it. A real kubelet kills the container's cgroup, which holds them all."""
    for process in pod_processes(uid):
        with contextlib.suppress(psutil.Error):
            process.kill()


@dataclass
class _Container:
    """The one container the kubelet runs for a pod, across its restarts, and the state it reports for it."""

    namespace: str
    pod: str
    uid: str
    node: str
    name: str
    image: str
    restart_policy: str
    log_path: Path
    pod_started_at: str
    process: subprocess.Popen[bytes] | None = None
    pid: int | None = None  # of the current or last run
    run_started_at: str = ""
    run_started_mono: float = 0.0
    log_offset: int = 0
    restart_count: int = 0
    state: Obj = field(default_factory=dict)  # Kubernetes' ContainerState: running / waiting / terminated
    last_state: Obj = field(default_factory=dict)
    restart_at: float | None = None  # time.monotonic() of the next start, while backing off
    backoff_s: float = 0.0
    done: bool = False  # terminated for good
    term_sent_at: float | None = None
    kill_at: float | None = None
    confirmed: bool = False
    written: Obj | None = None  # the last status written

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass(frozen=True)
class _Replica:
    """One pod of a PyTorchJob."""

    rtype: str  # as in the spec: "Master" / "Worker"
    index: int
    rank: int
    name: str
    spec: Obj

    @property
    def policy(self) -> str:
        return self.spec.get("restartPolicy") or "OnFailure"  # the operator's default


@dataclass
class _JobTracking:
    """What a real Job controller keeps with its pod finalizers: which pods it has counted, by uid."""

    succeeded: dict[str, int | None] = field(default_factory=dict)  # pod uid -> completion index
    failed: set[str] = field(default_factory=set)
    active: set[str] = field(default_factory=set)
    removed: set[str] = field(default_factory=set)  # deleted by the controller itself: counted neither way
    started: float | None = None  # time.monotonic() when this controller set status.startTime (which has whole seconds only)


# --------------------------------------------------------------------------------------------------
# The test kubelet.
# --------------------------------------------------------------------------------------------------


class TestKubelet:
    """Scheduler, kubelets, Job/PyTorchJob controllers and pod garbage collector for the emulator (module docstring)."""

    __test__ = False  # a helper, not a pytest test class

    def __init__(self, kubeconfig: Path, workdir: Path, *, poll_seconds: float = 0.1) -> None:
        self.workdir = Path(workdir)
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        (self.workdir / "nodes").mkdir(parents=True, exist_ok=True)
        self.poll_seconds = poll_seconds
        self.errors: list[str] = []  # unexpected exceptions in the loop, each once (a test may clear it)
        self._seen_errors: set[str] = set()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._closed = False
        self._api = _Api(kubeconfig)  # the loop's
        self._test_api = _Api(kubeconfig)  # the public methods' (called from the test's thread)
        self._nodes: dict[str, _Node] = {}
        self._containers: dict[str, _Container] = {}  # by pod uid
        self._master_ports: dict[str, int] = {}  # by PyTorchJob uid
        self._job_tracking: dict[str, _JobTracking] = {}  # by Job uid
        from k8s_trainer import TrainerControllers  # here, not at the top: it builds on this module's helpers
        self._trainer = TrainerControllers(self._api.client, self._api.merge_patch)
        self._thread = threading.Thread(target=self._run, name="test-kubelet", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # its processes run in their own sessions: never leave them behind, even unclosed

    def __enter__(self) -> TestKubelet:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ---- public API ----

    def node_dir(self, name: str) -> Path:
        """The node's own directory: the root of its hostPath volumes."""
        path = self.workdir / "nodes" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def add_node(self, name: str, *, labels: dict[str, str] | None = None, allocatable: dict[str, str] | None = None,
                 taints: list[Obj] | None = None) -> None:
        """Create a Ready Node (and its Lease) whose pods this kubelet runs; ``taints`` as a kubelet's
        ``--register-with-taints`` gives them."""
        resources = {**DEFAULT_ALLOCATABLE, **(allocatable or {})}
        now = _now()
        conditions = [{"type": kind, "status": "False", "reason": reason, "message": message, "lastHeartbeatTime": now, "lastTransitionTime": now}
                      for kind, reason, message in (("MemoryPressure", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                                                    ("DiskPressure", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                                                    ("PIDPressure", "KubeletHasSufficientPID", "kubelet has sufficient PID available"))]
        conditions.append({"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status",
                           "lastHeartbeatTime": now, "lastTransitionTime": now})
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                                      "kubernetes.io/arch": _arch(), **(labels or {})}},
                "spec": {"taints": list(taints)} if taints else {},
                "status": {"capacity": resources, "allocatable": dict(resources), "conditions": conditions,
                           "addresses": [{"type": "InternalIP", "address": LOOPBACK}, {"type": "Hostname", "address": name}],
                           "nodeInfo": self._node_info(name)}}
        self.node_dir(name)
        self._test_api.create_lease(self._test_api.create_node(body))
        with self._lock:
            self._nodes[name] = _Node(name, lease_renewed=time.monotonic())

    @staticmethod
    def _node_info(name: str) -> Obj:
        """Every field the client's V1NodeSystemInfo model requires (it refuses a Node that lacks one)."""
        node_id = str(uuid.uuid5(uuid.NAMESPACE_DNS, name))
        return {"architecture": _arch(), "bootID": str(uuid.uuid4()), "containerRuntimeVersion": "emulated://local-processes",
                "kernelVersion": platform.release(), "kubeProxyVersion": "", "kubeletVersion": "v1.32.0-test-kubelet",
                "machineID": node_id.replace("-", ""), "operatingSystem": "linux", "osImage": "the test machine", "systemUUID": node_id}

    def fail_node(self, name: str) -> None:
        """The node loses power: its processes die, its kubelet stops, and the Node goes NotReady (Unknown) at once."""
        with self._lock:
            self._nodes[name].failed = True
            for container in self._containers.values():
                if container.node == name:
                    self._kill(container)
        node = self._test_api.read_node(name)
        now = _now()
        conditions = [{**c, "status": "Unknown", "reason": "NodeStatusUnknown", "message": "Kubelet stopped posting node status.",
                       "lastTransitionTime": now} for c in (node.get("status") or {}).get("conditions") or []]
        taints = [t for t in _spec(node).get("taints") or [] if t.get("key") != UNREACHABLE]
        taints += [{"key": UNREACHABLE, "effect": "NoSchedule"}, {"key": UNREACHABLE, "effect": "NoExecute", "timeAdded": now}]
        self._test_api.merge_patch(f"/api/v1/nodes/{name}", {"spec": {"taints": taints}})
        self._test_api.merge_patch(f"/api/v1/nodes/{name}/status", {"status": {"conditions": conditions}})
        log.info("node %s failed", name)

    def reboot_node(self, name: str) -> str:
        """The machine reboots: its pods' processes die and its kubelet comes back Ready on a new
        ``status.nodeInfo.bootID`` (returned), as a real kubelet reports after a boot."""
        with self._lock:
            for container in self._containers.values():
                if container.node == name:
                    self._kill(container)
        boot = str(uuid.uuid4())
        self._test_api.merge_patch(f"/api/v1/nodes/{name}/status", {"status": {"nodeInfo": {"bootID": boot}}})
        log.info("node %s rebooted: bootID %s", name, boot)
        return boot

    def pid_of(self, namespace: str, pod: str) -> int | None:
        """The pid of the pod's running process (None when it is not running)."""
        with self._lock:
            for container in self._containers.values():
                if (container.namespace, container.pod) == (namespace, pod) and container.running():
                    return container.pid
        return None

    def log_path(self, namespace: str, pod: str) -> Path:
        """The file the pod's container writes stdout and stderr to."""
        with self._lock:
            for container in self._containers.values():
                if (container.namespace, container.pod) == (namespace, pod):
                    return container.log_path
        found = sorted((self.workdir / "logs").glob(f"{namespace}_{pod}_*.log"))
        if not found:
            raise KeyError(f"no log for pod {namespace}/{pod}")
        return found[0]

    def pods_on(self, node: str, namespace: str | None = None) -> list[str]:
        """Names of the pods bound to ``node`` (from the API), sorted."""
        pods = self._test_api.pods(field_selector=f"spec.nodeName={node}")
        return sorted(_meta(p)["name"] for p in pods if namespace is None or _meta(p)["namespace"] == namespace)

    def close(self) -> None:
        """Stop the loop and SIGKILL every process group this kubelet started."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._stop.set()
        self._thread.join(timeout=30)
        with self._lock:
            for container in self._containers.values():
                self._kill(container)
        self._api.close()
        self._test_api.close()

    # ---- the loop ----

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._guard("reconcile", self._reconcile)
            self._stop.wait(self.poll_seconds)

    def _guard(self, what: str, action: Any, *args: Any) -> Any:
        """Run one step; an exception is logged and remembered, and the loop goes on. 404/409 are races, not errors."""
        try:
            return action(*args)
        except ApiException as e:
            if e.status in (404, 409):
                log.info("%s: %s %s (a race; retried next round)", what, e.status, e.reason)
                return None
            self._record(what)
        except Exception:
            self._record(what)
        return None

    def _record(self, what: str) -> None:
        log.exception("test kubelet: %s failed", what)
        text = f"{what}: {traceback.format_exc(limit=-1).strip().splitlines()[-1]}"
        if text not in self._seen_errors:
            self._seen_errors.add(text)
            self.errors.append(text)

    def _reconcile(self) -> None:
        """One round. Pods are listed before their owners, so that a pod whose owner is missing really is orphaned."""
        pods = self._api.pods()
        nodes = self._api.nodes()
        pytorchjobs = self._api.pytorchjobs()
        jobs = self._api.jobs()
        self._reap_gone({_meta(p)["uid"] for p in pods})
        self._collect_garbage(pods, {_meta(o)["uid"] for o in [*pytorchjobs, *jobs]})
        self._guard("TrainJob and JobSet controllers", self._trainer.sync, jobs, self._guard)
        for job in pytorchjobs:
            pods += self._guard(f"PyTorchJob {_meta(job)['namespace']}/{_meta(job)['name']}", self._sync_pytorchjob, job, pods) or []
        for job in jobs:
            pods += self._guard(f"Job {_meta(job)['namespace']}/{_meta(job)['name']}", self._sync_job, job, pods) or []
        self._schedule(pods, nodes)
        for pod in pods:
            node = self._nodes.get(_spec(pod).get("nodeName") or "")
            if node is not None and not node.failed:
                self._guard(f"pod {_meta(pod)['namespace']}/{_meta(pod)['name']}", self._sync_pod, pod)
        self._renew_leases()

    def _renew_leases(self) -> None:
        now = time.monotonic()
        for node in self._nodes.values():
            if not node.failed and now - node.lease_renewed >= LEASE_RENEW_S:
                self._guard(f"lease {node.name}", self._api.renew_lease, node.name)
                node.lease_renewed = now

    def _collect_garbage(self, pods: list[Obj], owner_uids: set[str]) -> None:
        """Delete the pods whose controller (a Job or PyTorchJob) is gone; forget what was kept for gone owners."""
        for pod in pods:
            ref = _controller_ref(pod)
            if ref and (ref.get("apiVersion"), ref.get("kind")) in OWNERS and ref.get("uid") not in owner_uids and not _deleting(pod):
                log.info("garbage-collecting pod %s/%s (owner %s gone)", _meta(pod)["namespace"], _meta(pod)["name"], ref.get("name"))
                self._guard("garbage collection", self._api.delete_pod, pod)
        for uid in [*self._master_ports]:
            if uid not in owner_uids:
                del self._master_ports[uid]
        for uid in [*self._job_tracking]:
            if uid not in owner_uids:
                del self._job_tracking[uid]

    # ---- scheduler ----

    def _schedule(self, pods: list[Obj], nodes: list[Obj]) -> None:
        usage: dict[str, dict[str, float]] = {}
        for pod in pods:
            node = _spec(pod).get("nodeName")
            if node and _phase(pod) not in TERMINAL:
                for resource, amount in _extended_requests(pod).items():
                    usage.setdefault(node, {})[resource] = usage.get(node, {}).get(resource, 0) + amount
        residents: dict[str, list[Obj]] = {}
        for pod in pods:
            if _spec(pod).get("nodeName") and _active(pod):
                residents.setdefault(_spec(pod)["nodeName"], []).append(pod)
        waiting = [p for p in pods if not _spec(p).get("nodeName") and _active(p)]
        waiting.sort(key=lambda p: (_meta(p).get("creationTimestamp") or "", _meta(p)["namespace"], _meta(p)["name"]))
        ordered = sorted(nodes, key=lambda n: _meta(n)["name"])
        for pod in waiting:
            self._guard(f"scheduling {_meta(pod)['namespace']}/{_meta(pod)['name']}", self._schedule_one, pod, ordered, usage,
                        residents)

    def _unfit(self, pod: Obj, node: Obj, usage: dict[str, dict[str, float]], residents: dict[str, list[Obj]]) -> str | None:
        """Why the pod cannot go to the node (in the scheduler's words), or None when it fits."""
        name = _meta(node)["name"]
        managed = self._nodes.get(name)
        if managed is None or managed.failed or not _node_ready(node):
            return "node(s) were not ready"
        tolerations = _spec(pod).get("tolerations") or []
        if _spec(node).get("unschedulable") and not any(_tolerates(t, {"key": UNSCHEDULABLE, "effect": "NoSchedule"}) for t in tolerations):
            return "node(s) were unschedulable"
        for taint in _spec(node).get("taints") or []:
            if taint.get("effect") in ("NoSchedule", "NoExecute") and not any(_tolerates(t, taint) for t in tolerations):
                return f"node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value') or ''}}}"
        if not _node_selected(pod, node):
            return "node(s) didn't match Pod's node affinity/selector"
        if _repelled(pod, residents.get(name, [])):
            return "node(s) didn't match pod anti-affinity rules"
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        for resource, amount in sorted(_extended_requests(pod).items()):
            have = _quantity(allocatable[resource]) if resource in allocatable else 0.0
            if usage.get(name, {}).get(resource, 0) + amount > have:
                return f"Insufficient {resource}"
        return None

    def _schedule_one(self, pod: Obj, nodes: list[Obj], usage: dict[str, dict[str, float]], residents: dict[str, list[Obj]]) -> None:
        reasons: dict[str, int] = {}
        for node in nodes:
            why = self._unfit(pod, node, usage, residents)
            if why is None:
                name = _meta(node)["name"]
                self._api.patch_pod(pod, {"spec": {"nodeName": name}})
                pod.setdefault("spec", {})["nodeName"] = name  # so that its kubelet starts it in this round
                residents.setdefault(name, []).append(pod)
                for resource, amount in _extended_requests(pod).items():
                    usage.setdefault(name, {})[resource] = usage.get(name, {}).get(resource, 0) + amount
                log.info("bound %s/%s to %s", _meta(pod)["namespace"], _meta(pod)["name"], name)
                return
            reasons[why] = reasons.get(why, 0) + 1
        details = ", ".join(f"{count} {why}" for why, count in sorted(reasons.items()))
        message = f"0/{len(nodes)} nodes are available: {details}." if details else "0/0 nodes are available."
        conditions = (pod.get("status") or {}).get("conditions") or []
        updated = _set_condition(conditions, "PodScheduled", "False", "Unschedulable", message)
        if updated is not conditions:
            self._api.patch_pod_status(pod, {"conditions": updated})

    # ---- kubelet ----

    def _reap_gone(self, present: set[str]) -> None:
        """Pods gone from the API: SIGKILL whatever still runs for them and forget them."""
        for uid in [u for u in self._containers if u not in present]:
            container = self._containers.pop(uid)
            if container.running():
                log.info("pod %s/%s is gone: killing pid %s", container.namespace, container.pod, container.pid)
            self._kill(container)

    @staticmethod
    def _kill(container: _Container) -> None:
        process = container.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        _kill_pod_processes(container.uid)

    def _sync_pod(self, pod: Obj) -> None:
        meta = _meta(pod)
        container = self._containers.get(meta["uid"])
        deleting = _deleting(pod)
        if container is None:
            if deleting:
                self._api.delete_pod(pod, 0)  # never ran here: nothing to stop
                return
            if _phase(pod) != "Pending":
                return  # not started by this kubelet
            container = self._admit(pod)
        self._observe_exit(container, deleting)
        if deleting:
            self._stop_for_deletion(container, pod)
            return
        if container.restart_at is not None and time.monotonic() >= container.restart_at:
            self._start(container, pod)
        self._write_status(container, pod)

    def _admit(self, pod: Obj) -> _Container:
        meta, spec = _meta(pod), _spec(pod)
        first = (spec.get("containers") or [{}])[0]
        name = first.get("name") or "main"
        container = _Container(namespace=meta["namespace"], pod=meta["name"], uid=meta["uid"], node=spec["nodeName"], name=name,
                               image=first.get("image") or "", restart_policy=spec.get("restartPolicy") or "Always",
                               log_path=self.workdir / "logs" / f"{meta['namespace']}_{meta['name']}_{name}.log", pod_started_at=_now())
        self._containers[meta["uid"]] = container
        self._start(container, pod)
        return container

    def _start(self, container: _Container, pod: Obj) -> None:
        container.restart_at = None
        spec = (_spec(pod).get("containers") or [{}])[0]
        try:
            argv, env, cwd = self._command(pod, spec, container.node)
        except _ConfigError as e:
            container.state = {"waiting": {"reason": e.reason, "message": str(e)}}
            log.warning("pod %s/%s cannot start: %s", container.namespace, container.pod, e)
            return
        container.log_path.parent.mkdir(parents=True, exist_ok=True)
        container.log_offset = container.log_path.stat().st_size if container.log_path.exists() else 0
        # where this pod's run begins in the (per pod name) file: what the emulator's pods/<name>/log serves
        start = container.log_path.with_name(container.log_path.name + ".start")
        start.with_suffix(".tmp").write_text(json.dumps({"uid": container.uid, "offset": container.log_offset}))
        start.with_suffix(".tmp").replace(start)
        container.run_started_at, container.run_started_mono = _now(), time.monotonic()
        container.term_sent_at = container.kill_at = None
        with open(container.log_path, "ab") as out:
            try:
                container.process = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                                     stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as e:
                out.write(f"test kubelet: cannot start {argv!r}: {e}\n".encode())
                self._finish_run(container, {"exitCode": 128, "reason": "StartError", "message": str(e),
                                             "startedAt": container.run_started_at, "finishedAt": _now()}, deleting=False)
                return
        container.pid = container.process.pid
        container.state = {"running": {"startedAt": container.run_started_at}}
        log.info("started %s/%s on %s: pid %d", container.namespace, container.pod, container.node, container.pid)

    def _command(self, pod: Obj, spec: Obj, node: str) -> tuple[list[str], dict[str, str], Path]:
        """argv, environment and cwd of the container's process, hostPath mounts rewritten into the node's directory."""
        mounts = self._host_mounts(pod, spec, node)
        own = self._container_env(pod, spec, node)
        argv = [_rewrite(_expand(str(a), own), mounts) for a in [*(spec.get("command") or []), *(spec.get("args") or [])]]
        if not argv:
            raise _ConfigError("CreateContainerError", "the test kubelet runs a container's command and args; this container has "
                                                       "none (an image's entrypoint cannot run here)")
        # the image's python is this one (it has torch and unbroken), first on PATH as in a training image
        image_path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        env = {**os.environ, "PATH": image_path, **{k: _rewrite(v, mounts) for k, v in own.items()},
               POD_MARKER: _meta(pod)["uid"]}
        working = spec.get("workingDir")
        cwd = Path(_rewrite(working, mounts)) if working else None
        if cwd is None or not cwd.is_dir():
            cwd = self.node_dir(node)
        return argv, env, cwd

    def _host_mounts(self, pod: Obj, spec: Obj, node: str) -> list[tuple[str, Path]]:
        """(mount path, directory under the node's directory) for each hostPath mount, longest path first; created."""
        volumes = {v.get("name"): v for v in _spec(pod).get("volumes") or []}
        mounts: list[tuple[str, Path]] = []
        for mount in spec.get("volumeMounts") or []:
            host_path = (volumes.get(mount.get("name")) or {}).get("hostPath")
            mount_path = (mount.get("mountPath") or "").rstrip("/")
            if not host_path or not mount_path:
                continue
            host = self.node_dir(node) / str(host_path.get("path") or "").lstrip("/")
            if mount.get("subPath"):
                host = host / mount["subPath"]
            if host_path.get("type") in ("File", "FileOrCreate", "Socket", "CharDevice", "BlockDevice"):
                host.parent.mkdir(parents=True, exist_ok=True)
            else:
                host.mkdir(parents=True, exist_ok=True)
            mounts.append((mount_path, host))
        return sorted(mounts, key=lambda m: len(m[0]), reverse=True)

    def _container_env(self, pod: Obj, spec: Obj, node: str) -> dict[str, str]:
        if spec.get("envFrom"):
            raise _ConfigError("CreateContainerConfigError", "envFrom is not supported by the test kubelet")
        env: dict[str, str] = {}
        for item in spec.get("env") or []:
            if "valueFrom" in item:
                env[item["name"]] = self._field_value(pod, node, item["valueFrom"])
            else:
                env[item["name"]] = _expand(str(item.get("value") or ""), env)
        return env

    @staticmethod
    def _field_value(pod: Obj, node: str, value_from: Obj) -> str:
        path = (value_from.get("fieldRef") or {}).get("fieldPath")
        meta = _meta(pod)
        simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"), "metadata.uid": meta.get("uid"),
                  "spec.nodeName": node, "spec.serviceAccountName": _spec(pod).get("serviceAccountName") or "default",
                  "status.podIP": LOOPBACK, "status.hostIP": LOOPBACK, "status.podIPs": LOOPBACK, "status.hostIPs": LOOPBACK}
        if path in simple:
            return str(simple[path])
        if path and (m := re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)):
            return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
        raise _ConfigError("CreateContainerConfigError", f"the test kubelet does not support this env source: {json.dumps(value_from)}")

    def _observe_exit(self, container: _Container, deleting: bool) -> None:
        process = container.process
        if process is None or process.poll() is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # what the container left behind dies with it, as with a cgroup
        _kill_pod_processes(container.uid)
        container.process = None
        code = _exit_code(process.returncode)
        terminated: Obj = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "startedAt": container.run_started_at,
                           "finishedAt": _now(), "containerID": f"emulated://{container.pid}"}
        if code != 0:
            terminated["message"] = self._log_tail(container)
        if process.returncode < 0:
            terminated["signal"] = -process.returncode
        log.info("pod %s/%s: pid %s exited %d", container.namespace, container.pod, container.pid, code)
        self._finish_run(container, terminated, deleting)

    @staticmethod
    def _log_tail(container: _Container) -> str:
        try:
            with open(container.log_path, "rb") as log_file:
                size = log_file.seek(0, os.SEEK_END)
                log_file.seek(max(container.log_offset, size - LOG_TAIL_BYTES))
                return log_file.read().decode(errors="replace")
        except OSError:
            return ""

    @staticmethod
    def _finish_run(container: _Container, terminated: Obj, deleting: bool) -> None:
        """After a run: done for good (Never, OnFailure + 0, or being deleted), else back off and restart."""
        code = terminated["exitCode"]
        policy = container.restart_policy
        if deleting or policy == "Never" or (policy == "OnFailure" and code == 0):
            container.state, container.done = {"terminated": terminated}, True
            return
        ran = time.monotonic() - container.run_started_mono
        first = container.backoff_s == 0 or ran >= BACKOFF_RESET_S
        container.backoff_s = BACKOFF_FIRST_S if first else min(container.backoff_s * 2, BACKOFF_CAP_S)
        container.restart_count += 1
        container.last_state = {"terminated": terminated}
        container.restart_at = time.monotonic() + container.backoff_s
        container.state = {"waiting": {"reason": "CrashLoopBackOff", "message": f"back-off {container.backoff_s:g}s restarting failed "
                                       f"container={container.name} pod={container.pod}_{container.namespace}({container.uid})"}}

    def _stop_for_deletion(self, container: _Container, pod: Obj) -> None:
        """SIGTERM, SIGKILL after the grace period, then the terminal status and the grace-0 DELETE that confirms."""
        if container.running():
            now = time.monotonic()
            assert container.process is not None
            if container.term_sent_at is None:
                grace = min(int(_meta(pod).get("deletionGracePeriodSeconds") or 0), GRACE_CAP_S)
                container.term_sent_at, container.kill_at = now, now + grace
                log.info("pod %s/%s is being deleted: SIGTERM to pid %s (grace %d s)", container.namespace, container.pod, container.pid, grace)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(container.process.pid, signal.SIGTERM)
            elif container.kill_at is not None and now >= container.kill_at:
                log.info("pod %s/%s: grace period over, SIGKILL to pid %s", container.namespace, container.pod, container.pid)
                container.kill_at = None
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(container.process.pid, signal.SIGKILL)
                _kill_pod_processes(container.uid)
            return
        if container.confirmed:
            return
        container.restart_at = None
        if not container.done:  # stopped while backing off, or never started
            container.done = True
            if "terminated" in container.last_state:
                container.state = container.last_state
        self._write_status(container, pod)
        self._api.delete_pod(pod, 0)
        container.confirmed = True
        log.info("pod %s/%s: deletion confirmed", container.namespace, container.pod)

    def _write_status(self, container: _Container, pod: Obj) -> None:
        status = self._pod_status(container, pod)
        if status != container.written:
            self._api.patch_pod_status(pod, status)
            container.written = status

    @staticmethod
    def _pod_status(container: _Container, pod: Obj) -> Obj:
        ready = "running" in container.state
        exit_code = (container.state.get("terminated") or {}).get("exitCode")
        if container.done:
            phase = "Succeeded" if exit_code == 0 else "Failed"
        elif container.pid is None and container.restart_count == 0:
            phase = "Pending"  # could not start at all
        else:
            phase = "Running"
        if ready:
            reason, message = "", ""
        elif container.done:
            reason, message = "PodCompleted", ""
        else:
            reason, message = "ContainersNotReady", f"containers with unready status: [{container.name}]"
        conditions = ((container.written or pod.get("status") or {}).get("conditions")) or []
        conditions = _set_condition(conditions, "PodScheduled", "True")
        conditions = _set_condition(conditions, "Initialized", "True")
        conditions = _set_condition(conditions, "ContainersReady", str(ready), reason, message)
        conditions = _set_condition(conditions, "Ready", str(ready), reason, message)
        status_of_container = {"name": container.name, "image": container.image, "imageID": "",
                               "containerID": f"emulated://{container.pid}" if container.pid else "", "ready": ready, "started": ready,
                               "restartCount": container.restart_count, "state": container.state, "lastState": container.last_state}
        return {"phase": phase, "hostIP": LOOPBACK, "hostIPs": [{"ip": LOOPBACK}], "podIP": LOOPBACK, "podIPs": [{"ip": LOOPBACK}],
                "startTime": container.pod_started_at, "conditions": conditions, "containerStatuses": [status_of_container]}

    # ---- PyTorchJob controller ----

    @staticmethod
    def _replicas(job: Obj) -> list[_Replica]:
        """The job's pods in rank order: the master first (rank 0), then worker i (rank i+1)."""
        specs = _spec(job).get("pytorchReplicaSpecs") or {}
        replicas: list[_Replica] = []
        for rtype in sorted(specs, key=lambda t: (t.lower() != "master", t.lower())):
            count = specs[rtype].get("replicas")
            for index in range(1 if count is None else int(count)):
                replicas.append(_Replica(rtype, index, len(replicas), f"{_meta(job)['name']}-{rtype.lower()}-{index}", specs[rtype]))
        return replicas

    @staticmethod
    def _replica_statuses(replicas: list[_Replica], owned: dict[str, Obj]) -> Obj:
        """As the operator counts: a Terminating Running pod counts as failed."""
        statuses: Obj = {}
        for replica in replicas:
            counts = statuses.setdefault(replica.rtype, {"active": 0, "succeeded": 0, "failed": 0})
            pod = owned.get(replica.name)
            phase = _phase(pod) if pod else None
            if phase == "Running":
                counts["failed" if _deleting(pod or {}) else "active"] += 1
            elif phase == "Succeeded":
                counts["succeeded"] += 1
            elif phase == "Failed":
                counts["failed"] += 1
        return statuses

    def _sync_pytorchjob(self, job: Obj, pods: list[Obj]) -> list[Obj]:
        meta, spec = _meta(job), _spec(job)
        name = meta["name"]
        status = copy.deepcopy(job.get("status") or {})
        before = copy.deepcopy(status)
        conditions = status.get("conditions") or []
        if not any(c.get("type") == "Created" for c in conditions):
            conditions = _set_job_condition(conditions, "Created", "True", "PyTorchJobCreated", f"PyTorchJob {name} is created.")
        replicas = self._replicas(job)
        owned = {_meta(p)["name"]: p for p in pods if _controller_uid(p) == meta["uid"]}
        run_policy = spec.get("runPolicy") or {}
        status["replicaStatuses"] = self._replica_statuses(replicas, owned)
        created: list[Obj] = []
        if _is_true(conditions, "Succeeded") or _is_true(conditions, "Failed"):
            self._clean_finished_pytorchjob(run_policy.get("cleanPodPolicy") or "None", owned)
        elif run_policy.get("suspend"):
            conditions = self._suspend_pytorchjob(job, owned, conditions)
            status.pop("startTime", None)
            for counts in status["replicaStatuses"].values():
                counts["active"] = 0
        else:
            if _is_true(conditions, "Suspended"):
                conditions = _set_job_condition(conditions, "Suspended", "False", "PyTorchJobResumed", f"PyTorchJob {name} is resumed.")
                status["startTime"] = _now()
            status.setdefault("startTime", _now())
            conditions, created = self._run_pytorchjob(job, replicas, owned, conditions)
            if _is_true(conditions, "Succeeded") or _is_true(conditions, "Failed"):
                status.setdefault("completionTime", _now())
        status["conditions"] = conditions
        if status != before:
            self._api.patch_pytorchjob_status(job, _status_patch(before, status))
        return created

    def _clean_finished_pytorchjob(self, policy: str, owned: dict[str, Obj]) -> None:
        for pod in owned.values():
            if not _deleting(pod) and (policy == "All" or (policy == "Running" and _phase(pod) not in TERMINAL)):
                self._api.delete_pod(pod)

    def _suspend_pytorchjob(self, job: Obj, owned: dict[str, Obj], conditions: list[Obj]) -> list[Obj]:
        for pod in owned.values():
            if not _deleting(pod):
                self._api.delete_pod(pod)
        message = f"PyTorchJob {_meta(job)['name']} is suspended."
        if _is_true(conditions, "Running"):
            conditions = _set_job_condition(conditions, "Running", "False", "PyTorchJobSuspended", message)
        return _set_job_condition(conditions, "Suspended", "True", "PyTorchJobSuspended", message)

    def _run_pytorchjob(self, job: Obj, replicas: list[_Replica], owned: dict[str, Obj],
                        conditions: list[Obj]) -> tuple[list[Obj], list[Obj]]:
        """Judge the pods, then create the missing ones and move the conditions on."""
        name = _meta(job)["name"]
        restarting = False
        for replica in replicas:
            pod = owned.get(replica.name)
            if pod is None or _deleting(pod) or _phase(pod) != "Failed":
                continue
            code = self._exit_code_of(pod)
            if replica.policy == "ExitCode" and code is not None and code >= 128:
                log.info("PyTorchJob %s: pod %s exited %d (retryable): recreating it", name, replica.name, code)
                self._api.delete_pod(pod)
                restarting = True
                continue
            message = f"PyTorchJob {name} is failed because pod {replica.name} ({replica.rtype} replica) failed with exit code {code}."
            return _set_job_condition(conditions, "Failed", "True", "PyTorchJobFailed", message), []
        created = self._create_pytorch_pods(job, replicas, owned)
        for pod_name, pod in owned.items():
            if pod_name not in {r.name for r in replicas} and not _deleting(pod):
                self._api.delete_pod(pod)  # scaled down
        phases = {r.name: _phase(owned[r.name]) if r.name in owned and not _deleting(owned[r.name]) else None for r in replicas}
        deciding = [r for r in replicas if r.rtype.lower() == "master"] or replicas
        if deciding and all(phases[r.name] == "Succeeded" for r in deciding):
            conditions = _set_job_condition(conditions, "Succeeded", "True", "PyTorchJobSucceeded",
                                            f"PyTorchJob {_meta(job)['namespace']}/{name} successfully completed.")
        elif restarting:
            conditions = _set_job_condition(conditions, "Restarting", "True", "PyTorchJobRestarting",
                                            f"PyTorchJob {name} is restarting because a replica failed.")
        elif replicas and all(phases[r.name] == "Running" for r in replicas):
            conditions = _set_job_condition(conditions, "Running", "True", "PyTorchJobRunning",
                                            f"PyTorchJob {_meta(job)['namespace']}/{name} is running.")
        return conditions, created

    @staticmethod
    def _exit_code_of(pod: Obj) -> int | None:
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        chosen = next((s for s in statuses if s.get("name") == "pytorch"), statuses[0] if statuses else None)
        return ((chosen or {}).get("state") or {}).get("terminated", {}).get("exitCode")

    def _create_pytorch_pods(self, job: Obj, replicas: list[_Replica], owned: dict[str, Obj]) -> list[Obj]:
        created = []
        for replica in replicas:
            if replica.name in owned:
                continue
            if replica.rank == 0:
                self._pick_master_port(job, owned)
            body = self._pytorch_pod(job, replica, len(replicas), self._master_port(job, owned))
            created.append(self._api.create_pod(_meta(job)["namespace"], body))
            log.info("PyTorchJob %s: created pod %s", _meta(job)["name"], replica.name)
        return created

    def _pick_master_port(self, job: Obj, owned: dict[str, Obj]) -> None:
        """The port for a new rank-0 pod: the one its live workers were given, if any (they know no other: a
        worker recreated before its master, while the old master pod was still Terminating, has it); else the
        job's previous one if it is free; else a new one."""
        uid = _meta(job)["uid"]
        previous = self._master_ports.get(uid)
        live = {port for pod in owned.values() if not _deleting(pod) and _phase(pod) not in TERMINAL
                and (port := self._port_in(pod)) is not None}
        if live:
            self._master_ports[uid] = min(live)
        else:
            self._master_ports[uid] = previous if previous and _port_free(previous) else _free_port()

    @staticmethod
    def _port_in(pod: Obj) -> int | None:
        for container in _spec(pod).get("containers") or []:
            for item in container.get("env") or []:
                if item.get("name") == "MASTER_PORT" and str(item.get("value", "")).isdigit():
                    return int(item["value"])
        return None

    def _master_port(self, job: Obj, owned: dict[str, Obj]) -> int:
        uid = _meta(job)["uid"]
        if uid not in self._master_ports:  # the rank-0 pod predates this kubelet: read its port
            ports = [port for pod in owned.values() if (port := self._port_in(pod)) is not None]
            self._master_ports[uid] = ports[-1] if ports else _free_port()
        return self._master_ports[uid]

    @staticmethod
    def _pytorch_pod(job: Obj, replica: _Replica, world_size: int, port: int) -> Obj:
        meta = _meta(job)
        template = copy.deepcopy(replica.spec.get("template") or {})
        template_meta, spec = template.get("metadata") or {}, template.get("spec") or {}
        labels = {**(template_meta.get("labels") or {}), "training.kubeflow.org/job-name": meta["name"],
                  "training.kubeflow.org/operator-name": "pytorchjob-controller",
                  "training.kubeflow.org/replica-type": replica.rtype.lower(), "training.kubeflow.org/replica-index": str(replica.index)}
        if replica.rtype.lower() == "master":
            labels["training.kubeflow.org/job-role"] = "master"
        spec["restartPolicy"] = "Never" if replica.policy == "ExitCode" else replica.policy
        nproc = _spec(job).get("nprocPerNode") or (_spec(job).get("elasticPolicy") or {}).get("nProcPerNode")
        nproc = "1" if nproc in (None, "", "auto") else str(nproc)
        values = dict(zip(PYTORCH_ENV, (LOOPBACK, str(port), str(world_size), str(replica.rank), LOOPBACK, str(port), str(world_size),
                                        str(replica.rank), nproc, "1"), strict=True))
        containers = spec.get("containers") or []
        target = next((c for c in containers if c.get("name") == "pytorch"), containers[0] if containers else None)
        if target is not None:
            kept = [e for e in target.get("env") or [] if e.get("name") not in values]
            target["env"] = kept + [{"name": k, "value": v} for k, v in values.items()]
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": replica.name, "namespace": meta["namespace"], "labels": labels,
                             "annotations": dict(template_meta.get("annotations") or {}), "ownerReferences": [_owner_reference(job, "kubeflow.org/v1", "PyTorchJob")]},
                "spec": spec}

    # ---- Job controller ----

    def _sync_job(self, job: Obj, pods: list[Obj]) -> list[Obj]:
        meta, spec = _meta(job), _spec(job)
        policy = _spec(spec.get("template") or {}).get("restartPolicy")
        if policy not in ("Never", "OnFailure"):
            raise ValueError(f"Job {meta['namespace']}/{meta['name']}: spec.template.spec.restartPolicy must be Never or OnFailure, "
                             f"not {policy!r} (a real API server refuses such a Job)")
        status = copy.deepcopy(job.get("status") or {})
        before = copy.deepcopy(status)
        conditions = status.get("conditions") or []
        owned = [p for p in pods if _controller_uid(p) == meta["uid"]]
        tracking = self._job_tracking.setdefault(meta["uid"], _JobTracking())
        self._count_job_pods(tracking, owned)
        active = [p for p in owned if _active(p)]
        created: list[Obj] = []
        if _is_true(conditions, "Complete") or _is_true(conditions, "Failed"):
            self._remove_job_pods(tracking, active)
            active = []
        elif spec.get("suspend"):
            self._remove_job_pods(tracking, active)
            active = []
            conditions = _set_condition(conditions, "Suspended", "True", "JobSuspended", "Job suspended", stamps=("lastProbeTime",))
            status.pop("startTime", None)
            tracking.started = None
        else:
            if _is_true(conditions, "Suspended"):
                conditions = _set_condition(conditions, "Suspended", "False", "JobResumed", "Job resumed", stamps=("lastProbeTime",))
                status.pop("startTime", None)
            if "startTime" not in status:
                status["startTime"], tracking.started = _now(), time.monotonic()
            ending = self._job_ending(job, tracking, active, status["startTime"])
            if ending is not None:
                kind, reason, message = ending
                conditions = _set_condition(conditions, kind, "True", reason, message, stamps=("lastProbeTime",))
                if kind == "Complete":
                    status.setdefault("completionTime", _now())
                self._remove_job_pods(tracking, active)
                active = []
            else:
                created = self._create_job_pods(job, tracking, active)
                active += created
        status.update(active=len(active), ready=sum(1 for p in active if _phase(p) == "Running"),
                      succeeded=len(tracking.succeeded), failed=len(tracking.failed), conditions=conditions)
        if spec.get("completionMode") == "Indexed":
            status["completedIndexes"] = _index_ranges([i for i in tracking.succeeded.values() if i is not None])
        if status != before:
            self._api.patch_job_status(job, _status_patch(before, status))
        return created

    @staticmethod
    def _index_of(pod: Obj) -> int | None:
        value = (_meta(pod).get("annotations") or {}).get(COMPLETION_INDEX)
        return int(value) if value is not None and str(value).isdigit() else None

    def _count_job_pods(self, tracking: _JobTracking, owned: list[Obj]) -> None:
        """Count finished pods once each; a pod deleted before it finished (Terminating, or vanished) counts as failed."""
        present = set()
        for pod in owned:
            uid = _meta(pod)["uid"]
            present.add(uid)
            if uid in tracking.removed or uid in tracking.succeeded or uid in tracking.failed:
                continue
            if _phase(pod) == "Succeeded":
                tracking.succeeded[uid] = self._index_of(pod)
            elif _phase(pod) == "Failed" or _deleting(pod):
                tracking.failed.add(uid)
        for uid in tracking.active - present - tracking.removed - set(tracking.succeeded):
            tracking.failed.add(uid)
        tracking.active = {_meta(p)["uid"] for p in owned if _active(p)}

    def _remove_job_pods(self, tracking: _JobTracking, pods: list[Obj]) -> None:
        for pod in pods:
            tracking.removed.add(_meta(pod)["uid"])
            self._api.delete_pod(pod)

    @staticmethod
    def _job_ending(job: Obj, tracking: _JobTracking, active: list[Obj], start_time: str) -> tuple[str, str, str] | None:
        """(condition, reason, message) when the Job is done -- complete, out of retries or out of time -- else None."""
        spec = _spec(job)
        completions = spec.get("completions")
        completions = 1 if completions is None else int(completions)
        if spec.get("completionMode") == "Indexed":
            complete = set(range(completions)) <= set(tracking.succeeded.values())
        else:
            complete = len(tracking.succeeded) >= completions
        if complete:
            return "Complete", "CompletionsReached", "Reached expected number of succeeded pods"
        backoff_limit = spec.get("backoffLimit")
        backoff_limit = 6 if backoff_limit is None else int(backoff_limit)
        restarts = sum(s.get("restartCount") or 0 for p in active for s in (p.get("status") or {}).get("containerStatuses") or [])
        if len(tracking.failed) + restarts > backoff_limit:
            return "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"
        deadline = spec.get("activeDeadlineSeconds")
        elapsed = time.monotonic() - tracking.started if tracking.started is not None else _seconds_since(start_time)
        if deadline is not None and elapsed >= int(deadline):
            return "Failed", "DeadlineExceeded", "Job was active longer than specified deadline"
        return None

    def _create_job_pods(self, job: Obj, tracking: _JobTracking, active: list[Obj]) -> list[Obj]:
        spec = _spec(job)
        parallelism = 1 if spec.get("parallelism") is None else int(spec["parallelism"])
        completions = 1 if spec.get("completions") is None else int(spec["completions"])
        if spec.get("completionMode") == "Indexed":
            busy = {self._index_of(p) for p in active} | set(tracking.succeeded.values())
            indexes: list[int | None] = [i for i in range(completions) if i not in busy]
            indexes = indexes[: max(0, parallelism - len(active))]
        else:
            indexes = [None] * max(0, min(parallelism, completions - len(tracking.succeeded)) - len(active))
        created = []
        for index in indexes:
            pod = self._api.create_pod(_meta(job)["namespace"], self._job_pod(job, index))
            created.append(pod)
            log.info("Job %s: created pod %s", _meta(job)["name"], _meta(pod)["name"])
        return created

    @staticmethod
    def _job_pod(job: Obj, index: int | None) -> Obj:
        meta = _meta(job)
        template = copy.deepcopy(_spec(job).get("template") or {})
        template_meta, spec = template.get("metadata") or {}, template.get("spec") or {}
        labels = {**(template_meta.get("labels") or {}), "batch.kubernetes.io/controller-uid": meta["uid"],
                  "batch.kubernetes.io/job-name": meta["name"], "controller-uid": meta["uid"], "job-name": meta["name"]}
        annotations = dict(template_meta.get("annotations") or {})
        generate_name = f"{meta['name']}-"
        if index is not None:
            labels[COMPLETION_INDEX] = annotations[COMPLETION_INDEX] = str(index)
            generate_name = f"{meta['name']}-{index}-"
            for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
                container["env"] = [*(container.get("env") or []), {"name": "JOB_COMPLETION_INDEX", "valueFrom": {
                    "fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}}]
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"generateName": generate_name, "namespace": meta["namespace"], "labels": labels, "annotations": annotations,
                             "ownerReferences": [_owner_reference(job, "batch/v1", "Job")]},
                "spec": spec}
