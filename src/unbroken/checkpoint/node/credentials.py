"""The cluster's TLS credentials: what nodes (and ranks) prove to each other when they exchange shards.

``cluster up`` makes a private certificate authority for the cluster and one
certificate it signed, which every node agent and rank of the cluster holds:

    <dir>/cluster-ca.crt    the CA every peer is checked against (and nothing else is trusted)
    <dir>/cluster.crt       the cluster's certificate, signed by that CA
    <dir>/cluster.key       its private key (0600, like the CA's, which is not kept)

Mutual TLS then does what a shared secret did before, and more: a peer without
the cluster's certificate cannot connect or be connected to, and the shards on
the wire are encrypted. Peers are checked by the CA, not by host name: node
addresses change (pods, network namespaces), the cluster does not. Locally
the CA's key is thrown away once it signed, so nobody can mint a second
certificate. On Kubernetes the operator keeps it (:class:`Authority`, in a
Secret only it reads) and certifies each node's agent for its own node: the
three files on a node are its CA certificate, its own certificate and key, which
its training pods mount (kubernetes/backend/node_credentials.py).
"""

from __future__ import annotations

import datetime
import functools
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from unbroken.errors import CheckpointError
from unbroken.plumbing.waiting import WaitTimeout, wait_until

CA_FILE = "cluster-ca.crt"
CERT_FILE = "cluster.crt"
KEY_FILE = "cluster.key"
VALID_DAYS = 3650
"""A cluster lives as long as its directory: the certificates do not expire under a long run."""


@dataclass(frozen=True)
class Credentials:
    ca: Path
    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        return _server_context(self)

    def client_context(self) -> ssl.SSLContext:
        """One per credentials and process, shared by every connection (contexts are thread-safe):
        loading the files costs milliseconds, which a restore's first request should not pay each time."""
        return _client_context(self)

    def _common(self, context: ssl.SSLContext) -> None:
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        try:
            context.load_verify_locations(cafile=str(self.ca))
            context.load_cert_chain(str(self.cert), str(self.key))
        except (OSError, ssl.SSLError) as exc:
            raise CheckpointError(f"cannot load the cluster's TLS credentials from {self.cert.parent}: {exc}") from None


@functools.cache
def _server_context(credentials: Credentials) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    credentials._common(context)
    context.verify_mode = ssl.CERT_REQUIRED  # the client must hold the cluster's certificate too
    return context


@functools.cache
def _client_context(credentials: Credentials) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    credentials._common(context)
    context.check_hostname = False  # peers are the cluster's by their certificate, not by an address
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def at(directory: Path) -> Credentials:
    return Credentials(directory / CA_FILE, directory / CERT_FILE, directory / KEY_FILE)


def load(directory: Path) -> Credentials:
    """The credentials in ``directory``; a clear error if they are missing."""
    credentials = at(directory)
    if missing := _missing(credentials):
        raise CheckpointError(f"{directory}: the cluster's TLS credentials are missing ({', '.join(missing)}); "
                              "they are made by 'unbroken cluster up'")
    return credentials


def _missing(credentials: Credentials) -> list[str]:
    return [p.name for p in (credentials.ca, credentials.cert, credentials.key) if not p.is_file()]


NODE_CERTIFIED_WITHIN_S = 60.0
"""How long a rank waits for its node's credentials (``load_when_written``): on Kubernetes the node's agent writes
them once the operator has certified it, and a pod may start first on a node that just joined or whose agent is
restarting (seen in CI: a rank 1.4 s ahead of its agent failed the job's first attempt)."""


def load_when_written(directory: Path, timeout: float = NODE_CERTIFIED_WITHIN_S) -> Credentials:
    """``load``, waiting up to ``timeout`` seconds for the files to appear first (a clear error after that)."""
    credentials = at(directory)
    try:
        wait_until(lambda: not _missing(credentials), timeout, f"the cluster's TLS credentials in {directory}", interval=0.2)
    except WaitTimeout:
        pass  # load names what is missing
    try:
        return load(directory)
    except CheckpointError as missing:
        raise CheckpointError(f"{missing} (waited {timeout:g} s: on Kubernetes the node's agent writes them once the "
                              "operator has certified it)") from None


def create(directory: Path, cluster: str) -> Credentials:
    """A new CA and the cluster's certificate in ``directory`` (kept if they exist already); the CA's key is not kept."""
    credentials = at(directory)
    if credentials.cert.exists() and credentials.key.exists() and credentials.ca.exists():
        return credentials
    authority = Authority.new(cluster)
    key_pem, request = new_request(f"unbroken {cluster}")
    return write(directory, authority.cert_pem, authority.sign(request, f"unbroken {cluster}", f"{cluster}.unbroken.invalid"), key_pem)


def write(directory: Path, ca_pem: bytes, cert_pem: bytes, key_pem: bytes) -> Credentials:
    """The three files in ``directory`` (each replaced atomically; the key 0600)."""
    credentials = at(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write(credentials.key, key_pem, mode=0o600)
    _write(credentials.cert, cert_pem, mode=0o644)
    _write(credentials.ca, ca_pem, mode=0o644)
    return credentials


def new_request(common_name: str) -> tuple[bytes, bytes]:
    """A new private key (PEM) and a certificate signing request for it (PEM): what a node sends to be certified,
    so that its key never leaves it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    request = (x509.CertificateSigningRequestBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])).sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return key_pem, request.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class Authority:
    """The cluster's certificate authority: its certificate and its key (PEM). Locally it signs once and is thrown
    away; on Kubernetes the operator keeps it (in a Secret only it reads) and certifies each node's agent."""

    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def new(cls, cluster: str) -> Authority:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        now = datetime.datetime.now(datetime.timezone.utc)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"unbroken {cluster} CA")])
        cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert.public_bytes(serialization.Encoding.PEM),
                   key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    def sign(self, request_pem: bytes, common_name: str, dns_name: str) -> bytes:
        """A certificate (PEM) for the key of ``request_pem`` (a CSR, whose own signature must verify), named
        ``common_name`` whatever the request asked: the caller decides who it certifies. ValueError for a request
        that is not a valid, self-signed CSR."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        request = x509.load_pem_x509_csr(request_pem)  # ValueError if it is not one
        if not request.is_signature_valid:
            raise ValueError("the certificate signing request's signature does not verify")
        ca = x509.load_pem_x509_certificate(self.cert_pem)
        ca_key = serialization.load_pem_private_key(self.key_pem, password=None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca.subject).public_key(request.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(dns_name)]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)


def common_name(cert_pem: bytes) -> str:
    """The name a certificate was issued to."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    names = x509.load_pem_x509_certificate(cert_pem).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else ""


def _write(path: Path, data: bytes, *, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
