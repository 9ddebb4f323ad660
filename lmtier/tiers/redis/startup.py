"""Why a ``rediss://`` / ``rediss-cluster://`` remote tier could not start: a TLS setting that can
never work (a configuration error) or an outage (the tier degrades to misses).

At start-up :class:`lmtier.tiers.redis.RedisTier` sends one PING; when that fails on a TLS endpoint,
:func:`tls_misconfiguration` tells the two apart:

* a TLS error in the exception chain (``ssl.SSLError`` other than a timeout or a connection the
  peer closed or reset mid-handshake: certificate not trusted, host name mismatch, wrong protocol
  version, a plain-text reply where a TLS record was expected) — the handshake failed and will fail
  the same way on every connection;
* a handshake that only timed out, where a plain-text ``PING`` to the same ``host:port`` is answered
  in RESP (``+PONG``, ``-NOAUTH ...``): the server speaks plain text. Redis reads a TLS ClientHello as
  the start of an inline command and waits for its newline, so a ``rediss://`` URL pointed at a
  plain-text port ends in a handshake timeout, not an SSL error — the case that used to degrade into
  misses forever. The probe sends ``PING\\r\\n`` only (never the password) and waits at most
  ``connect_timeout_s`` + ``timeout_s`` per seed host (``connect_timeout_s`` per address a host name
  resolves to; the name lookup itself is not bounded).

Anything else (refused, unreachable, a TLS server that accepts but does not answer, or one that
closes or resets the connection during the handshake — ``ssl.SSLEOFError``,
``ssl.SSLZeroReturnError``, ``ssl.SSLSyscallError``: a server restarting or at ``maxclients``, a
load balancer without a healthy backend) is an outage.
"""

from __future__ import annotations

import socket
import ssl

from lmtier.remote_url import RedisEndpoint, node_address

__all__ = ["tls_misconfiguration", "speaks_plain_resp"]


def _chain(e: BaseException):
    seen: set[int] = set()
    stack: list[BaseException | None] = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        stack += [x.__cause__, x.__context__]


def _is_timeout(e: BaseException) -> bool:
    return isinstance(e, (TimeoutError, socket.timeout)) or "timed out" in str(e)


# SSL errors of a connection the peer closed or reset mid-handshake: an outage, not a setting
_TRANSIENT_SSL = (
    ssl.SSLEOFError,
    ssl.SSLZeroReturnError,
    ssl.SSLSyscallError,
    ssl.SSLWantReadError,
    ssl.SSLWantWriteError,
)


def speaks_plain_resp(host: str, port: int, *, connect_timeout_s: float, timeout_s: float) -> bool:
    """True when ``host:port`` answers a plain-text inline ``PING`` with a RESP simple string or
    error (first byte ``+`` or ``-``); False on any socket error, a timeout or another reply (a TLS
    server answers with an alert record, first byte 0x15, or closes)."""
    try:
        with socket.create_connection((host, port), timeout=connect_timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(b"PING\r\n")
            reply = s.recv(64)
    except OSError:
        return False
    return reply[:1] in (b"+", b"-") and b"\r\n" in reply


def tls_misconfiguration(
    endpoint: RedisEndpoint, error: BaseException, *, connect_timeout_s: float, timeout_s: float
) -> str | None:
    """Why the start-up failure ``error`` of a TLS ``endpoint`` is a setting that cannot work, as a
    sentence for a :class:`~lmtier.tiers.base.TierError` (no password: nothing from the URL), or
    None when it is an outage or the endpoint has no TLS.

    Args:
        endpoint: the parsed ``rediss://`` / ``rediss-cluster://`` URL (``tls`` set).
        error: what the first PING (or the cluster client's construction) raised.
        connect_timeout_s: connect timeout of the plain-text probe, seconds.
        timeout_s: how long the probe waits for the PING reply, seconds.
    """
    if endpoint.tls is None:
        return None
    for x in _chain(error):
        if isinstance(x, ssl.SSLError) and not isinstance(x, _TRANSIENT_SSL) and not _is_timeout(x):
            why = getattr(x, "verify_message", None) or x.reason or str(x)
            return f"TLS handshake failed ({type(x).__name__}: {why})"
    for host, port in endpoint.hosts:
        if speaks_plain_resp(host, port, connect_timeout_s=connect_timeout_s, timeout_s=timeout_s):
            plain = endpoint.scheme.replace("rediss", "redis", 1)
            return (
                f"TLS handshake failed: {node_address(host, port)} answers plain-text Redis, not TLS "
                f"(use {plain}:// for a plain-text server, or the server's TLS port)"
            )
    return None
