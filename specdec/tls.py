"""TLS for the gRPC links and the gateway's REST API.

A `TlsConfig` names PEM files: a certificate chain and its key (a server's own, and
what a client presents for mutual TLS), the CA certificates to trust (a client's:
those of the servers, default the system's roots; a server's: those of client
certificates) and whether a server requires a client certificate.

The internal links (gateway -> verifier -> drafters) are configured once for the
whole deployment, like SPECDEC_INTERNAL_TOKEN: every service reads the same
SPECDEC_INTERNAL_TLS_* variables, serves its internal port with that certificate and
presents it to the services it dials. Without them every link stays plaintext, as
on loopback.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

CERT_ENV = "SPECDEC_INTERNAL_TLS_CERT"
KEY_ENV = "SPECDEC_INTERNAL_TLS_KEY"
CA_ENV = "SPECDEC_INTERNAL_TLS_CA"
MTLS_ENV = "SPECDEC_INTERNAL_MTLS"  # "1": servers require a client certificate

# vLLM's --ssl-cert-reqs values (ssl.CERT_NONE, ssl.CERT_REQUIRED). CERT_OPTIONAL is
# left out: a gRPC server cannot ask for a certificate it does not require.
CERT_NONE, CERT_REQUIRED = 0, 2


@dataclass(frozen=True, slots=True)
class TlsConfig:
    certfile: str | None = None  # PEM chain: the server's certificate, or a client's for mTLS
    keyfile: str | None = None
    ca_certs: str | None = None  # PEM bundle to trust (None: the system's roots, for clients)
    require_client_cert: bool = False  # servers: mutual TLS

    def __post_init__(self):
        if bool(self.certfile) != bool(self.keyfile):
            raise ValueError("TLS: a certificate needs its key and a key its certificate")
        if self.require_client_cert and not self.ca_certs:
            raise ValueError("TLS: requiring client certificates needs the CA that signs them")
        # Found at start, not at a first connection on some background thread.
        for path in (self.certfile, self.keyfile, self.ca_certs):
            if path and not Path(path).is_file():
                raise ValueError(f"TLS: {path}: no such file")

    def server_credentials(self) -> grpc.ServerCredentials:
        if not self.certfile:
            raise ValueError("TLS: serving needs a certificate and key")
        return grpc.ssl_server_credentials(
            [(_read(self.keyfile), _read(self.certfile))],
            root_certificates=_read(self.ca_certs), require_client_auth=self.require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Verify the server against `ca_certs` and present `certfile`, when given."""
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca_certs),
                                            private_key=_read(self.keyfile),
                                            certificate_chain=_read(self.certfile))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TlsConfig | None:
        """The internal links' TLS from SPECDEC_INTERNAL_TLS_* (None: none of them set)."""
        env = os.environ if environ is None else environ
        cert, key, ca = (env.get(name) or None for name in (CERT_ENV, KEY_ENV, CA_ENV))
        if not (cert or key or ca):
            return None
        return cls(cert, key, ca, _mtls(env))


def _mtls(env: Mapping[str, str]) -> bool:
    return env.get(MTLS_ENV, "") not in ("", "0")


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def open_channel(address: str, tls: TlsConfig | None,
                 options: Sequence[tuple[str, int]] = ()) -> grpc.Channel:
    """A blocking channel to `address`: TLS with `tls`, plaintext without."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


def open_aio_channel(address: str, tls: TlsConfig | None,
                     options: Sequence[tuple[str, int]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to `address`: TLS with `tls`, plaintext without."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


# -- command lines -------------------------------------------------------------------

def add_server_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str] | None,
                         what: str) -> None:
    """--ssl-certfile, --ssl-keyfile, --ssl-ca-certs, --ssl-cert-reqs (vLLM's names and
    values); with `environ`, defaulting to its SPECDEC_INTERNAL_TLS_* (the internal
    services; the gateway's public side has no defaults)."""
    env = environ or {}

    def default(name: str) -> str:
        return f" (default ${name})" if environ is not None else ""

    p.add_argument("--ssl-certfile", default=env.get(CERT_ENV) or None, metavar="PEM",
                   help=f"serve {what} over TLS with this certificate chain{default(CERT_ENV)}")
    p.add_argument("--ssl-keyfile", default=env.get(KEY_ENV) or None, metavar="PEM",
                   help=f"the certificate's private key{default(KEY_ENV)}")
    p.add_argument("--ssl-ca-certs", default=env.get(CA_ENV) or None, metavar="PEM",
                   help=f"CA certificates that client certificates must chain to"
                   f"{default(CA_ENV)}")
    p.add_argument("--ssl-cert-reqs", type=int, choices=(CERT_NONE, CERT_REQUIRED),
                   default=CERT_REQUIRED if _mtls(env) else CERT_NONE,
                   help=f"{CERT_REQUIRED}: require a client certificate signed by "
                   f"--ssl-ca-certs (mutual TLS); {CERT_NONE}: ask for none (default"
                   + (f" {CERT_REQUIRED} when ${MTLS_ENV}=1, else" if environ is not None else "")
                   + f" {CERT_NONE})")


def server_from_args(args: argparse.Namespace) -> TlsConfig | None:
    """The server's TlsConfig from add_server_arguments' flags (None: no certificate,
    plaintext). ValueError names what is missing."""
    if not (args.ssl_certfile or args.ssl_keyfile):
        if args.ssl_cert_reqs == CERT_REQUIRED:
            raise ValueError("--ssl-cert-reqs 2 needs --ssl-certfile and --ssl-keyfile")
        return None
    return TlsConfig(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs,
                     args.ssl_cert_reqs == CERT_REQUIRED)


def add_client_arguments(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """A client's --ssl-ca-certs, --ssl-certfile, --ssl-keyfile (default: `environ`'s
    internal TLS) and --plaintext."""
    p.add_argument("--ssl-ca-certs", default=environ.get(CA_ENV) or None, metavar="PEM",
                   help=f"CA certificates to trust (default ${CA_ENV}; TLS when any of "
                   f"these three is set)")
    p.add_argument("--ssl-certfile", default=environ.get(CERT_ENV) or None, metavar="PEM",
                   help=f"certificate to present, for mutual TLS (default ${CERT_ENV})")
    p.add_argument("--ssl-keyfile", default=environ.get(KEY_ENV) or None, metavar="PEM",
                   help=f"its key (default ${KEY_ENV})")
    p.add_argument("--plaintext", action="store_true",
                   help="no TLS whatever the environment says (the gateway's API without "
                   "TLS of its own)")


def client_from_args(args: argparse.Namespace) -> TlsConfig | None:
    """The client's TlsConfig from add_client_arguments' flags (None: plaintext)."""
    if args.plaintext or not (args.ssl_ca_certs or args.ssl_certfile or args.ssl_keyfile):
        return None
    return TlsConfig(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs)
