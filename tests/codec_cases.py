"""What the codec tests share (tests/test_codec_chunk.py, tests/test_codec_tier.py,
tests/test_codec_config.py): the tiny chunk geometry, KV-like inputs, the dequantized reference and its
error bound, and valid, damaged and hand-built records."""

from __future__ import annotations

import struct

import numpy as np
import torch
import xxhash

from lmtier.codec import chunk as C
from lmtier.codec import format as fmt
from lmtier.codec import quant as Q
from lmtier.codec import rans

SHAPE = (2, 2, 16, 2, 64)  # [L, 2, T, H, D]: 16 KiB of bf16
LOSSY = ("high", "default", "low")
LEVELS = ("lossless", *LOSSY)
DTYPES = (torch.bfloat16, torch.float16)
DNAME = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def key(i: int) -> bytes:
    return bytes([i % 256]) * 31 + b"\x07"


def kv_like(shape=SHAPE, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """KV-like data: per-channel magnitudes, key outlier channels, a sink token, a zero head row."""
    g = torch.Generator().manual_seed(seed)
    nl, _, t, h, d = shape
    ch = torch.rand(nl, 2, 1, h, d, generator=g) + 0.05
    ch[:, 0, :, :, : max(1, d // 16)] *= 20.0
    x = torch.randn(shape, generator=g) * ch
    x[:, :, 0] *= 8.0
    x[0, 1, 3, 1] = 0.0
    return x.to(dtype)


def as_bytes(x: torch.Tensor) -> bytes:
    return x.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def check_within_bound(x: torch.Tensor, y: torch.Tensor, level: str) -> None:
    """|x - y| <= quant.error_bound (S/2) + the forward transform's fp32 rounding + the output cast."""
    _, side = Q.quantize(x, level)
    bound = Q.error_bound(side, level, tuple(x.shape))
    err = (y.float() - x.float()).abs()
    ulp = 2.0**-8 if x.dtype == torch.bfloat16 else 2.0**-11
    slack = y.float().abs() * ulp + 2.0**-24 + x.float().abs().amax(dim=-1, keepdim=True) * x.shape[-1] * 2.0**-22
    assert bool((err <= bound + slack).all()), float((err - bound - slack).max())
    assert float(err.max()) > 0  # lossy really is lossy here


def reference(x: torch.Tensor, level: str) -> torch.Tensor:
    if level == "lossless":
        return x
    sym, side = Q.quantize(x, level)
    return Q.dequantize(sym, side, level, tuple(x.shape), x.dtype)


def rechecksum(rec: bytearray) -> bytearray:
    """Recompute a record's xxh3 checksum (so damage reaches the checks behind it)."""
    end = fmt.unpack(bytes(rec), verify_checksum=False).nbytes
    h = xxhash.xxh3_64()
    h.update(bytes(rec[:56]))
    h.update(bytes(rec[64:end]))
    rec[56:64] = struct.pack("<Q", h.intdigest())
    return rec


def record(level="default", x=None, shape=SHAPE, dtype=torch.bfloat16) -> bytes:
    x = kv_like(shape, dtype) if x is None else x
    return C.encode_chunk(x, shape=shape, dtype=dtype, level=level)


def damaged(kind: str) -> tuple[bytes, str]:
    rec = bytearray(record())
    r = fmt.unpack(bytes(rec))
    if kind == "checksum":
        rec[r.payload_offset + 40] ^= 0x10
        return bytes(rec), "checksum"
    if kind == "truncated":
        return bytes(rec[: len(rec) - 100]), "truncated"
    if kind == "magic":
        return b"XXXX" + bytes(rec[4:]), "not a codec record"
    if kind == "level":
        rec[8] = 99
        return bytes(rechecksum(rec)), "unknown level"
    if kind == "rans":  # damage inside a coded segment, checksum fixed: the coder's status
        off, n = int(r.section_offsets()[0]), int(r.section_lengths()[0])
        rec[off + n - 8] ^= 0x5A
        return bytes(rechecksum(rec)), "rANS stream of layer 0, section 0 failed"
    if kind == "geometry":
        return record(shape=(2, 2, 8, 2, 64)), "geometry"
    if kind == "dtype":
        return record(dtype=torch.float16), "holds FLOAT16"
    if kind == "other_level":
        return record(level="high"), "level 'high', expected 'default'"
    raise AssertionError(kind)


DAMAGE = ("checksum", "truncated", "magic", "level", "rans", "geometry", "dtype", "other_level")


def tables42(x=None) -> C.StaticTables:
    """A static table set fitted on ``x`` (K, V symbol tables; per-stream tables for the codes)."""
    sym, _ = Q.quantize(kv_like() if x is None else x, "default")
    tabs = np.stack(
        [rans.table_from_symbols(sym[:, 0], alphabet_size=13), rans.table_from_symbols(sym[:, 1], alphabet_size=7)]
    )
    return C.StaticTables(table_id=42, tables=tabs, section_tables=[0, 1, rans.ADAPTIVE_TABLE] * SHAPE[0])


def pack_symbols(sym: torch.Tensor, side: torch.Tensor, meta: bytes = b"") -> bytes:
    """A ``default`` record of :data:`SHAPE` (bf16) from quantized symbols ``sym`` and side data
    ``side`` (as :func:`lmtier.codec.quant.quantize` returns them), coded by hand: valid rANS streams
    whatever the symbols, plus ``meta`` bytes of metadata (encode_chunk writes none)."""
    nl = SHAPE[0]
    extra = side.view(nl, -1)
    streams = []
    for l in range(nl):
        streams += [sym[l, 0].reshape(-1), sym[l, 1].reshape(-1), extra[l]]
    b = rans.encode(streams)
    info = fmt.RecordInfo(2, nl, 2, 16, 2, 64, fmt.DType.BFLOAT16, 3)
    return fmt.pack(info, [b.stream(i) for i in range(len(streams))], meta)


def out_of_range_record() -> bytes:
    """A well-formed ``default`` record whose K symbols exceed 2*qmax (hand-built, valid streams)."""
    sym, side = Q.quantize(kv_like(), "default")
    sym = sym.clone()
    sym[1, 0, 0, 0, 5] = 200
    return pack_symbols(sym, side)


def record_with_meta(x: torch.Tensor, meta_bytes: int) -> bytes:
    """A valid ``default`` record of ``x`` carrying ``meta_bytes`` of metadata (encode_chunk writes
    none): longer than max_record_bytes when ``meta_bytes`` is large."""
    sym, side = Q.quantize(x, "default")
    return pack_symbols(sym, side, b"m" * meta_bytes)
