"""lmtier configuration: a YAML file plus ``LMTIER_<KEY>`` environment overrides, strictly validated.

Key names follow LMCache's where they mean the same thing, so an LMCache config file works
unchanged::

    chunk_size: 256                       # tokens per chunk (> 0; multiple of vLLM's block size)
    local_cpu: true                       # tier 1: pinned CPU pool
    max_local_cpu_size: 5                 # GiB (float) of the CPU pool (> 0 when local_cpu)
    local_disk: "file:///mnt/nvme/lmtier" # tier 2; several comma-separated paths spread I/O (see below)
    max_local_disk_size: 100              # GiB; must be > 0 when local_disk is set
    local_disk_path_sharding: by_gpu      # or null: pick one path per GPU id instead of spreading
    remote_url: "redis://host:6379/0"     # tier 3: redis://, rediss:// (TLS), unix://, redis(s)-cluster://h:p,h:p
    remote_serde: naive                   # "naive" (raw canonical bytes) or "cachegen" (needs lmtier.codec)

``local_disk`` paths: ``file:///abs/dir`` (three slashes: an absolute path), ``file://rel/dir`` (two
slashes: ``rel/dir`` relative to the working directory of the process that loads the config — the
form of LMCache's examples, ``file://local_disk/``), or a plain path; ``~`` is expanded and
percent-escapes are decoded. Each is made absolute once, when the config is loaded
(:func:`lmtier.config_checks.parse_disk_paths`), so a later ``chdir`` does not move the cache, and
``to_dict()`` shows the absolute ``file://`` form.

Per-tenant budgets of the CPU pool (issue 18, :mod:`lmtier.tiers.tenants`; off unless one is set)::

    cpu_tenant_share: 0.2                 # each cache_salt tenant is guaranteed 20% of the pool
    cpu_tenant_shares: "default=0.1,3f2a0c9e1b7d4a65=0.5"   # per tenant (tenant_id(salt) or default)

A tenant is a request's ``cache_salt`` (no salt: ``default``), named by a 16-hex-digit digest
(:func:`lmtier.tiers.tenants.tenant_id`), never by the salt. Other tenants' stores never evict a
tenant's chunks below its guaranteed share; unused shares are borrowed and reclaimed.

The same in the Redis/Valkey remote tier (:mod:`lmtier.tiers.redis.budget`; single instance only,
not Redis Cluster nor Mooncake Store: a :class:`ConfigError` names the key)::

    remote_tenant_capacity: 40            # GiB of records lmtier keeps in Redis (the shares' whole)
    remote_tenant_share: 0.05             # and/or remote_tenant_shares: "id=fraction,..."

lmtier then evicts in Redis itself, so the budgets hold only while Redis does not: set the server's
``maxmemory-policy`` to ``noeviction`` (or ``volatile-*``), not ``allkeys-*``, which evicts any key,
other tenants' guaranteed records and lmtier's accounting among them. This is not enforced: at
start-up lmtier reads the policy (``CONFIG GET``) and, for ``allkeys-*`` or a ``maxmemory`` below
``remote_tenant_capacity``, logs a warning and starts anyway (the budgets are then not guaranteed);
where the server refuses ``CONFIG`` (managed Redis) it logs a line saying what to check and starts.
LMCache has per-``cache_salt`` quotas only in its multiprocess server (``IsolatedLRU``, set at run
time through ``/quota``), with no configuration key to mirror, hence lmtier's names.

lmtier-only keys: ``remote_timeout_s`` (seconds per remote call, default 1.0),
``remote_password_env`` (name of an environment variable holding the Redis password; never logged),
``disk_io_threads`` (default 4), and the codec keys below.

Sealed remote records (docs/threat_model.md, :mod:`lmtier.tiers.seal`)::

    remote_auth_key: "file:/etc/lmtier/seal.key"   # or "env:KV_SEAL_KEY"; hex text, 32..64 bytes
    remote_auth_accept_keys: "env:OLD_SEAL_KEY"    # further keys accepted when verifying (rotation)
    remote_encrypt: true                           # AES-256-GCM payloads (default false: GMAC only)

The configuration names where each key is, never the key (name a variable outside ``LMTIER_*``:
those are lmtier's settings, and ``LMTIER_REMOTE_AUTH_KEY`` overrides the *source*, so a key pasted
there is rejected unechoed); keys are read and checked when the config
is built (an unreadable file, an unset variable, non-hex text or a key outside 32..64 bytes is a
:class:`ConfigError`). With ``remote_auth_key`` every remote record is authenticated and bound to
its chunk key and namespace, and a record that does not verify is a miss (deleted); without it
the tier manager warns at start-up that anyone able to write to the store can plant KV.

Mooncake Store (docs/mooncake.md): ``remote_url: "mooncakestore://MASTER_HOST:PORT/"``; the client
settings come from the JSON file named by ``MOONCAKE_CONFIG_PATH`` (Mooncake's key names) and/or the
lmtier keys ``mooncake_local_hostname``, ``mooncake_metadata_server`` (default ``P2PHANDSHAKE``),
``mooncake_global_segment_size`` / ``mooncake_local_buffer_size`` (GiB), ``mooncake_protocol``
(``tcp`` default, ``rdma``), ``mooncake_device_name``; the keys win over the file
(:mod:`lmtier.tiers.mooncake.settings`).

P2P sharing over NIXL (docs/p2p.md): ``enable_p2p``, ``p2p_host``, ``p2p_init_ports`` (LMCache's
keys), ``p2p_directory_url``, ``p2p_allowed_peers``, ``p2p_token_env``, ``p2p_timeout_s``,
``p2p_entry_ttl_s`` (:mod:`lmtier.tiers.p2p.settings`).

Codec (``lmtier.codec``, docs/codec.md)::

    remote_serde: cachegen                # LMCache's name: remote records are lmtier codec records
    local_disk_serde: cachegen            # lmtier-only: the same for the disk tier (default naive)
    codec_level: default                  # lossless | high | default | low | pca_high | pca_default
    codec_tables: auto                    # auto (default) | shipped | none: the rANS tables (below)
    codec_tables_dir: /path               # auto-calibrated tables (default: <local_disk>/lmtier-codec-tables)
    codec_pca_model: /path/model.lmtpca   # the PCA levels' model file (required with pca_*, else an error)

``cachegen`` selects lmtier's codec (CacheGen-style quantization + rANS, not LMCache's byte format;
an LMCache file's ``remote_serde: cachegen`` gets lmtier's ``default`` level unless ``codec_level``
says otherwise). ``codec_level`` applies to every tier whose serde is ``cachegen``; set without any
``cachegen`` serde it is accepted with a warning and unused. The CPU pool always holds raw
canonical chunks. The codec needs a bf16/fp16 cache with K and V planes; the lossy levels also a
power-of-two head size: :meth:`lmtier.manager.TierManager.from_config` raises :class:`ConfigError`
naming the serde key otherwise (the geometry is only known there, from the namespace).

``codec_tables`` (lmtier-only; LMCache has no such key): the static entropy-coding tables of the
lossy levels. ``shipped``: the tables shipped in the package where they exist for the model's
geometry (SmolLM2-135M today), else per-stream tables (each record carries its own, ~10 % larger).
``auto`` (default): the shipped tables where they exist, else tables calibrated on the first 16
chunks a tier stores for the namespace and persisted as a versioned, checksummed file in
``codec_tables_dir`` (:mod:`lmtier.codec.autotables`; records written before carry per-stream
tables and stay readable). The disk tier's default directory is ``lmtier-codec-tables`` in its
(first) ``local_disk`` directory; a remote tier auto-calibrates only with ``codec_tables_dir`` set —
a directory every node sharing the remote tier sees — and otherwise behaves as ``shipped``
(tables only one node knows would make its records unreadable to the others). ``none``: per-stream
tables always.

The PCA levels (``pca_high``, ``pca_default``; experimental, docs/codec.md "PCA levels") code with
per-model data calibrated offline: ``codec_pca_model`` names the file ``python -m lmtier.codec.pca``
wrote for the served model (``~`` expanded, made absolute at load). A PCA level without it, the key
with another level or without a ``cachegen`` serde, and a path that is not a readable file are
:class:`ConfigError`; the file's content (a PCA model file, calibrated for this rank's KV: ``L``,
this rank's KV heads, ``D``) is checked when the tiers are built
(:func:`lmtier.tiers.factory.build_tiers`, before serving). ``codec_tables`` / ``codec_tables_dir``
do not apply to the PCA levels (their tables are in the model file): set with one, they are
ignored with a warning. A PCA tier stores a chunk only when its store names the chunk's position.

Keys and the codec (decision): chunk keys do **not** change with the serde, and the namespace's
``codec`` field is not derived from these keys (it stays ``"none"`` for caches whose canonical
bytes are handed to the tiers as they are, which is every cache today): the serde is a property of
how one tier stores a chunk, and disk and remote may differ. Separation happens one level down:
:class:`lmtier.tiers.codec.CodecTier` stores each record under a key derived from the chunk key,
the serde, the record format version and the level, so raw chunks and records of different levels
never share a key in a shared disk directory or Redis. Records are self-describing (the LMKC
header names the level, geometry and dtype) and are checked on every read, but a raw chunk has no
header, so a naive reader could not tell a record from KV: disjoint key spaces, not headers, keep
them apart. Consequence: processes with different serdes or levels do not share chunks.

Sizes are GiB (2**30 bytes), as in LMCache. Defaults: the disk tier is off unless ``local_disk`` is
set, and then ``max_local_disk_size`` must be set too (> 0): lmtier never guesses how much of a
disk it may fill. ``max_local_disk_size`` without ``local_disk`` is accepted with a warning (LMCache
files often carry it) and ignored.

Loading (:func:`load_config`): the YAML file named by the ``path`` argument or else by
``LMTIER_CONFIG_FILE`` (optional), then ``LMTIER_<KEY>`` environment variables (``<KEY>`` is the
upper-cased key, e.g. ``LMTIER_MAX_LOCAL_CPU_SIZE=2.5``), parsed by the key's type (bools:
``1/0/true/false/yes/no/on/off``; optional strings: ``""``, ``none`` or ``null`` mean unset).

Strictness: an unknown key or a key given twice in the YAML file, a wrong type, an impossible value
(non-positive chunk size, negative or non-finite sizes, unwritable disk path, malformed URL,
unsupported serde) or an override variable whose text does not parse raises :class:`ConfigError`
naming the key and the value. An ``LMTIER_*`` variable that is not an override is not an error: the
registry of every variable lmtier reads (:mod:`lmtier.envs`) logs a warning naming an undeclared
one (a mistyped override, e.g. ``LMTIER_CHUNKSIZE``, shows there with the name it resembles). Two
short, documented lists of LMCache keys are tolerated in the file: :data:`IGNORED_LMCACHE_KEYS`
(harmless hints lmtier does not implement: accepted with a warning) and
:data:`DISABLED_LMCACHE_FEATURES` (LMCache features lmtier does not have: accepted only when set to
a false value, an error otherwise). The chunk size is checked against vLLM's actual block size by
:meth:`LMTierConfig.validate_for` once the block size is known.

Layout of the configuration code: the key table, the LMCache lists and the parsing of one value
are :mod:`lmtier.config_schema`; the checks against this machine (writable directories, memory and
file-system sizes) are :mod:`lmtier.config_checks`; the environment variables are declared in
:mod:`lmtier.envs`; reading the YAML file is :mod:`lmtier.config_file`. This module builds the
config (and parses ``remote_url``).

Logging: ``logging.getLogger("lmtier.config")``; :meth:`LMTierConfig.log_effective` logs the
effective configuration once per process, with passwords redacted.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lmtier import envs
from lmtier.config_checks import (
    check_readable_file,
    filesystems_bytes,
    parse_disk_paths,
    physical_memory_bytes,
    warn_chunk_size,
)
from lmtier.config_file import read_config_file
from lmtier.config_remote import RemoteConfig, parse_remote
from lmtier.config_schema import (
    CODEC_LEVELS,
    CODEC_TABLES,
    DISABLED_LMCACHE_FEATURES,
    DISK_SHARDINGS,
    GIB,
    IGNORED_LMCACHE_KEYS,
    KEYS,
    PCA_CODEC_LEVELS,
    ConfigError,
    check_serde,
    check_type,
    parse_env_value,
)
from lmtier.config_schema import config_error as _err
from lmtier.tiers.mooncake.settings import YAML_KEYS as MOONCAKE_KEYS
from lmtier.tiers.p2p.settings import P2PSettings
from lmtier.tiers.p2p.settings import resolve_settings as resolve_p2p
from lmtier.tiers.tenants import TenantShares, parse_tenant_shares

__all__ = [
    "ConfigError",
    "CPUConfig",
    "DiskConfig",
    "RemoteConfig",
    "LMTierConfig",
    "load_config",
    "naming_overrides",
    "CODEC_LEVELS",
    "PCA_CODEC_LEVELS",
    "IGNORED_LMCACHE_KEYS",
    "DISABLED_LMCACHE_FEATURES",
    "CONFIG_FILE_ENV",
    "GIB",
]

logger = logging.getLogger("lmtier.config")

CONFIG_FILE_ENV = envs.CONFIG_FILE


# --------------------------------------------------------------------------------------------- #
# Per-concern configs


@dataclass(frozen=True)
class CPUConfig:
    """Tier 1, the pinned CPU pool.

    Attributes:
        enabled: ``local_cpu``.
        max_size_gb: ``max_local_cpu_size`` in GiB (> 0 when enabled).
        tenants: per-tenant guaranteed shares (``cpu_tenant_share`` / ``cpu_tenant_shares``), or
            None: budgets off.
    """

    enabled: bool = True
    max_size_gb: float = 5.0
    tenants: TenantShares | None = None

    @property
    def capacity_bytes(self) -> int:
        """Pool capacity in bytes (0 when disabled)."""
        return int(self.max_size_gb * GIB) if self.enabled else 0


@dataclass(frozen=True)
class DiskConfig:
    """Tier 2, local disk.

    Attributes:
        paths: absolute directories from ``local_disk`` (empty: disk tier off).
        max_size_gb: ``max_local_disk_size`` in GiB.
        path_sharding: ``None`` (spread chunks over all paths) or ``"by_gpu"`` (one path per GPU).
        io_threads: ``disk_io_threads``.
        serde: ``local_disk_serde`` (``"naive"`` or ``"cachegen"``).
    """

    paths: tuple[str, ...] = ()
    max_size_gb: float = 0.0
    path_sharding: str | None = None
    io_threads: int = 4
    serde: str = "naive"

    @property
    def enabled(self) -> bool:
        return bool(self.paths)

    @property
    def capacity_bytes(self) -> int:
        return int(self.max_size_gb * GIB) if self.enabled else 0

    def paths_for(self, gpu_id: int) -> tuple[str, ...]:
        """The directories this process uses: one (``paths[gpu_id % n]``) with ``by_gpu``, else all."""
        if self.path_sharding == "by_gpu" and self.paths:
            return (self.paths[gpu_id % len(self.paths)],)
        return self.paths


@dataclass(frozen=True)
class LMTierConfig:
    """The whole configuration: ``chunk_size``, ``codec_level`` (the level of every ``cachegen``
    serde) plus one small config per tier."""

    chunk_size: int = 256
    cpu: CPUConfig = field(default_factory=CPUConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    codec_level: str = "default"
    codec_tables: str = "auto"
    """``codec_tables``: ``auto``, ``shipped`` or ``none`` (see the module doc)."""
    codec_tables_dir: str | None = None
    """``codec_tables_dir`` as an absolute path, or None."""
    codec_pca_model: str | None = None
    """``codec_pca_model`` as an absolute path (a readable file; loaded and checked against the cache
    by :func:`lmtier.tiers.factory.build_tiers`), or None: set exactly when ``codec_level`` is a PCA
    level."""
    p2p: P2PSettings | None = None
    """P2P sharing over NIXL (``enable_p2p`` and the ``p2p_*`` keys, :mod:`lmtier.tiers.p2p.settings`);
    None when off."""

    def serde_level(self, tier: str) -> str | None:
        """The codec level of ``tier`` (``"disk"`` or ``"remote"``), or None when its serde is naive."""
        serde = {"disk": self.disk.serde, "remote": self.remote.serde}[tier]
        return self.codec_level if serde == "cachegen" else None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, env: Mapping[str, str] | None = None) -> LMTierConfig:
        """Build and validate a config from flat LMCache-style keys (as in the YAML file).

        Args:
            values: the keys and their values.
            env: the environment the keys that name variables read (``remote_password_env``,
                ``p2p_token_env``, ``remote_auth_key: env:NAME``); None: an empty one, so such a key
                is refused as naming an unset variable. Pass ``os.environ`` to read the process's.
                The ``LMTIER_<KEY>`` overrides are :func:`load_config`'s, not read here.

        Raises:
            ConfigError: a bad key or value, a variable a key names that ``env`` lacks.
        """
        return _build(dict(values), {} if env is None else env)

    def validate_for(self, block_size: int) -> None:
        """Check ``chunk_size`` against vLLM's block size (tokens per KV block).

        Raises:
            ConfigError: when ``chunk_size`` is not a positive multiple of ``block_size``.
        """
        if type(block_size) is not int or block_size <= 0:
            raise ConfigError(f"lmtier config: block_size={block_size!r}: must be a positive int")
        if self.chunk_size % block_size:
            raise _err("chunk_size", self.chunk_size, f"must be a multiple of the KV block size {block_size}")

    def to_dict(self) -> dict[str, Any]:
        """The effective configuration as flat keys, passwords redacted (safe to log)."""
        return {
            "chunk_size": self.chunk_size,
            "local_cpu": self.cpu.enabled,
            "max_local_cpu_size": self.cpu.max_size_gb,
            "local_disk": ",".join("file://" + p for p in self.disk.paths) or None,
            "max_local_disk_size": self.disk.max_size_gb,
            "local_disk_path_sharding": self.disk.path_sharding,
            "disk_io_threads": self.disk.io_threads,
            "local_disk_serde": self.disk.serde,
            "remote_url": self.remote.redacted_url,
            "remote_serde": self.remote.serde,
            "remote_timeout_s": self.remote.timeout_s,
            "remote_password_env": self.remote.password_env,
            "remote_auth_key": self.remote.auth_key,
            "remote_auth_accept_keys": ",".join(self.remote.accept_keys) or None,
            "remote_encrypt": self.remote.encrypt,
            **self._mooncake_dict(),
            "codec_level": self.codec_level,
            "codec_tables": self.codec_tables,
            "codec_tables_dir": self.codec_tables_dir,
            "codec_pca_model": self.codec_pca_model,
            "cpu_tenant_share": None if self.cpu.tenants is None else self.cpu.tenants.default_share,
            "cpu_tenant_shares": None if self.cpu.tenants is None else (self.cpu.tenants.to_text() or None),
            **self._remote_tenants_dict(),
            **self._p2p_dict(),
        }

    def _remote_tenants_dict(self) -> dict[str, Any]:
        b = self.remote.tenants
        if b is None:
            return {"remote_tenant_share": None, "remote_tenant_shares": None, "remote_tenant_capacity": None}
        return {
            "remote_tenant_share": b.shares.default_share,
            "remote_tenant_shares": b.shares.to_text() or None,
            "remote_tenant_capacity": b.capacity_bytes / GIB,
        }

    def _p2p_dict(self) -> dict[str, Any]:
        p = self.p2p
        if p is None:
            return {"enable_p2p": False}
        return {
            "enable_p2p": True,
            "p2p_host": p.host,
            "p2p_init_ports": ",".join(map(str, p.init_ports)),
            "p2p_directory_url": p.directory_url,
            "p2p_allowed_peers": ",".join(p.allowed_peers) or None,
            "p2p_token_env": p.token_env,
            "p2p_timeout_s": p.timeout_s,
            "p2p_entry_ttl_s": p.entry_ttl_s,
        }

    def _mooncake_dict(self) -> dict[str, Any]:
        m = self.remote.mooncake
        if m is None:
            return {}
        d = dataclasses.asdict(m)
        gib = {"global_segment_size", "local_buffer_size"}
        return {k: (d[f] / GIB if f in gib else d[f]) for k, f in MOONCAKE_KEYS.items()}

    def log_effective(self) -> bool:
        """Log the effective configuration (INFO, ``lmtier.config``) once per process per distinct
        configuration. Returns True if it logged."""
        items = tuple(sorted(self.to_dict().items()))
        if items in _LOGGED:
            return False
        _LOGGED.add(items)
        logger.info("lmtier effective config: %s", ", ".join(f"{k}={v!r}" for k, v in items))
        return True


_LOGGED: set[tuple] = set()


def _build(raw: dict[str, Any], env: Mapping[str, str]) -> LMTierConfig:
    values = {k: spec.default for k, spec in KEYS.items()}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise ConfigError(f"lmtier config: key {key!r} is not a string")
        if key in KEYS:
            values[key] = check_type(key, value)
        elif key in IGNORED_LMCACHE_KEYS:
            if key == "cache_policy" and str(value).upper() != "LRU":
                raise _err(key, value, "lmtier implements only LRU")
            logger.warning("lmtier config: LMCache key %s=%r is not used by lmtier; ignored", key, value)
        elif key in DISABLED_LMCACHE_FEATURES:
            if value not in (None, False, 0):
                raise _err(key, value, "this LMCache feature is not implemented by lmtier; set it false or remove it")
        else:
            close = difflib.get_close_matches(key, [*KEYS, *IGNORED_LMCACHE_KEYS, *DISABLED_LMCACHE_FEATURES], n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise _err(key, value, f"unknown key ({hint}known: {sorted(KEYS)})")

    chunk_size = values["chunk_size"]
    if chunk_size <= 0:
        raise _err("chunk_size", chunk_size, "must be > 0")
    warn_chunk_size(chunk_size)

    for k in ("max_local_cpu_size", "max_local_disk_size"):
        if not math.isfinite(values[k]):
            raise _err(k, values[k], "must be a finite number of GiB")
        if values[k] < 0:
            raise _err(k, values[k], "must be >= 0")
    ram = physical_memory_bytes()
    if values["local_cpu"] and ram and values["max_local_cpu_size"] * GIB > ram:
        raise _err(
            "max_local_cpu_size",
            values["max_local_cpu_size"],
            f"exceeds this machine's physical memory ({ram / GIB:.1f} GiB)",
        )
    if values["local_cpu"] and values["max_local_cpu_size"] <= 0:
        raise _err("max_local_cpu_size", values["max_local_cpu_size"], "must be > 0 when local_cpu is true")
    tenants = parse_tenant_shares("cpu_tenant_shares", values["cpu_tenant_shares"], values["cpu_tenant_share"])
    if tenants is not None and not values["local_cpu"]:
        logger.warning("lmtier config: cpu_tenant_share(s) without local_cpu; unused")
    cpu = CPUConfig(enabled=values["local_cpu"], max_size_gb=values["max_local_cpu_size"], tenants=tenants)

    sharding = values["local_disk_path_sharding"]
    if sharding is not None and sharding not in DISK_SHARDINGS:
        raise _err("local_disk_path_sharding", sharding, f"must be null or one of {list(DISK_SHARDINGS)}")
    io_threads = values["disk_io_threads"]
    if not 1 <= io_threads <= 256:
        raise _err("disk_io_threads", io_threads, "must be in 1..256")
    local_disk = values["local_disk"]
    if local_disk is not None and local_disk.strip() == "":
        local_disk = None
    if local_disk is not None:
        paths = parse_disk_paths("local_disk", local_disk)
        if int(values["max_local_disk_size"] * GIB) < 1:
            raise _err(
                "max_local_disk_size",
                values["max_local_disk_size"],
                "must be > 0 (at least one byte) when local_disk is set",
            )
        capacity = filesystems_bytes(paths)
        if capacity and values["max_local_disk_size"] * GIB > capacity:
            raise _err(
                "max_local_disk_size",
                values["max_local_disk_size"],
                f"exceeds the total size of the file systems holding local_disk ({capacity / GIB:.1f} GiB)",
            )
    else:
        paths = ()
        if values["max_local_disk_size"] > 0:
            logger.warning(
                "lmtier config: max_local_disk_size=%r without local_disk; the disk tier stays off",
                values["max_local_disk_size"],
            )
        for key in ("local_disk_path_sharding", "disk_io_threads"):
            if key in raw and values[key] != KEYS[key].default:
                logger.warning("lmtier config: %s=%r without local_disk; unused", key, values[key])
    disk_serde = values["local_disk_serde"]
    check_serde("local_disk_serde", disk_serde)
    if disk_serde != "naive" and not paths:
        logger.warning("lmtier config: local_disk_serde=%r without local_disk; unused", disk_serde)
    disk = DiskConfig(
        paths=paths,
        max_size_gb=values["max_local_disk_size"],
        path_sharding=sharding,
        io_threads=io_threads,
        serde=disk_serde,
    )
    remote = parse_remote(values, env)
    level = values["codec_level"]
    if level not in CODEC_LEVELS + PCA_CODEC_LEVELS:
        raise _err("codec_level", level, f"must be one of {list(CODEC_LEVELS + PCA_CODEC_LEVELS)}")
    for key in ("codec_level", "codec_tables", "codec_tables_dir"):
        if key in raw and "cachegen" not in (disk_serde, remote.serde):
            logger.warning("lmtier config: %s=%r but no serde is 'cachegen'; unused", key, values[key])
    tables = values["codec_tables"]
    if tables not in CODEC_TABLES:
        raise _err("codec_tables", tables, f"must be one of {list(CODEC_TABLES)}")
    tables_dir = values["codec_tables_dir"]
    if tables_dir is not None:
        dirs = parse_disk_paths("codec_tables_dir", tables_dir)
        if len(dirs) != 1:
            raise _err("codec_tables_dir", tables_dir, "must be one directory")
        tables_dir = dirs[0]
        if tables != "auto" and "cachegen" in (disk_serde, remote.serde):
            logger.warning(
                "lmtier config: codec_tables_dir=%r with codec_tables=%r (not auto); unused", tables_dir, tables
            )
    pca_model = _pca_model(raw, values, level, "cachegen" in (disk_serde, remote.serde))
    p2p = resolve_p2p(values, env)  # P2P sharing (lmtier.tiers.p2p.settings)
    return LMTierConfig(
        chunk_size=chunk_size,
        cpu=cpu,
        disk=disk,
        remote=remote,
        codec_level=level,
        codec_tables=tables,
        codec_tables_dir=tables_dir,
        codec_pca_model=pca_model,
        p2p=p2p,
    )


def _pca_model(raw: Mapping[str, Any], values: Mapping[str, Any], level: str, cachegen: bool) -> str | None:
    """``codec_pca_model`` checked against ``codec_level`` and the serdes (``cachegen``: some serde is
    cachegen), as an absolute path of a readable file, or None.

    Raises:
        ConfigError: a PCA level without the key; the key with another level or without a cachegen
            serde; no readable file there.
    """
    path = values["codec_pca_model"]
    if path is not None and path.strip() == "":
        path = None
    if level in PCA_CODEC_LEVELS:
        if path is None:
            raise _err(
                "codec_level",
                level,
                "a PCA level needs codec_pca_model: the model file `python -m lmtier.codec.pca` wrote for the "
                "served model",
            )
        for key in ("codec_tables", "codec_tables_dir"):
            if key in raw and cachegen:
                logger.warning(
                    "lmtier config: %s=%r with codec_level=%r: unused (a PCA level's entropy tables are in "
                    "codec_pca_model)",
                    key,
                    values[key],
                    level,
                )
    if path is None:
        return None
    if level not in PCA_CODEC_LEVELS:
        given = "" if "codec_level" in raw else " (the default)"  # raw: the file and the LMTIER_* overrides
        raise _err(
            "codec_pca_model",
            path,
            f"set with codec_level={level!r}{given}, which is not a PCA level ({', '.join(PCA_CODEC_LEVELS)})",
        )
    if not cachegen:
        raise _err("codec_pca_model", path, "no serde is 'cachegen' (set local_disk_serde or remote_serde: cachegen)")
    return check_readable_file("codec_pca_model", path)


def load_config(path: str | os.PathLike | None = None, env: Mapping[str, str] | None = None) -> LMTierConfig:
    """Load the configuration: YAML file, then ``LMTIER_<KEY>`` environment overrides.

    Args:
        path: YAML file; when ``None``, ``env[LMTIER_CONFIG_FILE]`` if set, else no file (defaults).
        env: environment mapping (default ``os.environ``).

    Returns:
        The validated :class:`LMTierConfig`.

    Raises:
        ConfigError: unreadable, non-UTF-8 or malformed file, a key given twice or an unknown key
            in the file, an override variable that does not parse, wrong type, impossible value
            (the message names the key and the value).
            Undeclared ``LMTIER_*`` variables are only logged (:func:`lmtier.envs.warn_undeclared`).
    """
    env = os.environ if env is None else env
    if path is None:
        path = env.get(CONFIG_FILE_ENV) or None
    raw: dict[str, Any] = {} if path is None else read_config_file(path)
    from_env: dict[str, str] = {}
    for name, text in env.items():
        key = envs.config_key_of(name)
        if key is not None:
            raw[key] = parse_env_value(key, name, text)
            from_env[key] = name
    named = _variables_named(raw)  # e.g. p2p_token_env: LMTIER_P2P_SECRET is read, not ignored
    envs.warn_undeclared({k: v for k, v in env.items() if k not in named})
    try:
        return _build(raw, env)
    except ConfigError as e:
        err = naming_overrides(e, env)
        if err is e:
            raise
        raise err from None


_KEY_LISTS = re.compile(r"\(did you mean [^)]*\)|known: \[[^\]]*\]")
"""Parts of a message that list keys without blaming them (an unknown key's guess and the known keys)."""


def naming_overrides(e: ConfigError, env: Mapping[str, str] | None = None) -> ConfigError:
    """``e`` with the ``LMTIER_<KEY>`` variables of ``env`` (default ``os.environ``) it is about named:
    the variable of the key at fault (``e.key``), else those of other keys the message names (a check
    across keys, e.g. ``codec_pca_model`` without a cachegen serde because
    ``LMTIER_LOCAL_DISK_SERDE=naive``; lists of known keys and guesses do not count). Only names,
    never values (a variable may hold a secret). Returns ``e`` itself when there is none."""
    env = os.environ if env is None else env
    from_env = {key: name for name in env if (key := envs.config_key_of(name)) is not None}
    if e.key in from_env:
        err = ConfigError(f"{e} (the value of the environment variable {from_env[e.key]})")
    else:
        text = _KEY_LISTS.sub("", str(e))
        named = [f"{k} from the environment variable {n}" for k, n in sorted(from_env.items())
                 if re.search(rf"\b{re.escape(k)}\b", text)]  # fmt: skip
        if not named:
            return e
        err = ConfigError(f"{e} ({'; '.join(named)})")
    err.key = e.key
    return err


def _variables_named(raw: Mapping[str, Any]) -> set[str]:
    """The environment variables the configuration ``raw`` names as where a secret is
    (``remote_password_env``, ``p2p_token_env``, ``env:NAME`` items of ``remote_auth_key`` /
    ``remote_auth_accept_keys``): read by lmtier, so never reported as unknown ``LMTIER_*`` ones."""
    names = {raw.get(k) for k in ("remote_password_env", "p2p_token_env")}
    for k in ("remote_auth_key", "remote_auth_accept_keys"):
        if isinstance(raw.get(k), str):
            names.update(item.strip()[4:] for item in raw[k].split(",") if item.strip().startswith("env:"))
    return {n for n in names if isinstance(n, str)}
