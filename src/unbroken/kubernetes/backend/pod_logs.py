"""A job's logs on Kubernetes: its pods' container output, read through the API (``pods/<name>/log``).

Locally the agents write a job's logs into the cluster directory; on Kubernetes
the kubelet keeps them, and only the current pods' (an attempt's restart
recreates the pods, so earlier attempts' output is gone with them unless a log
collector kept it). Each pod's training container (its first) is read once,
whole; a pod not started yet says why instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from unbroken.errors import NotFoundError
from unbroken.kubernetes.backend.api import RequestRefused, call
from unbroken.kubernetes.backend.store import KubernetesStore


@dataclass(frozen=True)
class PodLog:
    pod: str
    text: str | None
    """The container's output; None when the kubelet has none to give (``unavailable`` says why)."""
    unavailable: str = ""


def job_pod_logs(store: KubernetesStore, job: str, *, node: str | None = None) -> list[PodLog]:
    """The logs of ``job``'s pods (only those on ``node``), ordered by pod name."""
    namespace = job.partition("/")[0]
    found = []
    for pod in sorted(store.job_pods(job), key=lambda p: p["metadata"]["name"]):
        spec = pod.get("spec") or {}
        if node is not None and spec.get("nodeName") != node:
            continue
        container = ((spec.get("containers") or [{}])[0]).get("name") or ""
        found.append(_read(store, namespace, pod["metadata"]["name"], container))
    return found


def _read(store: KubernetesStore, namespace: str, pod: str, container: str) -> PodLog:
    try:
        text = call(lambda: store.core.read_namespaced_pod_log(pod, namespace, container=container))
    except RequestRefused as exc:  # 400: the container is waiting to start, or was never created
        return PodLog(pod, None, exc.server_message)
    except NotFoundError:
        return PodLog(pod, None, "the pod was deleted while its log was asked for (the job is restarting)")
    return PodLog(pod, str(text))
