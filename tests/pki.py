"""Throwaway certificates for the TLS tests: a CA, a server certificate for
127.0.0.1 and localhost, a client certificate it signed, and a second CA that
trusts none of them."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from specdec.tls import TlsConfig


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # signed none of the above

    def server(self, require_client_cert: bool = False) -> TlsConfig:
        return TlsConfig(str(self.server_cert), str(self.server_key), str(self.ca),
                         require_client_cert)

    def client(self, with_cert: bool = True) -> TlsConfig:
        if not with_cert:
            return TlsConfig(ca_certs=str(self.ca))
        return TlsConfig(str(self.client_cert), str(self.client_key), str(self.ca))


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer: str, issuer_key, *, ca: bool,
          sans: list[x509.GeneralName] | None = None,
          usage: list | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                          crl_sign=True, content_commitment=False,
                                          key_encipherment=False, data_encipherment=False,
                                          key_agreement=False, encipher_only=False,
                                          decipher_only=False), critical=True)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage:
        b = b.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate, key=None) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))


def make_pki(directory: Path) -> Pki:
    ca_key, other_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1())
                                                 for _ in range(4))
    ca = _cert("specdec test CA", ca_key, "specdec test CA", ca_key, ca=True)
    other = _cert("another CA", other_key, "another CA", other_key, ca=True)
    server = _cert("specdec test server", server_key, "specdec test CA", ca_key, ca=False,
                   sans=[x509.DNSName("localhost"),
                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
                   usage=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    client = _cert("specdec test client", client_key, "specdec test CA", ca_key, ca=False,
                   usage=[ExtendedKeyUsageOID.CLIENT_AUTH])
    _write(directory / "ca.pem", ca)
    _write(directory / "other-ca.pem", other)
    _write(directory / "server.pem", server, server_key)
    _write(directory / "client.pem", client, client_key)
    return Pki(directory / "ca.pem", directory / "server.pem", directory / "server.key",
               directory / "client.pem", directory / "client.key", directory / "other-ca.pem")
