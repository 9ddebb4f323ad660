"""Chunk-level codec API: one canonical KV chunk <-> one self-describing codec record.

This is the entry point the tiers (:class:`lmtier.tiers.codec.CodecTier`) and the benchmarks use;
it strings together the quantizer (:mod:`.quant`, :mod:`.levels`), the interleaved rANS coder
(:mod:`.rans`) and the record format (:mod:`.format`):

Quantization and dequantization use the compiled kernels of :mod:`lmtier.codec.native` where they
support the level and geometry (bit-identical to the torch reference :mod:`lmtier.codec.quant`,
which handles the rest; see :data:`USE_NATIVE`).

* :func:`encode_chunk`: quantize -> rANS encode (static tables when given, a per-stream table
  otherwise) -> :func:`lmtier.codec.format.pack`.
* :func:`decode_chunk`: :func:`parse_record` (:func:`lmtier.codec.format.unpack`, checksum
  verified; header and table-set checks) -> batched rANS decode -> dequantize into a caller buffer,
  through a reusable :class:`lmtier.codec.decoder.ChunkDecoder` (tables uploaded once, buffers and
  descriptors preallocated, one stream per concurrent caller). CUDA destinations are decoded on
  the GPU (the CUDA rANS kernels, then the CUDA dequantize kernel, or the reference's torch ops on
  the device); CPU destinations by the native multi-threaded CPU coder and the native CPU
  dequantizer (or the torch reference). All give bit-identical chunks (the coder's CPU and CUDA
  paths are byte/bit exact; every dequantizer is the same integer / correctly rounded fp32
  arithmetic).

Record layout (what the sections of a :mod:`.format` record hold; every section is one rANS
stream, coded independently)::

    quantized levels (high, default, low): 3 sections per layer
        [K symbols [H, D, T], V symbols [H, D, T], scale codes (K codes then V codes)]
    lossless: 4 sections per layer
        [K hi plane, V hi plane, K lo plane, V lo plane]   (each [H, D, T], see quant.py)

Header fields: ``level_id`` = the level's id, ``dtype`` = bf16/fp16, geometry ``[L, 2, T, H, D]``,
``table_id`` = :data:`lmtier.codec.format.NO_TABLE` (every stream carries its own table) or the
:attr:`StaticTables.table_id` of the static table set the streams were coded with.

Size bound: an rANS segment that would not shrink is stored raw, so a record is never larger than
:func:`max_record_bytes` — the raw symbol bytes plus a fixed per-section overhead (16-byte stream
header, at most 544 bytes of own table, 7 bytes per 16 Ki-symbol segment, alignment) plus the
record header and index. For lossless levels the raw symbol bytes equal the chunk's bytes; for the
quantized levels they are half of them plus the scale codes. Callers can size receive buffers from
the geometry alone.

Sources: CacheGen (Liu et al., "CacheGen: KV Cache Compression and Streaming for Fast Large
Language Model Serving", SIGCOMM 2024) for the per-(layer, K/V, channel) stream grouping and
entropy coding of quantized KV; dietgpu (facebookresearch/dietgpu) for the interleaved, warp-wide
rANS construction (implemented from the description, see csrc/include/lmtier/rans.h); the scheme
and its measured quality are in docs/codec.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmtier import geometry

from . import bound, quant
from . import format as fmt
from .levels import LEVELS_BY_ID, Level, get_level, resolve
from .quant import CodecInputError
from .spans import Spans

__all__ = [
    "CodecRecordError",
    "StaticTables",
    "CODEC_DTYPES",
    "sections_per_layer",
    "section_layout",
    "decoded_buffer_bytes",
    "max_record_bytes",
    "encode_chunk",
    "decode_chunk",
    "check_record_info",
    "parse_record",
    "dequantize_layers",
    "USE_NATIVE",
]

CODEC_DTYPES: dict[torch.dtype, fmt.DType] = {
    geometry.torch_dtype(n): geometry.kv_dtype(n).code for n in geometry.CODEC_DTYPE_NAMES
}
"""Element types the codec takes (and the record's dtype code for each), from :mod:`lmtier.geometry`."""

USE_NATIVE = True
"""Quantize / dequantize with the compiled kernels of :mod:`lmtier.codec.native` where they support
the level, geometry and device (byte/bit-identical to :mod:`lmtier.codec.quant`, tested in
tests/test_kvquant_native.py); False forces the torch reference (tests compare the two)."""


class CodecRecordError(CodecInputError):
    """A codec record that does not decode to the expected chunk: truncated, corrupted (checksum,
    rANS integrity, symbols out of range), foreign (not a record, unknown version / level / table
    set) or of another geometry or dtype. The message says which."""


@dataclass(frozen=True)
class StaticTables:
    """A set of static rANS tables (calibrated offline) and which table codes which section.

    Attributes:
        table_id: id of the table set, written into the record header so a decoder can refuse
            records coded with another set (any uint32 but :data:`lmtier.codec.format.NO_TABLE`).
        tables: ``[N, 256]`` uint16, each row summing to 4096 (:func:`lmtier.codec.rans.build_table`).
        section_tables: ``[L * S]`` ints, the table (``< N``) of each section in record order, or
            :data:`lmtier.codec.rans.ADAPTIVE_TABLE` for a per-stream table. A stream whose static
            table lacks one of its symbols falls back to its own table automatically.
        section_runs: ``[L * S]`` ints or None (all 0). Table switching: ``k > 0`` codes the
            section's symbols in runs of ``k * T`` (T = the chunk's tokens) with tables
            ``section_tables[i] + run`` — e.g. ``k = 1`` on a symbol section ``[H, D, T]`` gives one
            table per (head, channel), ``k = H`` on a scale section ``[2, H, T]`` one per plane. A
            chunk whose ``k * T`` is not a multiple of 32 is coded with per-stream tables instead
            (the record then says ``table_id = NO_TABLE``).
        plane_qmax: adaptive levels only: uint8 ``[L, 2]``, the qmax each (layer, plane)'s symbol
            tables were fitted for; a chunk whose chosen qmax differs codes that section with its
            own table (the stream says so), the other sections with the static tables.
    """

    table_id: int
    tables: np.ndarray
    section_tables: np.ndarray
    section_runs: np.ndarray | None = None
    plane_qmax: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.table_id, (int, np.integer)) or not 0 <= int(self.table_id) < fmt.NO_TABLE:
            raise ValueError(f"StaticTables.table_id must be in [0, {fmt.NO_TABLE}), got {self.table_id!r}")
        t = np.ascontiguousarray(np.asarray(self.tables))
        if t.ndim != 2 or t.shape[1] != 256 or t.dtype != np.uint16:
            raise ValueError(f"StaticTables.tables must be uint16 [N, 256], got {t.dtype} {t.shape}")
        object.__setattr__(self, "tables", t)
        object.__setattr__(self, "section_tables", np.asarray(self.section_tables, np.int64).reshape(-1))
        runs = (
            np.zeros_like(self.section_tables)
            if self.section_runs is None
            else np.asarray(self.section_runs, np.int64).reshape(-1)
        )
        if runs.shape != self.section_tables.shape or (runs < 0).any():
            raise ValueError("StaticTables.section_runs must be non-negative, one per section")
        object.__setattr__(self, "section_runs", runs)

    def run_lens(self, num_tokens: int) -> np.ndarray | None:
        """Run length (symbols) of each section for chunks of ``num_tokens`` tokens, or None when
        table switching cannot apply (a run length not a multiple of 32 or too long)."""
        from . import rans

        r = self.section_runs * int(num_tokens)
        if (r % rans.LANES).any() or (r > rans.MAX_RUN_LEN).any():
            return None
        return r


# ------------------------------------------------------------------------------------------------
# geometry


def _shape(shape: Sequence[int]) -> tuple[int, int, int, int, int]:
    try:
        s = tuple(int(v) for v in shape)
    except TypeError:
        raise ValueError(f"shape must be (L, 2, T, H, D), got {shape!r}") from None
    if len(s) != 5 or s[1] != 2 or min(s) <= 0:
        raise ValueError(f"shape must be (L, 2, T, H, D) with positive sizes, got {shape!r}")
    return s  # type: ignore[return-value]


def _dtype(dtype: Any) -> torch.dtype:
    dt = dtype
    if isinstance(dtype, str):
        try:
            dt = geometry.torch_dtype(dtype)  # names and aliases ("bf16", "half") from lmtier.geometry
        except ValueError:
            dt = None
    if dt not in CODEC_DTYPES:
        raise TypeError(f"the codec takes bf16/fp16 KV, not {dtype}")
    return dt


def sections_per_layer(level: str | int | Level) -> int:
    """Record sections per layer: 4 for ``lossless`` (hi/lo planes of K and V), 3 otherwise."""
    return 4 if get_level(level).lossless else 3


def decoded_buffer_bytes(level: str | int | Level, shape: Sequence[int]) -> tuple[int, int]:
    """(symbol bytes, side bytes) that decoding a record of ``shape`` produces: the symbols
    ``[L, 2, H, D, T]`` and the side data (scale codes, or the lossless lo plane)."""
    nl, _, t, h, d = _shape(shape)
    ks, vs = quant.side_sizes(level, (nl, 2, t, h, d))
    return nl * 2 * h * d * t, nl * (ks + vs)


def section_layout(level: str | int | Level, shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each record section decodes to.

    Returns ``(to_side, offset, length)``, arrays of ``L * S`` entries in record order:
    ``to_side`` (bool) — the section goes to the side buffer, else to the symbol buffer;
    ``offset`` (int64) — byte offset in that buffer; ``length`` (int64) — decoded bytes (the exact
    symbol count the stream must hold). The buffers are sized by :func:`decoded_buffer_bytes`.
    """
    lv = get_level(level)
    nl, _, t, h, d = _shape(shape)
    hdt = h * d * t
    S = sections_per_layer(lv)
    to_side = np.zeros(S * nl, bool)
    off = np.zeros(S * nl, np.int64)
    length = np.zeros(S * nl, np.int64)
    if lv.lossless:
        for l in range(nl):
            for s in range(4):
                i = l * 4 + s
                to_side[i] = s >= 2
                off[i] = (l * 2 + (s & 1)) * hdt
                length[i] = hdt
    else:
        ks, vs = quant.side_sizes(lv, (nl, 2, t, h, d))
        for l in range(nl):
            for s in range(2):
                off[l * 3 + s], length[l * 3 + s] = (l * 2 + s) * hdt, hdt
            to_side[l * 3 + 2], off[l * 3 + 2], length[l * 3 + 2] = True, l * (ks + vs), ks + vs
    return to_side, off, length


def max_record_bytes(shape: Sequence[int], level: str | int | Level) -> int:
    """Upper bound on the bytes of any record :func:`encode_chunk` makes for this geometry and
    level (whatever the data and tables): the raw symbol bytes plus a bounded per-section and
    per-record overhead (see the module doc). A buffer of this size receives any valid record."""
    from . import rans

    lv = get_level(level)
    nl, _, t, h, d = _shape(shape)
    _, _, length = section_layout(lv, (nl, 2, t, h, d))
    info = fmt.RecordInfo(lv.level_id, nl, 2, t, h, d, fmt.DType.BFLOAT16, sections_per_layer(lv))
    meta = len(bound.META_MAGIC) + 2 * nl if lv.adaptive else 0
    return fmt.record_size(info, [rans.max_encoded_bytes(int(n)) for n in length], meta)


# ------------------------------------------------------------------------------------------------
# encode


def _as_chunk(chunk: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(chunk, torch.Tensor):
        raise TypeError(f"chunk must be a torch.Tensor, got {type(chunk).__name__}")
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if chunk.dtype == torch.uint8:
        if chunk.numel() != nbytes:
            raise ValueError(f"chunk has {chunk.numel()} bytes, shape {shape} of {dtype} needs {nbytes}")
        return chunk.contiguous().reshape(-1).view(dtype).view(shape)
    if chunk.dtype != dtype:
        raise TypeError(f"chunk dtype {chunk.dtype} differs from dtype={dtype}")
    if tuple(chunk.shape) != shape:
        raise ValueError(f"chunk shape {tuple(chunk.shape)} differs from shape={shape}")
    return chunk.contiguous()


def encode_chunk(
    chunk: torch.Tensor,
    *,
    shape: Sequence[int],
    dtype: Any,
    level: str | int | Level,
    tables: StaticTables | None = None,
    num_threads: int = 0,
    scratch: bool = False,
) -> bytes | memoryview:
    """Encode one canonical KV chunk into a codec record.

    Args:
        chunk: the chunk, CPU or CUDA: ``uint8 [nbytes]`` (its canonical bytes) or typed
            ``[L, 2, T, H, D]`` of ``dtype``. On CUDA (with a CUDA build of ``lmtier._C``)
            quantization and rANS encoding run on the device; the record is returned in host memory.
        shape: the canonical geometry ``(L, 2, T, H, D)``.
        dtype: ``torch.bfloat16`` or ``torch.float16`` (or their names).
        level: codec level (name, id or :class:`~lmtier.codec.levels.Level`).
        tables: static rANS tables (one per section, see :class:`StaticTables`); ``None``: every
            stream is coded with its own table.
        num_threads: CPU encoder threads (0: the coder's default).
        scratch: return the record as a read-only view of this thread's packing buffer, valid until
            its next record (:func:`lmtier.codec.format.pack_runs`), instead of a new ``bytes``.

    Returns:
        The record (``bytes``, or the view with ``scratch``; at most :func:`max_record_bytes`).
        Deterministic: the same chunk, level and tables give the same bytes on the CPU and on the
        GPU. For an adaptive level
        (:attr:`~lmtier.codec.levels.Level.adaptive`) the qmax per (layer, plane) is chosen from the
        chunk's measured error (:func:`lmtier.codec.bound.choose_qmax`) and stored in the record's
        metadata.

    Raises:
        TypeError: dtype not bf16/fp16, or a typed chunk of another dtype.
        ValueError: shape mismatch, unknown level, a head size that is not a power of two with a
            quantized level, ``tables`` that do not fit the record.
        CodecInputError: NaN/inf or magnitudes beyond the scale range with a quantized level
            (only ``lossless`` stores them).
    """
    from . import rans

    lv = get_level(level)
    shp = _shape(shape)
    dt = _dtype(dtype)
    x = _as_chunk(chunk, shp, dt)
    if x.is_cuda:
        from lmtier import _C

        if not _C.built_with_cuda():
            x = x.cpu()
    nl = shp[0]
    S = sections_per_layer(lv)
    runs = 0
    if tables is not None and tables.section_tables.size != nl * S:
        raise ValueError(
            f"tables.section_tables has {tables.section_tables.size} entries, the record has {nl * S} sections"
        )
    if tables is not None and tables.run_lens(shp[2]) is not None:
        table_id, ids, tab = int(tables.table_id), tables.section_tables, tables.tables
        runs = tables.run_lens(shp[2])
        if x.is_cuda:  # the set's device copy, uploaded once per (set, device), not per chunk
            from .decoder import device_tables

            tab = device_tables(tables, x.device)
    else:  # no tables, or table switching impossible for this T: per-stream tables
        table_id, ids, tab = fmt.NO_TABLE, rans.ADAPTIVE_TABLE, None
    meta = b""
    if lv.adaptive:
        with _on_device(x):
            qk, qv, _met = bound.choose_qmax(x, lv)
        lv = resolve(lv, qk, qv)
        meta = bound.record_meta(lv)
        if table_id != fmt.NO_TABLE:
            ids = np.array(ids, np.int64)
            pq = tables.plane_qmax
            for l in range(nl):
                for p, q in ((0, qk[l]), (1, qv[l])):
                    if pq is None or int(pq[l, p]) != q:
                        ids[l * S + p] = rans.ADAPTIVE_TABLE  # tables fitted for another qmax
    with _on_device(x):
        sym, side = _quantize(x, lv, num_threads)
        # per layer: the K and V symbol planes, then the side bytes (two parts lossless, one otherwise);
        # byte ranges of the two buffers, not a tensor per stream (each torch call from a background
        # thread is a GIL hand-off: lmtier.codec.spans)
        streams = Spans.of_planes(sym.contiguous(), side.contiguous(), nl, 2 if lv.lossless else 1)
        batch = rans.encode(streams, ids, tab, num_threads=num_threads, run_lens=runs)
    data = batch.data.cpu().numpy() if isinstance(batch.data, torch.Tensor) else np.asarray(batch.data)
    _, _, t, h, d = shp
    info = fmt.RecordInfo(lv.level_id, nl, 2, t, h, d, dtype=CODEC_DTYPES[dt], sections_per_layer=S, table_id=table_id)
    return fmt.pack_back_to_back(info, data, batch.offsets, meta, scratch=scratch)


# ------------------------------------------------------------------------------------------------
# decode


def check_record_info(
    info: fmt.RecordInfo, *, expected_shape: Sequence[int], dtype: Any, level: str | int | Level | None = None
) -> Level:
    """Check a parsed record header against what the caller expects; returns the record's level.

    Raises:
        CodecRecordError: unknown level id, another level than ``level`` (when given), another
            geometry, dtype or section count than the level's.
    """
    shp = _shape(expected_shape)
    dt = _dtype(dtype)
    lv = LEVELS_BY_ID.get(int(info.level_id))
    if lv is None:
        raise CodecRecordError(f"codec record has unknown level id {info.level_id} (known: {sorted(LEVELS_BY_ID)})")
    if level is not None:
        want = get_level(level)
        if want.level_id != lv.level_id:
            raise CodecRecordError(f"codec record is level {lv.name!r}, expected {want.name!r}")
    got = (info.num_layers, info.num_planes, info.num_tokens, info.num_heads, info.head_size)
    if got != shp:
        raise CodecRecordError(f"codec record has geometry {got}, expected {shp}")
    if info.dtype != CODEC_DTYPES[dt]:
        raise CodecRecordError(f"codec record holds {info.dtype.name}, expected {CODEC_DTYPES[dt].name}")
    if info.sections_per_layer != sections_per_layer(lv):
        raise CodecRecordError(
            f"codec record has {info.sections_per_layer} sections per layer, level {lv.name!r} "
            f"has {sections_per_layer(lv)}"
        )
    return lv


def record_level(level: Level, rec: fmt.Record) -> Level:
    """The level to dequantize ``rec`` with: ``level`` itself, or for an adaptive level the one
    resolved with the record's qmax table (CodecRecordError if the metadata is not one)."""
    if not level.adaptive:
        return level
    try:
        return bound.level_from_meta(level, rec.meta, rec.info.num_layers)
    except ValueError as e:
        raise CodecRecordError(str(e)) from None


def _host_u8(record: Any) -> np.ndarray:
    """The record as a 1-D uint8 NumPy array at a 4-byte aligned address (rANS streams need it)."""
    if isinstance(record, torch.Tensor):
        if record.is_cuda:
            raise TypeError("record must be host memory (bytes-like or a CPU tensor)")
        a = record.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    else:
        a = np.frombuffer(memoryview(record).cast("B"), np.uint8)
    if a.ctypes.data % 4:
        a = a.copy()  # NumPy allocations are aligned
    return a


def _dest(out: Any, nbytes: int) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    flat = out.reshape(-1).view(torch.uint8)
    if flat.numel() < nbytes:
        raise ValueError(f"out has {flat.numel()} bytes, the chunk needs {nbytes}")
    return flat[:nbytes]


def parse_record(
    buf: np.ndarray,
    *,
    expected_shape: Sequence[int],
    dtype: Any,
    level: str | int | Level | None = None,
    tables: StaticTables | None = None,
) -> tuple[fmt.Record, Level, StaticTables | None]:
    """Parse and check a record's bytes before decoding: structure and checksum
    (:func:`lmtier.codec.format.unpack`), header (:func:`check_record_info`), table set.

    Args:
        buf: the record's host bytes (1-D uint8 NumPy array; trailing bytes ignored).
        expected_shape, dtype, level: what the record must be (``level`` None: any known level).
        tables: the decoder's static table set (or None).

    Returns:
        ``(record, level, tables)``: the parsed :class:`~lmtier.codec.format.Record`, its level and
        the table set its streams use (None: per-stream tables).

    Raises:
        CodecRecordError: truncated, not a record, bad checksum, unsupported version, unknown level,
            level/geometry/dtype mismatch, coded with a static table set the decoder does not have.
    """
    try:
        rec = fmt.unpack(buf)
    except ValueError as e:
        raise CodecRecordError(str(e)) from None
    lv = check_record_info(rec.info, expected_shape=expected_shape, dtype=dtype, level=level)
    if rec.info.table_id == fmt.NO_TABLE:
        return rec, lv, None
    if tables is None or int(tables.table_id) != rec.info.table_id:
        have = "none" if tables is None else tables.table_id
        raise CodecRecordError(
            f"codec record was coded with static table set {rec.info.table_id}, the decoder has {have}"
        )
    return rec, lv, tables


def decode_chunk(
    record: Any,
    out: torch.Tensor,
    *,
    expected_shape: Sequence[int],
    dtype: Any,
    level: str | int | Level | None = None,
    tables: StaticTables | None = None,
    num_threads: int = 0,
) -> None:
    """Decode a codec record into ``out``.

    Args:
        record: the record in host memory (bytes-like, NumPy array or CPU uint8 tensor); trailing
            bytes after the record's end (e.g. buffer slack) are ignored.
        out: destination, a contiguous tensor of at least the chunk's bytes (``uint8 [nbytes]``
            or any dtype, written as bytes; the chunk's canonical bytes land in its first
            ``L*2*T*H*D*2`` bytes). A CUDA ``out`` is decoded on its device (record copied over
            once, rANS decode and dequantize on a stream of the decoder's own, done before return);
            a CPU ``out`` by the native CPU coder and dequantizer (see :data:`USE_NATIVE`).
        expected_shape: the geometry ``(L, 2, T, H, D)`` the record must have.
        dtype: ``torch.bfloat16`` / ``torch.float16`` (or their names) the record must hold.
        level: the level the record must have (``None``: any known level).
        tables: the static table set, needed when the record was coded with one.
        num_threads: CPU decoder threads (0: the coder's default).

    ``out`` is written only once the whole record decoded and passed every check. Decoding runs
    through a :class:`lmtier.codec.decoder.ChunkDecoder` shared by calls with the same geometry,
    level, table set and device (:func:`lmtier.codec.decoder.shared_decoder`): buffers, descriptors
    and the table set's device copy are reused. Thread-safe.

    Raises:
        CodecRecordError: anything wrong with the record — truncated, not a record, bad checksum,
            unsupported version, unknown level, level/geometry/dtype mismatch, missing or other
            static table set, an rANS stream failing to decode (the coder's status, e.g. corrupt
            payload), a wrong symbol count, symbols outside the level's range.
        TypeError / ValueError: bad ``out`` (not a tensor, too small, non-contiguous) or bad
            ``expected_shape`` / ``dtype`` arguments.
    """
    from . import decoder

    shp = _shape(expected_shape)
    dt = _dtype(dtype)
    dst = _dest(out, math.prod(shp) * 2)
    buf = _host_u8(record)
    rec, lv, tab = parse_record(buf, expected_shape=shp, dtype=dt, level=level, tables=tables)
    dec = decoder.shared_decoder(shape=shp, dtype=dt, level=lv, tables=tab, device=dst.device, num_threads=num_threads)
    dec.decode_parsed(buf, rec, tab, dst)


def _native():
    """:mod:`lmtier.codec.native` (compiled quantize/dequantize) or None (disabled / not built)."""
    if not USE_NATIVE:
        return None
    try:
        from . import native
    except (ImportError, AttributeError):  # an lmtier._C without the kvquant kernels
        return None
    return native


def _quantize(x: torch.Tensor, lv: Level, num_threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    nat = _native()
    if nat is not None and nat.supported(lv, tuple(x.shape), x.device):
        if x.data_ptr() % 16:
            x = x.clone()
        syms, sides = nat.quantize([x], lv, num_threads=num_threads)
        return syms[0], sides[0]
    return quant.quantize(x, lv)


def _on_device(x: torch.Tensor):
    import contextlib

    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------
# building blocks for pipelined decoders (lmtier.bench.ttft)


def dequantize_layers(
    sym: torch.Tensor,
    side: torch.Tensor,
    level: str | int | Level,
    shape: Sequence[int],
    out: torch.Tensor,
    l0: int = 0,
    l1: int | None = None,
) -> None:
    """Dequantize layers ``[l0, l1)`` of decoded buffers into ``out`` (no checks, no host sync).

    ``sym`` / ``side``: the flat uint8 buffers :func:`section_layout` decodes into (at least
    :func:`decoded_buffer_bytes` bytes; same device as ``out``); ``out``: a ``[l1 - l0, 2, T, H, D]``
    view of the destination (any strides, bf16/fp16). The arithmetic of
    :func:`lmtier.codec.quant.dequantize`, bit for bit; unlike it, symbols out of the level's range
    are not detected (callers that need that check use :func:`decode_chunk`).
    """
    lv = get_level(level)
    nl, _, t, h, d = _shape(shape)
    l1 = nl if l1 is None else l1
    s = sym[: nl * 2 * h * d * t].view(nl, 2, h, d, t)[l0:l1]
    if lv.lossless:
        lo = side[: nl * 2 * h * d * t].view(nl, 2, h, d, t)[l0:l1]
        rr = (s.to(torch.int32) << 8) | lo.to(torch.int32)
        u = ((rr >> 1) | ((rr & 1) << 15)) & 0xFFFF
        u = torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16)
        out.copy_(u.permute(0, 1, 4, 2, 3).view(out.dtype))
        return
    ks, vs = quant.side_sizes(lv, (nl, 2, t, h, d))
    side2 = side[: nl * (ks + vs)].view(nl, ks + vs)[l0:l1]
    for p, pq, codes in ((0, lv.k, side2[:, :ks]), (1, lv.v, side2[:, ks:])):
        qt = pq.qmax_table(nl)[l0:l1]
        qmax = (
            qt[0] if len(set(qt)) == 1 else torch.tensor(qt, dtype=torch.int32, device=s.device).reshape(-1, 1, 1, 1)
        )  # no upload when uniform
        q = s[:, p].to(torch.int32) - qmax
        codes = quant._reshape_codes(codes, pq.granularity, l1 - l0, t, h, d)
        out[:, p].copy_(quant._dequantize_plane(q.permute(0, 3, 1, 2), codes, pq))
