"""specdec.server's guard against serving beyond loopback with nothing to authenticate
the callers: what counts as loopback, what counts as authentication, and the published
address of a service in a container."""

from __future__ import annotations

import argparse

import pytest

from specdec.server import (
    add_open_access_argument,
    internal_callers_authenticated,
    is_loopback,
    open_access_refusal,
)
from specdec.tls import TlsConfig


def test_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("[::1]")
    assert is_loopback("localhost") and is_loopback("127.9.9.9")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.5")
    assert not is_loopback("verifier")  # a name may resolve anywhere


@pytest.mark.parametrize(("argv", "authenticated", "refused_on"), [
    (["--host", "0.0.0.0"], False, "0.0.0.0"),
    (["--host", "0.0.0.0"], True, None),
    (["--host", "0.0.0.0", "--allow-unauthenticated"], False, None),
    (["--host", "127.0.0.1"], False, None),
    # In a container: the address the host publishes it on counts, not the bind.
    (["--host", "0.0.0.0", "--published-host", "127.0.0.1"], False, None),
    (["--host", "127.0.0.1", "--published-host", "0.0.0.0"], False, "0.0.0.0"),
])
def test_open_access_is_refused_unless_told(monkeypatch, argv, authenticated, refused_on):
    monkeypatch.delenv("SPECDEC_ALLOW_UNAUTHENTICATED", raising=False)
    monkeypatch.delenv("SPECDEC_PUBLISHED_HOST", raising=False)
    p = argparse.ArgumentParser()
    p.add_argument("--host")
    add_open_access_argument(p, "a key")
    refusal = open_access_refusal("svc", p.parse_args(argv), authenticated, "Set a key")
    if refused_on is None:
        assert refusal is None
    else:
        assert refusal.startswith(f"svc: refusing to serve on {refused_on} without")
        assert "Set a key" in refusal


def test_internal_callers_authenticate_by_token_or_client_certificates(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDEC_INTERNAL_TOKEN", raising=False)
    ca = tmp_path / "ca.pem"
    ca.write_text("unused")
    for name in ("cert.pem", "key.pem"):
        (tmp_path / name).write_text("unused")
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    assert not internal_callers_authenticated(None)
    assert not internal_callers_authenticated(TlsConfig(cert, key, str(ca)))  # TLS alone
    assert internal_callers_authenticated(TlsConfig(cert, key, str(ca), require_client_cert=True))
    monkeypatch.setenv("SPECDEC_INTERNAL_TOKEN", "t")
    assert internal_callers_authenticated(None)
