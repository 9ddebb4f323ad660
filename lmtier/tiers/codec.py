"""A tier decorator that stores chunks as :mod:`lmtier.codec` records (``serde: cachegen``).

:class:`CodecTier` wraps a disk or remote tier and implements the whole
:class:`~lmtier.tiers.base.Tier` protocol by forwarding to it (``contains``, ``contains_many``,
``get_into``, ``put``, ``delete``, ``forget``, ``usage``, ``close``, eviction listeners; what it
shares with the PCA levels' tier is :class:`lmtier.tiers.record_tier.RecordTier`). ``put``
encodes the chunk's canonical bytes with :func:`lmtier.codec.chunk.encode_chunk` and stores the
record in the inner tier; ``get_into`` fetches the record into a decode slot's record buffer and
decodes it into the caller's buffer with the tier's :class:`lmtier.codec.decoder.ChunkDecoder` for
that buffer's device (on the GPU for CUDA destinations: static tables uploaded once, buffers and
descriptors reused, one CUDA stream per concurrent caller, one host sync per chunk). To everything
above it (the tier manager) it is an ordinary tier holding full canonical chunks. With
``encode_device=cuda:N`` (the vLLM worker's GPU) ``put`` encodes host chunks on that GPU
(:class:`lmtier.codec.encoder.DeviceEncoder`: a device buffer and a CUDA stream per concurrent
caller), else on the CPU; the records are the same bytes either way.

Decisions:

* **Keys.** The inner tier holds the record under a *derived* key, ``key XOR pad`` with
  ``pad = BLAKE2b-256(person="lmtier-serde", "cachegen" || format version || level id || table id)``
  (:func:`lmtier.tiers.record_tier.key_pad`),
  so naive (raw) chunks and codec records of every level live in disjoint key spaces of a shared
  disk directory or Redis (chunk keys are BLAKE2b outputs: a raw key equal to a record's derived
  key would need two chunk hashes differing by exactly the pad, as unlikely as a collision): a
  naive reader never takes a record for raw KV (raw chunks carry no magic it could check), a codec
  reader never deletes another process's raw chunk as corrupt, and a ``lossless`` reader never
  receives lossy KV. Processes configured with different levels do not share chunks. The chunk key
  itself (and :class:`lmtier.keys.Namespace`) is unchanged: the serde is a property of a tier's
  storage, not of the KV (see :mod:`lmtier.config`). The derivation is invertible
  (:meth:`CodecTier.outer_key`), so the inner tier's evictions reach the wrapper's listeners under
  chunk keys — records found on disk at startup included. (Before the XOR pad the derived key was a
  hash of salt and key: records written then are misses now.)
* **Size.** Records are always stored as records (never as raw bytes): the rANS coder stores a
  segment raw when coding would not shrink it, so a record never exceeds
  :func:`lmtier.codec.chunk.max_record_bytes` — the raw symbol bytes plus a per-stream overhead
  bounded by the geometry (about 0.6 KiB per (layer, section) stream plus 7 bytes per 16 Ki
  symbols). The record buffer of ``get_into`` (a decode slot's) has that size (rounded up to 4 KiB);
  a record that does not fit cannot be valid.
* **Failures.** ``get_into`` returns ``None`` (a miss) on any failure; ``out`` is written only
  once the whole record verified (checksum, header, rANS status, symbol counts and range): a
  record that fails leaves it untouched; after another failure (a device error during the final
  copy) its contents are unspecified — None is the signal, never a chunk to take for a hit. A record that fails to
  decode (:class:`lmtier.codec.chunk.CodecRecordError`: checksum, structure, level, geometry,
  dtype, rANS status, symbol range) is deleted from the inner tier; other failures (a destination
  too small, a device error) leave it. ``put`` returns ``False`` (a dropped store) for payloads
  that are not exactly one chunk of the geometry and for KV the level cannot represent (NaN/inf or
  out-of-range magnitudes with a lossy level; ``lossless`` stores everything).
* **Where puts encode.** A CUDA payload is encoded on its device; a host payload (the tier
  manager's CPU-pool slot) on ``encode_device`` when one is set, else on the CPU. The GPU is
  touched only at the first such put (a CPU-only process may build the tier with ``cuda:0``). If a
  GPU encode raises anything but :class:`~lmtier.codec.quant.CodecInputError`, ``ValueError`` or
  ``TypeError`` (the input's faults, raised as on the CPU) — out of memory, a CUDA error, an
  ``lmtier._C`` built without CUDA — that chunk is encoded on the CPU, GPU encoding is turned off
  for the tier and one warning is logged (counter ``gpu_encode_fallbacks``); a record is stored
  only once fully produced, whichever path made it.
* **Types.** Lossy levels (``high``, ``default``, ``low``) need bf16/fp16 KV, two planes (K and
  V) and a power-of-two head size (the Hadamard rotation); ``lossless`` needs bf16/fp16 KV and two
  planes. Anything else is a :class:`lmtier.config.ConfigError` at construction naming the config
  key (``remote_serde`` / ``local_disk_serde``).

Thread-safe (encode keeps no shared state; decode slots come from each decoder's locked pool).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmtier.codec import chunk as cchunk
from lmtier.codec import format as cformat
from lmtier.codec.autotables import CALIBRATION_CHUNKS, AutoTables, record_table_id
from lmtier.codec.decoder import ChunkDecoder
from lmtier.codec.encoder import DeviceEncoder
from lmtier.codec.levels import EXPERIMENTAL_LEVELS, LEVELS, Level
from lmtier.codec.quant import CodecInputError
from lmtier.config import ConfigError
from lmtier.tiers.base import Tier
from lmtier.tiers.record_tier import CACHEGEN_SALT, CODEC_KV_DTYPES, RecordTier, check_record_geometry

__all__ = ["CODEC_KV_DTYPES", "CodecTier", "check_codec_geometry"]

log = logging.getLogger("lmtier.tiers.codec")

_IDLE_SLOTS = {"cuda": 8, "cpu": 2}
"""Idle decode slots a tier keeps per device type (a slot serves one concurrent ``get_into``: the
tier manager's I/O threads); more are created while more callers decode at once and freed
afterwards. CUDA slots also hold a stream and device buffers worth keeping (about 2x the chunk's
bytes each, plus a pinned record buffer); host slots are cheap to recreate."""


_AUTO_SALT = b"auto-tables"  # longer than a 4-byte table id: no table id spells it


def check_codec_geometry(
    shape: Sequence[int],
    dtype: Any,
    level: str | Level,
    *,
    config_key: str = "serde",
    config_value: str = "cachegen",
) -> tuple[tuple[int, ...], torch.dtype, Level]:
    """Validate a chunk geometry for the codec; returns ``(shape, torch dtype, level)``.

    Args:
        shape: ``(L, P, T, H, D)``, the namespace's canonical chunk shape.
        dtype: a torch dtype or a :class:`lmtier.keys.Namespace` ``kv_dtype`` name.
        level: ``lossless``, ``high``, ``default`` or ``low``.
        config_key, config_value: named in the error (``remote_serde``, ``local_disk_serde``).

    Raises:
        ConfigError: unknown level, a dtype other than bf16/fp16, one plane (MLA), a head size that
            is not a power of two with a lossy level, non-positive sizes.
    """

    def bad(why: str) -> ConfigError:
        return ConfigError(f"lmtier config: {config_key}={config_value!r}: {why}")

    if isinstance(level, Level):
        lv = level
    elif isinstance(level, str) and (level in LEVELS or level in EXPERIMENTAL_LEVELS):
        lv = LEVELS.get(level) or EXPERIMENTAL_LEVELS[level]  # experimental: the library API only
    else:
        raise ConfigError(f"lmtier config: codec_level={level!r}: must be one of {list(LEVELS)}")

    def no_dtype(name: str) -> str:
        if lv.lossless:
            return f"codec level 'lossless' needs a 16-bit float KV cache (bfloat16/float16), kv_dtype is {name}"
        return (
            f"lossy codec level {lv.name!r} needs a bfloat16/float16 KV cache, kv_dtype is {name} "
            f"(use {config_key}: naive)"
        )

    shp, dt = check_record_geometry(shape, dtype, bad, no_dtype)
    d = shp[4]
    if not lv.lossless and d & (d - 1):
        raise bad(
            f"lossy codec level {lv.name!r} needs a power-of-two head size (Hadamard rotation), head_size is "
            f"{d}; use codec_level: lossless"
        )
    return shp, dt, lv


def _tables_can_code(level: Level, shape: tuple[int, ...]) -> bool:
    """Whether static tables can code chunks of ``shape`` (a lossy level, table switching possible
    for its token count: run lengths multiples of the coder's lanes)."""
    from lmtier.codec import calibrate, rans

    if level.lossless:
        return False
    nl, _, t, h, d = shape
    try:
        g = calibrate.channels_per_table((nl, h, d))
    except ValueError:
        return False
    return all(r * t % rans.LANES == 0 and r * t <= rans.MAX_RUN_LEN for r in (g, h))


class CodecTier(RecordTier):
    """Store chunks of one geometry in ``inner`` as codec records (see the module doc).

    Args:
        inner: the tier holding the records (a :class:`~lmtier.tiers.disk.DiskTier`,
            :class:`~lmtier.tiers.redis.RedisTier`, ...). Closed by :meth:`close`.
        shape: canonical chunk shape ``(L, 2, T, H, D)``.
        dtype: ``torch.bfloat16`` / ``torch.float16`` or their names.
        level: ``"lossless"``, ``"high"``, ``"default"`` or ``"low"``.
        tables: static rANS tables (:class:`lmtier.codec.chunk.StaticTables`), ``"shipped"``
            (default: the calibrated tables shipped for this geometry and level,
            :func:`lmtier.codec.calibrate.shipped_tables`, or per-stream tables when there are none),
            ``"auto"`` (the shipped tables where they exist; else tables calibrated on the first
            stored chunks and persisted in ``tables_dir``: :mod:`lmtier.codec.autotables`) or None
            (per-stream tables). The table set's id salts the keys, so records written with
            other tables are misses, not decode failures; with auto-calibrated tables the keys are
            salted with a fixed ``auto`` marker instead and the record header's ``table_id`` picks
            the set (per-stream records written before calibration stay hits; a set this process
            cannot find is a miss, the record kept).
        tables_dir: the table directory of ``"auto"`` (required with it).
        namespace_id: the namespace's id in table file names (``"auto"``; 1-16 characters of
            ``[0-9A-Za-z_.]``, e.g. ``namespace.digest()[:8].hex()``).
        calibration_chunks: chunks ``"auto"`` calibrates on
            (:data:`lmtier.codec.autotables.CALIBRATION_CHUNKS`).
        config_key, config_value: the config key that selected the codec (named in errors).
        encode_device: None (default: host payloads are encoded on the CPU) or the CUDA device
            (``cuda:N``, index given) host payloads are encoded on — the vLLM worker's GPU
            (:func:`lmtier.tiers.factory.wrap_codec`). Not touched before the first put; a failure
            there falls back to the CPU (see the module doc).

    The wrapper registers itself as an eviction listener of ``inner``: evictions of the inner
    tier reach the wrapper's listeners with chunk keys (:meth:`outer_key`) and ``payloads=None``
    (the inner tier's bytes are records, not chunks).

    Attributes:
        name: the inner tier's name (so hit counters and logs read ``disk`` / ``remote``).
        raw_bytes: bytes of one chunk; ``max_record_bytes``: the record bound (record buffer size).
        counters: ``puts``, ``put_failures``, ``raw_bytes_in``, ``record_bytes_out``, ``hits``,
            ``misses``, ``corrupt_deleted``, ``decode_failures``, ``unknown_table_set`` (records of an
            auto-calibrated table set this process cannot find: misses, kept), ``gpu_encodes``
            (stored puts encoded on ``encode_device``), ``gpu_encode_fallbacks`` (puts whose GPU
            encode failed and that were encoded on the CPU).

    Raises:
        ConfigError: see :func:`check_codec_geometry`.
        ValueError: ``encode_device`` is not ``cuda:N``; a bad ``tables``.
    """

    _log = log

    def __init__(
        self,
        inner: Tier,
        *,
        shape: Sequence[int],
        dtype: Any,
        level: str | Level,
        tables: cchunk.StaticTables | str | None = "shipped",
        tables_dir: str | Path | None = None,
        namespace_id: str = "",
        calibration_chunks: int = 0,
        config_key: str = "serde",
        config_value: str = "cachegen",
        encode_device: torch.device | str | None = None,
    ) -> None:
        self.shape, self.dtype, self.level = check_codec_geometry(
            shape, dtype, level, config_key=config_key, config_value=config_value
        )
        self._gpu: DeviceEncoder | None = None
        if encode_device is not None:
            self._gpu = DeviceEncoder(shape=self.shape, dtype=self.dtype, level=self.level, device=encode_device)
        self._auto: AutoTables | None = None
        if isinstance(tables, str):
            if tables not in ("shipped", "auto"):
                raise ValueError(f"tables must be StaticTables, 'shipped', 'auto' or None, got {tables!r}")
            from lmtier.codec import calibrate

            mode, tables = tables, calibrate.shipped_tables(self.level, self.shape)
            if mode == "auto" and tables is None and _tables_can_code(self.level, self.shape):
                if tables_dir is None:
                    raise ValueError("CodecTier(tables='auto') needs tables_dir")
                try:
                    self._auto = AutoTables(
                        tables_dir,
                        namespace=namespace_id,
                        level=self.level,
                        shape=self.shape,
                        chunks=calibration_chunks or CALIBRATION_CHUNKS,
                    )
                except OSError as e:  # the directory cannot be made: today's behaviour (per-stream)
                    log.warning("codec tables directory %s unusable (%s); per-stream tables", tables_dir, e)
        self._tables = tables
        self.raw_bytes = math.prod(self.shape) * 2
        self.max_record_bytes = cchunk.max_record_bytes(self.shape, self.level)
        table_id = cformat.NO_TABLE if tables is None else int(tables.table_id)
        salt = CACHEGEN_SALT + bytes([cformat.FORMAT_VERSION, self.level.level_id])
        salt += _AUTO_SALT if self._auto is not None else table_id.to_bytes(4, "little")
        self._decoders: dict[torch.device, ChunkDecoder] = {}
        super().__init__(inner, salt=salt)  # the key pad (lmtier.tiers.record_tier), the eviction listener

    @property
    def tables(self) -> cchunk.StaticTables | None:
        """The table set new records are coded with (None: per-stream tables)."""
        return self._auto.current if self._auto is not None else self._tables

    @property
    def auto_tables(self) -> AutoTables | None:
        """The auto-calibration state (``tables="auto"`` for a geometry without shipped tables), else None."""
        return self._auto

    # ---- Tier (contains, delete, forget, usage, tenants, evictions: RecordTier) ----------------

    def put(self, key: bytes, payload: Any, **kw: Any) -> bool:
        """Encode ``payload`` (exactly one chunk's canonical bytes: bytes-like, NumPy, CPU or CUDA
        tensor) and store the record. Returns False when the payload is not one chunk, the level
        cannot represent it, or the inner put fails. ``kw`` (``tenant=``) goes to the inner put.

        A CUDA payload is encoded on its device; a host payload on :attr:`encode_device` when set
        (falling back to the CPU if that fails, see the module doc), else on the CPU. Returns once
        the record is stored or refused; the payload is not read afterwards."""
        self.inner_key(key)  # a bad key raises before anything is encoded
        src = self._chunk_source(key, payload)
        if src is None:
            return False
        tables = self.tables
        try:
            record, on_gpu = self._encode_on(
                key,
                src,
                lambda: cchunk.encode_chunk(
                    src, shape=self.shape, dtype=self.dtype, level=self.level, tables=tables, scratch=True
                ),
                lambda gpu: gpu.encode(src, tables=tables, scratch=True),  # records in this thread's packing buffer
            )
        except CodecInputError as e:  # NaN/inf or out-of-range KV with a lossy level
            return self._cannot_encode(key, e)
        ok = self._store_record(key, record, on_gpu, **kw)
        if ok and tables is None and self._auto is not None:
            self._calibrate(src)
        return ok

    def _calibrate(self, src: torch.Tensor) -> None:
        """Count a stored chunk towards the auto-calibrated tables; a failure turns calibration off
        (records keep per-stream tables), never a store."""
        auto = self._auto
        try:
            auto.observe(src.view(self.dtype).view(self.shape))
        except Exception as e:  # noqa: BLE001 - calibration is an optimisation
            log.warning("%s: codec table calibration failed (%r); records keep per-stream tables", self.name, e)
            auto.disable()

    def get_into(self, key: bytes, out: Any, *, stream: Any = None) -> int | None:
        """Fetch the record and decode the chunk into ``out`` (host buffer or CUDA tensor, >= one
        chunk's bytes). Returns the chunk's byte count, or None (miss, too small ``out``, any
        failure; records that fail to decode are deleted).

        The record is read into a :class:`~lmtier.codec.decoder.DecodeSlot`'s record buffer (pinned
        for CUDA ``out``) and decoded by this tier's :class:`~lmtier.codec.decoder.ChunkDecoder`
        for ``out``'s device (tables on the device once, buffers reused, one CUDA stream per
        concurrent caller). ``out`` is written only after the whole record verified (a record that
        fails leaves it untouched); after a None its contents must not be used (None is the
        signal, as for every tier).

        Args:
            stream: CUDA ``out`` only, a ``torch.cuda.Stream``: return once the record verified,
                with the chunk's copy into ``out`` ordered before any work queued on ``stream``
                afterwards (see :meth:`lmtier.codec.decoder.ChunkDecoder.decode`). None (default):
                return once ``out`` holds the chunk.

        Raises:
            ValueError: ``stream`` with a host ``out``.
        """
        return self.get_many_into([key], [out], stream=stream)[0]

    @contextlib.contextmanager
    def _record_buffer(self, dst: torch.Tensor):
        """A :class:`~lmtier.codec.decoder.DecodeSlot` of ``dst``'s device's decoder (its record buffer
        is pinned for a CUDA ``dst``), as ``(slot, slot.record)``."""
        with self.decoder(dst.device).slot() as slot:
            yield slot, slot.record

    def _decode(self, key: bytes, ikey: bytes, slot: Any, n: int | None, dst: torch.Tensor, stream: Any) -> int | None:
        """Decode the record of ``n`` bytes in ``slot`` into ``dst`` (None ``n``: the inner miss); with
        auto-calibrated tables the record's ``table_id`` picks the set (a set this process cannot find:
        a miss, the record kept)."""
        if n is None:
            return self._decoded(key, ikey, None, lambda: None)
        tables = self._tables
        if self._auto is not None:  # the record's table_id picks the set
            buf = np.frombuffer(slot.record[:n], np.uint8)
            tid = record_table_id(buf)
            tables = None if tid is None or tid == cformat.NO_TABLE else self._auto.lookup(tid)
            if tid not in (None, cformat.NO_TABLE) and tables is None:
                try:  # a damaged header names no real set: corrupt (deleted below), not unknown
                    cformat.verify(buf)
                except ValueError:
                    tables = self._tables
                else:
                    return self._unknown_set(key, tid)
        dec = self.decoder(dst.device)
        return self._decoded(
            key,
            ikey,
            n,
            lambda: dec.decode(slot.record[:n], dst[: self.raw_bytes], slot=slot, stream=stream, tables=tables),
        )

    def _unknown_set(self, key: bytes, tid: int) -> None:
        """A valid record of an auto-calibrated set this process cannot find: a miss, the record kept
        (another process holding the set's file may still read it)."""
        if self._count("unknown_table_set") == 1:  # logged once per tier
            log.warning(
                "%s: chunk %s was coded with codec table set %#010x, which %s does not hold: a miss "
                "(counter unknown_table_set)",
                self.name,
                bytes(key).hex()[:16],
                tid,
                self._auto.directory,
            )
        self._count("misses")
        return None

    def decoder(self, device: Any) -> ChunkDecoder:
        """This tier's :class:`~lmtier.codec.decoder.ChunkDecoder` for ``device`` (created on first
        use; kept until :meth:`close`)."""
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        with self._lock:
            dec = self._decoders.get(dev)
            if dec is None:
                dec = ChunkDecoder(
                    shape=self.shape,
                    dtype=self.dtype,
                    level=self.level,
                    tables=self._tables,
                    device=dev,
                    max_idle_slots=_IDLE_SLOTS.get(dev.type, 2),
                )
                self._decoders[dev] = dec
            return dec

    def close(self) -> None:
        if self._auto is not None:
            self._auto.close()
        try:
            super().close()  # the GPU encoder, the inner tier
        finally:
            with self._lock:
                decs, self._decoders = list(self._decoders.values()), {}
            for d in decs:
                d.close()
