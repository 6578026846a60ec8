"""The memory tier's TLS credentials on Kubernetes (kubernetes/backend/cluster_tls.py): one Secret, made by the operator, waited
for and read by the agents.

Real: kube-apiserver and etcd (tests/controlplane); real threads race to create the Secret, real certificates
are made and loaded into real TLS contexts.
"""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import kubernetes
import pytest

from helpers import race
from unbroken.kubernetes.backend import cluster_tls
from unbroken.checkpoint.node import credentials
from unbroken.errors import StoreUnavailable
from unbroken.kubernetes.backend import names
from unbroken.kubernetes.backend.client import api_client

pytestmark = pytest.mark.timeout(60)


def test_operators_racing_to_make_it_leave_one_ca_that_every_waiting_agent_reads(kubeconfig: Path, namespace: str,
                                                                                   tmp_path: Path) -> None:
    """Agents started before the operator wait for the Secret; two operator replicas racing to make it leave one,
    and every agent ends with that CA and a private key file only it may read."""
    stopping = threading.Event()
    found: dict[int, credentials.Credentials | None] = {}
    agents = [threading.Thread(target=lambda i=i: found.__setitem__(i, cluster_tls.wait(
        api_client(kubeconfig), namespace, tmp_path / f"node-{i}", stopping))) for i in range(3)]
    for agent in agents:
        agent.start()
    errors = race(2, lambda i: cluster_tls.make(api_client(kubeconfig), namespace, "c"))
    assert not errors, errors
    for agent in agents:
        agent.join(30)
    assert set(found) == {0, 1, 2} and all(found.values()), found
    cas = {(tmp_path / f"node-{i}" / credentials.CA_FILE).read_bytes() for i in range(3)}
    assert len(cas) == 1, "one CA for the cluster, whichever replica created the Secret"
    key = tmp_path / "node-0" / credentials.KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    loaded = credentials.load(tmp_path / "node-0")
    loaded.server_context()
    loaded.client_context()


def test_an_agent_waiting_for_the_secret_stops_when_told(kubeconfig: Path, namespace: str, tmp_path: Path) -> None:
    stopping = threading.Event()
    result: list[credentials.Credentials | None] = []
    waiter = threading.Thread(target=lambda: result.append(cluster_tls.wait(api_client(kubeconfig), namespace,
                                                                            tmp_path / "node", stopping)))
    waiter.start()
    stopping.set()
    waiter.join(15)
    assert result == [None] and not (tmp_path / "node").exists()


def test_a_secret_missing_a_file_is_a_clear_error_that_says_how_to_mend_it(kubeconfig: Path, namespace: str,
                                                                           tmp_path: Path) -> None:
    core = kubernetes.client.CoreV1Api(api_client(kubeconfig))
    core.create_namespaced_secret(namespace, {"metadata": {"name": names.CLUSTER_TLS_SECRET}, "data": {credentials.CA_FILE: "eA=="}})
    with pytest.raises(StoreUnavailable, match=f"{names.CLUSTER_TLS_SECRET} lacks cluster.crt, cluster.key: delete it"):
        cluster_tls.make(api_client(kubeconfig), namespace, "c")
    with pytest.raises(StoreUnavailable, match=f"{names.CLUSTER_TLS_SECRET} lacks cluster.crt, cluster.key: delete it"):
        cluster_tls.fetch(api_client(kubeconfig), namespace, tmp_path / "node")
    assert not (tmp_path / "node").exists(), "nothing half-written"


def test_fetch_reads_the_operators_secret_and_never_makes_one(kubeconfig: Path, namespace: str, tmp_path: Path) -> None:
    """``ckpt verify`` on a cluster presents the agents' certificate; with no Secret yet it says why and creates none."""
    from unbroken.errors import NotFoundError

    with pytest.raises(NotFoundError, match="the operator has not led yet"):
        cluster_tls.fetch(api_client(kubeconfig), namespace, tmp_path / "cli")
    core = kubernetes.client.CoreV1Api(api_client(kubeconfig))
    assert not [s for s in core.list_namespaced_secret(namespace).items if s.metadata.name == names.CLUSTER_TLS_SECRET]

    cluster_tls.make(api_client(kubeconfig), namespace, "c")
    assert cluster_tls.wait(api_client(kubeconfig), namespace, tmp_path / "agent", threading.Event()) is not None
    fetched = cluster_tls.fetch(api_client(kubeconfig), namespace, tmp_path / "cli")
    assert fetched.ca.read_bytes() == (tmp_path / "agent" / credentials.CA_FILE).read_bytes()
    assert fetched.key.read_bytes() == (tmp_path / "agent" / credentials.KEY_FILE).read_bytes()
    assert stat.S_IMODE(fetched.key.stat().st_mode) == 0o600
