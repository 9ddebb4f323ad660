"""Rates and decodes of the codec levels and of the CacheGen reference on canonical KV
(``[L, 2, T, H, D]``, 256-token chunks), no model: the ideal static-table coder's bits
(:func:`level_rate`), the real records' ratio (:func:`shipped_ratio`), the decoded KV
(:func:`decode_level`) and its error (:func:`layer_rel_error`). Used by :mod:`codec_quality`
(protocol in its docstring) and :mod:`codec_matrix`.
"""

from __future__ import annotations

import torch

from lmtier.codec import levels as L
from lmtier.codec import quant as Q

CHUNK_TOKENS = 256

# --------------------------------------------------------------------------------------------
# rate: ideal static-table coder over byte streams
# --------------------------------------------------------------------------------------------
TABLE_PRECISION_BITS = 12
_M = 1 << TABLE_PRECISION_BITS


def chunk_views(kv: torch.Tensor, chunk_tokens: int = CHUNK_TOKENS):
    """Canonical [L, 2, T, H, D] -> list of contiguous chunks along T."""
    t = kv.shape[2]
    return [kv[:, :, i : i + chunk_tokens].contiguous() for i in range(0, t, chunk_tokens)]


def stream_counts(streams: list[torch.Tensor]) -> torch.Tensor:
    """streams: list of uint8 [S, n] -> counts int64 [S, 256]."""
    s = streams[0].shape[0]
    counts = torch.zeros(s * 256, dtype=torch.int64)
    base = (torch.arange(s, dtype=torch.int64) * 256)[:, None]
    for x in streams:
        counts += torch.bincount((x.to(torch.int64) + base).reshape(-1), minlength=s * 256)
    return counts.reshape(s, 256)


def normalize_table(counts: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """12-bit frequency tables [S, 256] (each row sums to 4096): symbol i of the support gets
    ``1 + floor(c_i * (4096 - k) / n)`` (k = support size), the residue goes to the most frequent."""
    sup = support.to(torch.float64)
    c = counts.to(torch.float64) * sup
    n = c.sum(1, keepdim=True).clamp_min(1)
    k = sup.sum(1, keepdim=True)
    f = (sup * (1 + torch.floor(c * (_M - k) / n))).to(torch.int64)
    resid = _M - f.sum(1)
    assert bool((resid >= 0).all())
    f[torch.arange(f.shape[0]), f.argmax(1)] += resid
    return f


def static_bits(x: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """Cost in bits per stream of coding x [S, n] with tables freq [S, 256] (inf if freq == 0)."""
    logp = torch.log2(freq.to(torch.float64) / _M)
    return -logp.gather(1, x.to(torch.int64)).sum(1)


def local_bits(x: torch.Tensor) -> torch.Tensor:
    """Chunk-local table: empirical entropy of each stream + its description
    (8 bits count + 8 bits symbol + 12 bits frequency per distinct symbol)."""
    c = stream_counts([x]).to(torch.float64)
    n = x.shape[1]
    p = c / n
    ent = -(c * torch.where(c > 0, torch.log2(p), torch.zeros_like(p))).sum(1)
    return ent + 8 + 20 * (c > 0).sum(1)


def empirical_bits(x: torch.Tensor) -> torch.Tensor:
    """Per-stream empirical entropy (no table cost): the 'entropy bound' of per-chunk tables."""
    c = stream_counts([x]).to(torch.float64)
    p = c / x.shape[1]
    return -(c * torch.where(c > 0, torch.log2(p), torch.zeros_like(p))).sum(1)


class StaticCoderModel:
    """Static tables per stream fitted on calibration chunks; cost = min(static, local + desc) + 1
    flag bit per (chunk, stream)."""

    def __init__(self, calib_streams: list[torch.Tensor], support: torch.Tensor):
        self.freq = normalize_table(stream_counts(calib_streams), support | (stream_counts(calib_streams) > 0))

    def stream_bits(self, x: torch.Tensor) -> torch.Tensor:
        """Cost in bits of each stream of x [S, n]: min(static, local + description) + 1 flag bit."""
        return torch.minimum(static_bits(x, self.freq), local_bits(x)) + 1

    def bits(self, x: torch.Tensor) -> tuple[float, float]:
        st = static_bits(x, self.freq)
        return float(self.stream_bits(x).sum()), float(st[torch.isfinite(st)].sum())


def _symbol_streams(sym: torch.Tensor) -> torch.Tensor:
    """[L, 2, H, D, T] -> [L*2*H*D, T]."""
    return sym.reshape(-1, sym.shape[-1])


def level_support(level, shape) -> torch.Tensor:
    """[S, 256] bool: the symbols a quantized level can emit in each stream."""
    lv = L.get_level(level)
    nl, _, t, h, d = shape
    sym = torch.arange(256)
    rows = []
    for pq in (lv.k, lv.v):
        qm = torch.tensor(pq.qmax_table(nl))
        rows.append(sym[None, :] <= 2 * qm[:, None])  # [L, 256]: alphabet 0 .. 2*qmax
    sup = torch.stack(rows, dim=1)  # [L, 2, 256]
    return sup[:, :, None, None, :].expand(nl, 2, h, d, 256).reshape(-1, 256)


_RATE_MODELS: dict = {}


_RESOLVED: dict = {}


def resolved_level(chunk: torch.Tensor, lv):
    """``lv``, or an adaptive level resolved for ``chunk`` (memoized by the chunk's bytes)."""
    if not lv.adaptive:
        return lv
    import hashlib

    from lmtier.codec import bound as B

    key = (lv, tuple(chunk.shape), hashlib.blake2b(chunk.contiguous().view(torch.uint8).numpy()).digest())
    if key not in _RESOLVED:
        qk, qv, _ = B.choose_qmax(chunk, lv)
        _RESOLVED[key] = L.resolve(lv, qk, qv)
    return _RESOLVED[key]


def quantize_any(chunk: torch.Tensor, lv):
    """:func:`lmtier.codec.quant.quantize`, resolving an adaptive level for the chunk first."""
    return Q.quantize(chunk, resolved_level(chunk, lv))


def _rate_models(lv, calib_kv: torch.Tensor, shape) -> tuple:
    """Static-table rate models (symbols, lossless side, K scales, V scales) fitted on ``calib_kv``."""
    cal = [quantize_any(c, lv) for c in chunk_views(calib_kv)]
    if lv.lossless or lv.adaptive:
        sup = torch.ones(1, 256, dtype=torch.bool).expand(_symbol_streams(cal[0][0]).shape[0], 256)
    else:
        sup = level_support(lv, shape)
    sym_model = StaticCoderModel([_symbol_streams(s) for s, _ in cal], sup)
    # side: lossless -> lo plane, coded per stream like the symbols (or raw, whichever is cheaper);
    # quantized -> scale codes, one stream per (layer, plane) (K and V code counts may differ).
    side_model = kmodel = vmodel = None
    if lv.lossless:
        side_model = StaticCoderModel([_symbol_streams(sd.reshape(s.shape)) for s, sd in cal], torch.ones_like(sup))
    else:
        ks, vs = Q.side_sizes(lv, shape)
        nl = shape[0]
        kmodel = StaticCoderModel(
            [sd.reshape(nl, ks + vs)[:, :ks] for _, sd in cal], torch.ones(nl, 256, dtype=torch.bool)
        )
        vmodel = StaticCoderModel(
            [sd.reshape(nl, ks + vs)[:, ks:] for _, sd in cal], torch.ones(nl, 256, dtype=torch.bool)
        )
    return sym_model, side_model, kmodel, vmodel


def level_rate(level, calib_kv: torch.Tensor, eval_kv: torch.Tensor) -> dict:
    """Bits of ``eval_kv`` (bf16 canonical) under ``level`` with static tables from ``calib_kv``.

    Returns symbol bits (static+fallback), side bits, per-chunk entropy bound, value count, ratio."""
    lv = L.get_level(level)
    ev = [quantize_any(c, lv) for c in chunk_views(eval_kv)]
    shape = tuple(chunk_views(eval_kv)[0].shape)
    key = (calib_kv.data_ptr(), tuple(calib_kv.shape), lv)
    if key not in _RATE_MODELS:
        _RATE_MODELS[key] = _rate_models(lv, calib_kv, shape)
    sym_model, side_model, kmodel, vmodel = _RATE_MODELS[key]
    sym_bits = side_bits = bound_bits = 0.0

    nvals = 0
    for (s, sd), chunk in zip(ev, chunk_views(eval_kv)):
        st = _symbol_streams(s)
        sym_bits += sym_model.bits(st)[0]
        bound_bits += float(empirical_bits(st).sum())
        nvals += chunk.numel()
        if lv.lossless:
            lo = _symbol_streams(sd.reshape(s.shape))
            side_bits += min(side_model.bits(lo)[0], 8.0 * lo.numel())
        else:
            ks, vs = Q.side_sizes(lv, tuple(chunk.shape))
            nl = chunk.shape[0]
            s2 = sd.reshape(nl, ks + vs)
            for part, model in ((s2[:, :ks], kmodel), (s2[:, ks:], vmodel)):
                side_bits += min(model.bits(part)[0], 8.0 * part.numel())
    total = sym_bits + side_bits
    return dict(
        bits_per_value=total / nvals,
        symbol_bits_per_value=sym_bits / nvals,
        side_bits_per_value=side_bits / nvals,
        chunk_entropy_bound_bits_per_value=bound_bits / nvals,
        ratio=16.0 * nvals / total,
    )


# --------------------------------------------------------------------------------------------
# CacheGen reference (LMCache's arithmetic: cachegen_encoder.py torch_quant)
# --------------------------------------------------------------------------------------------
def cachegen_bins(num_layers: int) -> tuple[list[int], list[int]]:
    """K: 32 bins for the first ceil(L/3) layers, 16 after; V: 32 for the first 2, 16 after."""
    k = [32 if l < -(-num_layers // 3) else 16 for l in range(num_layers)]
    v = [32 if l < 2 else 16 for l in range(num_layers)]
    return k, v


def cachegen_chunk(chunk: torch.Tensor):
    """One chunk [L, 2, T, H, D] -> (decoded fp32 chunk, symbols [L*2*H*D, T] uint8, scale count).

    ``C = bins // 2 - 1``; ``max1 = amax |x|`` over heads × channels per (layer, plane, token);
    ``xq = round(x * (C / max1))``; decoded ``xq / C * max1``; symbol ``xq + C``."""
    nl, _, t, h, d = chunk.shape
    kb, vb = cachegen_bins(nl)
    x = chunk.float().reshape(nl, 2, t, h * d)
    c = torch.tensor([kb, vb], dtype=torch.float32).T.reshape(nl, 2, 1, 1) // 2 - 1
    max1 = x.abs().amax(dim=-1, keepdim=True)
    xq = torch.round(x * (c / max1))
    dec = (xq / c * max1).reshape(chunk.shape)
    sym = (xq + c).to(torch.uint8).reshape(nl, 2, t, h, d).permute(0, 1, 3, 4, 2).reshape(-1, t)
    return dec, sym, nl * 2 * t


def cachegen_rate_and_decode(eval_kv: torch.Tensor, calib_kv: torch.Tensor) -> tuple[dict, torch.Tensor]:
    decs, bound, shipped, static, nvals = [], 0.0, 0.0, 0.0, 0
    cal_syms = [cachegen_chunk(c)[1] for c in chunk_views(calib_kv)]
    model = StaticCoderModel(cal_syms, torch.zeros(cal_syms[0].shape[0], 256, dtype=torch.bool))
    for chunk in chunk_views(eval_kv):
        dec, sym, nscales = cachegen_chunk(chunk)
        decs.append(dec)
        ent = float(empirical_bits(sym).sum())
        scale_bits = 16.0 * nscales  # the max of bf16 values is a bf16 value: 16 bits suffice
        bound += ent + scale_bits
        shipped += ent + scale_bits + sym.shape[0] * 33 * 16  # LMCache ships an int16 CDF (33 entries) per stream
        static += model.bits(sym)[0] + scale_bits
        nvals += chunk.numel()
    return (
        dict(
            ratio=16.0 * nvals / bound,
            bits_per_value=bound / nvals,
            ratio_as_shipped=16.0 * nvals / shipped,
            ratio_static_tables=16.0 * nvals / static,
        ),
        torch.cat(decs, dim=2),
    )


def shipped_ratio(level, kv_bf16: torch.Tensor) -> float | None:
    """bf16 bytes / bytes of the real codec records of every chunk (None for levels without a
    record path here, e.g. ``cachegen_ref``). Quantized levels use the shipped calibrated tables
    (per-stream tables when none fit the geometry), ``lossless`` per-stream tables."""
    from lmtier.codec import calibrate as CAL
    from lmtier.codec import chunk as CH

    lv = L.get_level(level)
    if lv.name not in L.LEVELS and lv.name not in L.EXPERIMENTAL_LEVELS:
        return None
    total = raw = 0
    for c in chunk_views(kv_bf16):
        tab = CAL.shipped_tables(lv, tuple(c.shape))
        rec = CH.encode_chunk(c, shape=tuple(c.shape), dtype=c.dtype, level=lv, tables=tab)
        total += len(rec)
        raw += c.numel() * c.element_size()
    return raw / total


def decode_level(level, kv_bf16: torch.Tensor) -> torch.Tensor:
    outs = []
    lv = L.get_level(level)
    for c in chunk_views(kv_bf16):
        rl = resolved_level(c, lv)
        s, sd = Q.quantize(c, rl)
        outs.append(Q.dequantize(s, sd, rl, tuple(c.shape), c.dtype))
    return torch.cat(outs, dim=2)


def layer_rel_error(ref: torch.Tensor, dec: torch.Tensor) -> dict:
    """Relative L2 error per (layer, plane): ||dec - ref|| / ||ref||; summary for K and V."""
    r = ref.float()
    e = (dec.float() - r).flatten(2).norm(dim=2) / r.flatten(2).norm(dim=2).clamp_min(1e-30)  # [L, 2]
    out = {}
    for p, name in ((0, "k"), (1, "v")):
        out[f"{name}_rel_err_mean"] = float(e[:, p].mean())
        out[f"{name}_rel_err_max"] = float(e[:, p].max())
        out[f"{name}_rel_err_max_layer"] = int(e[:, p].argmax())
    out["per_layer"] = e.tolist()
    return out
