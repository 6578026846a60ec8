"""Every name unbroken writes into a Kubernetes cluster, in one place.

The node label values are HyperPod's (``node-health-status``,
``deep-health-check-status``) under unbroken's own prefix, so selectors and
dashboards written for one read the other with a prefix change.
"""

from __future__ import annotations

import re

PREFIX = "unbroken.dev"

# -- nodes ------------------------------------------------------------------------------------------
NODE_HEALTH_STATUS = f"{PREFIX}/node-health-status"
"""Label: Schedulable | Unschedulable | UnschedulablePendingReboot | UnschedulablePendingReplacement."""
DEEP_HEALTH_CHECK_STATUS = f"{PREFIX}/deep-health-check-status"
"""Label: InProgress | Passed | Failed (absent: never checked)."""
FAULT_TYPES = f"{PREFIX}/fault-types"
"""Label: the current fault's type, label-safe (``NvidiaXID79Error``)."""
FAULT_REASONS = f"{PREFIX}/fault-reasons"
"""Label: the current fault's reason, shortened to a label value."""
FAULT_DETAILS = f"{PREFIX}/fault-details"
"""Annotation: JSON list of the node's recent faults ``[{"time", "type", "message"}]``, newest last."""
NODE_STATE = f"{PREFIX}/node-state"
"""Annotation: the node's full record as unbroken keeps it (JSON, with its own version counter)."""
TAINT_KEY = NODE_HEALTH_STATUS
TAINT_VALUE = "Unschedulable"
TAINT_EFFECT = "NoSchedule"
"""The taint ``unbroken.dev/node-health-status=Unschedulable:NoSchedule`` while a node is not Schedulable."""
CONDITION_TYPE = "UnbrokenHealthy"
"""Node condition for external repair (EKS node auto repair, Cluster API MachineHealthCheck, medik8s)."""
HOSTNAME_LABEL = "kubernetes.io/hostname"
REBOOT_FROM_BOOT = f"{PREFIX}/reboot-from-boot-id"
"""Annotation the operator writes when it asks for a reboot: the node's ``status.nodeInfo.bootID``
then. A different bootID later is the node back from that reboot (it joins again, deep checks
first); with the SelfReboot remediator, the agent on that boot is the one that reboots."""
CORDONED = f"{PREFIX}/cordoned"
"""Annotation: unbroken cordoned this node (a remediation), so unbroken uncordons it when the node
is back; a cordon without it is an administrator's and is left alone."""
SHARD_SERVER = f"{PREFIX}/shard-server"
"""Annotation: where the node agent's shard server (the checkpoint memory tier's peer API) listens, ``host:port``."""

# -- jobs (annotations on a PyTorchJob / TrainJob) ----------------------------------------------------
AUTO_RESUME = f"{PREFIX}/enable-job-auto-resume"
MAX_RETRY = f"{PREFIX}/job-max-retry-count"
HANG_TIMEOUT = f"{PREFIX}/hang-timeout-seconds"
"""Annotation: absent, the operator sets the job's hang timeout from its ranks' step times."""
STRAGGLER_POLICY = f"{PREFIX}/straggler-policy"
"""Annotation: ``report`` (default), ``shadow``, ``replace`` or ``off`` (config.job.StragglerPolicy)."""
STRAGGLER_RESTART_COST = f"{PREFIX}/straggler-restart-cost-seconds"
"""Annotation: what ``replace`` weighs a straggler's cost against (``resilience.straggler_restart_cost``)."""
REQUIRE_DEEP_HEALTH = f"{PREFIX}/require-deep-health-passed"
STARTUP_TIMEOUT = f"{PREFIX}/startup-timeout-seconds"
"""Annotation: ranks that said hello but reported no step this long after their container started are hung."""
SPARE_PODS = f"{PREFIX}/spare-pods"
"""Annotation: how many of the job's pods are spare pods (``unbroken run --spare-pods``): pods that stand by warm and
take a lost pod's place, so a pod lost with its node is not a restart (an elastic job's are its replicas past max)."""
CHECKPOINT_TIERS = f"{PREFIX}/checkpoint-tiers"
"""Annotation: the job's tiered checkpoint policy as JSON (config.checkpoint.TierPolicy), for the node agents."""
JOB_STATE = f"{PREFIX}/job-state"
"""Annotation: the job's record as the operator keeps it (phase, attempt, reason, times, version)."""
JOB_PHASE = f"{PREFIX}/phase"
RESTART_COUNT = f"{PREFIX}/restart-count"
"""Annotation: restarts so far; lives on the annotated object, so recreating its pods never resets it."""
ATTEMPT = f"{PREFIX}/attempt"
"""Annotation on the pod template (so on every pod): which attempt the pod belongs to."""
INVALID_ANNOTATIONS = f"{PREFIX}/invalid-annotations"
"""Annotation the operator writes on a job whose annotations it refused (so it warns once per value)."""

TRAINJOB_DEFAULT_RUNTIME = "torch-distributed"
"""The ClusterTrainingRuntime Kubeflow Trainer ships for torchrun jobs: what a rendered TrainJob names by default."""

# -- the operator's own objects (in its namespace) -------------------------------------------------
CLUSTER_CONFIGMAP = "unbroken-cluster"
LEASE_PREFIX = "unbroken-node-"
"""The agent's heartbeat: Lease ``unbroken-node-<node>``; ranks' progress rides in an annotation."""
LEASE_PROGRESS = f"{PREFIX}/progress"
LEADER_LEASE = "unbroken-operator"
COMPONENT = "unbroken"
CHECKPOINT_JOB = f"{PREFIX}/checkpoint-job"
"""On each checkpoint catalog ConfigMap (kubernetes/backend/catalog.py): label = the job's digest, annotation = its name."""
CLUSTER_TLS_SECRET = "unbroken-cluster-tls"
"""The cluster's certificate authority for the memory tier's peer API (checkpoint/node/credentials.py), made and read by
the operator alone."""
CLUSTER_CA = f"{PREFIX}/cluster-ca"
"""On the leader Lease: the cluster CA's certificate (PEM), by which agents check the operator that certifies them."""
AGENT_ACCOUNT = "unbroken-agent"
"""The agents' ServiceAccount (deploy/base/serviceaccounts.yaml): the operator certifies its tokens' nodes only."""
NODE_NAME_CLAIM = "authentication.kubernetes.io/node-name"
"""What a node- or pod-bound ServiceAccount token says of its node (TokenReview's ``user.extra``)."""

_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def label_value(text: str | None) -> str:
    """``text`` as a valid label value: at most 63 characters of ``[A-Za-z0-9._-]``,
    starting and ending alphanumeric (``"heartbeat lost: 4.2 s"`` → ``heartbeat_lost_4.2_s``)."""
    if not text:
        return ""
    value = _LABEL_UNSAFE.sub("_", text)[:63]
    return value.strip("._-")
