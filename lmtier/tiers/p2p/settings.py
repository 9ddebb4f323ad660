"""P2P sharing settings: the ``enable_p2p`` / ``p2p_*`` configuration keys resolved into one frozen
:class:`P2PSettings`.

Pure Python (no ``nixl`` or ``redis`` import): :mod:`lmtier.config` resolves the settings at load
time, so a bad key is a :class:`~lmtier.config_schema.ConfigError` naming it before anything starts.

Keys (LMCache's names where they mean the same thing; docs/p2p.md)::

    enable_p2p: true                  # LMCache: turn P2P sharing on
    p2p_host: "10.0.0.7"              # LMCache: the address peers know this node by
    p2p_init_ports: [28200, 28201]    # LMCache: one port per TP rank; node id = "<p2p_host>:<port>"
    p2p_directory_url: "redis://dir:6379/0"   # lmtier: the Redis/Valkey holding the directory
                                              # (default: remote_url when that is a redis:// URL)
    p2p_allowed_peers: "10.0.0.8,10.0.0.9:28200"  # lmtier: node ids or hosts allowed as peers
    p2p_token_env: P2P_SECRET         # lmtier: variable holding the shared token (entries are MACed)
    p2p_timeout_s: 1.0                # lmtier: longest wait of one directory call or NIXL read
    p2p_entry_ttl_s: 300              # lmtier: lifetime of a directory entry (refreshed while held)

A node must name its peers (``p2p_allowed_peers``), share a token (``p2p_token_env``), or both.
LMCache's ``p2p_lookup_ports`` is accepted and ignored (lookups go through the directory).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lmtier.config_schema import KEYS as CONFIG_KEYS
from lmtier.config_schema import MAX_CALL_TIMEOUT_S, MAX_ENTRY_TTL_S, config_error
from lmtier.remote_url import RedisEndpoint, RemoteURLError, parse_redis_url

__all__ = ["P2PSettings", "KEYS", "resolve_settings", "MIN_TOKEN_BYTES"]

log = logging.getLogger("lmtier.config")

KEYS = (
    "p2p_host",
    "p2p_init_ports",
    "p2p_directory_url",
    "p2p_allowed_peers",
    "p2p_token_env",
    "p2p_timeout_s",
    "p2p_entry_ttl_s",
)
"""The ``p2p_*`` keys (besides ``enable_p2p``) this module resolves."""

MIN_TOKEN_BYTES = 16
"""Shortest shared token accepted (bytes of its UTF-8 text)."""


@dataclass(frozen=True)
class P2PSettings:
    """What a node needs to share its CPU pool with peers.

    Attributes:
        host: ``p2p_host``.
        init_ports: ``p2p_init_ports`` (one per TP rank).
        directory: the directory's parsed endpoint (``p2p_directory_url``, else ``remote_url``).
        directory_url: the URL for logs (no credentials).
        allowed_peers: ``p2p_allowed_peers`` entries (node ids ``host:port`` or hosts); empty: any
            node holding the token.
        token_env: ``p2p_token_env``.
        token: the shared token's bytes (never in repr), or None.
        timeout_s: ``p2p_timeout_s``.
        entry_ttl_s: ``p2p_entry_ttl_s``.
    """

    host: str
    init_ports: tuple[int, ...]
    directory: RedisEndpoint
    directory_url: str
    allowed_peers: tuple[str, ...] = ()
    token_env: str | None = None
    token: bytes | None = field(default=None, repr=False, compare=False)
    timeout_s: float = 1.0
    entry_ttl_s: float = 300.0

    def node_id(self, tp_rank: int) -> str:
        """This rank's node id, ``"<p2p_host>:<p2p_init_ports[tp_rank]>"``.

        Raises:
            ConfigError: ``p2p_init_ports`` has no port for ``tp_rank``.
        """
        if not 0 <= tp_rank < len(self.init_ports):
            raise config_error(
                "p2p_init_ports", list(self.init_ports), f"has no port for TP rank {tp_rank} (one port per rank)"
            )
        return f"{self.host}:{self.init_ports[tp_rank]}"

    def allows(self, node_id: str) -> bool:
        """True if ``node_id`` may be a peer: no allow-list, or it lists the node id or its host."""
        if not self.allowed_peers:
            return True
        return node_id in self.allowed_peers or node_id.rpartition(":")[0] in self.allowed_peers


def _ports(value: Any) -> tuple[int, ...]:
    if value is None:
        raise config_error("p2p_init_ports", value, "must be set when enable_p2p is true (one port per TP rank)")
    ports = tuple(value)
    if not ports:
        raise config_error("p2p_init_ports", value, "must name at least one port")
    for p in ports:
        if type(p) is not int or not 1 <= p <= 65535:
            raise config_error("p2p_init_ports", value, f"port {p!r} is not an int in 1..65535")
    if len(set(ports)) != len(ports):
        raise config_error("p2p_init_ports", value, "ports must be distinct (one per TP rank)")
    return ports


def resolve_settings(values: Mapping[str, Any], env: Mapping[str, str]) -> P2PSettings | None:
    """The P2P settings of a configuration, or None when ``enable_p2p`` is false.

    Args:
        values: the config's type-checked values of ``enable_p2p``, :data:`KEYS`, ``local_cpu`` and
            ``remote_url`` (``None`` = unset).
        env: the environment (the token variable named by ``p2p_token_env``).

    Raises:
        ConfigError: naming the key: a missing ``p2p_host`` / ``p2p_init_ports`` / directory, a bad
            port, a directory URL that is not a single Redis/Valkey instance, an unset or short
            token variable, neither allow-list nor token, non-positive timeouts, no CPU pool.
    """
    if not values["enable_p2p"]:
        for k in KEYS:
            if values.get(k) != CONFIG_KEYS[k].default:
                log.warning("lmtier config: %s=%r without enable_p2p; unused", k, values[k])
        return None
    if not values["local_cpu"]:
        raise config_error("enable_p2p", True, "P2P shares the CPU pool: local_cpu must be true")
    host = values["p2p_host"]
    if host is None or not host.strip() or any(c in host for c in " ,"):
        raise config_error("p2p_host", host, "must be the address peers know this node by (no spaces or commas)")
    ports = _ports(values["p2p_init_ports"])
    key, url = "p2p_directory_url", values["p2p_directory_url"]
    if url is None:
        remote = values.get("remote_url")
        if remote is None or not remote.lower().startswith(("redis://", "rediss://", "unix://")):
            raise config_error(
                "p2p_directory_url", url, "must be set (a redis:// URL) unless remote_url is a redis:// URL"
            )
        key, url = "remote_url", remote
    try:
        directory = parse_redis_url(url, env=env)
    except RemoteURLError as e:
        raise config_error(key, e.value, e.why) from None
    if directory.kind == "cluster":
        raise config_error(key, directory.describe(), "the P2P directory needs a single Redis/Valkey instance")
    allowed = tuple(p.strip() for p in (values["p2p_allowed_peers"] or "").split(",") if p.strip())
    token_env = values["p2p_token_env"]
    token = None
    if token_env is not None:
        text = env.get(token_env)
        if not text:
            raise config_error("p2p_token_env", token_env, "names an environment variable that is not set")
        token = text.encode()
        if len(token) < MIN_TOKEN_BYTES:
            raise config_error("p2p_token_env", token_env, f"the token must have >= {MIN_TOKEN_BYTES} bytes")
    if not allowed and token is None:
        raise config_error(
            "enable_p2p", True, "name the peers (p2p_allowed_peers) or a shared token (p2p_token_env), or both"
        )
    if not 0 < values["p2p_timeout_s"] <= MAX_CALL_TIMEOUT_S:
        raise config_error(
            "p2p_timeout_s", values["p2p_timeout_s"], f"must be > 0 and <= {MAX_CALL_TIMEOUT_S:g} seconds per call"
        )
    if not 1 <= values["p2p_entry_ttl_s"] <= MAX_ENTRY_TTL_S:  # below 1 s an entry expires before peers read it
        raise config_error(
            "p2p_entry_ttl_s", values["p2p_entry_ttl_s"], f"must be >= 1 and <= {MAX_ENTRY_TTL_S:g} seconds"
        )
    return P2PSettings(
        host=host.strip(),
        init_ports=ports,
        directory=directory,
        directory_url=directory.describe(),
        allowed_peers=allowed,
        token_env=token_env,
        token=token,
        timeout_s=float(values["p2p_timeout_s"]),
        entry_ttl_s=float(values["p2p_entry_ttl_s"]),
    )
