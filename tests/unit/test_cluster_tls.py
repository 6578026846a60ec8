"""The memory tier's TLS credentials on Kubernetes (agent/cluster_tls.py): one Secret, made by the first agent.

Real: kube-apiserver and etcd (tests/controlplane); real threads race to create the Secret, real certificates
are made and loaded into real TLS contexts.
"""

from __future__ import annotations

import stat
from pathlib import Path

import kubernetes
import pytest

from helpers import race
from unbroken.agent import cluster_tls
from unbroken.checkpoint import credentials
from unbroken.errors import StoreUnavailable
from unbroken.backends.kubernetes import names
from unbroken.backends.kubernetes.client import api_client

pytestmark = pytest.mark.timeout(60)


def test_agents_racing_to_create_it_all_end_with_the_same_ca_and_a_private_key_file(kubeconfig: Path, namespace: str,
                                                                                     tmp_path: Path) -> None:
    errors = race(4, lambda i: cluster_tls.ensure(api_client(kubeconfig), namespace, tmp_path / f"node-{i}", "c"))
    assert not errors, errors
    cas = {(tmp_path / f"node-{i}" / credentials.CA_FILE).read_bytes() for i in range(4)}
    assert len(cas) == 1, "one CA for the cluster, whoever created the Secret"
    key = tmp_path / "node-0" / credentials.KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    loaded = credentials.load(tmp_path / "node-0")
    loaded.server_context()
    loaded.client_context()


def test_a_secret_missing_a_file_is_a_clear_error_that_says_how_to_mend_it(kubeconfig: Path, namespace: str,
                                                                           tmp_path: Path) -> None:
    core = kubernetes.client.CoreV1Api(api_client(kubeconfig))
    core.create_namespaced_secret(namespace, {"metadata": {"name": names.CLUSTER_TLS_SECRET}, "data": {credentials.CA_FILE: "eA=="}})
    with pytest.raises(StoreUnavailable, match=f"{names.CLUSTER_TLS_SECRET} lacks cluster.crt, cluster.key: delete it"):
        cluster_tls.ensure(api_client(kubeconfig), namespace, tmp_path / "node", "c")
    assert not (tmp_path / "node").exists(), "nothing half-written"


def test_fetch_reads_the_agents_secret_and_never_makes_one(kubeconfig: Path, namespace: str, tmp_path: Path) -> None:
    """``ckpt verify`` on a cluster presents the agents' certificate; with no Secret yet it says why and creates none."""
    from unbroken.errors import NotFoundError

    with pytest.raises(NotFoundError, match="no node agent has started the checkpoint memory tier yet"):
        cluster_tls.fetch(api_client(kubeconfig), namespace, tmp_path / "cli")
    core = kubernetes.client.CoreV1Api(api_client(kubeconfig))
    assert not [s for s in core.list_namespaced_secret(namespace).items if s.metadata.name == names.CLUSTER_TLS_SECRET]

    cluster_tls.ensure(api_client(kubeconfig), namespace, tmp_path / "agent", "c")
    fetched = cluster_tls.fetch(api_client(kubeconfig), namespace, tmp_path / "cli")
    assert fetched.ca.read_bytes() == (tmp_path / "agent" / credentials.CA_FILE).read_bytes()
    assert fetched.key.read_bytes() == (tmp_path / "agent" / credentials.KEY_FILE).read_bytes()
    assert stat.S_IMODE(fetched.key.stat().st_mode) == 0o600
