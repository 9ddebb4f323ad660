"""Building the tiers from the configuration (:func:`build_tiers`, which
:meth:`lmtier.manager.TierManager.from_config` calls): the default disk and remote factories (the
remote tier sealed as configured), the codec check and wrapper, and the factory types a caller may
replace them with (tests, custom tiers).

A PCA ``codec_level`` (``pca_high``, ``pca_default``) wraps a tier in
:class:`~lmtier.tiers.codec_pca.PCACodecTier` instead of :class:`~lmtier.tiers.codec.CodecTier`;
:func:`build_tiers` loads ``codec_pca_model`` once (:func:`load_pca_model`: cached per path, size
and modification time) and hands the same :class:`~lmtier.codec.pca.PCAModel` to the disk and the
remote tier, after checking it against the cache's geometry (:func:`check_codecs`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from lmtier.config import ConfigError, DiskConfig, LMTierConfig, RemoteConfig
from lmtier.config_schema import config_error
from lmtier.keys import Namespace
from lmtier.record import DISK_PAYLOAD_OFFSET
from lmtier.tiers.base import Tier
from lmtier.tiers.buffers import round_up
from lmtier.tiers.cpu import CPUPool
from lmtier.tiers.disk import DiskTier
from lmtier.tiers.seal import seal_remote

if TYPE_CHECKING:
    import torch

    from lmtier.codec.pca import PCAModel, RankModels
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
    "load_pca_model",
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


def _codec_tiers(config: LMTierConfig) -> list[tuple[str, str]]:
    """``(serde key, codec level)`` of each enabled disk or remote tier whose serde is cachegen."""
    tiers = (("disk", "local_disk_serde", config.disk.enabled), ("remote", "remote_serde", config.remote.enabled))
    return [(key, level) for tier, key, enabled in tiers if enabled and (level := config.serde_level(tier)) is not None]


def _uses_pca(config: LMTierConfig) -> bool:
    """Whether an enabled disk or remote tier has a PCA codec level."""
    return config.codec_pca_model is not None and bool(_codec_tiers(config))


def load_pca_model(
    config: LMTierConfig, *, tp_rank: int = 0, tp_size: int = 1, total_kv_heads: int | None = None
) -> PCAModel | None:
    """The :class:`~lmtier.codec.pca.PCAModel` of ``codec_pca_model`` for tensor-parallel rank
    ``tp_rank`` of ``tp_size`` when an enabled disk or remote tier uses a PCA level, else None. The
    file is loaded once per process per (path, size, modification time). A tensor-parallel file
    (``python -m lmtier.codec.pca --tensor-parallel-size``, :mod:`lmtier.codec.pca.ranks`) gives the
    model of the rank's KV heads; a file of one model serves every rank at ``tp_size`` 1, and at
    ``tp_size`` > 1 only a model of one KV head that all ranks hold (``total_kv_heads`` 1, where
    known). ``total_kv_heads``: the served model's KV heads, all ranks' (None: not checked).

    Raises:
        ConfigError: the file cannot be read or is not a usable PCA model file; it was calibrated for
            another ``tensor_parallel_size`` or another number of KV heads; a one-model file at
            ``tp_size`` > 1; a rank outside ``[0, tp_size)`` (each message names ``codec_pca_model``
            and the remedy).
    """
    if not _uses_pca(config):
        return None
    path = config.codec_pca_model
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"lmtier config: codec_pca_model={path!r}: tensor-parallel rank {tp_rank} of {tp_size}")
    try:
        st = os.stat(path)
        got = _load_pca(path, st.st_size, st.st_mtime_ns)
    except OSError as e:
        raise ConfigError(f"lmtier config: codec_pca_model={path!r}: cannot read the file: {e}") from None
    except ValueError as e:  # lmtier.codec.pca.PCAModelError
        raise ConfigError(f"lmtier config: codec_pca_model={path!r}: not a usable PCA model file: {e}") from None
    from lmtier.codec.pca import RankModels

    fix = f"calibrate it with python -m lmtier.codec.pca --tensor-parallel-size {tp_size}"
    if not isinstance(got, RankModels):
        if tp_size > 1 and (got.num_heads != 1 or total_kv_heads not in (None, 1)):
            raise ConfigError(
                f"lmtier config: codec_pca_model={path!r}: one model (of {got.num_heads} KV heads) for "
                f"tensor_parallel_size {tp_size}, whose ranks each hold a slice of the KV heads: {fix}"
            )
        return got
    if got.num_kv_heads == 1 and total_kv_heads in (None, 1):  # one KV head: every rank holds it, at any TP
        return got.models[0]
    if total_kv_heads is not None and got.num_kv_heads != total_kv_heads:
        raise ConfigError(
            f"lmtier config: codec_pca_model={path!r}: calibrated for a model of {got.num_kv_heads} KV heads, "
            f"the served model has {total_kv_heads}: calibrate it for the served model"
        )
    if got.tp_size != tp_size:
        raise ConfigError(
            f"lmtier config: codec_pca_model={path!r}: calibrated for tensor_parallel_size {got.tp_size} "
            f"({len(got.models)} models of the {got.num_kv_heads} KV heads' slices), this engine runs "
            f"{tp_size}: {fix}"
        )
    return got.for_rank(tp_rank)


@functools.lru_cache(maxsize=2)
def _load_pca(path: str, size: int, mtime_ns: int) -> PCAModel | RankModels:
    """:func:`lmtier.codec.pca.load_file` of ``path`` (``size``, ``mtime_ns``: the cache key's
    version)."""
    from lmtier.codec import pca

    return pca.load_file(path)


def check_codec_dtype(config: LMTierConfig, kv_dtype: str) -> None:
    """The part of :func:`check_codecs` that needs only the KV cache's element type (``kv_dtype``: a
    :class:`~lmtier.keys.Namespace` name), for the vLLM connector's checks before vLLM builds its
    caches (:func:`lmtier.integration.vllm.connector.preflight`).

    Raises:
        ConfigError: an enabled disk or remote tier with a codec level (``local_disk_serde`` /
            ``remote_serde``: cachegen) and a KV cache the codec does not store (not bf16 / fp16),
            naming the key."""
    from lmtier.tiers.record_tier import CODEC_KV_DTYPES

    for key, level in _codec_tiers(config):
        if kv_dtype not in CODEC_KV_DTYPES:
            raise config_error(
                key,
                "cachegen",
                f"codec level {level!r} stores bfloat16/float16 KV, this engine's KV cache is {kv_dtype} (vLLM's "
                f"--dtype, or --kv-cache-dtype); use {key}: naive",
            )


def _rank_model(config: LMTierConfig, namespace: Namespace) -> PCAModel | None:
    """:func:`load_pca_model` for ``namespace``'s tensor-parallel rank."""
    return load_pca_model(config, tp_rank=namespace.tp_rank, tp_size=namespace.tp_size)


def check_codecs(config: LMTierConfig, namespace: Namespace, *, pca_model: PCAModel | None = None) -> None:
    """Raise ConfigError now (before any tier is built) if a cachegen serde cannot take this cache
    (``pca_model``: :func:`load_pca_model`'s, loaded here when None and a PCA level is in use)."""
    for key, level in _codec_tiers(config):
        if config.codec_pca_model is not None:  # a PCA level (lmtier.config checks the pair)
            from lmtier.tiers.codec_pca import check_pca_geometry

            model = pca_model if pca_model is not None else _rank_model(config, namespace)
            check_pca_geometry(
                codec_chunk_shape(namespace),
                namespace.kv_dtype,
                level,
                model,
                config_key=key,
                model_path=config.codec_pca_model,
            )
        else:
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
    pca_model: PCAModel | None = None,
) -> Tier:
    """``tier`` in a :class:`~lmtier.tiers.codec.CodecTier` when the ``which`` tier's serde
    (``"disk"``: ``local_disk_serde``, ``"remote"``: ``remote_serde``) is ``cachegen``, in a
    :class:`~lmtier.tiers.codec_pca.PCACodecTier` when its level is a PCA level (``pca_model``: the
    model data, :func:`load_pca_model`'s when None), else ``tier`` (tables: :func:`codec_tables_args`;
    ``encode_device``: the CUDA device the codec tier encodes host chunks on, None for the CPU).

    Raises:
        ConfigError: what :class:`~lmtier.tiers.codec.CodecTier` / :func:`load_pca_model` /
            :class:`~lmtier.tiers.codec_pca.PCACodecTier` raise.
    """
    level = config.serde_level(which)
    if level is None:
        return tier
    key = "local_disk_serde" if which == "disk" else "remote_serde"
    if config.codec_pca_model is not None:  # a PCA level (lmtier.config checks the pair)
        from lmtier.tiers.codec_pca import PCACodecTier

        model = pca_model if pca_model is not None else _rank_model(config, namespace)
        return PCACodecTier(
            tier,
            shape=codec_chunk_shape(namespace),
            dtype=namespace.kv_dtype,
            level=level,
            model=model,
            config_key=key,
            model_path=config.codec_pca_model,
            encode_device=encode_device,
        )
    from lmtier.tiers.codec import CodecTier

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
    from lmtier.tiers.record_tier import RecordTier

    if not isinstance(disk, RecordTier):  # CodecTier, PCACodecTier
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
    is wrapped in :class:`~lmtier.tiers.codec.CodecTier` (a PCA level:
    :class:`~lmtier.tiers.codec_pca.PCACodecTier`, with ``codec_pca_model`` loaded once for both) after
    its factory built it. If one tier
    fails to build, those already built are closed before the error propagates.

    Raises:
        ConfigError: no tier enabled, inconsistent chunk size, CPU pool smaller than one chunk, a
            ``cachegen`` serde the cache cannot take (:func:`check_codecs`: a PCA model file that does
            not load or does not fit the cache's geometry included), a ``cachegen`` disk tier smaller
            than one record of its level. What a factory raises.
    """
    if config.chunk_size != namespace.chunk_size:
        raise ConfigError(
            f"lmtier config: chunk_size={config.chunk_size!r}: differs from the namespace's {namespace.chunk_size}"
        )
    if not (config.cpu.enabled or config.disk.enabled or config.remote.enabled or config.p2p is not None):
        raise ConfigError(
            "lmtier config: local_cpu=False: no tier is enabled; set local_cpu: true, local_disk or remote_url"
        )
    pca_model = load_pca_model(config, tp_rank=namespace.tp_rank, tp_size=namespace.tp_size)  # for both tiers
    check_codecs(config, namespace, pca_model=pca_model)
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
                pca_model=pca_model,
            )
            _check_codec_disk_room(disk, config)
        if config.remote.enabled:
            remote = wrap_codec(
                remote_factory(config.remote, namespace),
                config,
                namespace,
                "remote",
                encode_device=encode_device,
                pca_model=pca_model,
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
