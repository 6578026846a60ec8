"""Deep health checks on join, as batch/v1 Jobs pinned to the joining node.

Which nodes are joining: a Node that registered with the startup taint
``unbroken.dev/node-health-status=Unschedulable:NoSchedule`` (kubelet
``--register-with-taints``, an EKS node group taint, Karpenter ``startupTaints``)
and that unbroken has not recorded yet reads as ``Joining``
(``KubernetesStore``), and so does a node coming back from a reboot. Nodes that
were there before unbroken was installed are adopted as they are: checking them
would taint nodes that run jobs.

For a joining node this runs its instance group's ``OnStartDeepHealthChecks``
one suite at a time, each as a Job in the operator's namespace:

* pinned to the node (required node affinity on ``metadata.name``), tolerating
  the unbroken taint, ``backoffLimit: 0``, ``activeDeadlineSeconds`` = the
  suite's check timeouts + ``Kubernetes.DeepCheckStartSeconds``;
* its pod runs ``python -m unbroken.health.pod`` (``unbroken.health.pod``) with
  the suite and the check context in its environment, needs no API access, and
  leaves its verdict in its termination message.

The node goes ``InProgress`` when the first Job is created, ``Passed`` when
every suite's Job completed (the node reconciler then admits it and the taint
goes), ``Failed`` with the failing checks as the fault when one did not (the
node reconciler takes it out and the remediator acts). Each step is an Event on
the node.

The group of a node: the group named by its label ``unbroken.dev/instance-group``,
else the first whose ``InstanceType`` is the node's ``node.kubernetes.io/instance-type``.
A joining node in no group has nothing to run and passes at once (said in the event).

``InstanceConnectivity`` runs the collective sweep across the joining node and
up to ``join.MAX_PEERS`` idle peers (Schedulable, deep check Passed, no training
pod of a job unbroken manages: a busy peer's GPUs are taken, its pod would not
schedule) as one Indexed Job: a pod per node (required node affinity on the
set, required pod anti-affinity on the hostname), in the host's network
(``hostNetwork``: the nodes' own links are what is measured, not an overlay's),
ranks laid out node by node with rank 0 on the joining node, which listens on
``Kubernetes.ConnectivityPort`` at its InternalIP. Each pod starts its own node's
ranks; the joining node's pod judges and leaves the verdict. With no idle peer
the node sweeps alone (two ranks, or one per GPU), in a plain Job as the other
suites. A peer the sweep names as the slow one is taken out (``FaultyInstance``),
and the joining node passes, as on the local backend.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes

from unbroken.config.cluster import ClusterConfig, InstanceGroup
from unbroken.errors import NotFoundError
from unbroken.health import catalogue, events, join
from unbroken.health.context import CheckContext, Peer
from unbroken.health.pod import CONTEXT_ENV, DIR_ENV, SUITE_ENV, SWEEP_CHECK, parse_verdict
from unbroken.health.result import FaultAction, Suite
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.api import STRICT, call
from unbroken.state.phases import DeepHealthStatus, NodeState
from unbroken.state.records import EventType, Node
from unbroken.state.store import ClusterStore, StaleUpdate
from unbroken.state.updates import NodeUpdate

log = logging.getLogger("unbroken.kubernetes.operator.deep_checks")

COMPONENT_LABEL = "app.kubernetes.io/component"
COMPONENT = "deep-check"
NODE_ANNOTATION = f"{names.PREFIX}/check-node"
SUITE_ANNOTATION = f"{names.PREFIX}/check-suite"
SWEEP_LABEL = f"{names.PREFIX}/sweep"
"""On the pods of a cross-node sweep: their anti-affinity keeps one per node."""
SCRATCH = "/var/lib/unbroken/deep-check"
"""On the node (hostPath): where stress and storage checks write. Checking the node's own disk is the point."""
FAILED_FAULT = "DeepHealthCheckFailed"
TTL_SECONDS = 86400
"""Finished Jobs (and their pods' logs) are kept a day for people to read, then collected."""
_SHORT = {Suite.INSTANCE_STRESS: "stress", Suite.INSTANCE_CONNECTIVITY: "connectivity"}


def group_of(cluster: ClusterConfig, node: Node) -> InstanceGroup | None:
    return cluster.group_matching(node.group, node.instance_type)


def job_name(node: Node, suite: Suite) -> str:
    """Unique per node incarnation and round: a node re-created under the same name, or back from a
    reboot, gets fresh Jobs instead of an old verdict. At most 63 characters (the job-name label)."""
    digest = hashlib.sha256(f"{node.name}/{node.registered_at}/{node.reboots}".encode()).hexdigest()[:8]
    prefix = f"unbroken-check-{_SHORT[suite]}-"
    room = 63 - len(prefix) - len(digest) - 1
    return f"{prefix}{node.name[:room].rstrip('.-')}-{digest}".lower()


def job_manifest(namespace: str, cluster: ClusterConfig, group: InstanceGroup, node: Node, suite: Suite, name: str,
                 peers: tuple[Peer, ...] = ()) -> dict[str, Any]:
    """The Job that runs ``suite`` on ``node`` (module docstring); with ``peers`` (InstanceConnectivity
    only) the Indexed Job across ``node`` and them. The group's InstanceType picks the health profile
    (its thresholds), as on a local cluster. Needs no API connection."""
    settings = cluster.Kubernetes
    profile = cluster.profile(group.InstanceType)
    across = (Peer(node.name, node.address), *peers) if peers and suite is Suite.INSTANCE_CONNECTIVITY else ()
    context = CheckContext(node=node.name, instance_type=group.InstanceType, profile=profile, settings=cluster.Health,
                           node_dir=Path(SCRATCH), storage_dir=Path(SCRATCH) / "storage", peers=across,
                           params={"port": settings.ConnectivityPort} if across else {})
    checks = catalogue.for_suite(suite, cluster.Health)
    deadline = int(sum(catalogue.timeout_for(c, cluster.Health) for c in checks) + settings.DeepCheckStartSeconds)
    labels = {"app.kubernetes.io/name": names.COMPONENT, COMPONENT_LABEL: COMPONENT,
              "app.kubernetes.io/managed-by": "unbroken-operator"}
    annotations = {NODE_ANNOTATION: node.name, SUITE_ANNOTATION: suite.value}
    container: dict[str, Any] = {
        "name": "check",
        "image": settings.DeepCheckImage,
        "command": list(settings.DeepCheckCommand),
        "env": [
            {"name": SUITE_ENV, "value": suite.value},
            {"name": CONTEXT_ENV, "value": context.to_json()},
            {"name": DIR_ENV, "value": SCRATCH},
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        "volumeMounts": [{"name": "scratch", "mountPath": SCRATCH}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if profile.Accelerator == "gpu" and profile.GpuCount:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(profile.GpuCount)}}
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,  # the pod reports through its termination message only
        # One term per node, ORed: the API server refuses a metadata.name field selector with several values.
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [name]}]}
            for name in [p.name for p in across] or [node.name]]}}},
        "tolerations": [{"key": names.TAINT_KEY, "operator": "Exists", "effect": names.TAINT_EFFECT}],
        "containers": [container],
        "volumes": [{"name": "scratch", "hostPath": {"path": SCRATCH, "type": "DirectoryOrCreate"}}],
    }
    spec: dict[str, Any] = {"backoffLimit": 0, "activeDeadlineSeconds": deadline, "ttlSecondsAfterFinished": TTL_SECONDS}
    if across:
        pod.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
        pod["affinity"]["podAntiAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {SWEEP_LABEL: name}}, "topologyKey": "kubernetes.io/hostname"}]}
        labels = {**labels, SWEEP_LABEL: name}
        spec.update(completionMode="Indexed", completions=len(across), parallelism=len(across))
    spec["template"] = {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations}, "spec": spec}


@dataclass(frozen=True)
class SuiteJob:
    """What became of one suite's Job."""

    name: str
    done: bool
    passed: bool
    reason: str = ""
    fault_type: str | None = None
    blamed: tuple[str, ...] = ()
    """Peers a cross-node sweep named as the slow nodes (the joining node passed)."""


class DeepCheckJobs:
    """Runs joining nodes' deep checks as Jobs in ``namespace`` and writes the verdicts through ``store``."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str, store: ClusterStore,
                 busy: Callable[[], set[str]] = set) -> None:
        """``busy``: the nodes running a training pod now (never asked to lend ranks to a sweep)."""
        self.namespace = namespace
        self.store = store
        self.busy = busy
        self.batch = kubernetes.client.BatchV1Api(api)
        self.core = kubernetes.client.CoreV1Api(api)

    def reconcile(self, cluster: ClusterConfig) -> None:
        joining = [n for n in self.store.list_nodes()
                   if n.state is NodeState.JOINING and n.deep_health in (DeepHealthStatus.NOT_RUN, DeepHealthStatus.IN_PROGRESS)]
        if not joining:
            return
        jobs = self._jobs()
        for node in joining:
            try:
                self._advance(cluster, node, jobs)
            except (StaleUpdate, NotFoundError) as exc:
                log.info("node changed under the deep-check pass; next pass: %s", exc, extra={"node": node.name})

    def _advance(self, cluster: ClusterConfig, node: Node, jobs: dict[str, dict[str, Any]]) -> None:
        group = group_of(cluster, node)
        if group is None:
            self._verdict(node, True, f"no instance group for this node (label {names.PREFIX}/instance-group, or "
                                      f"InstanceType {node.instance_type}): nothing to run")
            return
        suites = [Suite(s.value) for s in group.OnStartDeepHealthChecks]
        if not suites:
            self._verdict(node, True, f"instance group {group.InstanceGroupName} has no OnStartDeepHealthChecks")
            return
        if node.deep_health is DeepHealthStatus.NOT_RUN:
            node = self.store.update_node(node.name, NodeUpdate(deep_health=DeepHealthStatus.IN_PROGRESS),
                                          expect_version=node.version)
        passed: list[str] = []
        for suite in suites:
            name = job_name(node, suite)
            job = jobs.get(name)
            if job is None:
                self._start(cluster, group, node, suite, name)
                return
            outcome = self._outcome(job)
            if not outcome.done:
                return
            if not outcome.passed:
                self._verdict(node, False, f"{suite.value}: {outcome.reason}", outcome.fault_type or FAILED_FAULT)
                return
            self._take_out_blamed(node, suite, name, outcome.blamed)
            passed.append(f"{suite.value} ({self.namespace}/{name})")
        self._verdict(node, True, "passed " + ", ".join(passed))

    # -- starting ---------------------------------------------------------------------------

    def _start(self, cluster: ClusterConfig, group: InstanceGroup, node: Node, suite: Suite, name: str) -> None:
        peers = self._sweep_peers(node) if suite is Suite.INSTANCE_CONNECTIVITY else ()
        body = job_manifest(self.namespace, cluster, group, node, suite, name, peers)
        call(lambda: self.batch.create_namespaced_job(self.namespace, body, field_validation=STRICT))
        deadline = body["spec"]["activeDeadlineSeconds"]
        where = (f"Indexed Job {self.namespace}/{name} across {node.name} (rank 0), {', '.join(p.name for p in peers)}"
                 if peers else f"Job {self.namespace}/{name} pinned to {node.name}")
        self.store.add_event("Node", node.name, "DeepHealthCheckStarted", f"{suite.value}: {where} (deadline {deadline} s)")
        log.info("deep check started", extra={"node": node.name, "suite": suite.value, "job_name": name})

    def _sweep_peers(self, node: Node) -> tuple[Peer, ...]:
        busy = self.busy()
        ready = [n for n in self.store.list_nodes() if n.name != node.name and n.state is NodeState.SCHEDULABLE
                 and n.deep_health is DeepHealthStatus.PASSED and n.name not in busy]
        return tuple(Peer(n.name, n.address) for n in sorted(ready, key=lambda n: n.name)[:join.MAX_PEERS])

    # -- reading ----------------------------------------------------------------------------

    def _jobs(self) -> dict[str, dict[str, Any]]:
        response = call(lambda: self.batch.list_namespaced_job(self.namespace, label_selector=f"{COMPONENT_LABEL}={COMPONENT}",
                                                                _preload_content=False))
        items = json.loads(response.data)["items"]
        return {j["metadata"]["name"]: j for j in items if (j["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == COMPONENT}

    def _outcome(self, job: dict[str, Any]) -> SuiteJob:
        name = job["metadata"]["name"]
        conditions = {c.get("type"): c for c in (job.get("status") or {}).get("conditions") or [] if c.get("status") == "True"}
        node = (job["metadata"].get("annotations") or {}).get(NODE_ANNOTATION, "")
        if "Complete" in conditions:
            # only a sweep across nodes can blame a peer: other suites' pods are not read again on every pass
            across = SWEEP_LABEL in (job["metadata"].get("labels") or {})
            blamed = tuple((self._pod_verdict(name, node) or {}).get("blamed") or ()) if across else ()
            return SuiteJob(name, done=True, passed=True, blamed=blamed)
        failed = conditions.get("Failed")
        if failed is None:
            return SuiteJob(name, done=False, passed=False)
        verdict = self._pod_verdict(name, node)
        if verdict is not None and not verdict.get("passed"):
            return SuiteJob(name, True, False, str(verdict.get("reason") or "failed"), verdict.get("fault_type"))
        why = f"{failed.get('reason') or 'Failed'}: {failed.get('message') or 'the check pod did not finish'}"
        return SuiteJob(name, True, False, f"Job {self.namespace}/{name} failed: {why}")

    def _pod_verdict(self, job: str, node: str) -> dict[str, Any] | None:
        """The verdict the last pod of ``job`` on ``node`` left in its termination message (or log tail):
        a sweep's peers' pods leave theirs too, but only the joining node's pod judges."""
        response = call(lambda: self.core.list_namespaced_pod(self.namespace, label_selector=f"job-name={job}",
                                                              _preload_content=False))
        pods = [p for p in json.loads(response.data)["items"] if (p["metadata"].get("labels") or {}).get("job-name") == job
                and (p.get("spec") or {}).get("nodeName") in (node, None)]
        pods.sort(key=lambda p: p["metadata"].get("creationTimestamp") or "")
        for pod in reversed(pods):
            for status in (pod.get("status") or {}).get("containerStatuses") or []:
                terminated = (status.get("state") or {}).get("terminated") or {}
                found = parse_verdict(terminated.get("message") or "")
                if found is not None:
                    return found
        return None

    # -- deciding ---------------------------------------------------------------------------

    def _take_out_blamed(self, node: Node, suite: Suite, job: str, blamed: tuple[str, ...]) -> None:
        """The peers the sweep named slow (and not the joining node) leave service, as on the local backend."""
        for peer in blamed:
            if self.store.get_node(peer).state is not NodeState.SCHEDULABLE:
                continue  # out already: the Job is read again on every pass until the node's verdict
            reason = f"{suite.value} of {node.name} (Job {self.namespace}/{job}) named {peer} the slow node of the sweep"
            events.apply_fault(self.store, lambda _: (), peer, FaultAction.REPLACE, reason, source=SWEEP_CHECK)

    def _verdict(self, node: Node, passed: bool, reason: str, fault_type: str | None = None) -> None:
        if passed:
            update = NodeUpdate(deep_health=DeepHealthStatus.PASSED)
        else:
            update = NodeUpdate(deep_health=DeepHealthStatus.FAILED, fault_type=fault_type, fault_reason=reason)
        self.store.update_node(node.name, update, expect_version=node.version)
        status = DeepHealthStatus.PASSED if passed else DeepHealthStatus.FAILED
        self.store.add_event("Node", node.name, f"JoinChecks{status.value}", reason,
                             type=EventType.NORMAL if passed else EventType.WARNING)
        log.info("join checks %s: %s", status.value, reason, extra={"node": node.name})

