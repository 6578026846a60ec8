"""What a training pod carries so that its ranks report progress to their node's agent.

The node agent (the DaemonSet) listens on ``/var/run/unbroken/agent.sock`` on
the host. A pod that mounts that directory and says who its ranks are gets
hang detection: each rank's ``ctx.progress(step)`` reaches the agent, the agent
puts it in its Lease, and the operator restarts the job when no rank of it made
progress for ``unbroken.dev/hang-timeout-seconds``. Without it a job still gets
crash and node-fault handling; only hangs go unseen.

Who the ranks are comes from the downward API, so one template serves every
attempt: the job is ``<namespace>/<workload name label>``, the attempt is the
pod template's ``unbroken.dev/attempt`` annotation (written by the operator at
each restart; empty, read as 0, before the first). ``with_rank_env`` adds all
of it to a pod template (``unbroken k8s render`` does; a hand-written job can
copy the same lines).
"""

from __future__ import annotations

import copy
from typing import Any

from unbroken import launch_env
from unbroken.kube import names

AGENT_DIR = "/var/run/unbroken"
"""The agent's socket directory on every node (deploy/base/agent.yaml mounts the same hostPath)."""
VOLUME = "unbroken-agent"
_NAMESPACE = "UNBROKEN_POD_NAMESPACE"
_WORKLOAD = "UNBROKEN_WORKLOAD_NAME"


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def rank_env(job_name_label: str) -> list[dict[str, Any]]:
    """The env entries, in order (``$(VAR)`` references need the variables they name defined before them)."""
    return [
        _field(_NAMESPACE, "metadata.namespace"),
        _field(_WORKLOAD, f"metadata.labels['{job_name_label}']"),
        {"name": launch_env.JOB, "value": f"$({_NAMESPACE})/$({_WORKLOAD})"},
        _field(launch_env.ATTEMPT, f"metadata.annotations['{names.ATTEMPT}']"),
        _field(launch_env.NODE, "spec.nodeName"),
        {"name": launch_env.AGENT_SOCKET, "value": f"{AGENT_DIR}/agent.sock"},
    ]


def with_rank_env(template: dict[str, Any], job_name_label: str) -> dict[str, Any]:
    """A copy of the pod ``template`` whose containers report to the node agent: the env (replacing
    entries of the same names), the agent's socket directory (hostPath) mounted in each."""
    out = copy.deepcopy(template)
    spec = out.setdefault("spec", {})
    ours = rank_env(job_name_label)
    our_names = {e["name"] for e in ours}
    for container in spec.get("containers") or []:
        container["env"] = [e for e in container.get("env") or [] if e.get("name") not in our_names] + ours
        mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != VOLUME]
        container["volumeMounts"] = [*mounts, {"name": VOLUME, "mountPath": AGENT_DIR}]
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") != VOLUME]
    spec["volumes"] = [*volumes, {"name": VOLUME, "hostPath": {"path": AGENT_DIR, "type": "DirectoryOrCreate"}}]
    return out
