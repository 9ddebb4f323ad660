"""Native (C++ / CUDA) KV quantize and dequantize, bit-exact with :mod:`lmtier.codec.quant`.

The compiled kernels (``csrc/kvquant_cpu.cpp``, ``csrc/kvquant_cuda.cu``; contract in
``csrc/include/lmtier/kvquant.h``) implement the levels whose K and V planes are both
``TOKEN_HEAD`` + ``HADAMARD`` (``high``, ``default``, ``low``) and ``lossless``; they produce the
same bytes as :func:`lmtier.codec.quant.quantize` (symbols ``[L, 2, H, D, T]`` uint8, side = E5M3
codes ``[L, 2, H, T]`` or the lossless lo plane) and the same bits as
:func:`lmtier.codec.quant.dequantize`. Other levels (``cachegen_ref``) stay on the torch reference.

One native call per batch of chunks and direction; CUDA calls are asynchronous on ``stream`` (the
current stream when None) and allocate nothing but the small descriptor upload (prebuild it once
with :func:`make_batch` for a hot loop). CPU calls run on ``num_threads`` threads (0: up to 16).

Entry points:

* :func:`quantize` / :func:`dequantize` — convenience: allocate outputs, run, check, raise.
* :func:`make_batch`, :func:`quantize_batch`, :func:`dequantize_batch`, :func:`check_status` — the
  hot path: caller-provided buffers, prebuilt descriptors, status checked when the caller chooses.
* :func:`supported`, :func:`qmax_table`, :func:`symbol_bytes`, :func:`side_bytes` — geometry.

Errors: data the codec cannot represent (non-finite KV, magnitudes beyond the scale range) and
corrupt input (symbols above ``2 * qmax``) raise :class:`~lmtier.codec.quant.CodecInputError`
naming the chunk(s); bad arguments raise ``ValueError`` / ``TypeError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmtier import _C

from .levels import Granularity, Level, Transform, get_level
from .native_args import order_after_current, stream_handle, sync_stream  # shared with the rANS coder
from .quant import CodecInputError

__all__ = [
    "DESC",
    "NativeBatch",
    "supported",
    "qmax_table",
    "symbol_bytes",
    "side_bytes",
    "make_batch",
    "quantize_batch",
    "dequantize_batch",
    "check_status",
    "quantize",
    "dequantize",
]

_K = _C.kvquant
DESC = np.dtype([("chunk", "<u8"), ("symbols", "<u8"), ("side", "<u8")])
assert DESC.itemsize == _K.DESC_BYTES == 24

_DTYPES = {torch.bfloat16: _K.DTYPE_BF16, torch.float16: _K.DTYPE_FP16}
_CUDA_HEAD_SIZES = (32, 64, 128, 256)


def _mode(level: Level) -> int:
    if level.lossless:
        return _K.MODE_LOSSLESS
    for pq in (level.k, level.v):
        if pq.granularity != Granularity.TOKEN_HEAD or pq.transform != Transform.HADAMARD:
            raise ValueError(
                f"level {level.name!r} is not implemented natively (needs TOKEN_HEAD + HADAMARD on K and V); "
                "use lmtier.codec.quant"
            )
    return _K.MODE_HADAMARD_ROW


def supported(level: Any, shape: Sequence[int], device: Any = "cpu") -> bool:
    """True when the native kernels handle ``level`` for canonical ``shape`` on ``device``."""
    lv = get_level(level)
    nl, npl, _t, _h, d = (int(v) for v in shape)
    try:
        _mode(lv)
    except ValueError:
        return False
    if npl != 2 or not 1 <= nl <= _K.MAX_LAYERS:
        return False
    if torch.device(device).type == "cuda":
        return d in _CUDA_HEAD_SIZES
    return lv.lossless or (d & (d - 1) == 0 and d <= 1024)


def qmax_table(level: Any, num_layers: int) -> np.ndarray:
    """uint8 ``[L, 2]`` (layer-major, K then V): what the kernels take; zeros for lossless."""
    lv = get_level(level)
    if lv.lossless:
        return np.zeros((num_layers, 2), np.uint8)
    return np.ascontiguousarray(np.array([lv.k.qmax_table(num_layers), lv.v.qmax_table(num_layers)], np.uint8).T)


def symbol_bytes(shape: Sequence[int]) -> int:
    """Bytes of one chunk's symbols (``[L, 2, H, D, T]`` uint8) for canonical ``shape``."""
    nl, _, t, h, d = (int(v) for v in shape)
    return int(_K.symbol_bytes(nl, t, h, d))


def side_bytes(level: Any, shape: Sequence[int]) -> int:
    """Bytes of one chunk's side array for ``level`` (= ``L * sum(quant.side_sizes(...))``)."""
    nl, _, t, h, d = (int(v) for v in shape)
    return int(_K.side_bytes(_mode(get_level(level)), nl, t, h, d))


@dataclass(frozen=True)
class NativeBatch:
    """Descriptors of C chunks with their symbol and side buffers, ready for the native calls.

    ``descs``: ``[C]`` :data:`DESC` (NumPy for CPU; a uint8 tensor on the device for CUDA).
    ``keep``: the tensors the descriptors point into (kept alive with the batch).
    """

    descs: Any
    num_chunks: int
    shape: tuple[int, int, int, int, int]
    dtype: torch.dtype
    device: torch.device
    keep: tuple[Any, ...]


def _as_list(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        if x.dim() == 6:
            return list(x.unbind(0))
        return [x]
    return list(x)


def make_batch(chunks: Any, symbols: Any, sides: Any) -> NativeBatch:
    """Build the descriptors for a batch (one small host-to-device copy on CUDA).

    Args:
        chunks: C tensors ``[L, 2, T, H, D]`` bf16/fp16 (or one ``[C, L, 2, T, H, D]`` tensor), contiguous,
            all on one device; CUDA chunks must start 16-byte aligned. Input of quantize, output of
            dequantize.
        symbols: C contiguous uint8 tensors of :func:`symbol_bytes` bytes each (any shape).
        sides: C contiguous uint8 tensors of :func:`side_bytes` bytes each.
    """
    chunks, symbols, sides = _as_list(chunks), _as_list(symbols), _as_list(sides)
    n = len(chunks)
    if len(symbols) != n or len(sides) != n:
        raise ValueError(f"got {n} chunks, {len(symbols)} symbol buffers, {len(sides)} side buffers")
    if n == 0:
        return NativeBatch(np.zeros(0, DESC), 0, (1, 2, 0, 1, 1), torch.bfloat16, torch.device("cpu"), ())
    shape = tuple(int(v) for v in chunks[0].shape)
    if len(shape) != 5 or shape[1] != 2:
        raise ValueError(f"expected canonical chunks [L, 2, T, H, D], got shape {shape}")
    dtype, device = chunks[0].dtype, chunks[0].device
    if dtype not in _DTYPES:
        raise TypeError(f"chunks must be bf16 or fp16, got {dtype}")
    desc = np.zeros(n, DESC)
    for i, (c, s, sd) in enumerate(zip(chunks, symbols, sides)):
        if tuple(c.shape) != shape or c.dtype != dtype or c.device != device:
            raise ValueError(f"chunk {i}: shape/dtype/device differ from chunk 0")
        for name, t in (("chunk", c), ("symbols", s), ("side", sd)):
            if t.device != device:
                raise ValueError(f"chunk {i}: {name} on {t.device}, expected {device}")
            if not t.is_contiguous():
                raise ValueError(f"chunk {i}: {name} must be contiguous")
        if s.dtype != torch.uint8 or sd.dtype != torch.uint8:
            raise TypeError(f"chunk {i}: symbols and side must be uint8")
        if device.type == "cuda" and c.data_ptr() % 16:
            raise ValueError(f"chunk {i}: CUDA chunks must be 16-byte aligned")
        desc[i] = (c.data_ptr(), s.data_ptr(), sd.data_ptr())
    sizes = (int(s.numel()) for s in symbols)
    need = int(_K.symbol_bytes(shape[0], shape[2], shape[3], shape[4]))
    if any(v != need for v in sizes):
        raise ValueError(f"symbol buffers must hold {need} bytes")
    keep = (*chunks, *symbols, *sides)
    if device.type == "cuda":
        d = torch.from_numpy(desc.view(np.uint8)).to(device)
        return NativeBatch(d, n, shape, dtype, device, keep)
    return NativeBatch(desc, n, shape, dtype, device, keep)


def _call(fn, batch: NativeBatch, level: Any, status: Any, num_threads: int, stream: Any) -> None:
    lv = get_level(level)
    mode = _mode(lv)
    nl, _, t, h, d = batch.shape
    if batch.num_chunks == 0:
        return
    if not supported(lv, batch.shape, batch.device):
        raise ValueError(f"level {lv.name!r} with shape {batch.shape} is not supported on {batch.device.type}")
    side_need = int(_K.side_bytes(mode, nl, t, h, d))
    for sd in batch.keep[2 * batch.num_chunks :]:
        if sd.numel() != side_need:
            raise ValueError(f"side buffers must hold {side_need} bytes for level {lv.name!r}")
    if (
        not isinstance(status, torch.Tensor)
        or status.dtype != torch.int32
        or status.numel() < batch.num_chunks
        or status.device != batch.device
        or not status.is_contiguous()
    ):
        raise ValueError("status must be a contiguous int32 tensor of >= C elements on the chunks' device")
    q = qmax_table(lv, nl)
    on_cuda = batch.device.type == "cuda"
    descs = batch.descs.data_ptr() if on_cuda else batch.descs.ctypes.data
    handle = stream_handle(stream, batch.device) if on_cuda else 0
    if on_cuda:  # inputs were produced / descriptors uploaded on the current stream
        order_after_current(stream, batch.device)
    fn(
        on_cuda,
        mode,
        _DTYPES[batch.dtype],
        nl,
        t,
        h,
        d,
        descs,
        batch.num_chunks,
        q.ctypes.data,
        status.data_ptr(),
        num_threads,
        handle,
    )


def quantize_batch(
    batch: NativeBatch, level: Any, *, status: torch.Tensor, num_threads: int = 0, stream: Any = None
) -> None:
    """Quantize ``batch``'s chunks into its symbol / side buffers (one native call).

    ``status``: int32 ``[C]`` on the chunks' device; receives per-chunk flags (0 = ok; see
    :func:`check_status`). CUDA: asynchronous on ``stream``; outputs of a flagged chunk are unspecified.
    """
    _call(_K.quantize, batch, level, status, num_threads, stream)


def dequantize_batch(
    batch: NativeBatch, level: Any, *, status: torch.Tensor, num_threads: int = 0, stream: Any = None
) -> None:
    """Dequantize ``batch``'s symbol / side buffers into its chunks (dtype = the chunks' dtype)."""
    _call(_K.dequantize, batch, level, status, num_threads, stream)


_FLAGS = (
    (_K.ERR_NON_FINITE, "KV contains NaN or inf; only 'lossless' can store it"),
    (_K.ERR_SCALE_RANGE, "KV magnitude exceeds the codec's scale range; use 'lossless'"),
    (_K.ERR_SYMBOL, "symbol outside the level's range (corrupt data)"),
    (8, "chunk not 16-byte aligned"),
)


def check_status(status: Any, what: str = "codec") -> None:
    """Raise :class:`CodecInputError` naming the chunks whose status is nonzero (syncs on CUDA)."""
    st = status.cpu().numpy() if isinstance(status, torch.Tensor) else np.asarray(status)
    bad = np.flatnonzero(st)
    if not bad.size:
        return
    parts = []
    for i in bad[:8]:
        v = int(st[i])
        if v & _K.ERR_NON_FINITE:  # non-finite input also overflows the scale: report the cause
            v &= ~_K.ERR_SCALE_RANGE
        msgs = [m for f, m in _FLAGS if v & f] or [f"status {v}"]
        parts.append(f"chunk {int(i)}: {'; '.join(msgs)}")
    more = f" (+{bad.size - 8} more)" if bad.size > 8 else ""
    raise CodecInputError(f"native {what} failed for {bad.size} chunk(s): {', '.join(parts)}{more}")


def quantize(
    chunks: Any, level: Any, *, num_threads: int = 0, stream: Any = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Quantize C canonical chunks; returns ``(symbols, sides)``: per chunk a uint8 ``[L, 2, H, D, T]``
    tensor and a 1-D uint8 side tensor, byte-identical to :func:`lmtier.codec.quant.quantize`.

    Raises:
        CodecInputError: non-finite KV or magnitudes beyond the scale range (quantized levels).
        ValueError / TypeError: unsupported level or geometry, bad shapes / dtypes.
    """
    chunks = [c.contiguous() for c in _as_list(chunks)]
    if not chunks:
        return [], []
    shape = tuple(int(v) for v in chunks[0].shape)
    if len(shape) != 5:
        raise ValueError(f"expected canonical chunks [L, 2, T, H, D], got shape {shape}")
    dev = chunks[0].device
    if dev.type == "cuda":
        chunks = [c if c.data_ptr() % 16 == 0 else c.clone() for c in chunks]
    nl, _, t, h, d = shape
    sb, sdb = symbol_bytes(shape), side_bytes(level, shape)
    sym_all = torch.empty((len(chunks), nl, 2, h, d, t), dtype=torch.uint8, device=dev)
    side_all = torch.empty((len(chunks), sdb), dtype=torch.uint8, device=dev)
    assert sym_all[0].numel() == sb
    syms, sides = list(sym_all.unbind(0)), list(side_all.unbind(0))
    status = torch.zeros(len(chunks), dtype=torch.int32, device=dev)
    batch = make_batch(chunks, syms, sides)
    quantize_batch(batch, level, status=status, num_threads=num_threads, stream=stream)
    if dev.type == "cuda":
        sync_stream(stream, dev)
    check_status(status, "quantize")
    return syms, sides


def dequantize(
    symbols: Any,
    sides: Any,
    level: Any,
    shape: Sequence[int],
    dtype: torch.dtype = torch.bfloat16,
    *,
    num_threads: int = 0,
    stream: Any = None,
) -> list[torch.Tensor]:
    """Inverse of :func:`quantize`: C canonical ``[L, 2, T, H, D]`` tensors of ``dtype``, bit-identical
    to :func:`lmtier.codec.quant.dequantize`.

    Raises:
        CodecInputError: symbols above ``2 * qmax`` (names the chunk).
    """
    symbols = [s.contiguous() for s in _as_list(symbols)]
    sides = [s.contiguous() for s in _as_list(sides)]
    if not symbols:
        return []
    shape = tuple(int(v) for v in shape)
    dev = symbols[0].device
    if dtype not in _DTYPES:
        raise TypeError(f"output dtype must be bf16 or fp16, got {dtype}")
    out_all = torch.empty((len(symbols), *shape), dtype=dtype, device=dev)
    outs = list(out_all.unbind(0))
    sdb = side_bytes(level, shape)
    for i, sd in enumerate(sides):
        if sd.numel() != sdb:
            raise CodecInputError(f"chunk {i}: side: expected {sdb} bytes, got {sd.numel()}")
    for i, s in enumerate(symbols):
        if s.numel() != symbol_bytes(shape) or s.dtype != torch.uint8:
            raise CodecInputError(
                f"chunk {i}: symbols: expected {symbol_bytes(shape)} uint8, got {s.numel()} {s.dtype}"
            )
    status = torch.zeros(len(symbols), dtype=torch.int32, device=dev)
    batch = make_batch(outs, symbols, sides)
    dequantize_batch(batch, level, status=status, num_threads=num_threads, stream=stream)
    if dev.type == "cuda":
        sync_stream(stream, dev)
    check_status(status, "dequantize")
    return outs
