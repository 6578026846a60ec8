"""A job's logs on Kubernetes: its pods' container output, read through the API (``pods/<name>/log``).

Locally the agents write a job's logs into the cluster directory; on Kubernetes
the kubelet keeps them, and only the current pods' (an attempt's restart
recreates the pods, so earlier attempts' output is gone with them unless a log
collector kept it). Each pod's training container is read once, whole or its
last ``tail`` lines; a pod not started yet says why instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubernetes.client import ApiException

from unbroken.errors import NotFoundError
from unbroken.kube import names
from unbroken.kube.api import call
from unbroken.kube.store import KubernetesStore


@dataclass(frozen=True)
class PodLog:
    pod: str
    node: str | None
    attempt: int | None
    """The attempt the pod belongs to (its template's ``unbroken.dev/attempt``), None if unmarked."""
    container: str
    text: str | None
    """The container's output; None when the kubelet has none to give (``unavailable`` says why)."""
    unavailable: str = ""


def job_pod_logs(store: KubernetesStore, job: str, *, node: str | None = None, tail: int | None = None) -> list[PodLog]:
    """The logs of ``job``'s pods (only those on ``node``), ordered by pod name."""
    namespace, _, short = job.partition("/")
    kind = store.kind_of(job)
    pods: list[dict[str, Any]] = store._json(store.core.list_namespaced_pod, namespace, label_selector=kind.pod_selector(short))["items"]
    found = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        meta, spec = pod["metadata"], pod.get("spec") or {}
        if node is not None and spec.get("nodeName") != node:
            continue
        container = ((spec.get("containers") or [{}])[0]).get("name") or ""
        attempt = (meta.get("annotations") or {}).get(names.ATTEMPT)
        text, unavailable = _read(store, namespace, meta["name"], container, tail)
        found.append(PodLog(meta["name"], spec.get("nodeName"), int(attempt) if attempt is not None else None, container,
                            text, unavailable))
    return found


def _read(store: KubernetesStore, namespace: str, pod: str, container: str, tail: int | None) -> tuple[str | None, str]:
    try:
        text = call(lambda: store.core.read_namespaced_pod_log(pod, namespace, container=container, tail_lines=tail))
    except ApiException as exc:  # 400: the container is waiting to start, or was never created
        return None, _message(exc)
    except NotFoundError:
        return None, "the pod was deleted while its log was asked for (the job is restarting)"
    return str(text), ""


def _message(exc: ApiException) -> str:
    try:
        message = json.loads(exc.body or "{}").get("message")
    except ValueError:
        message = None
    return str(message or f"{exc.status} {exc.reason}")
