"""Each node's own credentials, issued by the operator (kubernetes/operator/credential_issuer.py) to the agent that asks
(kubernetes/backend/node_credentials.py) for the node its token is bound to.

Real: kube-apiserver and etcd (tests/controlplane) issue the ServiceAccount tokens, bound to real Nodes, and review
them (TokenReview); the issuer serves HTTPS on loopback; the agent's side checks it by the cluster's CA; the
certificates it hands out shake hands with each other over real sockets.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import kubernetes
import pytest

from helpers import tls_handshake as handshake
from unbroken.checkpoint.node import credentials
from unbroken.checkpoint.node.credentials import Authority
from unbroken.errors import CheckpointError, NotFoundError, StoreUnavailable
from unbroken.kubernetes.backend import heartbeats, names, node_credentials
from unbroken.kubernetes.backend.client import api_client
from unbroken.kubernetes.operator.credential_issuer import CredentialIssuer, IssuerServer

pytestmark = pytest.mark.timeout(60)
MASTER = b"m" * 32


class Issued:
    """The namespace's agent account, two Nodes, and an operator's issuer serving on loopback."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        self.core = kubernetes.client.CoreV1Api(api_client(kubeconfig))
        self.namespace = namespace
        for account in (names.AGENT_ACCOUNT, "someone-else"):
            self.core.create_namespaced_service_account(namespace, {"metadata": {"name": account}})
        self.nodes = [f"gpu-{uuid.uuid4().hex[:6]}" for _ in range(2)]
        for node in self.nodes:
            self.core.create_node({"metadata": {"name": node}})
        self.authority = Authority.new("c")
        self.issuer = CredentialIssuer(api_client(kubeconfig), namespace, self.authority, MASTER)
        self.server: IssuerServer = self.issuer.serve("127.0.0.1", 0)
        self.address = ("127.0.0.1", self.server.port)

    def token(self, *, node: str | None, account: str = names.AGENT_ACCOUNT) -> str:
        """A TokenRequest's token for ``account``, bound to ``node`` (as a pod's token is bound to its pod's node)."""
        spec: dict[str, Any] = {"expirationSeconds": 3600}
        if node is not None:
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": self.core.read_node(node).metadata.uid}
        return str(self.core.create_namespaced_service_account_token(account, self.namespace, {"spec": spec}).status.token)

    def ask(self, token: str, node: str, directory: Path) -> node_credentials.NodeCredentials:
        return node_credentials.request(self.address, self.authority.cert_pem, token, node, directory)


@pytest.fixture
def issued(kubeconfig: Path, namespace: str) -> Iterator[Issued]:
    setup = Issued(kubeconfig, namespace)
    yield setup
    setup.server.close()


def test_an_agent_is_certified_for_the_node_its_token_is_bound_to(issued: Issued, tmp_path: Path) -> None:
    """Each node gets a certificate named after it, for a key that never left it, and its own heartbeat key; two
    nodes' certificates are peers of each other (the memory tier's mutual TLS)."""
    first, second = issued.nodes
    one = issued.ask(issued.token(node=first), first, tmp_path / "one")
    two = issued.ask(issued.token(node=second), second, tmp_path / "two")
    assert credentials.common_name(one.tls.cert.read_bytes()) == f"unbroken node {first}"
    assert one.heartbeat_key == heartbeats.node_key(MASTER, first) != two.heartbeat_key
    assert one.tls.ca.read_bytes() == issued.authority.cert_pem
    assert b"PRIVATE KEY" in one.tls.key.read_bytes() and one.tls.key.stat().st_mode & 0o077 == 0
    handshake(one.tls, two.tls)
    assert issued.issuer.issued == 2 and issued.issuer.refused == 0


@pytest.mark.parametrize("case, message", [
    ("another node", "the token is bound to node {first}, the request asks for '{second}'"),
    ("bound to nothing", "the token is bound to no node"),
    ("another account", "the token is system:serviceaccount:{ns}:someone-else's; only system:serviceaccount:{ns}:unbroken-agent"),
    ("not a token", "(401): the API server does not accept the token"),
])
def test_the_operator_refuses_what_is_not_an_agent_asking_for_its_own_node(issued: Issued, tmp_path: Path, case: str,
                                                                          message: str) -> None:
    """What a compromised node could try: another node's credentials with its own token, or a token that is not a
    node-bound agent's. Each is refused with why, and the asking side writes nothing."""
    first, second = issued.nodes
    token = {"another node": lambda: issued.token(node=first), "bound to nothing": lambda: issued.token(node=None),
             "another account": lambda: issued.token(node=first, account="someone-else"),
             "not a token": lambda: "not-a-token"}[case]()
    with pytest.raises(node_credentials.Refused) as refused:
        issued.ask(token, second if case == "another node" else first, tmp_path / "node")
    assert message.format(first=first, second=second, ns=issued.namespace) in str(refused.value), refused.value
    assert not (tmp_path / "node").exists()
    assert issued.issuer.refused == 1 and issued.issuer.issued == 0


def test_the_agent_gives_its_token_only_to_an_operator_the_cluster_ca_signed(issued: Issued, tmp_path: Path,
                                                                             kubeconfig: Path, namespace: str) -> None:
    """An impostor listening where the agent asks (its own CA): the TLS handshake fails before the token is sent."""
    impostor = CredentialIssuer(api_client(kubeconfig), namespace, Authority.new("impostor"), MASTER).serve("127.0.0.1", 0)
    try:
        first = issued.nodes[0]
        with pytest.raises(StoreUnavailable, match="cannot be reached.*CERTIFICATE_VERIFY_FAILED"):
            node_credentials.request(("127.0.0.1", impostor.port), issued.authority.cert_pem, issued.token(node=first), first,
                                     tmp_path / "node")
        assert not (tmp_path / "node").exists()
    finally:
        impostor.close()


def test_an_agent_waits_for_a_leading_operator_then_asks_it(issued: Issued, tmp_path: Path) -> None:
    """The leader Lease names where to ask and the CA once an operator leads; until then the agent polls, and it
    stops when told."""
    first = issued.nodes[0]
    published: dict[str, str] = {}

    def lease_annotations() -> dict[str, str]:
        if not published:
            raise NotFoundError("no leader Lease yet")
        return published

    api = api_client_with_token(issued.token(node=first))
    result: list[node_credentials.NodeCredentials | None] = []
    stopping = threading.Event()
    waiter = threading.Thread(target=lambda: result.append(node_credentials.obtain(api, lease_annotations, first, tmp_path / "n",
                                                                                   stopping)))
    waiter.start()
    published.update({heartbeats.ADDRESS_ANNOTATION: f"127.0.0.1:{issued.server.port}",
                      names.CLUSTER_CA: issued.authority.cert_pem.decode()})
    waiter.join(30)
    assert result and result[0] is not None and result[0].heartbeat_key == heartbeats.node_key(MASTER, first)

    stopped: list[node_credentials.NodeCredentials | None] = []
    published.clear()
    waiter = threading.Thread(target=lambda: stopped.append(node_credentials.obtain(api, lease_annotations, first,
                                                                                    tmp_path / "m", stopping)))
    waiter.start()
    stopping.set()
    waiter.join(15)
    assert stopped == [None] and not (tmp_path / "m").exists()


def api_client_with_token(token: str) -> kubernetes.client.ApiClient:
    """A client that authenticates as the agent does (what node_credentials.bearer_token reads)."""
    configuration = kubernetes.client.Configuration()
    configuration.host = "https://127.0.0.1:1"  # never dialled here
    configuration.api_key = {"authorization": f"Bearer {token}"}
    return kubernetes.client.ApiClient(configuration)


def test_a_rank_waits_for_its_nodes_credentials_written_after_it_started(tmp_path: Path) -> None:
    """On Kubernetes a pod may start before its node's agent is certified: the rank waits for the files, not fails."""
    folder = tmp_path / "cluster"
    writer = threading.Timer(0.3, lambda: credentials.create(folder, "test"))
    writer.start()
    try:
        loaded = credentials.load_when_written(folder, timeout=30)
    finally:
        writer.join()
    assert loaded == credentials.at(folder) and loaded.key.is_file()


def test_a_rank_whose_nodes_credentials_never_come_fails_naming_what_is_missing_and_how_long_it_waited(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"credentials are missing \(cluster-ca.crt, cluster.crt, cluster.key\).*waited 0.3 s"):
        credentials.load_when_written(tmp_path / "cluster", timeout=0.3)
