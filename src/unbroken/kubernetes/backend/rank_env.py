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
copy the same lines); a TrainJob carries the same pieces in ``trainer.env`` and
a runtime patch (``render.render_trainjob``).
"""

from __future__ import annotations

import copy
from typing import Any

from unbroken.rank import env as launch_env
from unbroken.kubernetes.backend import names

AGENT_DIR = "/var/run/unbroken"
"""The agent's socket directory on every node (deploy/base/agent.yaml mounts the same hostPath)."""
VOLUME = "unbroken-agent"
CLUSTER_FOLDER = "cluster"
"""Under ``AGENT_DIR``: the cluster's TLS files, written there by the agent (the ranks' ``UNBROKEN_CLUSTER_DIR``)."""
SHM_DIR = "/dev/shm/unbroken"
"""The memory tier on every node (the agent mounts the same hostPath): shards outlive the pods."""
SHM_VOLUME = "unbroken-shm"
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


def memory_tier_env(tiers_json: str) -> list[dict[str, Any]]:
    """What a rank needs for the tiered checkpoint: the policy, the cluster's TLS folder, the memory tier's base."""
    return [
        {"name": launch_env.CHECKPOINT_TIERS, "value": tiers_json},
        {"name": launch_env.CLUSTER_DIR, "value": f"{AGENT_DIR}/{CLUSTER_FOLDER}"},
        {"name": launch_env.SHM_BASE, "value": SHM_DIR},
    ]


def all_env(job_name_label: str, *, tiers_json: str | None = None) -> list[dict[str, Any]]:
    """Every env entry a rank needs: its identity and the agent's socket; with ``tiers_json`` the tiered checkpoint's."""
    return rank_env(job_name_label) + (memory_tier_env(tiers_json) if tiers_json is not None else [])


def host_paths(*, memory_tier: bool) -> dict[str, str]:
    """Volume name -> the node's directory a rank's container mounts at the same path."""
    return {VOLUME: AGENT_DIR, **({SHM_VOLUME: SHM_DIR} if memory_tier else {})}


def volume_mounts(paths: dict[str, str]) -> list[dict[str, Any]]:
    return [{"name": name, "mountPath": path} for name, path in paths.items()]


def volumes(paths: dict[str, str]) -> list[dict[str, Any]]:
    return [{"name": name, "hostPath": {"path": path, "type": "DirectoryOrCreate"}} for name, path in paths.items()]


def with_rank_env(template: dict[str, Any], job_name_label: str, *, tiers_json: str | None = None) -> dict[str, Any]:
    """A copy of the pod ``template`` whose containers report to the node agent: the env (replacing
    entries of the same names), the agent's socket directory (hostPath) mounted in each; with
    ``tiers_json`` (a TierPolicy) also the tiered checkpoint's env and the node's memory tier."""
    out = copy.deepcopy(template)
    spec = out.setdefault("spec", {})
    ours = all_env(job_name_label, tiers_json=tiers_json)
    our_names = {e["name"] for e in ours}
    paths = host_paths(memory_tier=tiers_json is not None)
    for container in spec.get("containers") or []:
        container["env"] = [e for e in container.get("env") or [] if e.get("name") not in our_names] + ours
        mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") not in paths]
        container["volumeMounts"] = [*mounts, *volume_mounts(paths)]
    kept = [v for v in spec.get("volumes") or [] if v.get("name") not in paths]
    spec["volumes"] = [*kept, *volumes(paths)]
    return out
