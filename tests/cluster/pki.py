"""The test cluster's certificates and keys: one CA, the API server's serving certificate, client
certificates for each identity that talks to it, and the service-account signing key pair.

EC P-256 keys: a key takes well under a millisecond to make (RSA 2048 takes tens), and every
component of 1.37 accepts them. Everything lives in the cluster's temporary directory.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID = datetime.timedelta(days=1)  # the cluster lives for one test session


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _name(common: str, organization: str | None = None) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, common)]
    if organization:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(parts)


class Pki:
    """A CA in `root` and the certificates it signs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self._ca_key = _key()
        now = datetime.datetime.now(datetime.UTC)
        name = _name("dra-agent-test-ca")
        self._ca_cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(self._ca_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(self._ca_key, hashes.SHA256()))
        self.ca = root / "ca.crt"
        self.ca.write_bytes(self._ca_cert.public_bytes(serialization.Encoding.PEM))
        # The service-account token signing pair (the API server signs, and checks with the public half).
        sa = _key()
        self.sa_key = root / "sa.key"
        _write_key(self.sa_key, sa)
        self.sa_pub = root / "sa.pub"
        self.sa_pub.write_bytes(sa.public_key().public_bytes(serialization.Encoding.PEM,
                                                             serialization.PublicFormat.SubjectPublicKeyInfo))

    def _issue(self, stem: str, subject: x509.Name, usage: x509.ObjectIdentifier,
               dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()) -> Pair:
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(self._ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALID)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if dns or ips:
            names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
            names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        pair = Pair(self.root / f"{stem}.crt", self.root / f"{stem}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(pair.key, key)
        return pair

    def serving(self, stem: str, *, dns: tuple[str, ...], ips: tuple[str, ...]) -> Pair:
        return self._issue(stem, _name(dns[0] if dns else stem), ExtendedKeyUsageOID.SERVER_AUTH, dns, ips)

    def client(self, stem: str, user: str, group: str | None = None) -> Pair:
        """A client certificate: the API server takes CN as the user name and O as a group."""
        return self._issue(stem, _name(user, group), ExtendedKeyUsageOID.CLIENT_AUTH)
