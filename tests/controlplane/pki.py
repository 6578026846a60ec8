"""The control plane's credentials, made by the fixture as kubeadm would make them (one CA, ten years).

- the API server's serving certificate (127.0.0.1, localhost and the in-cluster names);
- client certificates: the admin (group ``system:masters``), the controller-manager and the scheduler
  (their bootstrap RBAC identities), the process kubelet (admin: it plays every node at once);
- the API server's certificate towards kubelets, and the process kubelet's serving certificate (the API
  server verifies it with the CA: ``kubectl logs`` goes API server -> kubelet over TLS);
- the service-account signing key pair (the controller-manager mints tokens, the API server checks them);
- webhook serving certificates for the Kubeflow controllers (127.0.0.1 plus their Service's DNS name).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=3650)
# Long validity: cert-controller (in the Kubeflow controllers) re-issues a certificate that expires
# within 90 days, which would replace the fixture's with one whose SANs the API server's URL lacks.


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_key(key: rsa.RSAPrivateKey, path: Path) -> Path:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


class Authority:
    """A CA in ``directory`` that signs what the control plane needs."""

    def __init__(self, directory: Path, name: str = "unbroken-test-ca", *, named: bool = False) -> None:
        """``named``: the CA certificate also carries its name as a DNS name (cert-controller, in the Kubeflow
        controllers, checks a CA it finds by verifying it for that name, and replaces one that fails)."""
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._key = _key()
        now = datetime.datetime.now(datetime.UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
                      .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                      .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                   content_commitment=False, key_encipherment=False,
                                                   data_encipherment=False, key_agreement=False,
                                                   encipher_only=False, decipher_only=False), critical=True))
        if named:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        self._cert = builder.sign(self._key, hashes.SHA256())
        self.cert = _write_cert(self._cert, directory / "ca.crt")
        self.key = _write_key(self._key, directory / "ca.key")

    @property
    def cert_pem(self) -> bytes:
        return self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, *, common_name: str, organizations: tuple[str, ...] = (), server: bool = False,
              client: bool = False, dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()) -> KeyPair:
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
                            + [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations])
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(self._cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=True, key_cert_sign=False,
                                                crl_sign=False, content_commitment=False, data_encipherment=False,
                                                key_agreement=False, encipher_only=False, decipher_only=False),
                                  critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        if dns or ips:
            names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
            names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return KeyPair(_write_cert(cert, self.directory / f"{name}.crt"), _write_key(key, self.directory / f"{name}.key"))


def service_account_keys(directory: Path) -> KeyPair:
    """The RSA key pair that signs and verifies service-account tokens (``cert`` is the public key)."""
    key = _key()
    public = directory / "sa.pub"
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return KeyPair(public, _write_key(key, directory / "sa.key"))
