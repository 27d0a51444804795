"""Certificates for a private etcd: a one-job CA, a server certificate and a client certificate.

The embedded etcd serves its clients over mutual TLS with these (see :mod:`rlaunch.store.embedded`):
only a process that can read the client key, that is, the job's own user, can talk to it. The
same helpers make the certificates of the TLS tests. Keys are ECDSA P-256; certificates are
valid from a minute ago for ``days`` days. Private keys are written with mode 0600.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class Issued:
    """A certificate and its private key, PEM-encoded."""

    cert: bytes
    key: bytes


@dataclasses.dataclass(frozen=True)
class Pki:
    """Paths of a CA certificate, a server certificate and key, and a client certificate and key."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _builder(subject: str, issuer: x509.Name, public: ec.EllipticCurvePublicKey, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


class CertificateAuthority:
    """A self-signed CA that issues server and client certificates."""

    def __init__(self, common_name: str = "rlaunch test CA", days: int = 30) -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        self.name = _name(common_name)
        self.cert = (
            _builder(common_name, self.name, self._key.public_key(), days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )  # fmt: skip
            .sign(self._key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, common_name: str, hosts: Sequence[str] = (), *, server: bool, days: int = 30) -> Issued:
        """A certificate for ``common_name``: a server one valid for ``hosts`` (IPs or DNS names), or a client one.

        etcd takes a client certificate's common name as its user name when auth is enabled.
        """
        key = ec.generate_private_key(ec.SECP256R1())
        # A server certificate also authenticates its holder as a client (etcd's peer connections).
        usages = (
            [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            if server
            else [ExtendedKeyUsageOID.CLIENT_AUTH]
        )
        builder = _builder(common_name, self.name, key.public_key(), days)
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if hosts:
            names: list[x509.GeneralName] = []
            for host in hosts:
                try:
                    names.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    names.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file readable by its owner only (0600 from creation, never wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_pki(directory: Path, hosts: Sequence[str], client_name: str = "root") -> Pki:
    """A fresh CA with one server certificate (for ``hosts``) and one client certificate, in ``directory``."""
    ca = CertificateAuthority("rlaunch private etcd CA", days=3650)
    server = ca.issue("rlaunch etcd", hosts, server=True, days=3650)
    client = ca.issue(client_name, server=False, days=3650)
    pki = Pki(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server-key.pem",
        client_cert=directory / "client.pem",
        client_key=directory / "client-key.pem",
    )
    write_private(pki.ca, ca.pem)
    write_private(pki.server_cert, server.cert)
    write_private(pki.server_key, server.key)
    write_private(pki.client_cert, client.cert)
    write_private(pki.client_key, client.key)
    return pki
