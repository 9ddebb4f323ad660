"""lmtier.tiers.redis.startup: which start-up failures of a TLS endpoint are a setting (TierError)
and which an outage (degrade). No Redis server needed: the errors are built by hand and the
plain-text probe goes to a local port nothing listens on (refused at once)."""

from __future__ import annotations

import socket
import ssl
import time

import pytest

from lmtier.remote_url import parse_redis_url
from lmtier.tiers.redis.startup import tls_misconfiguration


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chained(inner: BaseException) -> BaseException:
    """The shape redis-py raises: ConnectionError raised while handling the socket/SSL error."""
    try:
        try:
            raise inner
        except OSError as e:
            raise ConnectionError(f"Error connecting to 127.0.0.1: {e}") from e
    except ConnectionError as outer:
        return outer


@pytest.mark.parametrize(
    "err",
    [
        ssl.SSLEOFError(8, "EOF occurred in violation of protocol (_ssl.c:1000)"),
        ssl.SSLZeroReturnError(6, "TLS/SSL connection has been closed (EOF) (_ssl.c:1000)"),
        ssl.SSLSyscallError(5, "Some I/O error occurred (_ssl.c:1000)"),
        TimeoutError("_ssl.c:1000: The handshake operation timed out"),
        ConnectionRefusedError(111, "Connection refused"),
    ],
    ids=["eof", "zero-return", "syscall", "timeout", "refused"],
)
def test_peer_closing_or_resetting_mid_handshake_is_an_outage(err):
    """A TLS server restarting, at maxclients or behind a load balancer without a backend closes the
    connection during the handshake: an outage (None), never a configuration error."""
    ep = parse_redis_url(f"rediss://:pw@127.0.0.1:{_closed_port()}/0")
    t0 = time.monotonic()
    assert tls_misconfiguration(ep, _chained(err), connect_timeout_s=0.5, timeout_s=0.5) is None
    assert time.monotonic() - t0 < 2.0


def test_untrusted_certificate_is_a_setting_without_the_password():
    ep = parse_redis_url(f"rediss://:s3cret-pw@127.0.0.1:{_closed_port()}/0")
    err = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    err.verify_message = "self-signed certificate"
    why = tls_misconfiguration(ep, _chained(err), connect_timeout_s=0.5, timeout_s=0.5)
    assert why == "TLS handshake failed (SSLCertVerificationError: self-signed certificate)"


def test_plain_text_endpoint_has_no_tls_question():
    ep = parse_redis_url(f"redis://127.0.0.1:{_closed_port()}/0")
    assert tls_misconfiguration(ep, _chained(ssl.SSLError(1, "x")), connect_timeout_s=0.5, timeout_s=0.5) is None
