"""Kubernetes objects the unit tests create on their module's real API server (no controller acts on them)."""

from __future__ import annotations

import uuid

import kubernetes


def make_job(api: kubernetes.client.ApiClient, namespace: str, job_annotations: dict[str, str] | None) -> str:
    """A PyTorchJob (Master + 2 Workers, 2 processes a pod) with ``job_annotations``; its name. No training-operator
    runs beside these tests: a test that needs pods makes them itself."""
    name = f"train-{uuid.uuid4().hex[:6]}"
    replica = {"replicas": 1, "restartPolicy": "OnFailure",
               "template": {"spec": {"containers": [{"name": "pytorch", "image": "img", "command": ["python", "train.py"]}]}}}
    kubernetes.client.CustomObjectsApi(api).create_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": name, "annotations": job_annotations or {}},
        "spec": {"nprocPerNode": "2", "pytorchReplicaSpecs": {"Master": replica, "Worker": {**replica, "replicas": 2}}},
    })
    return name
