"""The schema of lmtier's configuration: every key with its type, default and meaning, the LMCache
compatibility lists, and the type check / environment-string parsing of one value.

Imported by :mod:`lmtier.config` (building and validating a config) and by :mod:`lmtier.envs`
(which declares one ``LMTIER_<KEY>`` override variable per key of :data:`KEYS`). Imports neither,
nor torch. The user-facing description of the keys is :mod:`lmtier.config`'s module doc.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

from lmtier.errors import LMTierError

__all__ = [
    "ConfigError",
    "KeySpec",
    "KEYS",
    "CONFIG_KEYS",
    "CODEC_LEVELS",
    "PCA_CODEC_LEVELS",
    "SERDES",
    "DISK_SHARDINGS",
    "IGNORED_LMCACHE_KEYS",
    "DISABLED_LMCACHE_FEATURES",
    "GIB",
    "check_type",
    "parse_env_value",
]

GIB = 2**30
MAX_CALL_TIMEOUT_S = 3600.0
"""Largest per-call timeout (``remote_timeout_s``, ``p2p_timeout_s``): a dead server holds a request
that long; 1e300 passed a > 0 check and failed every connection (the socket cannot take it:
OverflowError)."""
MAX_ENTRY_TTL_S = 30 * 86400.0
"""Largest ``p2p_entry_ttl_s`` (30 days; Redis refused 1e300 s as an expiry, which turned sharing off)."""
"""Bytes per GiB: every size key is in GiB (2**30 bytes), as in LMCache."""


class ConfigError(LMTierError, ValueError):
    """Invalid lmtier configuration; the message names the key and the offending value.

    Attributes:
        key: the configuration key at fault when one is (:func:`config_error`), else None.
    """

    key: str | None = None


def config_error(key: str, value: Any, why: str) -> ConfigError:
    """The :class:`ConfigError` for ``key=value`` (the message names both; ``.key`` is ``key``)."""
    err = ConfigError(f"lmtier config: {key}={value!r}: {why}")
    err.key = key
    return err


INT, FLOAT, BOOL, OPT_STR, STR, OPT_FLOAT = "int", "float", "bool", "optional str", "str", "optional float"
OPT_INT_LIST = "optional int list"


@dataclass(frozen=True)
class KeySpec:
    """One configuration key.

    Attributes:
        kind: ``"int"``, ``"float"``, ``"bool"``, ``"str"``, ``"optional str"``, ``"optional float"``
            or ``"optional int list"`` (``None`` allowed; a list of ints, one int, or a
            comma-separated string such as ``"28200,28201"``, as in the environment).
        default: the value when neither the YAML file nor the environment sets the key.
        meaning: one line for the environment registry (:mod:`lmtier.envs`) and error messages.
    """

    kind: str
    default: Any
    meaning: str


KEYS: dict[str, KeySpec] = {
    "chunk_size": KeySpec(INT, 256, "tokens per chunk (> 0, a multiple of vLLM's block size)"),
    "local_cpu": KeySpec(BOOL, True, "tier 1, the pinned CPU pool, on or off"),
    "max_local_cpu_size": KeySpec(FLOAT, 5.0, "GiB of the pinned CPU pool"),
    "local_disk": KeySpec(
        OPT_STR, None, "tier 2: comma-separated file:// directories (file://rel: cwd-relative; unset: no disk tier)"
    ),
    "max_local_disk_size": KeySpec(FLOAT, 0.0, "GiB the disk tier may fill (> 0 when local_disk is set)"),
    "local_disk_path_sharding": KeySpec(
        OPT_STR, None, "null (spread over all paths) or by_gpu (one path per GPU; on a CPU, per worker rank)"
    ),
    "disk_io_threads": KeySpec(INT, 4, "disk I/O threads (1..256)"),
    "remote_url": KeySpec(OPT_STR, None, "tier 3: redis://, rediss://, unix://, redis(s)-cluster:// URL"),
    "remote_serde": KeySpec(STR, "naive", "remote record format: naive or cachegen (the codec)"),
    "remote_timeout_s": KeySpec(FLOAT, 1.0, "seconds per remote call (> 0, <= 3600)"),
    "remote_password_env": KeySpec(OPT_STR, None, "name of the environment variable holding the Redis password"),
    "remote_auth_key": KeySpec(
        OPT_STR, None, "where the key sealing remote records is: file:PATH or env:NAME (never the key itself)"
    ),
    "remote_auth_accept_keys": KeySpec(
        OPT_STR, None, "comma-separated file:PATH / env:NAME of further keys accepted when verifying (rotation)"
    ),
    "remote_encrypt": KeySpec(BOOL, False, "encrypt remote records with AES-256-GCM (needs remote_auth_key)"),
    "mooncake_local_hostname": KeySpec(OPT_STR, None, "Mooncake: this client's address (default: route to master)"),
    "mooncake_metadata_server": KeySpec(OPT_STR, None, "Mooncake: P2PHANDSHAKE (default) or http://h:p/metadata"),
    "mooncake_global_segment_size": KeySpec(
        OPT_FLOAT, None, "Mooncake: GiB of memory mounted into the store (at most physical memory)"
    ),
    "mooncake_local_buffer_size": KeySpec(
        OPT_FLOAT, None, "Mooncake: GiB of the client's transfer buffer (at most physical memory)"
    ),
    "mooncake_protocol": KeySpec(OPT_STR, None, "Mooncake: tcp (default) or rdma"),
    "mooncake_device_name": KeySpec(OPT_STR, None, "Mooncake: RDMA device(s), e.g. mlx5_0"),
    "local_disk_serde": KeySpec(STR, "naive", "disk record format: naive or cachegen (the codec)"),
    "codec_level": KeySpec(
        STR, "default", "codec level of every cachegen serde: lossless, high, default, low, pca_high, pca_default"
    ),
    "codec_pca_model": KeySpec(
        OPT_STR, None, "PCA model file of the pca_* codec levels (written by python -m lmtier.codec.pca)"
    ),
    "codec_tables": KeySpec(
        STR, "auto", "codec entropy tables: auto (shipped, else calibrated per namespace), shipped, none"
    ),
    "codec_tables_dir": KeySpec(
        OPT_STR, None, "directory of auto-calibrated codec tables (default: lmtier-codec-tables in local_disk)"
    ),
    # Per-tenant budgets of the CPU pool (issue 18; lmtier.tiers.tenants). Both unset: budgets off.
    "cpu_tenant_share": KeySpec(
        OPT_FLOAT, None, "fraction [0, 1] of the CPU pool guaranteed to each cache_salt tenant"
    ),
    "cpu_tenant_shares": KeySpec(
        OPT_STR, None, "per-tenant CPU pool shares: tenant_id=fraction,... (id: default or 16 hex)"
    ),
    # The same in the Redis/Valkey remote tier (lmtier.tiers.redis.budget); needs remote_tenant_capacity.
    "remote_tenant_share": KeySpec(
        OPT_FLOAT, None, "fraction [0, 1] of remote_tenant_capacity guaranteed to each cache_salt tenant"
    ),
    "remote_tenant_shares": KeySpec(
        OPT_STR, None, "per-tenant remote shares: tenant_id=fraction,... (id: default or 16 hex)"
    ),
    "remote_tenant_capacity": KeySpec(
        OPT_FLOAT, None, "GiB of records all tenants together may keep in the remote tier (budgets on)"
    ),
    # ---- P2P sharing over NIXL (lmtier.tiers.p2p.settings, docs/p2p.md) ----
    "enable_p2p": KeySpec(BOOL, False, "P2P: share the CPU pool with peers over NIXL (LMCache's key)"),
    "p2p_host": KeySpec(OPT_STR, None, "P2P: the address peers know this node by (LMCache's key)"),
    "p2p_init_ports": KeySpec(OPT_INT_LIST, None, "P2P: one port per TP rank; node id = host:port (LMCache's key)"),
    "p2p_directory_url": KeySpec(OPT_STR, None, "P2P: redis:// URL of the directory (default: a redis remote_url)"),
    "p2p_allowed_peers": KeySpec(OPT_STR, None, "P2P: comma-separated node ids (host:port) or hosts allowed as peers"),
    "p2p_token_env": KeySpec(OPT_STR, None, "P2P: name of the environment variable holding the shared token"),
    "p2p_timeout_s": KeySpec(FLOAT, 1.0, "P2P: seconds per directory call or NIXL read (> 0)"),
    "p2p_entry_ttl_s": KeySpec(FLOAT, 300.0, "P2P: seconds a directory entry lives unless refreshed (> 0)"),
}
"""Every configuration key (LMCache's names where they mean the same thing)."""

CONFIG_KEYS = frozenset(KEYS)

SERDES = ("naive", "cachegen")
"""``remote_serde`` / ``local_disk_serde`` values."""

CODEC_LEVELS = ("lossless", "high", "default", "low")
"""``codec_level`` values of :class:`lmtier.tiers.codec.CodecTier` (the user levels of
:data:`lmtier.codec.levels.LEVELS`; a test keeps the two in step — the config does not import the
codec, which needs torch)."""

PCA_CODEC_LEVELS = ("pca_high", "pca_default")
"""The other ``codec_level`` values: the PCA levels (:data:`lmtier.codec.pca.PCA_LEVELS`, kept in step
by the same test; :class:`lmtier.tiers.codec_pca.PCACodecTier`), which need ``codec_pca_model``."""

CODEC_TABLES = ("auto", "shipped", "none")
"""``codec_tables`` values (:class:`lmtier.tiers.codec.CodecTier`'s ``tables`` argument)."""

DISK_SHARDINGS = ("by_gpu",)
"""``local_disk_path_sharding`` values besides null."""

IGNORED_LMCACHE_KEYS = frozenset(
    {
        "use_layerwise",  # lmtier's load path is layer-pipelined by design
        "save_decode_cache",  # lmtier stores prompt KV only; ignoring it only lowers the hit rate
        "save_unfull_chunk",  # partial chunks are never stored (see lmtier.keys)
        "enable_async_loading",
        "py_enable_gc",
        "cache_policy",  # only "LRU" (lmtier's policy) is accepted
        "p2p_lookup_ports",  # P2P lookups go through the directory (lmtier.tiers.p2p), no lookup server
    }
)
"""LMCache keys accepted in a YAML file with a warning: they do not change what lmtier computes."""

DISABLED_LMCACHE_FEATURES = frozenset({"enable_blending", "enable_controller", "enable_nixl"})
"""LMCache feature switches accepted only when false/null (lmtier does not implement them)."""


def check_type(key: str, value: Any) -> Any:
    """``value`` (from YAML or a dict) checked against ``KEYS[key].kind``; ints become floats for
    float keys. Raises :class:`ConfigError` naming the key on a wrong type or a non-finite float."""
    kind = KEYS[key].kind
    if kind == INT:
        if type(value) is not int:
            raise config_error(key, value, "must be an integer")
    elif kind == FLOAT or (kind == OPT_FLOAT and value is not None):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise config_error(key, value, "must be a number" + _yaml_float_hint(value))
        if not math.isfinite(value):
            raise config_error(key, value, "must be finite")
        value = float(value)
    elif kind == BOOL:
        if not isinstance(value, bool):
            raise config_error(key, value, "must be true or false")
    elif kind == STR:
        if not isinstance(value, str):
            raise config_error(key, value, "must be a string")
    elif kind == OPT_STR:
        if value is not None and not isinstance(value, str):
            raise config_error(key, value, "must be a string or null")
    elif kind == OPT_INT_LIST and value is not None:
        items = [value] if type(value) is int else value
        if isinstance(value, str):
            try:
                items = [int(v, 10) for v in value.strip("[] ").split(",")]
            except ValueError:
                raise config_error(key, value, "must be a list of integers such as [28200, 28201]") from None
        if not isinstance(items, (list, tuple)) or any(type(v) is not int for v in items):
            raise config_error(key, value, "must be a list of integers (or one integer) or null")
        value = tuple(items)
    return value


def _yaml_float_hint(value: Any) -> str:
    """A hint for text that is a number to Python but a string to YAML 1.1 (PyYAML reads ``1e-3``,
    without a dot or an exponent sign, as text)."""
    if not isinstance(value, str):
        return ""
    try:
        float(value)
    except ValueError:
        return ""
    return " (YAML read it as text: write a number without quotes, and an exponent as 5.0e-1, not 5e-1)"


def parse_env_value(key: str, env_name: str, raw: str) -> Any:
    """Parse the text of environment variable ``env_name`` as a value of ``key``.

    Bools: ``1/0/true/false/yes/no/on/off`` (any case); optional strings: ``""``, ``none`` or
    ``null`` mean unset; surrounding white space is ignored. Raises :class:`ConfigError` naming
    the variable and the key when the text does not parse as the key's type."""
    kind = KEYS[key].kind
    text = raw.strip()
    try:
        if kind == INT:
            return int(text, 10)
        if kind == FLOAT:
            return float(text)
        if kind == OPT_FLOAT:
            return None if text.lower() in ("", "none", "null") else float(text)
        if kind == BOOL:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind == OPT_STR:
            return None if text.lower() in ("", "none", "null") else text
        if kind == OPT_INT_LIST:
            low = text.lower().strip("[]")
            return None if low in ("", "none", "null") else tuple(int(v, 10) for v in low.split(","))
        return text
    except ValueError:
        raise ConfigError(f"lmtier config: {env_name}={raw!r}: cannot parse as {kind} for key {key!r}") from None


def check_serde(key: str, serde: str) -> None:
    """ConfigError naming ``key`` unless ``serde`` is one of :data:`SERDES` this build can run
    (``cachegen`` needs :mod:`lmtier.codec`)."""
    if serde not in SERDES:
        raise config_error(key, serde, f"must be one of {list(SERDES)}")
    if serde == "cachegen" and importlib.util.find_spec("lmtier.codec") is None:
        raise config_error(key, serde, "requires the lmtier.codec module, which this build does not have")
