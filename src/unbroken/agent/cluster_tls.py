"""The cluster's TLS credentials on Kubernetes: one Secret, made by the first agent that needs it.

The memory tier's peer API is mutual TLS under a CA of the cluster's own
(checkpoint/credentials.py). On Kubernetes the three files live in the Secret
``unbroken-cluster-tls`` in unbroken's namespace. Agents race to create it: the
first one's CA wins (a create is atomic; the losers read the winner's), so there
is no install step and no operator dependency. Each agent then writes the files
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
from unbroken.errors import NotFoundError, StoreUnavailable
from unbroken.kube import names
from unbroken.kube.api import STRICT, ApiConflict, RequestRefused, call

_FILES = (credentials.CA_FILE, credentials.CERT_FILE, credentials.KEY_FILE)


def ensure(api: kubernetes.client.ApiClient, namespace: str, directory: Path, cluster_name: str) -> Credentials:
    """The cluster's credentials, written into ``directory`` (the Secret is created first if missing)."""
    core = kubernetes.client.CoreV1Api(api)
    data = _read(core, namespace)
    if data is None:
        data = _create(core, namespace, cluster_name)
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
    try:
        secret = call(lambda: core.read_namespaced_secret(names.CLUSTER_TLS_SECRET, namespace))
    except NotFoundError:
        return None
    except RequestRefused as exc:  # 403: the agent's Role lacks it (deploy/base/rbac-agent.yaml)
        raise StoreUnavailable(f"reading Secret {namespace}/{names.CLUSTER_TLS_SECRET}: {exc}") from None
    data = secret.data or {}
    missing = [n for n in _FILES if n not in data]
    if missing:
        raise StoreUnavailable(f"Secret {namespace}/{names.CLUSTER_TLS_SECRET} lacks {', '.join(missing)}: delete it and an "
                               "agent makes a new one (every node's agent must then restart to read it)")
    return dict(data)


def _create(core: kubernetes.client.CoreV1Api, namespace: str, cluster_name: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory(prefix="unbroken-tls-") as scratch:
        credentials.create(Path(scratch), cluster_name)
        data = {n: base64.b64encode((Path(scratch) / n).read_bytes()).decode() for n in _FILES}
    body = {"metadata": {"name": names.CLUSTER_TLS_SECRET, "labels": {"app.kubernetes.io/part-of": names.COMPONENT}},
            "type": "Opaque", "data": data}
    try:
        call(lambda: core.create_namespaced_secret(namespace, body, field_validation=STRICT))
        return data
    except ApiConflict:
        pass
    except RequestRefused as exc:
        raise StoreUnavailable(f"creating Secret {namespace}/{names.CLUSTER_TLS_SECRET}: {exc}") from None
    theirs = _read(core, namespace)  # another agent's create won: use its CA
    if theirs is None:
        raise StoreUnavailable(f"Secret {namespace}/{names.CLUSTER_TLS_SECRET} was created and is gone again")
    return theirs
