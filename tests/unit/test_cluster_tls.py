"""The cluster's certificate authority on Kubernetes (kubernetes/backend/cluster_tls.py): one Secret, made and read by
the operator alone; ``ckpt verify`` certifies itself from it.

Real: kube-apiserver and etcd (tests/controlplane); real threads race to create the Secret, real certificates are made
and loaded into real TLS contexts that shake hands over a real socket.
"""

from __future__ import annotations

import stat
from pathlib import Path

import kubernetes
import pytest

from helpers import race, tls_handshake as handshake
from unbroken.checkpoint.node import credentials
from unbroken.errors import NotFoundError, StoreUnavailable
from unbroken.kubernetes.backend import cluster_tls, names
from unbroken.kubernetes.backend.client import api_client

pytestmark = pytest.mark.timeout(60)


def test_operators_racing_to_make_it_leave_one_ca(kubeconfig: Path, namespace: str) -> None:
    made: dict[int, credentials.Authority] = {}
    errors = race(2, lambda i: made.__setitem__(i, cluster_tls.make(api_client(kubeconfig), namespace, "c")))
    assert not errors, errors
    assert made[0] == made[1], "one CA for the cluster, whichever replica created the Secret"
    assert cluster_tls.make(api_client(kubeconfig), namespace, "c") == made[0], "a later leader keeps it"


def test_a_command_certified_by_the_operators_ca_is_a_peer_of_the_nodes(kubeconfig: Path, namespace: str,
                                                                         tmp_path: Path) -> None:
    """``ckpt verify`` reads the Secret (an administrator's right) and certifies itself: the nodes' shard servers, whose
    certificates the same CA signed, accept it; its key is its own, 0600."""
    authority = cluster_tls.make(api_client(kubeconfig), namespace, "c")
    key, request = credentials.new_request("node")
    node = credentials.write(tmp_path / "node", authority.cert_pem, authority.sign(request, "unbroken node n", "n.invalid"), key)
    fetched = cluster_tls.fetch(api_client(kubeconfig), namespace, tmp_path / "cli")
    assert stat.S_IMODE(fetched.key.stat().st_mode) == 0o600
    assert credentials.common_name(fetched.cert.read_bytes()) == "unbroken ckpt verify"
    handshake(node, fetched)
    stranger = credentials.create(tmp_path / "stranger", "other")  # another cluster's CA
    with pytest.raises(Exception, match="certificate"):
        handshake(node, stranger)


def test_a_secret_missing_a_field_is_a_clear_error_that_says_how_to_mend_it(kubeconfig: Path, namespace: str,
                                                                           tmp_path: Path) -> None:
    """The Secret of an install before per-node credentials (the CA's certificate and one shared certificate, no CA
    key) is named with its remedy, and nothing is half-written."""
    core = kubernetes.client.CoreV1Api(api_client(kubeconfig))
    core.create_namespaced_secret(namespace, {"metadata": {"name": names.CLUSTER_TLS_SECRET},
                                              "data": {credentials.CA_FILE: "eA==", "cluster.crt": "eA==", "cluster.key": "eA=="}})
    with pytest.raises(StoreUnavailable, match=f"{names.CLUSTER_TLS_SECRET} lacks cluster-ca.key: delete it and restart the operator"):
        cluster_tls.make(api_client(kubeconfig), namespace, "c")
    with pytest.raises(StoreUnavailable, match=f"{names.CLUSTER_TLS_SECRET} lacks cluster-ca.key"):
        cluster_tls.fetch(api_client(kubeconfig), namespace, tmp_path / "cli")
    assert not (tmp_path / "cli").exists(), "nothing half-written"


def test_fetch_never_makes_the_secret(kubeconfig: Path, namespace: str, tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="the operator has not led yet"):
        cluster_tls.fetch(api_client(kubeconfig), namespace, tmp_path / "cli")
    core = kubernetes.client.CoreV1Api(api_client(kubeconfig))
    assert not [s for s in core.list_namespaced_secret(namespace).items if s.metadata.name == names.CLUSTER_TLS_SECRET]
