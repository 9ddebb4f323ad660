"""One canonical KV chunk <-> one codec record at a PCA level (:mod:`lmtier.codec.format`).

Record: header ``level_id`` = the :class:`~.levels.PCALevel`'s id, ``table_id`` = the
:attr:`~.model.PCAModel.model_id` of the data it was coded with, geometry ``[L, 2, T, H, D]``,
``dtype``; metadata ``<q I I 16s`` (:class:`RecordMeta`): the chunk's first position, exact tokens,
escapes, and the model data's :attr:`~.model.PCAModel.digest` (16 bytes of its SHA-256: a 32-bit id
can collide, and a record must never decode with other data). Sections, in order
(``S = ceil((2R + 3) / L)`` per layer, the ones after the last empty):

* ``2R`` rANS streams, one per (layer group, K/V): symbols ``[N, T32]`` (``T32``: ``T`` rounded up
  to 32, padded with the zero symbol), component ``j``'s run coded with table ``j`` of the level's
  ``N`` tables for that (layer group, K/V), its header naming the first of them within its coder call's
  slice (:func:`.streams.table_base`: several streams share a call); symbol ``q + 127``,
  or 255 for ``|q| > 127``;
* escapes: int16 ``q`` of every symbol 255, in stream order;
* exact bitmap: ``ceil(T / 8)`` bytes, token ``t`` at bit ``t % 8`` (LSB first) of byte ``t // 8``;
* exact tokens: ``dtype`` ``[L, 2, n_exact, H, D]`` raw, tokens in order.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import torch

from lmtier import cuda_streams
from lmtier.codec import format as fmt
from lmtier.codec import rans
from lmtier.codec.chunk import CODEC_DTYPES, CodecRecordError
from lmtier.codec.quant import CodecInputError

from . import imatmul, kernels, native_decode, scan, streams
from . import transform as tf
from .levels import PCA_LEVELS_BY_ID, PCALevel, get_pca_level
from .model import DIGEST_BYTES, PCAModel

__all__ = [
    "encode",
    "decode",
    "decode_queued",
    "PendingChunk",
    "max_record_bytes",
    "record_meta",
    "RecordMeta",
    "sections_per_layer",
    "MAX_POSITION",
    "LAYOUT_VERSION",
    "chunk_symbols",
    "symbols_to_kv",
]

_META = struct.Struct(f"<qII{DIGEST_BYTES}s")
_DTYPES = {v: k for k, v in CODEC_DTYPES.items()}


LAYOUT_VERSION = 2
"""The layout of a PCA record's streams (module doc); tiers bind it into their keys, so a record of
another layout is never looked up (1: every stream's header named table 0, one coder call each)."""

MAX_POSITION = 1 << 52
"""Positions (``start + T``) stay below it: RoPE angles are ``position * inv_freq`` in float64, exact
positions need them below 2**53."""


class RecordMeta(NamedTuple):
    """A PCA record's metadata: first position, exact tokens, escapes, model data digest."""

    start: int
    exact_tokens: int
    escapes: int
    model_digest: bytes


def record_meta(record: Any) -> RecordMeta:
    """The metadata of a PCA record (checksum verified; not checked against a model).

    Raises:
        CodecRecordError: not a record, corrupted, or metadata of another size."""
    return _meta(_unpack(record))


def _unpack(record: Any) -> fmt.Record:
    try:
        return fmt.unpack(record)
    except ValueError as e:
        raise CodecRecordError(str(e)) from None


def _meta(rec: fmt.Record) -> RecordMeta:
    if rec.meta.nbytes != _META.size:
        raise CodecRecordError(f"codec record metadata of {rec.meta.nbytes} bytes, a PCA record has {_META.size}")
    return RecordMeta(*_META.unpack(rec.meta))


def _check_model(model: Any) -> None:
    if not isinstance(model, PCAModel):
        raise TypeError(
            f"model must be a lmtier.codec.pca.PCAModel (lmtier.codec.pca.load), got {type(model).__name__}"
        )


def sections_per_layer(m: PCAModel) -> int:
    """``S`` of a record of model ``m``: ``2R + 3`` sections over ``L`` layers."""
    return -(-(2 * m.rows + 3) // m.num_layers)


def _level(m: PCAModel, level: str | int | PCALevel) -> tuple[PCALevel, Any]:
    lv = get_pca_level(level)
    if lv.name not in m.levels:
        raise ValueError(f"PCA model {m.name!r} has no level {lv.name!r} (it has {sorted(m.levels)})")
    return lv, m.levels[lv.name]


class _LevelArrays(NamedTuple):
    """A level's arrays as torch tensors on one device: rANS tables, ``k``, energy threshold, ``f``,
    and on CUDA the tables' validity bitmap (:func:`lmtier.codec.rans.build_tables_ok`; the native
    decode's rANS calls then do not read the tables to check them; empty on the host)."""

    tables: torch.Tensor
    k: torch.Tensor
    threshold: torch.Tensor
    f: torch.Tensor
    tables_ok: torch.Tensor


def _level_arrays(m: PCAModel, level: str, device: str) -> _LevelArrays:
    """:class:`_LevelArrays` of ``m``'s ``level`` on ``device`` (cached per model object, level and
    device: a CUDA coder uploads them once; marked :func:`.imatmul.in_use` by the current stream)."""
    got = _cached_level_arrays(m, level, imatmul.device_key(device))
    imatmul.in_use(*got)
    return got


@lru_cache(maxsize=8)
def _cached_level_arrays(m: PCAModel, level: str, device: str) -> _LevelArrays:
    d = m.levels[level]
    f = lambda a, dt=None: torch.from_numpy(a).to(device=device, dtype=dt)  # noqa: E731
    tables = f(d.tables)
    ok = rans.build_tables_ok(tables) if tables.is_cuda else torch.empty(0, dtype=torch.int32)
    got = _LevelArrays(tables, f(d.k), f(d.energy_threshold, torch.float64), f(d.f), ok)
    imatmul.settled(device)  # read by other threads' streams
    return got


_RUN_LUTS = {"enabled": True}


def use_run_luts(on: bool) -> None:
    """Whether CUDA decodes read the rANS tables' decode lookups (:func:`lmtier.codec.rans.build_run_luts`,
    1 KiB a table, built at a level's first CUDA decode on a device and kept with its arrays) or build
    each table run's lookups in the coder (the same symbols; ``lmtier.bench.codec_pca``'s A/B).
    Turning them off frees the lookups built so far (up to 8 levels' worth on the devices)."""
    _RUN_LUTS["enabled"] = bool(on)
    if not on:
        _cached_run_luts.cache_clear()


def _run_luts(m: PCAModel, level: str, device: str) -> torch.Tensor | None:
    """The decode lookups of ``m``'s ``level`` tables on a CUDA ``device`` (None when turned off),
    cached as :func:`_level_arrays` and marked in use by the current stream."""
    if not _RUN_LUTS["enabled"]:
        return None
    got = _cached_run_luts(m, level, imatmul.device_key(device))
    imatmul.in_use(got)
    return got


@lru_cache(maxsize=8)
def _cached_run_luts(m: PCAModel, level: str, device: str) -> torch.Tensor:
    got = rans.build_run_luts(_cached_level_arrays(m, level, device).tables)
    imatmul.settled(device)  # read by other threads' streams
    return got


def chunk_symbols(
    m: PCAModel, x: torch.Tensor, start: int, k: torch.Tensor, thr: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 symbols ``[R, 2, N, T32]``, bool exact ``[T]``, escaped coefficients in stream order) of
    a checked chunk ``x`` on its device (``k``, ``thr``: the level's, moved there): the fused CUDA
    kernels (:mod:`.kernels`) when built, else :mod:`.transform`'s torch arithmetic.

    Raises:
        CodecInputError: NaN or inf in ``x`` (the kernels find it while transforming, so a CUDA chunk
            is not read twice)."""
    if x.device.type == "cuda" and kernels.available():
        return kernels.encode(m, x, start, k, thr)
    if not bool(torch.isfinite(x).all()):
        raise CodecInputError(tf.NONFINITE)
    fw = tf.forward(m, x, start, k.to(x.device), thr.to(device=x.device, dtype=torch.float64))
    q = fw.q.to(torch.int64).transpose(2, 3)  # [R, 2, N, T]
    t = x.shape[2]
    sym = torch.full((*q.shape[:3], streams.run_length(t)), tf.OFFSET, dtype=torch.uint8, device=x.device)
    sym[..., :t], esc = tf.symbols(q)
    return sym, fw.exact, q[esc]


def encode(
    chunk: torch.Tensor,
    *,
    start: int,
    model: PCAModel,
    level: str | int | PCALevel,
    num_threads: int = 0,
    scratch: bool = False,
) -> bytes | memoryview:
    """Encode one chunk.

    Args:
        chunk: canonical KV ``[L, 2, T, H, D]``, bf16 or fp16, of the model's geometry, on the host or
            a CUDA device (coded there: the same bytes, :mod:`.imatmul`).
        start: position of the chunk's first token in its sequence (>= 0): RoPE is undone at the
            positions ``start .. start + T - 1``, and positions below ``model.exact_first`` are exact.
        model: the calibrated data (:func:`lmtier.codec.pca.fit.fit` / :func:`~.model.load`).
        level: a PCA level of ``model`` (name, id or :class:`PCALevel`).
        num_threads: rANS encoder threads (0: its default).
        scratch: return the record as a read-only view of this thread's packing buffer, valid until
            its next record (:func:`lmtier.codec.format.pack_runs`), instead of a new ``bytes``.

    Returns:
        The record (``bytes``, or the view with ``scratch``). Deterministic: the same chunk, start,
        model and level give the same bytes.

    Raises:
        TypeError: not bf16/fp16, not a tensor, ``model`` not a :class:`PCAModel`.
        ValueError: geometry other than the model's, a chunk on a device other than the host or
            CUDA, a start outside ``[0, MAX_POSITION - T]`` (or
            not an integer), an unknown level.
        CodecInputError: NaN or inf in the chunk.
    """
    _check_model(model)
    if not isinstance(chunk, torch.Tensor):
        raise TypeError(f"chunk must be a torch.Tensor, got {type(chunk).__name__}")
    if chunk.dtype not in CODEC_DTYPES:
        raise TypeError(f"chunk dtype must be one of {sorted(map(str, CODEC_DTYPES))}, got {chunk.dtype}")
    nl, h, d = model.num_layers, model.num_heads, model.head_size
    if chunk.dim() != 5 or (chunk.shape[0], chunk.shape[1], chunk.shape[3], chunk.shape[4]) != (nl, 2, h, d):
        raise ValueError(f"chunk shape {tuple(chunk.shape)} does not fit the PCA model's [L={nl}, 2, T, H={h}, D={d}]")
    if (
        isinstance(start, bool)
        or not isinstance(start, (int, np.integer))
        or not 0 <= start <= MAX_POSITION - chunk.shape[2]
    ):
        raise ValueError(f"start must be an integer in [0, {MAX_POSITION} - T], got {start!r}")
    lv, _ = _level(model, level)
    x = chunk.detach()
    dev = x.device
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"chunk must be on the host or a CUDA device, got {dev}")
    t, t32 = x.shape[2], streams.run_length(x.shape[2])
    arrays = _level_arrays(model, lv.name, str(dev))
    if dev.type == "cuda" and kernels.available() and t:
        runs, escapes, exact, raw = _device_sections(model, x, int(start), arrays, t32)
    else:
        sym, exact_t, escapes_t = chunk_symbols(model, x, int(start), arrays.k, arrays.threshold)
        runs = streams.encode_runs(sym.reshape(2 * model.rows, -1), arrays.tables, t32, num_threads)
        escapes, exact, raw = streams.host_arrays(
            escapes_t.to(torch.int16), exact_t, x[:, :, exact_t].contiguous().view(torch.uint8)
        )
    escapes = escapes.astype("<i2")
    S = sections_per_layer(model)
    for sec in (escapes.view(np.uint8), np.packbits(exact, bitorder="little"), raw.reshape(-1)):
        runs.append((sec, [0, sec.size]))
    runs.append((sec[:0], [0] * (nl * S - 2 * model.rows - 3 + 1)))  # the empty sections after the last
    info = fmt.RecordInfo(
        lv.level_id, nl, 2, t, h, d, dtype=CODEC_DTYPES[x.dtype], sections_per_layer=S, table_id=model.model_id
    )
    meta = _META.pack(int(start), int(exact.sum()), len(escapes), model.digest)
    return fmt.pack_runs(info, runs, meta, scratch=scratch)


def _device_sections(
    m: PCAModel, x: torch.Tensor, start: int, arrays: _LevelArrays, t32: int
) -> tuple[list[tuple[np.ndarray, list[int]]], np.ndarray, np.ndarray, np.ndarray]:
    """``(runs, escapes, exact, raw)`` of a CUDA chunk ``x`` (at least one token), what :func:`encode`
    packs, with two synchronizations: the fused kernels' symbols and the coder calls are queued, the
    host reads the non-finite flag, the escapes' count, the exact tokens and the coder's offsets and
    status in one copy, then the streams, the escaped coefficients and the exact tokens' bytes in a
    second (host arrays: the runs as :func:`.streams.encode_runs`, int16 escapes, bool ``[T]``,
    uint8 raw bytes).

    Raises:
        CodecInputError: NaN or inf in ``x``. ValueError: a coder status other than ok."""
    t = x.shape[2]
    with torch.cuda.device(x.device):
        qs = kernels.encode_queued(m, x, start, arrays.k, arrays.threshold)
        enc = streams.QueuedEncode(qs.sym.reshape(2 * m.rows, -1), arrays.tables, t32)
        (head,) = streams.host_arrays(torch.cat([qs.head, qs.exact.long(), enc.checks]))
        if head[0]:
            raise CodecInputError(tf.NONFINITE)
        exact = head[2 : 2 + t].astype(bool)
        idx = torch.nonzero_static(qs.exact, size=int(exact.sum())).reshape(-1)
        raw = x.index_select(2, idx).contiguous().view(torch.uint8)
        runs, (escapes, raw_h) = enc.runs(head[2 + t :], (qs.escapes(int(head[1])), raw))
    return runs, escapes, exact, raw_h


def max_record_bytes(model: PCAModel, tokens: int) -> int:
    """Upper bound on the bytes of any record :func:`encode` makes of ``tokens`` tokens with ``model``
    (any level of it, bf16 or fp16, whatever the KV): a buffer of this size receives any valid record.

    From the format (module doc): each of the ``2R`` rANS streams of ``N * T32`` symbols is at most
    :func:`lmtier.codec.rans.max_encoded_bytes` of them (the coder stores a segment raw when coding
    would not shrink it); the escapes and the exact tokens together at most ``4·L·H·D`` bytes a token
    — a token is either exact (its ``L·2·H·D`` 16-bit values raw, its coefficients zeroed: never
    escaped) or not (at most its ``2R·N = 2·L·H·D`` coefficients escaped, 2 bytes each), never both;
    the bitmap ``ceil(T / 8)``; the header, section index and metadata
    (:func:`lmtier.codec.format.record_size`), plus 8 bytes for the 4-byte alignment of the escape and
    bitmap sections, which the bound counts as one section.

    Args:
        model: the model data (its ``L``, ``H``, ``D``, ``G``).
        tokens: ``T`` (>= 0).

    Raises:
        TypeError: ``model`` not a :class:`PCAModel`. ValueError: ``tokens`` < 0.
    """
    _check_model(model)
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 0:
        raise ValueError(f"tokens must be an integer >= 0, got {tokens!r}")
    nl, h, d, t = model.num_layers, model.num_heads, model.head_size, int(tokens)
    r2, S = 2 * model.rows, sections_per_layer(model)
    stream = rans.max_encoded_bytes(model.vector_size * streams.run_length(t))
    lengths = [stream] * r2 + [4 * nl * h * d * t, -(-t // 8)]
    lengths += [0] * (nl * S - len(lengths))
    info = fmt.RecordInfo(0, nl, 2, t, h, d, dtype=fmt.DType.BFLOAT16, sections_per_layer=S, table_id=0)
    return fmt.record_size(info, lengths, _META.size) + 8


def symbols_to_kv(
    m: PCAModel, sym: torch.Tensor, escapes: torch.Tensor, f: torch.Tensor, start: int, dtype: torch.dtype
) -> torch.Tensor:
    """``dtype`` ``[L, 2, T, H, D]`` of checked symbols ``[R, 2, N, T]`` and escaped coefficients (stream
    order; ``f``: the level's; both moved to the symbols' device); exact tokens come out as the mean. The
    fused CUDA kernels (:mod:`.kernels`) when built, else :mod:`.transform`'s torch arithmetic.

    Raises:
        kernels.EscapeCountError: escaped coefficients not one per escape symbol (both paths count)."""
    if sym.device.type == "cuda" and kernels.available():
        return kernels.decode(m, sym, escapes, f, start, dtype)
    esc = sym == tf.ESCAPE
    if (found := int(esc.sum())) != escapes.numel():
        raise kernels.EscapeCountError(found, escapes.numel())
    q = sym.to(torch.int64) - tf.OFFSET
    q[esc] = escapes.to(device=sym.device, dtype=torch.int64)
    return tf.inverse(m, q.transpose(2, 3).double(), f.to(sym.device), start, dtype)


def decode(record: Any, *, model: PCAModel, num_threads: int = 0, device: Any = None) -> torch.Tensor:
    """Decode a record of :func:`encode` (host bytes-like or uint8 array) with ``model``, on the host
    or (``device``, a CUDA device) on the GPU: the same bits either way (:mod:`.imatmul`).
    :func:`decode_queued` and its :meth:`PendingChunk.result`.

    Returns:
        The chunk, ``[L, 2, T, H, D]`` of the record's dtype, on ``device`` (default the host):
        exact tokens bit for bit, each coefficient of the others within half the level's step
        (plus the fixed-point and int16 matrix roundings; ``tests/test_codec_pca_product.py``
        derives the bound).

    Raises:
        TypeError: ``model`` not a :class:`PCAModel`.
        ValueError: ``device`` neither the host nor a CUDA device present here.
        CodecRecordError: not a record, corrupted (checksum, rANS, counts), a level that is not a PCA
            level of ``model``, a record of other model data (its ``table_id`` names them), a
            geometry other than the model's, or an element type other than bf16 / fp16.
    """
    return decode_queued(record, model=model, num_threads=num_threads, device=device).result()


class PendingChunk:
    """A chunk of :func:`decode_queued`: decoded on the host, or queued on a CUDA device's current
    stream with the checks that only the device can make (every rANS stream decoded to its count, no
    escape symbol in a chunk stored without escapes) on their way to page-locked host memory behind
    it. :meth:`result` waits for this chunk's work only (not for records queued after it) and hands
    out the chunk only if the checks passed; :attr:`ready` is the event a consumer on another stream
    waits for.

    Args:
        chunk: the chunk (on the host: complete; on CUDA: being decoded on the current stream).
        checks: CUDA only: the device's check values (a tensor on the chunk's device, any dtype),
            copied now to page-locked memory behind :attr:`ready`.
        verify: CUDA only: called with the host copy of the checks (a NumPy array of their dtype;
            uint8 for ``host_checks``); raises ValueError naming what the record got wrong.
        host_checks: CUDA only, instead of ``checks``: a page-locked host buffer of uint8 that work
            already queued on the current stream fills with them (the native decode's
            ``DecodeStage``: :class:`.native_decode.Checks`' bytes), kept until read.

    Raises:
        ValueError: both ``checks`` and ``host_checks``."""

    def __init__(
        self,
        chunk: torch.Tensor,
        checks: torch.Tensor | None = None,
        verify: Callable[[np.ndarray], None] | None = None,
        *,
        host_checks: Any = None,
    ) -> None:
        if checks is not None and host_checks is not None:
            raise ValueError("PendingChunk: checks or host_checks, not both")
        self._chunk, self._verify = chunk, verify
        self._checked = checks is None and host_checks is None
        self._checks: Any = host_checks
        self.ready: torch.cuda.Event | None = None
        """CUDA: recorded on the decode's stream after its last kernel and the checks' copy (None on
        the host, where the chunk is ready)."""
        if checks is not None:  # the checks' copy, queued now: read by result() after `ready`
            self._checks = torch.empty(checks.shape, dtype=checks.dtype, pin_memory=True)
            self._checks.copy_(checks, non_blocking=True)
        if not self._checked:
            self.ready = torch.cuda.Event()
            self.ready.record(cuda_streams.current(chunk.device))

    def result(self) -> torch.Tensor:
        """The chunk, ``[L, 2, T, H, D]`` of the record's dtype on the device it was decoded on
        (CUDA: once :attr:`ready`, i.e. the chunk is complete there).

        Raises:
            CodecRecordError: a rANS stream that did not decode to its count, or escape symbols in a
                record that announces none (a corrupted record)."""
        if not self._checked:
            self.ready.synchronize()  # this chunk's kernels and its checks' copy, nothing queued later
            got = (
                self._checks.numpy()
                if isinstance(self._checks, torch.Tensor)
                else np.frombuffer(self._checks, np.uint8)
            )
            try:
                self._verify(got)
            except ValueError as e:
                raise CodecRecordError(f"corrupted PCA codec record: {e}") from None
            self._checked, self._checks = True, None  # a staging block goes back to its pool
        return self._chunk


def _queued_checks(queued: streams.QueuedStreams, found: torch.Tensor | None):
    """``(checks, verify)`` of :class:`PendingChunk` for a decode queued by :mod:`.kernels`: the coder's
    status and counts, then the escape symbols ``decode_pre_symbols`` counted (if it ran)."""
    parts = [queued.status.long(), queued.counts] + ([found.long()] if found is not None else [])
    s = queued.status.numel()

    def verify(got: np.ndarray) -> None:
        queued.verify(got[:s].astype(np.int32), got[s : 2 * s])
        if found is not None and (count := int(got[-1])):
            raise ValueError(f"{count} escape symbols, 0 announced")

    return torch.cat(parts), verify


class _Parsed(NamedTuple):
    """A record's checked header, metadata and section sizes (:func:`_parse`)."""

    rec: fmt.Record
    level: PCALevel
    start: int
    n_esc: int
    dtype: torch.dtype
    tokens: int
    exact: np.ndarray  # bool [T]


def decode_queued(record: Any, *, model: PCAModel, num_threads: int = 0, device: Any = None) -> PendingChunk:
    """:func:`decode` without waiting for a CUDA device: the record is checked on the host and copied
    to the device in one upload (its streams, escapes and exact tokens), its decode queued on the
    device's current stream, and the checks only the device can make are left on it for
    :meth:`PendingChunk.result`. Several records queued before the first result keep the device
    busy. The host decodes at once.

    Raises:
        As :func:`decode`, except the device's checks (raised by :meth:`PendingChunk.result`).
    """
    _check_model(model)
    dev = _device(device)
    fused = dev.type == "cuda" and kernels.available()
    if fused and native_decode.available():  # the common record's host checks in one native call
        try:
            sc = scan.scan(record, model)
        except ValueError as e:  # its checksum
            raise CodecRecordError(str(e)) from None
        if sc is not None and (got := _queue_native(model, sc, dev)) is not None:
            return got
    p = _parse(record, model)
    rec, t = p.rec, p.tokens
    nl, h, d, n = model.num_layers, model.num_heads, model.head_size, model.vector_size
    r2, S = 2 * model.rows, sections_per_layer(model)
    arrays, t32 = _level_arrays(model, p.level.name, str(dev)), streams.run_length(t)
    spans = rec.index[: r2 + 3]  # the streams, escapes, exact bitmap, exact tokens: payload offsets
    offs, lens = spans["offset"].astype(np.int64), spans["length"].astype(np.int64)
    n_exact = int(p.exact.sum())
    luts = _run_luts(model, p.level.name, str(dev)) if dev.type == "cuda" else None
    if fused and t and native_decode.available():  # the whole decode queued by one native call
        sc = scan.Scanned(p.level, p.start, p.n_esc, p.dtype, t, np.frombuffer(rec.payload, np.uint8), offs, lens,
                          p.exact)  # fmt: skip
        if (got := _queue_native(model, sc, dev, spans_checked=False)) is not None:
            return got
    try:  # sized by T: a stream of another count raises
        if fused:  # one upload of every section the device reads
            up = streams.upload(np.frombuffer(rec.payload, np.uint8)[: int((offs + lens).max())], dev)
            o_esc, o_raw = int(offs[r2]), int(offs[r2 + 2])
            q = streams.queue_spans(
                rec.payload, offs[:r2], lens[:r2], arrays.tables, n * t32, dev, uploaded=up, run_luts=luts
            )
            if p.n_esc:  # the escapes' index waits for the symbols anyway: check the streams first, so a
                q.result()  # stream that did not decode is named as such, not as an escape count
        else:
            q = streams.queue_spans(
                rec.payload, offs[:r2], lens[:r2], arrays.tables, n * t32, dev, num_threads, run_luts=luts
            )
            q.result()  # the torch path below reads the symbols' values on the host side of its checks
    except ValueError as e:
        raise CodecRecordError(f"corrupted PCA codec record: {e}") from None
    sym = q.symbols.reshape(model.rows, 2, n, t32)[..., :t]
    found = None
    try:
        if fused:
            esc = up[o_esc : o_esc + 2 * p.n_esc].view(torch.int16)
            with torch.cuda.device(dev):
                out, found = kernels.queue_decode(model, sym, esc, arrays.f, p.start, p.dtype)
        else:
            esc = torch.from_numpy(np.frombuffer(rec.section(r2 // S, r2 % S), "<i2").astype(np.int64)).to(dev)
            out = symbols_to_kv(model, sym, esc, arrays.f, p.start, p.dtype)
    except kernels.EscapeCountError as e:  # symbols_to_kv counts the escape symbols on either path
        raise CodecRecordError(f"corrupted PCA codec record: {e.found} escape symbols, {p.n_esc} announced") from None
    if n_exact:
        shape = (nl, 2, n_exact, h, d)
        if fused:
            raw = up[o_raw : o_raw + int(lens[r2 + 2])].view(p.dtype).reshape(shape)
            with torch.cuda.device(dev):
                idx = streams.upload(np.flatnonzero(p.exact).astype(np.int64), dev).view(torch.int64)
                out.index_copy_(2, idx, raw)
        else:
            raw = torch.frombuffer(bytearray(rec.section((r2 + 2) // S, (r2 + 2) % S)), dtype=p.dtype)
            out[:, :, torch.from_numpy(p.exact).to(dev)] = raw.reshape(shape).to(dev)
    return PendingChunk(out, *_queued_checks(q, found)) if fused else PendingChunk(out)


def _queue_native(m: PCAModel, sc: scan.Scanned, dev: torch.device, spans_checked: bool = True) -> PendingChunk | None:
    """The record's decode queued by one native call (:func:`.native_decode.queue`), or None: the
    native call refused (not the record's fault: turned off, the caller decodes the Python-driven way).

    Raises:
        CodecRecordError: the record's streams do not fit their layout (unless ``spans_checked``)."""
    arrays, luts = _level_arrays(m, sc.level.name, str(dev)), _run_luts(m, sc.level.name, str(dev))
    try:
        out, checks, how = native_decode.queue(
            m, sc.payload, sc.offs, sc.lens, sc.exact, sc.n_esc, arrays.tables, arrays.f, sc.start, sc.dtype, dev,
            run_luts=luts, tables_ok=arrays.tables_ok, spans_checked=spans_checked,
        )  # fmt: skip
    except native_decode.NativeRefused as e:
        native_decode.disable(str(e))
        return None
    except ValueError as e:
        raise CodecRecordError(f"corrupted PCA codec record: {e}") from None
    return PendingChunk(out, None, how.verify, host_checks=checks)


def _device(device: Any) -> torch.device:
    """The host or an indexed CUDA device present here.

    Raises:
        ValueError: anything else."""
    if isinstance(device, torch.device) and (got := _CHECKED.get(device)) is not None:
        return got
    try:
        dev = torch.device("cpu") if device is None else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be the host or a CUDA device, got {device!r} ({e})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be the host or a CUDA device, got {dev}")
    if dev.type == "cuda":
        if not (torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()):
            raise ValueError(f"device {dev}: no such CUDA device here ({torch.cuda.device_count()} visible)")
        if dev.index is None:  # one cache entry per GPU, and the native calls run on it
            return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, torch.device) and len(_CHECKED) < 64:
        _CHECKED[device] = dev
    return dev


_CHECKED: dict[torch.device, torch.device] = {}
""":func:`_device`'s answers for devices that fix one (the host, an indexed CUDA device present here)."""


def _parse(record: Any, model: PCAModel) -> _Parsed:
    """The record's header, metadata and section sizes checked against ``model``.

    Raises:
        CodecRecordError: as :func:`decode` (all but the rANS and escape-symbol checks)."""
    rec = _unpack(record)
    info = rec.info
    if info.level_id not in PCA_LEVELS_BY_ID:
        raise CodecRecordError(f"codec record of level id {info.level_id}: not a PCA level")
    lv = PCA_LEVELS_BY_ID[info.level_id]
    if lv.name not in model.levels:
        raise CodecRecordError(f"codec record of level {lv.name}: PCA model {model.name!r} lacks it")
    if info.table_id != model.model_id:
        raise CodecRecordError(
            f"codec record coded with PCA model {info.table_id:#010x}, this model is {model.model_id:#010x}"
        )
    nl, h, d, t = model.num_layers, model.num_heads, model.head_size, info.num_tokens
    S = sections_per_layer(model)
    if (info.num_layers, info.num_planes, info.num_heads, info.head_size, info.sections_per_layer) != (nl, 2, h, d, S):
        raise CodecRecordError(
            f"codec record geometry L={info.num_layers} P={info.num_planes} H={info.num_heads} D={info.head_size} "
            f"S={info.sections_per_layer}, the PCA model's is L={nl} P=2 H={h} D={d} S={S}"
        )
    if info.dtype not in _DTYPES:
        raise CodecRecordError(f"codec record of dtype {info.dtype.name}: a PCA record holds bf16 or fp16")
    start, n_exact, n_esc, digest = _meta(rec)
    if digest != model.digest:
        raise CodecRecordError(
            f"codec record coded with PCA model data {digest.hex()}, this model's are {model.digest.hex()} "
            f"(same 32-bit id {model.model_id:#010x})"
        )
    dtype = _DTYPES[info.dtype]
    r2 = 2 * model.rows
    size = rec.index["length"].astype(np.int64)  # of every section, layer-major (section i: layer i // S)
    raw_bytes = n_exact * nl * 2 * h * d * dtype.itemsize
    if (
        not 0 <= start <= MAX_POSITION - t
        or size[r2 + 1] != -(-t // 8)
        or size[r2] != 2 * n_esc
        or size[r2 + 2] != raw_bytes
        or size[r2 + 3 :].any()
    ):
        raise CodecRecordError("corrupted PCA codec record: section sizes do not match its metadata")
    bitmap = rec.section((r2 + 1) // S, (r2 + 1) % S)
    exact = np.unpackbits(np.frombuffer(bitmap, np.uint8), count=t, bitorder="little").astype(bool)
    if int(exact.sum()) != n_exact:
        raise CodecRecordError(
            f"corrupted PCA codec record: {int(exact.sum())} exact tokens flagged, {n_exact} announced"
        )
    return _Parsed(rec, lv, start, n_esc, dtype, t, exact)
