"""The remote tier's part of the configuration: ``remote_url`` and the keys that go with it.

:class:`RemoteConfig` (tier 3: Redis/Valkey, Redis Cluster, Mooncake Store) and
:func:`parse_remote`, which :func:`lmtier.config.load_config` calls on the type-checked keys: the URL
(parsed once, :mod:`lmtier.remote_url`), the per-call timeout, the serde, sealed records
(``remote_auth_key`` / ``remote_auth_accept_keys`` / ``remote_encrypt``), per-tenant budgets and the
Mooncake client settings.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmtier.config_schema import GIB, KEYS, MAX_CALL_TIMEOUT_S, ConfigError, check_serde
from lmtier.config_schema import config_error as _err
from lmtier.remote_url import (
    MooncakeEndpoint,
    RedisEndpoint,
    RemoteEndpoint,
    RemoteURLError,
    parse_remote_url,
    redact_url,
)
from lmtier.tiers.mooncake.settings import YAML_KEYS as MOONCAKE_KEYS
from lmtier.tiers.mooncake.settings import MooncakeSettings, resolve_settings
from lmtier.tiers.seal.keys import KeyRing, load_keyring, parse_sources
from lmtier.tiers.tenants import SharedBudgets, parse_tenant_shares

__all__ = ["REMOTE_TENANT_KEYS", "RemoteConfig", "parse_remote"]

logger = logging.getLogger("lmtier.config")


@dataclass(frozen=True, repr=False)
class RemoteConfig:
    """Tier 3, Redis/Valkey (single instance or cluster) or Mooncake Store (``mooncakestore://``).

    Attributes:
        url: ``remote_url`` as given (``None``: remote tier off). Never log it: use ``redacted_url``.
        endpoint: the parsed URL (:class:`lmtier.remote_url.RedisEndpoint`: hosts, socket path,
            db, credentials — the password from the URL or ``remote_password_env`` — and TLS
            options; :class:`lmtier.remote_url.MooncakeEndpoint` for ``mooncakestore://``, built by
            :meth:`lmtier.tiers.mooncake.MooncakeTier.from_config`), or ``None`` when the tier is
            off. :class:`lmtier.tiers.redis.RedisTier` is
            built from it (:meth:`~lmtier.tiers.redis.RedisTier.from_config`); the URL is parsed
            once, here.
        serde: ``remote_serde``.
        timeout_s: ``remote_timeout_s`` (per call).
        password_env: ``remote_password_env``.
        mooncake: the Mooncake client settings (``MOONCAKE_CONFIG_PATH`` and the ``mooncake_*``
            keys, :mod:`lmtier.tiers.mooncake.settings`) for ``mooncakestore://``, else None.
        auth_key: ``remote_auth_key`` (a source: ``file:PATH`` / ``env:NAME``), or None.
        accept_keys: ``remote_auth_accept_keys`` as a tuple of sources.
        encrypt: ``remote_encrypt``.
        keyring: the keys those sources hold (:class:`lmtier.tiers.seal.keys.KeyRing`: key ids and
            derived subkeys; its repr shows ids and sources only), or None when records are not sealed.
        tenants: per-tenant budgets (``remote_tenant_share`` / ``remote_tenant_shares`` /
            ``remote_tenant_capacity``: :class:`lmtier.tiers.tenants.SharedBudgets`), or None: off.
    """

    url: str | None = None
    endpoint: RemoteEndpoint | None = None
    serde: str = "naive"
    timeout_s: float = 1.0
    password_env: str | None = None
    mooncake: MooncakeSettings | None = None
    auth_key: str | None = None
    accept_keys: tuple[str, ...] = ()
    encrypt: bool = False
    keyring: KeyRing | None = None
    tenants: SharedBudgets | None = None

    @property
    def enabled(self) -> bool:
        return self.url is not None

    @property
    def scheme(self) -> str | None:
        """``"redis"``, ``"rediss"`` (TLS), ``"unix"``, ``"redis-cluster"``, ``"rediss-cluster"`` (TLS),
        ``"mooncakestore"``."""
        return self.endpoint.scheme if self.endpoint else None

    @property
    def hosts(self) -> tuple[tuple[str, int], ...]:
        """``((host, port), ...)`` for TCP schemes (one for redis/rediss); empty for unix."""
        return self.endpoint.hosts if self.endpoint else ()

    @property
    def socket_path(self) -> str | None:
        return self.endpoint.socket_path if isinstance(self.endpoint, RedisEndpoint) else None

    @property
    def db(self) -> int:
        return self.endpoint.db if isinstance(self.endpoint, RedisEndpoint) else 0

    @property
    def username(self) -> str | None:
        return self.endpoint.username if isinstance(self.endpoint, RedisEndpoint) else None

    @property
    def password(self) -> str | None:
        """From the URL or from ``remote_password_env``; never in repr."""
        return self.endpoint.password if isinstance(self.endpoint, RedisEndpoint) else None

    def __repr__(self) -> str:  # the URL may carry a password: show it redacted
        return (
            f"RemoteConfig(url={self.redacted_url!r}, endpoint={self.endpoint!r}, serde={self.serde!r}, "
            f"timeout_s={self.timeout_s!r}, password_env={self.password_env!r}"
            + (f", mooncake={self.mooncake!r}" if self.mooncake is not None else "")
            + (f", auth_key={self.auth_key!r}, accept_keys={self.accept_keys!r}" if self.auth_key else "")
            + (", encrypt=True" if self.encrypt else "")
            + (f", tenants={self.tenants!r})" if self.tenants is not None else ")")
        )

    @property
    def redacted_url(self) -> str | None:
        """``url`` with any password replaced by ``***``."""
        if self.url is None:
            return None
        return redact_url(self.url)


def parse_remote(values: dict[str, Any], env: Mapping[str, str]) -> RemoteConfig:
    """The remote tier's keys of a type-checked config (``values``: every key, defaults filled in)
    as a :class:`RemoteConfig`; ``env`` holds the secrets' variables. Keys with no effect without
    ``remote_url`` (or without a ``mooncakestore://`` one) are logged as unused.

    Raises:
        ConfigError: naming the key (a bad URL, timeout, serde, budget or signing setting).
    """
    url = values["remote_url"]
    serde = values["remote_serde"]
    timeout_s = values["remote_timeout_s"]
    password_env = values["remote_password_env"]
    check_serde("remote_serde", serde)
    if not 0 < timeout_s <= MAX_CALL_TIMEOUT_S:
        raise _err("remote_timeout_s", timeout_s, f"must be > 0 and <= {MAX_CALL_TIMEOUT_S:g} seconds per call")
    if url is None or not url.lower().startswith("mooncakestore://"):
        for key in MOONCAKE_KEYS:
            if values[key] is not None:
                logger.warning("lmtier config: %s=%r without a mooncakestore:// remote_url; unused", key, values[key])
    auth_key, accept_keys, encrypt = _check_auth(values)
    tenants = _parse_remote_tenants(values)
    if url is None:
        unused = ("remote_auth_key", "remote_auth_accept_keys", "remote_encrypt", *REMOTE_TENANT_KEYS)
        for key in (*unused, "remote_password_env", "remote_serde", "remote_timeout_s"):
            if values[key] and values[key] != KEYS[key].default:
                logger.warning("lmtier config: %s=%r without remote_url; unused", key, values[key])
        return RemoteConfig(serde=serde, timeout_s=timeout_s, password_env=password_env)
    try:
        endpoint = parse_remote_url(url, password_env=password_env, env=env)
    except RemoteURLError as e:
        raise _err(e.config_key, e.value, e.why) from None
    mooncake = None
    if isinstance(endpoint, MooncakeEndpoint):
        mooncake = resolve_settings(endpoint.master_address, values, env)
    if tenants is not None:
        _check_remote_tenants_endpoint(values, endpoint)
    keyring = None
    if auth_key is not None:
        keyring = load_keyring(auth_key, accept_keys, env, keys=("remote_auth_key", "remote_auth_accept_keys"))
    return RemoteConfig(
        url=url,
        endpoint=endpoint,
        serde=serde,
        timeout_s=timeout_s,
        password_env=password_env,
        mooncake=mooncake,
        auth_key=auth_key,
        accept_keys=accept_keys,
        encrypt=encrypt,
        keyring=keyring,
        tenants=tenants,
    )


REMOTE_TENANT_KEYS = ("remote_tenant_share", "remote_tenant_shares", "remote_tenant_capacity")


def _parse_remote_tenants(values: dict[str, Any]) -> SharedBudgets | None:
    """``remote_tenant_share(s)`` + ``remote_tenant_capacity`` (all unset: None, budgets off)."""
    shares = parse_tenant_shares(
        "remote_tenant_shares",
        values["remote_tenant_shares"],
        values["remote_tenant_share"],
        default_key="remote_tenant_share",
    )
    cap = values["remote_tenant_capacity"]
    if cap is not None and not (math.isfinite(cap) and cap > 0):
        raise _err("remote_tenant_capacity", cap, "must be a positive, finite number of GiB")
    if shares is None:
        if cap is not None:
            raise _err("remote_tenant_capacity", cap, "needs remote_tenant_share or remote_tenant_shares (budgets)")
        return None
    if cap is None:
        key = "remote_tenant_shares" if values["remote_tenant_shares"] else "remote_tenant_share"
        raise _err(
            key,
            values[key],
            "needs remote_tenant_capacity (GiB of records all tenants together may keep; the shares' whole)",
        )
    cap_bytes = int(cap * GIB)
    if cap_bytes < 1:
        raise _err("remote_tenant_capacity", cap, "is less than one byte")
    return SharedBudgets(shares, cap_bytes)


def _check_remote_tenants_endpoint(values: dict[str, Any], endpoint: Any) -> None:
    """Budgets need a single Redis/Valkey instance (docs/ARCHITECTURE.md, "Tenant budgets")."""
    key = "remote_tenant_shares" if values["remote_tenant_shares"] else "remote_tenant_share"
    if isinstance(endpoint, MooncakeEndpoint):
        raise _err(
            key,
            values[key],
            "not available with a mooncakestore:// remote_url: Mooncake Store evicts by its own LRU "
            "across all objects and has no per-owner quota, so lmtier could not keep one tenant's "
            "writes from evicting another's (docs/ARCHITECTURE.md)",
        )
    if isinstance(endpoint, RedisEndpoint) and endpoint.kind == "cluster":
        raise _err(
            key,
            values[key],
            "not available with Redis Cluster: the budget scripts need the accounting and each record in "
            "one hash slot; use a single Redis/Valkey instance (docs/ARCHITECTURE.md)",
        )


def _check_auth(values: dict[str, Any]) -> tuple[str | None, tuple[str, ...], bool]:
    """``remote_auth_key`` (one source), ``remote_auth_accept_keys`` (sources) and ``remote_encrypt``,
    checked for form (the keys are read by :func:`lmtier.tiers.seal.keys.load_keyring`)."""
    signing = parse_sources("remote_auth_key", values["remote_auth_key"])
    if len(signing) > 1:
        raise ConfigError("lmtier config: remote_auth_key: one key signs; list further keys in remote_auth_accept_keys")
    accept = parse_sources("remote_auth_accept_keys", values["remote_auth_accept_keys"])
    encrypt = values["remote_encrypt"]
    if not signing:
        if accept:
            raise _err("remote_auth_accept_keys", values["remote_auth_accept_keys"], "needs remote_auth_key")
        if encrypt:
            raise _err("remote_encrypt", encrypt, "needs remote_auth_key (the key encryption uses)")
    return (signing[0] if signing else None), accept, encrypt
