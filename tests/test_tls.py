"""TLS on the gRPC links (specdec.tls): a server with a certificate answers clients
that trust its CA and no others; one that requires client certificates refuses a
client without one; the internal configuration comes from SPECDEC_INTERNAL_TLS_*,
which `specdec health` speaks too."""

from __future__ import annotations

import argparse

import pytest

from specdec import cli, tls
from specdec.server import check_health, start_server
from specdec.tls import TlsConfig


@pytest.fixture(scope="module")
def servers(loop, pki):
    """Health-only servers: TLS, and TLS requiring a client certificate."""
    started = {name: loop.run(start_server("127.0.0.1:0", lambda s: None, [],
                                           tls=pki.server(require_client_cert=mtls)))
               for name, mtls in (("tls", False), ("mtls", True))}
    yield {name: f"127.0.0.1:{s.port}" for name, s in started.items()}
    for s in started.values():
        loop.run(s.stop(0.1))


def test_a_tls_server_answers_only_clients_that_trust_its_ca(servers, pki):
    address = servers["tls"]
    assert check_health(address, tls=pki.client(with_cert=False))
    assert not check_health(address, timeout_s=1.0)  # plaintext
    assert not check_health(address, timeout_s=1.0, tls=TlsConfig(ca_certs=str(pki.other_ca)))
    assert not check_health(address, timeout_s=1.0, tls=TlsConfig())  # the system's roots


def test_mutual_tls_refuses_a_client_without_a_certificate(servers, pki):
    address = servers["mtls"]
    assert check_health(address, tls=pki.client(with_cert=True))
    assert not check_health(address, timeout_s=1.0, tls=pki.client(with_cert=False))
    assert not check_health(address, timeout_s=1.0)


def test_config_checks_its_files(pki, tmp_path):
    with pytest.raises(ValueError, match="needs its key"):
        TlsConfig(certfile=str(pki.server_cert))
    with pytest.raises(ValueError, match="needs the CA"):
        TlsConfig(str(pki.server_cert), str(pki.server_key), require_client_cert=True)
    with pytest.raises(ValueError, match="no such file"):
        TlsConfig(ca_certs=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="serving needs a certificate"):
        TlsConfig(ca_certs=str(pki.ca)).server_credentials()


def test_internal_config_from_the_environment(pki):
    assert TlsConfig.from_env({}) is None
    env = {tls.CERT_ENV: str(pki.server_cert), tls.KEY_ENV: str(pki.server_key),
           tls.CA_ENV: str(pki.ca)}
    assert TlsConfig.from_env(env) == pki.server()
    assert TlsConfig.from_env({**env, tls.MTLS_ENV: "1"}) == pki.server(require_client_cert=True)
    # The services' flags default to the same variables.
    p = argparse.ArgumentParser()
    tls.add_server_arguments(p, {**env, tls.MTLS_ENV: "1"}, "the API")
    assert tls.server_from_args(p.parse_args([])) == pki.server(require_client_cert=True)
    assert tls.server_from_args(p.parse_args(["--ssl-cert-reqs", "0"])) == pki.server()
    # The gateway's public flags do not: plaintext unless given.
    p = argparse.ArgumentParser()
    tls.add_server_arguments(p, None, "the API")
    assert tls.server_from_args(p.parse_args([])) is None
    with pytest.raises(ValueError, match="needs --ssl-certfile"):
        tls.server_from_args(p.parse_args(["--ssl-cert-reqs", "2"]))


def test_specdec_health_speaks_the_internal_tls(servers, pki, monkeypatch):
    for name in (tls.CERT_ENV, tls.KEY_ENV, tls.CA_ENV, tls.MTLS_ENV):
        monkeypatch.delenv(name, raising=False)
    argv = ["health", servers["mtls"], "--timeout", "1"]
    assert cli.main(argv) == 1
    monkeypatch.setenv(tls.CERT_ENV, str(pki.client_cert))
    monkeypatch.setenv(tls.KEY_ENV, str(pki.client_key))
    monkeypatch.setenv(tls.CA_ENV, str(pki.ca))
    assert cli.main(argv) == 0
    assert cli.main([*argv, "--plaintext"]) == 1
