"""The cluster's TLS credentials on Kubernetes: one Secret, made by the operator.

The memory tier's peer API is mutual TLS under a CA of the cluster's own
(checkpoint/node/credentials.py). On Kubernetes the three files live in the Secret
``unbroken-cluster-tls`` in unbroken's namespace, made by the operator when it
first leads (:func:`make`; kubernetes/backend/shared_secret.py: of two
replicas racing, the first create wins). An agent may only read it (its Role,
and deploy/admission/agent-policy.yaml, refuse it any Secret write): it waits for
the Secret (:func:`wait`), then writes the files into its node's socket folder
(``/var/run/unbroken/cluster``), which the training pods mount already: their
ranks present the same certificate to restore from peers. The CA's key is not
kept, as locally: nobody can mint a second certificate.

``unbroken ckpt verify`` on a cluster reads the same Secret (:func:`fetch`), never
creating it, to dial the nodes' shard servers as a peer would.
"""

from __future__ import annotations

import base64
import tempfile
import threading
from pathlib import Path

import kubernetes

from unbroken.plumbing.atomic_file import write_bytes_atomically
from unbroken.checkpoint.node import credentials
from unbroken.checkpoint.node.credentials import Credentials
from unbroken.errors import NotFoundError
from unbroken.kubernetes.backend import names, shared_secret

_FILES = (credentials.CA_FILE, credentials.CERT_FILE, credentials.KEY_FILE)
_REMEDY = "delete it and the operator makes a new one (every node's agent must then restart to read it)"


def make(api: kubernetes.client.ApiClient, namespace: str, cluster_name: str) -> None:
    """The operator's side: the Secret, created if there is none yet (an existing one is kept)."""
    shared_secret.ensure(kubernetes.client.CoreV1Api(api), namespace, names.CLUSTER_TLS_SECRET, _FILES,
                         lambda: _make(cluster_name), remedy=_REMEDY)


def wait(api: kubernetes.client.ApiClient, namespace: str, directory: Path, stopping: threading.Event) -> Credentials | None:
    """The agent's side: the cluster's credentials written into ``directory``, once the operator has made the Secret
    (polled: shared_secret.wait); None if ``stopping`` is set first."""
    core = kubernetes.client.CoreV1Api(api)
    return shared_secret.wait(lambda: _read(core, namespace), stopping, f"Secret {namespace}/{names.CLUSTER_TLS_SECRET}",
                              lambda data: _write(data, directory))


def fetch(api: kubernetes.client.ApiClient, namespace: str, directory: Path) -> Credentials:
    """The cluster's credentials from the Secret, written into ``directory``; NotFoundError if no agent has made them yet."""
    data = _read(kubernetes.client.CoreV1Api(api), namespace)
    if data is None:
        raise NotFoundError(f"Secret {namespace}/{names.CLUSTER_TLS_SECRET} does not exist: the operator has not "
                            "led yet (it makes it), so no node runs the checkpoint memory tier and none holds a copy to verify")
    return _write(data, directory)


def _write(data: dict[str, str], directory: Path) -> Credentials:
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    for name in _FILES:
        write_bytes_atomically(directory / name, base64.b64decode(data[name]), mode=0o600 if name.endswith(".key") else 0o644)
    return credentials.load(directory)


def _read(core: kubernetes.client.CoreV1Api, namespace: str) -> dict[str, str] | None:
    return shared_secret.read(core, namespace, names.CLUSTER_TLS_SECRET, _FILES, remedy=_REMEDY)


def _make(cluster_name: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory(prefix="unbroken-tls-") as scratch:
        credentials.create(Path(scratch), cluster_name)
        return {n: base64.b64encode((Path(scratch) / n).read_bytes()).decode() for n in _FILES}
