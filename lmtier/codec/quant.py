"""Reference quantize / dequantize of the KV codec (pure torch; CPU or CUDA tensors).

This is the specification the C++ and CUDA kernels mirror bit-exactly. Every step is integer
arithmetic or a single correctly rounded IEEE fp32 operation (no FMA contraction is possible in the
steps below; kernels must be built without ``--use_fast_math``/flush-to-zero, divisions are
``__fdiv_rn``, rounding is ``rintf`` = round-half-to-even).

Input chunk: canonical layout ``[L, 2, T, H, D]`` (layers, K/V planes, tokens, KV heads, head
size), bf16 or fp16, any device. Elements are widened to fp32 (exact).

Quantized levels (``high``, ``default``, ``low``; see :mod:`lmtier.codec.levels`)
--------------------------------------------------------------------------------------
For each plane ``p`` (0 = K, 1 = V) and layer ``l`` with ``qmax = level.<plane>.qmax_table(L)[l]``:

1. ``y = x`` or, for ``Transform.HADAMARD``, ``y = fwht(x)`` over D (unnormalized, see
   :func:`fwht`).
2. Per scale group (see ``Granularity``) ``a = max |y|`` over the group (fp32, exact).
3. Scale code ``c = scale_code_ceil(a / qmax)`` (fp32 division), ``c = 0`` when ``a == 0``;
   ``S = scale_value(c)`` is the smallest representable scale ``>= a / qmax`` (see below).
4. ``q = clamp(rint(y / S), -qmax, qmax)`` (fp32 division, round-half-to-even; the clamp never
   binds, it is a guard); ``q = 0`` where ``S == 0`` (all-zero group).
5. Symbol byte ``sym = q + qmax`` in ``[0, 2*qmax]`` (the alphabet ``0 .. 2*qmax`` of the layer's
   streams; ``sym == qmax`` is zero).

Dequantize: ``yhat = (sym - qmax) * S`` (exact in fp32: at most 7 + 4 significant bits), for
HADAMARD ``xhat = fwht(yhat) * 2**-log2(D) / 2**log2(D)`` — i.e. ``fwht(yhat)`` times ``1/D``,
exact when the group shares one S (``TOKEN_HEAD``: every partial sum is an integer multiple of
``S/8`` below 2**17 · S) — then one rounding to the output dtype (round-to-nearest-even).

Error bound (quantized levels, before the final cast): ``|x - xhat| <= S/2`` per element, where S
is the element's group scale (``S < (9/8) * a / qmax`` unless ``a / qmax < 2**-17``, where
``S = 2**-17``); with HADAMARD the bound in the input domain is the mean of S/2 over the row's D
rotated coordinates (``|(H e)_i| / D <= mean |e_j|``; = S/2 when the row shares S) plus the fp32
rounding of the forward transform (≤ 6 ulp of the group's magnitude). The final cast adds at most
half an ulp of the output dtype.

Scale code (8 bits, "E5M3", unsigned, fixed bias)
-------------------------------------------------
``c = 0``: S = 0 (all-zero group). ``c in 1..255``: with ``k = c - 1``, ``e = k >> 3`` (0..31),
``m = k & 7``: ``S = (1 + m/8) * 2**(e - 17)`` = the fp32 whose bits are
``((e + 110) << 23) | (m << 20)``. So S spans ``2**-17`` (7.6e-6) to ``1.75 * 2**14`` (28,672,
code 255); every byte is a valid code. :func:`scale_code_ceil` computes the smallest code whose S is ``>= s``
with integer operations on the fp32 bits of ``s`` (values below 2**-17 map to code 1; values above
28,672 raise — such KV must use ``lossless``).

Symbol stream order (what the entropy coder sees)
-------------------------------------------------
``symbols``: uint8 ``[L, 2, H, D, T]`` C-contiguous, i.e. ``L*2*H*D`` *streams* of T bytes, one per
(layer, plane, head, channel), tokens in order; stream index ``((l*2 + p)*H + h)*D + d``.

``side`` (scale codes): uint8, 1-D, layer-major: for layer l, the K codes then the V codes, each
in the order of its granularity: TOKEN ``[T]``, TOKEN_HEAD ``[H, T]``, CHANNEL ``[H, D]``,
HEAD ``[H]``. See :func:`side_sizes`.

Lossless
--------
Each 16-bit element ``u`` (bf16 or fp16 bits) is rotated left by one bit, ``r = (u << 1 | u >> 15)
& 0xFFFF``, and split: ``hi = r >> 8`` (bf16: the 8 exponent bits; fp16: 5 exponent + top 3
mantissa bits), ``lo = r & 0xFF`` (remaining mantissa bits, sign in bit 0). ``symbols`` = the hi
plane ``[L, 2, H, D, T]`` (entropy coded per stream), ``side`` = the lo plane in the same order
(near-random; stored or coded by the record). Exact round trip for every bit pattern (NaN, inf,
-0, subnormals included).

Sources: CacheGen (Liu et al., SIGCOMM 2024) for the (layer, K/V, channel) stream grouping and
layer-dependent bins; LMCache's ``cachegen_encoder.py`` for the reference scheme; KIVI (Liu et al.,
ICML 2024) for per-channel key scales; QuaRot (Ashkboos et al., 2024) for the Hadamard rotation.
"""

from __future__ import annotations

import math

import torch

from lmtier.errors import LMTierError

from .levels import Granularity, PlaneQuant, Transform, get_level

__all__ = [
    "quantize",
    "dequantize",
    "fwht",
    "scale_code_ceil",
    "scale_value",
    "side_sizes",
    "symbol_shape",
    "CodecInputError",
    "SCALE_MIN",
    "SCALE_MAX",
    "zero_symbols",
]

SCALE_MIN = 2.0**-17
SCALE_MAX = 1.75 * 2.0**14


class CodecInputError(LMTierError, ValueError):
    """Input the codec cannot represent (non-finite or out-of-range KV) or corrupt codec data."""


# ------------------------------------------------------------------------------------------------
# scale code
# ------------------------------------------------------------------------------------------------
def scale_code_ceil(s: torch.Tensor) -> torch.Tensor:
    """Smallest E5M3 code whose scale is ``>= s`` (fp32, finite, ``>= 0``); ``s == 0`` gives 0.

    Integer operations on the fp32 bits: ``E`` = unbiased exponent, ``mant`` = 23-bit mantissa,
    ``m = ceil(mant / 2**20)`` (a carry to 8 bumps ``E``), ``e = E + 17``; ``e < 0`` gives code 1,
    ``e > 31`` or ``(e, m) == (31, 7)`` raise.
    """
    if s.dtype != torch.float32:
        raise TypeError("scale_code_ceil takes fp32")
    bits = s.contiguous().view(torch.int32)
    exp_field = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    m = (mant + ((1 << 20) - 1)) >> 20
    carry = m == 8
    m = torch.where(carry, torch.zeros_like(m), m)
    e = exp_field - 127 + 17 + carry.to(torch.int32)
    too_big = (e > 31) | ((e == 31) & (m == 7))
    if bool(too_big.any()):
        raise CodecInputError(f"KV magnitude exceeds the codec's scale range (scale > {SCALE_MAX}); use 'lossless'")
    code = torch.where(e < 0, torch.ones_like(e), 1 + e * 8 + m)
    code = torch.where(s == 0, torch.zeros_like(code), code)
    return code.to(torch.uint8)


def scale_value(code: torch.Tensor) -> torch.Tensor:
    """fp32 scale of E5M3 codes (uint8); 0 -> 0.0 (every byte is a valid code)."""
    c = code.to(torch.int32)
    k = c - 1
    bits = (((k >> 3) + 110) << 23) | ((k & 7) << 20)
    s = bits.contiguous().view(torch.float32)
    return torch.where(c == 0, torch.zeros_like(s), s)


# ------------------------------------------------------------------------------------------------
# Walsh–Hadamard transform
# ------------------------------------------------------------------------------------------------
def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh–Hadamard transform over the last dim (a power of two), fp32.

    Fixed butterfly order, which kernels must follow for bit-identical fp32 rounding: for
    ``h = 1, 2, 4, ..., D/2``, for every pair ``(i, i + h)`` with ``i & h == 0``:
    ``(a, b) -> (a + b, a - b)`` (one fp32 add and one fp32 subtract each). ``fwht(fwht(x)) = D*x``.
    """
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"Hadamard transform needs a power-of-two head size, got {d}")
    y = x.to(torch.float32)
    lead = y.shape[:-1]
    h = 1
    while h < d:
        v = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return y


# ------------------------------------------------------------------------------------------------
# geometry
# ------------------------------------------------------------------------------------------------
def symbol_shape(shape) -> tuple[int, int, int, int, int]:
    """Symbol tensor shape ``[L, 2, H, D, T]`` for a canonical chunk shape ``[L, 2, T, H, D]``."""
    nl, npl, t, h, d = (int(v) for v in shape)
    return (nl, npl, h, d, t)


def _codes_per_layer(pq: PlaneQuant, t: int, h: int, d: int) -> int:
    g = pq.granularity
    if g == Granularity.TOKEN:
        return t
    if g == Granularity.TOKEN_HEAD:
        return h * t
    if g == Granularity.CHANNEL:
        return h * d
    if g == Granularity.HEAD:
        return h
    raise ValueError(f"unsupported granularity {g!r}")


def side_sizes(level, shape) -> tuple[int, int]:
    """(K codes, V codes) per layer; ``side`` has ``L * (K + V)`` bytes (lossless: the lo plane)."""
    lv = get_level(level)
    nl, npl, t, h, d = (int(v) for v in shape)
    if lv.lossless:
        return (t * h * d, t * h * d)
    return (_codes_per_layer(lv.k, t, h, d), _codes_per_layer(lv.v, t, h, d))


def _check_chunk(chunk: torch.Tensor) -> None:
    if chunk.dim() != 5 or chunk.shape[1] != 2:
        raise ValueError(f"expected a canonical chunk [L, 2, T, H, D], got shape {tuple(chunk.shape)}")
    if chunk.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"codec input must be bf16 or fp16, got {chunk.dtype}")


# ------------------------------------------------------------------------------------------------
# quantized levels
# ------------------------------------------------------------------------------------------------
def _group_absmax(y: torch.Tensor, g: Granularity) -> torch.Tensor:
    """y: [L, T, H, D] fp32 -> absmax per group, in the side order of the granularity."""
    a = y.abs()
    nl, t, h, d = y.shape
    if g == Granularity.TOKEN:
        return a.reshape(nl, t, h * d).amax(dim=2) if h * d else a.new_zeros(nl, t)
    if g == Granularity.TOKEN_HEAD:
        return a.amax(dim=3).transpose(1, 2) if d else a.new_zeros(nl, h, t)  # [L, H, T]
    if g == Granularity.CHANNEL:
        return a.amax(dim=1) if t else a.new_zeros(nl, h, d)  # [L, H, D]
    if g == Granularity.HEAD:
        return a.permute(0, 2, 1, 3).reshape(nl, h, t * d).amax(dim=2) if t * d else a.new_zeros(nl, h)
    raise ValueError(f"unsupported granularity {g!r}")


def _broadcast_scale(s: torch.Tensor, g: Granularity) -> torch.Tensor:
    """Per-group scale in side order -> broadcastable to [L, T, H, D]."""
    if g == Granularity.TOKEN:
        return s[:, :, None, None]
    if g == Granularity.TOKEN_HEAD:
        return s.transpose(1, 2)[:, :, :, None]
    if g == Granularity.CHANNEL:
        return s[:, None, :, :]
    if g == Granularity.HEAD:
        return s[:, None, :, None]
    raise ValueError(f"unsupported granularity {g!r}")


def _quantize_plane(x: torch.Tensor, pq: PlaneQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [L, T, H, D] fp32 -> (q int32 [L, T, H, D], codes uint8 [L, ...side order])."""
    nl = x.shape[0]
    qmax = torch.tensor(pq.qmax_table(nl), dtype=torch.float32, device=x.device)
    y = fwht(x) if pq.transform == Transform.HADAMARD else x
    a = _group_absmax(y, pq.granularity)
    target = a / qmax.reshape(nl, *([1] * (a.dim() - 1)))
    codes = scale_code_ceil(target)
    s = _broadcast_scale(scale_value(codes), pq.granularity)
    qm = qmax.reshape(nl, 1, 1, 1)
    safe = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.clamp(torch.round(y / safe), -qm, qm)  # torch.round: half to even == rintf
    q = torch.where(s == 0, torch.zeros_like(q), q)
    return q.to(torch.int32), codes


def _dequantize_plane(q: torch.Tensor, codes: torch.Tensor, pq: PlaneQuant) -> torch.Tensor:
    """q: [L, T, H, D] int32, codes in side order -> fp32 [L, T, H, D]."""
    s = _broadcast_scale(scale_value(codes), pq.granularity)
    y = q.to(torch.float32) * s
    if pq.transform == Transform.HADAMARD:
        d = y.shape[-1]
        y = fwht(y) * (1.0 / d)
    return y


def quantize(chunk: torch.Tensor, level) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize one canonical chunk.

    Args:
        chunk: ``[L, 2, T, H, D]`` bf16 or fp16, CPU or CUDA; must be finite for quantized levels.
        level: a :class:`~lmtier.codec.levels.Level`, its name or id.

    Returns:
        ``(symbols, side)``: ``symbols`` uint8 ``[L, 2, H, D, T]`` (stream order, see module doc);
        ``side`` uint8 1-D, ``L * sum(side_sizes(level, shape))`` bytes, layer-major (scale codes,
        or the lo byte plane for ``lossless``). Same device as ``chunk``. Deterministic.

    Raises:
        CodecInputError: non-finite values or magnitudes beyond the scale range (quantized levels).
        TypeError / ValueError: wrong dtype / shape, unknown level.
    """
    lv = get_level(level)
    _check_chunk(chunk)
    nl, _, t, h, d = chunk.shape
    if lv.lossless:
        u = chunk.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        r = ((u << 1) | (u >> 15)) & 0xFFFF
        hi = (r >> 8).to(torch.uint8).permute(0, 1, 3, 4, 2).contiguous()
        lo = (r & 0xFF).to(torch.uint8).permute(0, 1, 3, 4, 2).contiguous()
        return hi, lo.reshape(-1)
    x = chunk.to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise CodecInputError("KV chunk contains NaN or inf; only 'lossless' can store it")
    sym_planes, side_planes = [], []
    for p, pq in ((0, lv.k), (1, lv.v)):
        q, codes = _quantize_plane(x[:, p], pq)
        qmax = torch.tensor(pq.qmax_table(nl), dtype=torch.int32, device=x.device).reshape(nl, 1, 1, 1)
        sym_planes.append((q + qmax).to(torch.uint8).permute(0, 2, 3, 1))  # [L, H, D, T]
        side_planes.append(codes.reshape(nl, -1))
    symbols = torch.stack(sym_planes, dim=1).contiguous()
    side = torch.cat(side_planes, dim=1).reshape(-1).contiguous()
    return symbols, side


def dequantize(symbols: torch.Tensor, side: torch.Tensor, level, shape, dtype=torch.bfloat16) -> torch.Tensor:
    """Inverse of :func:`quantize`: a canonical ``[L, 2, T, H, D]`` tensor of ``dtype``.

    Args:
        symbols: uint8 ``[L, 2, H, D, T]`` (or anything with that many elements, read in that order).
        side: uint8 1-D side data as returned by :func:`quantize`.
        level: the level the data was quantized with.
        shape: the canonical chunk shape ``(L, 2, T, H, D)``.
        dtype: bf16 or fp16 output (lossless: must be the input's dtype to round-trip bits).

    Raises:
        CodecInputError: sizes that do not match, symbols above ``2 * qmax``.
    """
    lv = get_level(level)
    nl, npl, t, h, d = (int(v) for v in shape)
    if npl != 2:
        raise ValueError("canonical chunk has 2 planes")
    if dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"output dtype must be bf16 or fp16, got {dtype}")
    n = nl * 2 * t * h * d
    if symbols.dtype != torch.uint8 or symbols.numel() != n:
        raise CodecInputError(f"symbols: expected {n} uint8, got {symbols.numel()} {symbols.dtype}")
    ks, vs = side_sizes(lv, shape)
    if side.dtype != torch.uint8 or side.numel() != nl * (ks + vs):
        raise CodecInputError(f"side: expected {nl * (ks + vs)} uint8, got {side.numel()} {side.dtype}")
    sym = symbols.reshape(nl, 2, h, d, t)
    if lv.lossless:
        hi = sym.to(torch.int32)
        lo = side.reshape(nl, 2, h, d, t).to(torch.int32)
        r = (hi << 8) | lo
        u = ((r >> 1) | ((r & 1) << 15)) & 0xFFFF
        u = torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16)
        return u.permute(0, 1, 4, 2, 3).contiguous().view(dtype)
    side2 = side.reshape(nl, ks + vs)
    out = []
    for p, pq, codes in ((0, lv.k, side2[:, :ks]), (1, lv.v, side2[:, ks:])):
        qmax = torch.tensor(pq.qmax_table(nl), dtype=torch.int32, device=sym.device).reshape(nl, 1, 1, 1)
        q = sym[:, p].to(torch.int32) - qmax  # [L, H, D, T]
        if bool((q > qmax).any()):
            raise CodecInputError("symbol outside the level's range (corrupt data)")
        codes = _reshape_codes(codes, pq.granularity, nl, t, h, d)
        out.append(_dequantize_plane(q.permute(0, 3, 1, 2), codes, pq))
    return torch.stack(out, dim=1).to(dtype).contiguous()


def _reshape_codes(codes: torch.Tensor, g: Granularity, nl: int, t: int, h: int, d: int) -> torch.Tensor:
    if g == Granularity.TOKEN:
        return codes.reshape(nl, t)
    if g == Granularity.TOKEN_HEAD:
        return codes.reshape(nl, h, t)
    if g == Granularity.CHANNEL:
        return codes.reshape(nl, h, d)
    if g == Granularity.HEAD:
        return codes.reshape(nl, h)
    raise ValueError(f"unsupported granularity {g!r}")


def error_bound(side: torch.Tensor, level, shape) -> torch.Tensor:
    """Per-element bound ``S/2`` (fp32, canonical shape) on ``|x - dequantize(...)|`` before the
    output cast, for quantized levels. With HADAMARD the bound is the mean of S/2 over the D
    rotated coordinates of the row (equal to S/2 for TOKEN_HEAD), plus fp32 transform rounding."""
    lv = get_level(level)
    if lv.lossless:
        raise ValueError("lossless is exact")
    nl, _, t, h, d = (int(v) for v in shape)
    ks, vs = side_sizes(lv, shape)
    side2 = side.reshape(nl, ks + vs)
    out = []
    for pq, codes in ((lv.k, side2[:, :ks]), (lv.v, side2[:, ks:])):
        s = _broadcast_scale(scale_value(_reshape_codes(codes, pq.granularity, nl, t, h, d)), pq.granularity)
        s = s.expand(nl, t, h, d)
        if pq.transform == Transform.HADAMARD:  # |H e / D|_i <= mean_j |e_j|
            s = s.mean(dim=-1, keepdim=True).expand(nl, t, h, d)
        out.append(s * 0.5)
    return torch.stack(out, dim=1)


def zero_symbols(level, num_layers: int) -> torch.Tensor:
    """uint8 [L, 2]: the symbol that encodes 0 (= qmax) per layer and plane of a quantized level."""
    lv = get_level(level)
    return torch.tensor([lv.k.qmax_table(num_layers), lv.v.qmax_table(num_layers)], dtype=torch.uint8).T.contiguous()


def bits_per_value_raw(level, shape) -> float:
    """Uncoded size in bits per element (8-bit symbols + 8-bit scale codes) — an upper bound."""
    nl, _, t, h, d = (int(v) for v in shape)
    ks, vs = side_sizes(level, shape)
    n = nl * 2 * t * h * d
    return 8.0 + 8.0 * nl * (ks + vs) / n if n else math.nan
