"""Each node's own credentials on Kubernetes, issued by the operator (a TLS bootstrap, as the kubelet's).

An agent holds what its node needs and nothing of any other node's: a
certificate for the memory tier's peer API, named after its node and signed by
the cluster's CA (whose key only the operator holds: kubernetes/backend/cluster_tls.py),
and its node's heartbeat key (kubernetes/backend/heartbeats.node_key). It has no
Secret rights. When it starts it asks the leading operator for them
(:func:`obtain`): an HTTPS POST of a certificate signing request for a key it
made (the key never leaves the node), with its ServiceAccount token as the
bearer. The operator asks the API server who the token is (a TokenReview) and
certifies the node the token is bound to (``authentication.kubernetes.io/node-name``:
a pod-bound token names its pod's node), never the node the request names; a
token of another account, or bound to no node, is refused
(kubernetes/operator/credential_issuer.py).

Where: the operator listens on TCP at the address it publishes for heartbeats
(UDP) on the leader Lease, and the CA's certificate is there too
(``unbroken.dev/cluster-ca``); the agent checks the operator's certificate by
it, so a listener in between cannot take the token or hand out keys. Only the
operator can write that Lease (deploy/admission/agent-policy.yaml).

Cost: one TokenReview and one signature per agent start: 10,000 nodes starting
at once are 10,000 reviews (API server reads, no etcd write) and about 20 s of
one operator core, spread over the agents' retries.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import kubernetes

from unbroken.checkpoint.node import credentials
from unbroken.checkpoint.node.credentials import Credentials
from unbroken.errors import NotFoundError, StoreUnavailable
from unbroken.kubernetes.backend import heartbeats, names, shared_secret

PATH = "/v1/node-credentials"
REQUEST_TIMEOUT_SECONDS = 15.0
"""A request's bound: the operator's TokenReview is one API call; a slower answer is tried again."""


@dataclass(frozen=True)
class NodeCredentials:
    node: str
    heartbeat_key: bytes
    tls: Credentials


class Refused(StoreUnavailable):
    """The operator would not certify this agent (it says why): a state an administrator fixes while the agent waits."""


def obtain(api: kubernetes.client.ApiClient, lease_annotations: Callable[[], dict[str, str]], node: str, directory: Path,
           stopping: threading.Event) -> NodeCredentials | None:
    """This node's credentials (the TLS files written into ``directory``), asked of the leading operator once it leads
    and has made the cluster's CA (polled, refusals logged and tried again: kubernetes/backend/shared_secret.wait);
    None if ``stopping`` is set first. ``lease_annotations()``: the leader Lease's (NotFoundError: none yet)."""
    def ask() -> NodeCredentials | None:
        try:
            published = lease_annotations()
        except NotFoundError:
            return None
        address = heartbeats.parse_address(published.get(heartbeats.ADDRESS_ANNOTATION, ""))
        ca_pem = published.get(names.CLUSTER_CA, "").encode()
        if address is None or not ca_pem:
            return None
        return request(address, ca_pem, bearer_token(api), node, directory)

    return shared_secret.wait(ask, stopping, f"node {node}'s credentials", lambda issued: issued,
                              absent="wait for an operator that leads and has made the cluster's CA (the leader Lease "
                                     "names neither yet)")


def request(address: tuple[str, int], ca_pem: bytes, token: str, node: str, directory: Path) -> NodeCredentials:
    """One request to the operator at ``address``, checked by ``ca_pem``. Refused (StoreUnavailable) when the operator
    says no; StoreUnavailable when it cannot be reached."""
    key_pem, csr = credentials.new_request(f"unbroken node {node}")
    context = ssl.create_default_context(cadata=ca_pem.decode())
    context.check_hostname = False  # the operator is the cluster CA's by its certificate, not by an address (pod IPs change)
    connection = http.client.HTTPSConnection(address[0], address[1], context=context, timeout=REQUEST_TIMEOUT_SECONDS)
    try:
        connection.request("POST", PATH, body=json.dumps({"node": node, "csr": csr.decode()}),
                           headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        response = connection.getresponse()
        body = response.read()
    except (OSError, http.client.HTTPException) as exc:
        raise StoreUnavailable(f"the operator at {address[0]}:{address[1]} cannot be reached for node {node}'s "
                               f"credentials: {exc}") from None
    finally:
        connection.close()
    try:
        answer = json.loads(body)
    except ValueError:
        answer = {}
    if response.status != 200:
        raise Refused(f"the operator refused node {node}'s credentials ({response.status}): "
                      f"{answer.get('message') or body[:300].decode(errors='replace')}")
    try:
        issued = NodeCredentials(node, base64.b64decode(answer["heartbeat_key"]),
                                 credentials.write(directory, ca_pem, answer["cert"].encode(), key_pem))
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreUnavailable(f"the operator's answer for node {node} is not credentials: {exc!r}") from None
    return issued


def bearer_token(api: kubernetes.client.ApiClient) -> str:
    """The token the agent's client authenticates with (in a pod: its projected ServiceAccount token, refreshed as
    the client refreshes it); Refused when it authenticates otherwise (a client certificate proves no ServiceAccount)."""
    value = api.configuration.get_api_key_with_prefix("authorization") or ""
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Refused("the agent authenticates to the API server without a ServiceAccount token, which the operator "
                      f"needs to certify its node (run it as deploy/'s DaemonSet, account {names.AGENT_ACCOUNT})")
    return token
