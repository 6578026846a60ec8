"""The operator's side of the nodes' credentials: it certifies each agent for the node its token is bound to.

An agent POSTs a certificate signing request with its ServiceAccount token
(kubernetes/backend/node_credentials.py). The operator asks the API server who
the token is (a TokenReview: authenticated, the agents' ServiceAccount, and the
node it is bound to), then answers with a certificate for the request's key
named after *that* node, signed by the cluster's CA, and that node's heartbeat
key. A token of any other account, a token bound to no node, or a request for
another node than the token's is refused with 403 and says why; an invalid token
with 401. So a compromised node can get its own credentials again and nothing
else: no other node's heartbeat key (it cannot keep a dead node alive) and no
key the CA signed for another node.

Served over HTTPS on the heartbeat port (TCP), with a certificate the operator
issues itself from the CA at start; a thread per connection, each bounded by
``CONNECTION_TIMEOUT_SECONDS``, so a slow or silent client holds up nobody.
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import tempfile
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kubernetes

from unbroken.checkpoint.node import credentials
from unbroken.checkpoint.node.credentials import Authority
from unbroken.errors import BackendError
from unbroken.kubernetes.backend import heartbeats, names, node_credentials
from unbroken.kubernetes.backend.api import call

log = logging.getLogger("unbroken.kubernetes.operator.credential_issuer")

CONNECTION_TIMEOUT_SECONDS = 10.0
MAX_REQUEST_BYTES = 64 * 1024
"""A CSR and a node name are under 2 KB; anything larger is not a request."""


class IssueRefused(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


class CredentialIssuer:
    """Decides and signs; :func:`serve` puts it on the network."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str, authority: Authority, master: bytes, *,
                 agent_account: str = names.AGENT_ACCOUNT) -> None:
        self.authentication = kubernetes.client.AuthenticationV1Api(api)
        self.authority = authority
        self.master = master
        self.account = f"system:serviceaccount:{namespace}:{agent_account}"
        self.issued = 0
        self.refused = 0

    def issue(self, token: str, body: dict[str, Any]) -> dict[str, str]:
        """The node's credentials for ``token``'s node; IssueRefused says why not."""
        node = self._node_of(token)
        asked = body.get("node")
        if asked != node:
            raise IssueRefused(HTTPStatus.FORBIDDEN, f"the token is bound to node {node}, the request asks for {asked!r}: "
                                                     "an agent is certified for its own node only")
        csr = body.get("csr")
        if not isinstance(csr, str):
            raise IssueRefused(HTTPStatus.BAD_REQUEST, "no certificate signing request (field 'csr', PEM)")
        try:
            cert = self.authority.sign(csr.encode(), f"unbroken node {node}", f"{node}.node.unbroken.invalid")
        except ValueError as exc:
            raise IssueRefused(HTTPStatus.BAD_REQUEST, f"field 'csr': {exc}") from None
        return {"node": node, "cert": cert.decode(),
                "heartbeat_key": base64.b64encode(heartbeats.node_key(self.master, node)).decode()}

    def _node_of(self, token: str) -> str:
        """The node ``token`` is bound to, if it is an agent's (a TokenReview)."""
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
        try:
            status = call(lambda: self.authentication.create_token_review(review)).status
        except BackendError as exc:
            raise IssueRefused(HTTPStatus.SERVICE_UNAVAILABLE, f"the token cannot be reviewed now: {exc}") from None
        if not status.authenticated or status.user is None:
            raise IssueRefused(HTTPStatus.UNAUTHORIZED, f"the API server does not accept the token: {status.error or 'no reason given'}")
        if status.user.username != self.account:
            raise IssueRefused(HTTPStatus.FORBIDDEN, f"the token is {status.user.username}'s; only {self.account} is certified")
        nodes = (status.user.extra or {}).get(names.NODE_NAME_CLAIM) or []
        if len(nodes) != 1:
            raise IssueRefused(HTTPStatus.FORBIDDEN, "the token is bound to no node (a pod-bound token, as the DaemonSet's "
                                                     "projected one, names its node)")
        return str(nodes[0])

    def serve(self, host: str, port: int) -> IssuerServer:
        return IssuerServer(self, host, port)


class _Listener(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024
    """The listen backlog: a cluster's agents start together (a DaemonSet rollout, the operator back after an
    outage); with the default of 5, connections beyond it wait a SYN retry (1 s, then 3 s, ...)."""


class IssuerServer:
    """The issuer on HTTPS at ``host:port`` (TCP), until :meth:`close`."""

    def __init__(self, issuer: CredentialIssuer, host: str, port: int) -> None:
        self.server = _Listener((host, port), _handler(issuer))
        self.server.socket = _server_context(issuer.authority).wrap_socket(
            self.server.socket, server_side=True, do_handshake_on_connect=False)  # the handshake in the connection's thread
        self.port: int = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="credential-issuer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


def _server_context(authority: Authority) -> ssl.SSLContext:
    """TLS with a certificate the CA gives the operator now (the agents check it by the CA's certificate)."""
    key_pem, request = credentials.new_request("unbroken operator")
    with tempfile.TemporaryDirectory(prefix="unbroken-issuer-") as scratch:
        files = credentials.write(Path(scratch), authority.cert_pem, authority.sign(request, "unbroken operator",
                                                                                      "operator.unbroken.invalid"), key_pem)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(str(files.cert), str(files.key))
    return context


def _handler(issuer: CredentialIssuer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = CONNECTION_TIMEOUT_SECONDS

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            try:
                answer = self._answer()
                issuer.issued += 1
                log.info("node certified", extra={"node": answer["node"], "peer": self.client_address[0]})
                self._reply(HTTPStatus.OK, answer)
            except IssueRefused as refused:
                issuer.refused += 1
                log.warning("node credentials refused: %s", refused, extra={"peer": self.client_address[0]})
                self._reply(refused.status, {"message": str(refused)})

        def _answer(self) -> dict[str, str]:
            if self.path != node_credentials.PATH:
                raise IssueRefused(HTTPStatus.NOT_FOUND, f"nothing at {self.path}; POST {node_credentials.PATH}")
            scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise IssueRefused(HTTPStatus.UNAUTHORIZED, "no bearer token (the agent's ServiceAccount token)")
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_REQUEST_BYTES:
                raise IssueRefused(HTTPStatus.BAD_REQUEST, f"a request body of {length} bytes (1 to {MAX_REQUEST_BYTES})")
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError:
                raise IssueRefused(HTTPStatus.BAD_REQUEST, "the body is not JSON") from None
            if not isinstance(body, dict):
                raise IssueRefused(HTTPStatus.BAD_REQUEST, "the body is not a JSON object")
            return issuer.issue(token, body)

        def _reply(self, status: HTTPStatus, answer: dict[str, str]) -> None:
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            pass  # the outcome is logged above, structured

    return Handler
