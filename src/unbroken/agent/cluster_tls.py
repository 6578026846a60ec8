"""The cluster's TLS credentials on Kubernetes: one Secret, made by the first agent that needs it.

The memory tier's peer API is mutual TLS under a CA of the cluster's own
(checkpoint/credentials.py). On Kubernetes the three files live in the Secret
``unbroken-cluster-tls`` in unbroken's namespace, made by the first agent that
needs it (backends/kubernetes/shared_secret.py: the first one's CA wins). Each agent then writes the files
into its node's socket folder (``/var/run/unbroken/cluster``), which the training
pods mount already: their ranks present the same certificate to restore from
peers. The CA's key is not kept, as locally: nobody can mint a second certificate.

``unbroken ckpt verify`` on a cluster reads the same Secret (:func:`fetch`), never
creating it, to dial the nodes' shard servers as a peer would.
"""

from __future__ import annotations

import base64
import tempfile
from pathlib import Path

import kubernetes

from unbroken.atomic_file import write_bytes_atomically
from unbroken.checkpoint import credentials
from unbroken.checkpoint.credentials import Credentials
from unbroken.errors import NotFoundError
from unbroken.backends.kubernetes import names, shared_secret

_FILES = (credentials.CA_FILE, credentials.CERT_FILE, credentials.KEY_FILE)
_REMEDY = "delete it and an agent makes a new one (every node's agent must then restart to read it)"


def ensure(api: kubernetes.client.ApiClient, namespace: str, directory: Path, cluster_name: str) -> Credentials:
    """The cluster's credentials, written into ``directory`` (the Secret is created first if missing)."""
    data = shared_secret.ensure(kubernetes.client.CoreV1Api(api), namespace, names.CLUSTER_TLS_SECRET, _FILES,
                                lambda: _make(cluster_name), remedy=_REMEDY)
    return _write(data, directory)


def fetch(api: kubernetes.client.ApiClient, namespace: str, directory: Path) -> Credentials:
    """The cluster's credentials from the Secret, written into ``directory``; NotFoundError if no agent has made them yet."""
    data = _read(kubernetes.client.CoreV1Api(api), namespace)
    if data is None:
        raise NotFoundError(f"Secret {namespace}/{names.CLUSTER_TLS_SECRET} does not exist: no node agent has started the "
                            "checkpoint memory tier yet (it is made by the first one), so no node holds a copy to verify")
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
