"""The cluster's certificate authority on Kubernetes: one Secret, made and read by the operator alone.

The memory tier's peer API is mutual TLS under a CA of the cluster's own
(checkpoint/node/credentials.py). On Kubernetes the CA's certificate and key
live in the Secret ``unbroken-cluster-tls`` in unbroken's namespace, made by the
operator when it first leads (:func:`make`; kubernetes/backend/shared_secret.py:
of two replicas racing, the first create wins). No agent may read it (its Role
has no Secret rights): the operator certifies each node's agent with it
(kubernetes/operator/credential_issuer.py), so every node holds a certificate
and key of its own and nobody but the operator can mint one. The CA's
certificate, which is public, is on the leader Lease, where agents check the
operator's identity by it.

``unbroken ckpt verify`` on a cluster reads the Secret (:func:`fetch`, an
administrator's right, never creating it) and certifies itself for the run, to
dial the nodes' shard servers as a peer would.
"""

from __future__ import annotations

import base64
from pathlib import Path

import kubernetes

from unbroken.checkpoint.node import credentials
from unbroken.checkpoint.node.credentials import Authority, Credentials
from unbroken.errors import NotFoundError
from unbroken.kubernetes.backend import names, shared_secret

CA_KEY_FIELD = "cluster-ca.key"
_FIELDS = (credentials.CA_FILE, CA_KEY_FIELD)
_REMEDY = ("delete it and restart the operator, which makes a new one; then restart every agent (each asks the "
           "operator for its node's credentials when it starts)")


def make(api: kubernetes.client.ApiClient, namespace: str, cluster_name: str) -> Authority:
    """The operator's side: the cluster's CA, its Secret created if there is none yet (an existing one is kept)."""
    data = shared_secret.ensure(kubernetes.client.CoreV1Api(api), namespace, names.CLUSTER_TLS_SECRET, _FIELDS,
                                lambda: _encoded(Authority.new(cluster_name)), remedy=_REMEDY)
    return _decoded(data)


def fetch(api: kubernetes.client.ApiClient, namespace: str, directory: Path) -> Credentials:
    """Credentials for an administrator's command, certified by the cluster's CA, written into ``directory`` (a
    scratch folder); NotFoundError if the operator has not made the CA yet."""
    data = shared_secret.read(kubernetes.client.CoreV1Api(api), namespace, names.CLUSTER_TLS_SECRET, _FIELDS, remedy=_REMEDY)
    if data is None:
        raise NotFoundError(f"Secret {namespace}/{names.CLUSTER_TLS_SECRET} does not exist: the operator has not "
                            "led yet (it makes it), so no node runs the checkpoint memory tier and none holds a copy to verify")
    authority = _decoded(data)
    key_pem, request = credentials.new_request("unbroken ckpt verify")
    return credentials.write(directory, authority.cert_pem, authority.sign(request, "unbroken ckpt verify", "cli.unbroken.invalid"),
                             key_pem)


def _encoded(authority: Authority) -> dict[str, str]:
    return {credentials.CA_FILE: base64.b64encode(authority.cert_pem).decode(),
            CA_KEY_FIELD: base64.b64encode(authority.key_pem).decode()}


def _decoded(data: dict[str, str]) -> Authority:
    return Authority(base64.b64decode(data[credentials.CA_FILE]), base64.b64decode(data[CA_KEY_FIELD]))
