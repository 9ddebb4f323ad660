"""Building the tiers from the configuration (:func:`build_tiers`, which
:meth:`lmtier.manager.TierManager.from_config` calls): the default disk and remote factories (the
remote tier sealed as configured), the codec check and wrapper, and the factory types a caller may
replace them with (tests, custom tiers)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from lmtier.config import ConfigError, DiskConfig, LMTierConfig, RemoteConfig
from lmtier.keys import Namespace
from lmtier.record import DISK_PAYLOAD_OFFSET
from lmtier.tiers.base import Tier
from lmtier.tiers.buffers import round_up
from lmtier.tiers.cpu import CPUPool
from lmtier.tiers.disk import DiskTier
from lmtier.tiers.seal import seal_remote

if TYPE_CHECKING:
    import torch

    from lmtier.tiers.p2p.tier import P2PTier

__all__ = [
    "BuiltTiers",
    "DiskFactory",
    "RemoteFactory",
    "build_tiers",
    "check_codecs",
    "codec_chunk_shape",
    "codec_tables_args",
    "default_disk_factory",
    "default_remote_factory",
    "wrap_codec",
]

DiskFactory = Callable[[DiskConfig, Namespace, int], Tier]
RemoteFactory = Callable[[RemoteConfig, Namespace], Tier]


def default_disk_factory(disk: DiskConfig, namespace: Namespace, gpu_id: int) -> Tier:
    """Build :class:`lmtier.tiers.disk.DiskTier` from the config.

    Raises:
        ConfigError: a directory of ``local_disk`` cannot be created or listed (the config's
            writability check looks at the nearest existing ancestor, which can pass for root on
            ``/proc`` or ``/sys``), or a naive-serde tier smaller than one record of ``namespace``
            (a ``cachegen`` tier: checked by :func:`build_tiers` once the level is known).
    """
    paths = list(disk.paths_for(gpu_id))
    record_bytes = DISK_PAYLOAD_OFFSET + round_up(namespace.chunk_bytes)
    if disk.serde == "naive" and disk.capacity_bytes < record_bytes:
        raise ConfigError(
            f"lmtier config: max_local_disk_size={disk.max_size_gb!r}: {disk.capacity_bytes} bytes cannot hold "
            f"one record of {record_bytes} bytes (a chunk of {namespace.chunk_bytes} bytes + its header)"
        )
    try:
        return DiskTier(paths, disk.capacity_bytes, io_threads=disk.io_threads, namespace=namespace.digest()[:16])
    except OSError as e:
        raise ConfigError(f"lmtier config: local_disk={','.join(paths)!r}: cannot use the directory: {e}") from None


def default_remote_factory(remote: RemoteConfig, namespace: Namespace) -> Tier:
    """Build :class:`lmtier.tiers.redis.RedisTier`, or :class:`lmtier.tiers.mooncake.MooncakeTier`
    for ``mooncakestore://``, from the config's parsed endpoint (imported lazily: redis-py and
    mooncake are optional dependencies), sealed as the config says (:func:`~lmtier.tiers.seal.seal_remote`:
    a codec tier goes above the seal, so a factory that wraps this one in a
    :class:`~lmtier.tiers.codec.CodecTier` compresses before sealing too)."""
    if remote.mooncake is not None:
        from lmtier.tiers.mooncake import MooncakeTier

        tier: Tier = MooncakeTier.from_config(remote, namespace=namespace.digest()[:16])
    else:
        from lmtier.tiers.redis import RedisTier

        tier = RedisTier.from_config(remote)
    return seal_remote(tier, remote, namespace)


def codec_chunk_shape(namespace: Namespace) -> tuple[int, int, int, int, int]:
    """The canonical chunk shape ``(L, P, T, H, D)`` of ``namespace`` (what the codec encodes)."""
    return namespace.chunk_shape


def check_codecs(config: LMTierConfig, namespace: Namespace) -> None:
    """Raise ConfigError now (before any tier is built) if a cachegen serde cannot take this cache."""
    for tier, key, enabled in (
        ("disk", "local_disk_serde", config.disk.enabled),
        ("remote", "remote_serde", config.remote.enabled),
    ):
        level = config.serde_level(tier)
        if enabled and level is not None:
            from lmtier.tiers.codec import check_codec_geometry

            check_codec_geometry(codec_chunk_shape(namespace), namespace.kv_dtype, level, config_key=key)


def codec_tables_args(config: LMTierConfig, which: str, gpu_id: int = 0) -> tuple[str | None, str | None]:
    """``(tables, tables_dir)`` for the ``which`` tier's :class:`~lmtier.tiers.codec.CodecTier`
    from ``codec_tables`` / ``codec_tables_dir``: ``auto`` with the configured directory, else (disk
    tier) ``lmtier-codec-tables`` in this GPU's first ``local_disk`` directory; a remote tier
    without ``codec_tables_dir`` gets ``shipped`` (its records are shared: see :mod:`lmtier.config`)."""
    mode = config.codec_tables
    if mode == "none":
        return None, None
    if mode == "auto":
        if config.codec_tables_dir is not None:
            return "auto", config.codec_tables_dir
        if which == "disk" and config.disk.enabled:
            return "auto", os.path.join(config.disk.paths_for(gpu_id)[0], "lmtier-codec-tables")
    return "shipped", None


def wrap_codec(
    tier: Tier,
    config: LMTierConfig,
    namespace: Namespace,
    which: str,
    gpu_id: int = 0,
    *,
    encode_device: torch.device | str | None = None,
) -> Tier:
    """``tier`` in a :class:`~lmtier.tiers.codec.CodecTier` when the ``which`` tier's serde
    (``"disk"``: ``local_disk_serde``, ``"remote"``: ``remote_serde``) is ``cachegen``, else ``tier``
    (tables: :func:`codec_tables_args`; ``encode_device``: the CUDA device the codec tier encodes
    host chunks on, None for the CPU — :class:`~lmtier.tiers.codec.CodecTier`)."""
    level = config.serde_level(which)
    if level is None:
        return tier
    from lmtier.tiers.codec import CodecTier

    key = "local_disk_serde" if which == "disk" else "remote_serde"
    tables, tables_dir = codec_tables_args(config, which, gpu_id)
    return CodecTier(
        tier,
        shape=codec_chunk_shape(namespace),
        dtype=namespace.kv_dtype,
        level=level,
        tables=tables,
        tables_dir=tables_dir,
        namespace_id=namespace.digest()[:8].hex(),
        config_key=key,
        encode_device=encode_device,
    )


def _check_codec_disk_room(disk: Tier, config: LMTierConfig) -> None:
    """ConfigError when a ``cachegen`` disk tier cannot hold the largest record of its level (every
    store of a larger record would be dropped without a word; :func:`build_tiers` closes the tiers)."""
    from lmtier.tiers.codec import CodecTier

    if not isinstance(disk, CodecTier):
        return
    need = DISK_PAYLOAD_OFFSET + round_up(disk.max_record_bytes)
    if config.disk.capacity_bytes < need:
        raise ConfigError(
            f"lmtier config: max_local_disk_size={config.disk.max_size_gb!r}: {config.disk.capacity_bytes} bytes "
            f"cannot hold one codec record of up to {need} bytes (local_disk_serde: cachegen)"
        )


class BuiltTiers(NamedTuple):
    """The tiers a configuration enables (None where it does not)."""

    cpu: CPUPool | None
    disk: Tier | None
    remote: Tier | None
    p2p: P2PTier | None


def build_tiers(
    config: LMTierConfig,
    namespace: Namespace,
    *,
    gpu_id: int = 0,
    arena: Any = None,
    disk_factory: DiskFactory = default_disk_factory,
    remote_factory: RemoteFactory = default_remote_factory,
    encode_device: torch.device | str | None = None,
) -> BuiltTiers:
    """Build the tiers ``config`` enables for chunks of ``namespace`` (arguments: see
    :meth:`lmtier.manager.TierManager.from_config`); a disk/remote tier whose serde is ``cachegen``
    is wrapped in :class:`~lmtier.tiers.codec.CodecTier` after its factory built it. If one tier
    fails to build, those already built are closed before the error propagates.

    Raises:
        ConfigError: no tier enabled, inconsistent chunk size, CPU pool smaller than one chunk, a
            ``cachegen`` serde the cache cannot take (:func:`check_codecs`), a ``cachegen`` disk tier
            smaller than one record of its level. What a factory raises.
    """
    if config.chunk_size != namespace.chunk_size:
        raise ConfigError(
            f"lmtier config: chunk_size={config.chunk_size!r}: differs from the namespace's {namespace.chunk_size}"
        )
    if not (config.cpu.enabled or config.disk.enabled or config.remote.enabled or config.p2p is not None):
        raise ConfigError(
            "lmtier config: local_cpu=False: no tier is enabled; set local_cpu: true, local_disk or remote_url"
        )
    check_codecs(config, namespace)
    cpu = disk = remote = p2p = None
    try:
        if config.cpu.enabled:
            try:
                cpu = CPUPool(config.cpu.capacity_bytes, namespace.chunk_bytes, arena=arena, tenants=config.cpu.tenants)
            except ValueError as e:
                raise ConfigError(f"lmtier config: max_local_cpu_size={config.cpu.max_size_gb!r}: {e}") from None
        if config.disk.enabled:
            disk = wrap_codec(
                disk_factory(config.disk, namespace, gpu_id),
                config,
                namespace,
                "disk",
                gpu_id,
                encode_device=encode_device,
            )
            _check_codec_disk_room(disk, config)
        if config.remote.enabled:
            remote = wrap_codec(
                remote_factory(config.remote, namespace), config, namespace, "remote", encode_device=encode_device
            )
        if config.p2p is not None:  # P2P sharing over NIXL (docs/p2p.md); lookups only without a pool
            from lmtier.tiers.p2p.tier import P2PTier

            p2p = P2PTier.from_config(config.p2p, namespace, cpu)
    except BaseException:
        for t in (p2p, cpu, disk, remote):
            if t is not None:
                t.close()
        raise
    return BuiltTiers(cpu, disk, remote, p2p)
