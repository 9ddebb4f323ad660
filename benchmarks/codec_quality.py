"""KV codec quality on real KV: ratio vs bf16 (all side data) against perplexity / top-1 / KL.

What it does (CPU only, 2 threads):

1. Runs SmolLM2-135M-Instruct (``models/SmolLM2-135M-Instruct``; its weights are a dequantized
   4-bit GGUF, so absolute quality numbers are those of a degraded small model) over real offline
   English text: the GPL-3 text (2,048-token context) and the pydoc plain text of
   ``json re string textwrap`` (4,096-token context), plus a separate *calibration* text
   (Apache-2.0 followed by the pydoc of ``collections itertools functools``, 4,096 tokens) on which
   the static entropy tables are fitted. K (post-RoPE) and V of every layer are kept in the
   canonical layout ``[L, 2, T, H, D]``; extraction is cached under ``/tmp/lmtier_codec_kv``
   (safetensors, never pickle).
2. Scoring: teacher-forced continuation of the next 2,048 tokens of the same text, in float32,
   with the context KV replaced by (a) the bf16-rounded KV — the reference —, (b) the fp32 KV and
   the KV of a bf16 run of the model — the noise floor —, (c) each codec level's decoded KV and
   the CacheGen reference scheme's. Metrics against (a): perplexity change, top-1 agreement of the
   argmax predictions, mean KL(P_ref || P_test) in nats per token.
3. Ratio: bf16 bytes / (symbol bits under static 12-bit tables per (layer, K/V, channel) stream
   fitted on the calibration text, with a per-(chunk, stream) fallback to a chunk-local table
   whose description is charged, + the scale side data, itself entropy coded per (layer, K/V)
   stream). Chunks of 256 tokens. This is the ideal-coder bound of what
   ``lmtier.codec.rans`` ships (its framing bytes are not counted here).
4. Shipped ratio: bf16 bytes / the real records of :func:`lmtier.codec.chunk.encode_chunk` (every
   byte: record header, section index, rANS stream headers, lane states, segment tables, scale
   codes, fallback tables), coded with the calibrated table-switching tables shipped in
   ``lmtier/codec/tables/`` (:mod:`lmtier.codec.calibrate`, fitted on the calibration text above)
   for the quantized levels, per-stream tables for ``lossless``.

Usage::

    python benchmarks/codec_quality.py [--json out.json] [--levels lossless,high,default,low]
        [--texts gpl3,pydoc] [--no-reference] [--no-quality] [--smoke]
    python benchmarks/codec_quality.py --matrix [--schemes ...] [--matrix-texts ...]
        [--exact-first-tokens 1,4 [--exact-random-control] [--exact-planes kv,k,v]]

Prints a table and writes JSON; ``benchmarks/plot_codec_quality.py`` draws docs/codec_quality.png
from it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from lmtier import envs  # noqa: E402
from lmtier.codec import levels as L  # noqa: E402
from lmtier.codec import quant as Q  # noqa: E402

MODEL_DIR = ROOT / "models" / "SmolLM2-135M-Instruct"
CACHE_DIR = Path(envs.LMTIER_CODEC_KV_CACHE)
CHUNK_TOKENS = 256

# name -> (source, context tokens, continuation tokens)
TEXTS = {
    "gpl3": ("license:GPL-3", 2048, 2048),
    "pydoc": ("pydoc:json,re,string,textwrap", 4096, 2048),
    "calib": ("license:Apache-2.0+pydoc:collections,itertools,functools", 4096, 0),
}


# --------------------------------------------------------------------------------------------
# text and model
# --------------------------------------------------------------------------------------------
_MODEL = {}


def load_model(dtype=torch.float32, model: str = "smollm2"):
    """(model, tokenizer) of a model of :data:`codec_corpus.MODELS` (cached per name and dtype)."""
    import codec_corpus as CC
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sub, keep = CC.MODELS[model]
    if (model, dtype) not in _MODEL:
        m = AutoModelForCausalLM.from_pretrained(ROOT / "models" / sub, dtype=dtype, attn_implementation="sdpa")
        if keep is not None:
            CC.prune_layers(m, keep)
        m.eval()
        _MODEL[model, dtype] = m
    tok = AutoTokenizer.from_pretrained(ROOT / "models" / sub)
    return _MODEL[model, dtype], tok


def _cache_to_canonical(cache) -> torch.Tensor:
    """DynamicCache -> [L, 2, T, H, D] (batch 1)."""
    ks, vs = [], []
    for layer in cache.layers:
        ks.append(layer.keys[0].transpose(0, 1))  # [H, T, D] -> [T, H, D]
        vs.append(layer.values[0].transpose(0, 1))
    return torch.stack([torch.stack([k, v]) for k, v in zip(ks, vs)])


def _canonical_to_cache(kv: torch.Tensor, dtype):
    from transformers import DynamicCache

    cache = DynamicCache()
    for l in range(kv.shape[0]):
        k = kv[l, 0].transpose(0, 1).unsqueeze(0).to(dtype).contiguous()
        v = kv[l, 1].transpose(0, 1).unsqueeze(0).to(dtype).contiguous()
        cache.update(k, v, l)
    return cache


def get_text(name: str, model: str = "smollm2"):
    """Returns dict(ids (context+continuation, int64), ctx, cont, kv_fp32, kv_bf16model, model).

    ``name``: a text of :data:`TEXTS` or of the matrix corpus (``codec_corpus.MATRIX_TEXTS``; those
    have no bf16-model KV: ``kv_bf16model`` is None)."""
    import codec_corpus as CC
    from safetensors.torch import load_file, save_file

    matrix = name not in TEXTS
    if matrix:
        src, ctx, cont = CC.MATRIX_TEXTS[name][0], CC.MATRIX_CONTEXT, CC.MATRIX_CONTINUATION
    else:
        src, ctx, cont = TEXTS[name]
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path = CACHE_DIR / (f"{name}.safetensors" if model == "smollm2" and not matrix else f"{model}.{name}.safetensors")
    if path.exists():
        d = load_file(path)
        return dict(
            ids=d["ids"][: ctx + cont],
            ctx=ctx,
            cont=cont,
            kv_fp32=d["kv_fp32"],
            kv_bf16model=d.get("kv_bf16model"),
            model=model,
        )
    m32, tok = load_model(torch.float32, model)
    text = CC.source_text(src)
    ids = torch.tensor(tok(text).input_ids[: ctx + max(cont, 512)], dtype=torch.int64)  # cache 512 either way
    assert ids.numel() >= ctx + cont, (name, ids.numel())
    with torch.no_grad():
        out = m32(ids[None, :ctx], use_cache=True)
        kv32 = _cache_to_canonical(out.past_key_values).float().contiguous()
        tensors = {"ids": ids, "kv_fp32": kv32}
        kv16 = None
        if not matrix:
            m16, _ = load_model(torch.bfloat16, model)
            out16 = m16(ids[None, :ctx], use_cache=True)
            kv16 = tensors["kv_bf16model"] = _cache_to_canonical(out16.past_key_values).to(torch.bfloat16).contiguous()
    save_file(tensors, str(path))
    return dict(ids=ids[: ctx + cont], ctx=ctx, cont=cont, kv_fp32=kv32, kv_bf16model=kv16, model=model)


def continuation_logprobs(text: dict, kv: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log-probs [cont, vocab] (fp32) of the continuation, context KV = ``kv``."""
    m, _ = load_model(torch.float32, text.get("model", "smollm2"))
    ids = text["ids"]
    ctx = text["ctx"]
    cache = _canonical_to_cache(kv, torch.float32)
    with torch.no_grad():
        out = m(ids[None, ctx:], past_key_values=cache, use_cache=True)
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def compare(ref_lp: torch.Tensor, lp: torch.Tensor, ids_next: torch.Tensor) -> dict:
    """Metrics of ``lp`` against the reference log-probs; targets = next tokens."""
    n = ids_next.numel()
    ref_lp, lp = ref_lp[:n], lp[:n]
    nll_ref = -ref_lp.gather(1, ids_next[:, None]).mean().item()
    nll = -lp.gather(1, ids_next[:, None]).mean().item()
    agree = (ref_lp.argmax(1) == lp.argmax(1)).float().mean().item()
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(1).mean().item()
    return dict(
        ppl_ref=math.exp(nll_ref),
        ppl=math.exp(nll),
        dppl_pct=100.0 * (math.exp(nll - nll_ref) - 1.0),
        top1=100.0 * agree,
        kl=kl,
        n_scored=n,
    )


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

    def bits(self, x: torch.Tensor) -> tuple[float, float]:
        st = static_bits(x, self.freq)
        lo = local_bits(x)
        return float(torch.minimum(st, lo).sum() + x.shape[0]), float(st[torch.isfinite(st)].sum())


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


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------
def _system() -> dict:
    return dict(
        python=platform.python_version(),
        torch=torch.__version__,
        machine=platform.machine(),
        cpu=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        model=str(MODEL_DIR.name) + " (float32; weights dequantized from a 4-bit GGUF)",
        chunk_tokens=CHUNK_TOKENS,
        table_precision_bits=TABLE_PRECISION_BITS,
    )


def _fmt_row(r: dict, texts) -> str:
    shp = r.get("ratio_shipped")
    cells = [
        f"{r['name']:<22s}",
        f"{r['ratio']:>6.2f}x",
        f"{shp:>6.2f}x" if shp else f"{'-':>7s}",
        f"{r['bits_per_value']:>5.2f}",
    ]
    cells.append(f"{r.get('k_rel_err_mean', float('nan')):>6.3f}/{r.get('k_rel_err_max', float('nan')):<6.3f}")
    cells.append(f"{r.get('v_rel_err_mean', float('nan')):>6.3f}/{r.get('v_rel_err_max', float('nan')):<6.3f}")
    for t in texts:
        q = r["quality"].get(t)
        if q:
            cells.append(f"{q['dppl_pct']:>+7.2f}% {q['top1']:>6.2f}% {q['kl']:>8.5f}")
        else:
            cells.append(f"{'-':>8s} {'-':>7s} {'-':>8s}")
    return " ".join(cells)


def run(
    levels: list[str],
    texts: list[str],
    quality: bool,
    out_json: Path | None,
    reference: bool = True,
    merge: bool = False,
) -> dict:
    cal = get_text("calib")["kv_fp32"].to(torch.bfloat16)
    data = {t: get_text(t) for t in texts}
    refs = {}
    rows: list[dict] = []

    def add(name: str, kind: str, rates: list[dict], decs: dict, extra=None):
        row = dict(
            name=name,
            kind=kind,
            quality={},
            per_text={},
            measured_utc=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )
        n = len(rates)
        for key in ("ratio", "bits_per_value"):
            row[key] = sum(r[key] for r in rates) / n  # texts have equal weight
        for key in (
            "ratio_shipped",
            "ratio_as_shipped",
            "ratio_static_tables",
            "side_bits_per_value",
            "chunk_entropy_bound_bits_per_value",
        ):
            if key in rates[0]:
                row[key] = sum(r[key] for r in rates) / n
        errs = [layer_rel_error(data[t]["kv_fp32"].to(torch.bfloat16), decs[t]) for t in texts]
        for key in ("k_rel_err_mean", "v_rel_err_mean"):
            row[key] = sum(e[key] for e in errs) / n
        for key in ("k_rel_err_max", "v_rel_err_max"):
            row[key] = max(e[key] for e in errs)
        for t, r, e in zip(texts, rates, errs):
            row["per_text"][t] = dict(rate=r, rel_err_per_layer=e["per_layer"])
        if quality:
            for t in texts:
                d = data[t]
                ref_kv = d["kv_fp32"].to(torch.bfloat16)
                if decs[t].dtype == torch.bfloat16 and torch.equal(decs[t].view(torch.int16), ref_kv.view(torch.int16)):
                    q = compare(refs[t], refs[t], d["ids"][d["ctx"] + 1 :])  # bit-identical cache
                    q["bit_identical"] = True
                else:
                    q = compare(refs[t], continuation_logprobs(d, decs[t].float()), d["ids"][d["ctx"] + 1 :])
                row["quality"][t] = q
            row["dppl_pct_mean"] = sum(q["dppl_pct"] for q in row["quality"].values()) / n
            row["top1_mean"] = sum(q["top1"] for q in row["quality"].values()) / n
            row["kl_mean"] = sum(q["kl"] for q in row["quality"].values()) / n
        if extra:
            row.update(extra)
        rows.append(row)
        print(_fmt_row(row, texts), flush=True)

    if quality:
        for t in texts:
            d = data[t]
            refs[t] = continuation_logprobs(d, d["kv_fp32"].to(torch.bfloat16).float())
    hdr = (
        f"{'level / scheme':<22s} {'ratio':>7s} {'shipped':>7s} {'bits':>5s} {'K relerr':>13s} {'V relerr':>13s} "
        + " ".join(f"{t + ': dppl  top1   KL':>26s}" for t in texts)
    )
    print(hdr)
    print("-" * len(hdr))
    # noise floor: the fp32 cache and the cache of a bf16 run of the model, vs the bf16-rounded cache
    one = dict(ratio=1.0, bits_per_value=16.0)
    half = dict(ratio=0.5, bits_per_value=32.0)
    if reference:
        add("noise: fp32 cache", "noise", [half] * len(texts), {t: data[t]["kv_fp32"] for t in texts})
        add("noise: bf16-model KV", "noise", [one] * len(texts), {t: data[t]["kv_bf16model"].float() for t in texts})
        # CacheGen reference (LMCache arithmetic), then the same scheme in lmtier's arithmetic
        cg = {t: cachegen_rate_and_decode(data[t]["kv_fp32"].to(torch.bfloat16), cal) for t in texts}
        add("cachegen (LMCache)", "reference", [cg[t][0] for t in texts], {t: cg[t][1] for t in texts})
    for name in (["cachegen_ref"] if reference else []) + levels:
        lv = L.get_level(name)
        rates, decs = [], {}
        for t in texts:
            kv = data[t]["kv_fp32"].to(torch.bfloat16)
            rates.append(level_rate(lv, cal, kv))
            shipped = shipped_ratio(lv, kv)
            if shipped is not None:
                rates[-1]["ratio_shipped"] = shipped
            decs[t] = decode_level(lv, kv)
        add(name, "reference" if name == "cachegen_ref" else "level", rates, decs)
    result = dict(
        system=_system(),
        texts={t: dict(source=TEXTS[t][0], context_tokens=TEXTS[t][1], continuation_tokens=TEXTS[t][2]) for t in texts},
        calibration=dict(source=TEXTS["calib"][0], context_tokens=TEXTS["calib"][1]),
        rows=rows,
    )
    if merge and out_json and out_json.exists():
        # keep the rows of the previous JSON that this run did not measure (each row has its date)
        old = json.loads(out_json.read_text())
        mine = {r["name"] for r in rows}
        kept = [r for r in old.get("rows", []) if r["name"] not in mine]
        order = {r["name"]: i for i, r in enumerate(old.get("rows", []))}
        result["rows"] = sorted(kept + rows, key=lambda r: order.get(r["name"], len(order)))
        print(f"merged: kept {[r['name'] for r in kept]} from {out_json}")
    if out_json:
        out_json.write_text(json.dumps(result, indent=1))
        print(f"wrote {out_json}")
    return result


def smoke() -> None:
    """Tiny synthetic run (no model): rate model, CacheGen reference and every level's round trip."""
    g = torch.Generator().manual_seed(0)
    kv = (torch.randn(2, 2, 512, 2, 64, generator=g) * (torch.rand(2, 2, 1, 2, 64, generator=g) + 0.1)).to(
        torch.bfloat16
    )
    cal, ev = kv[:, :, :256].contiguous(), kv[:, :, 256:].contiguous()
    r, dec = cachegen_rate_and_decode(ev, cal)
    assert r["ratio"] > 1 and dec.shape == ev.shape
    for name in ["cachegen_ref", *L.LEVELS]:
        rate = level_rate(name, cal, ev)
        dec = decode_level(name, ev)
        err = layer_rel_error(ev, dec)
        print(
            f"{name:<14s} ratio {rate['ratio']:.2f} K relerr {err['k_rel_err_mean']:.4f} V relerr "
            f"{err['v_rel_err_mean']:.4f}"
        )
        if name == "lossless":
            assert torch.equal(dec.view(torch.int16), ev.view(torch.int16))
    print("smoke ok")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default=",".join(L.LEVELS))
    ap.add_argument("--texts", default="gpl3,pydoc")
    ap.add_argument("--no-quality", action="store_true", help="ratios and reconstruction errors only")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "codec_quality.json")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of the existing --json file that this run does not re-measure",
    )
    ap.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the noise floor and the CacheGen rows (screening a subset of levels)",
    )
    ap.add_argument("--smoke", action="store_true", help="tiny synthetic run without the model")
    ap.add_argument("--matrix", action="store_true", help="the texts x levels x models matrix (codec_matrix.py)")
    ap.add_argument("--models", default="smollm2,smollm2-d28", help="--matrix: models (codec_corpus.MODELS)")
    ap.add_argument("--matrix-texts", default="", help="--matrix: texts (default: all of codec_corpus.MATRIX_TEXTS)")
    ap.add_argument("--schemes", default="", help="--matrix: schemes (default: codec_matrix.DEFAULT_SCHEMES)")
    ap.add_argument(
        "--tables-compare",
        default="",
        metavar="LEVEL",
        help="auto-calibrated vs shipped vs per-stream tables of LEVEL on the held-out texts "
        "(codec_matrix.tables_comparison; JSON: benchmarks/codec_tables.json)",
    )
    ap.add_argument(
        "--exact-first-tokens",
        default="",
        metavar="S[,S...]",
        help="--matrix: after each level's cell, cells with the exact KV of the first S tokens put back "
        "(attention-sink experiment; codec_matrix.exact_cells)",
    )
    ap.add_argument(
        "--exact-random-control",
        action="store_true",
        help="--exact-first-tokens: also put back S random non-initial tokens (the control)",
    )
    ap.add_argument(
        "--exact-planes",
        default="kv",
        metavar="P[,P...]",
        help="--exact-first-tokens: which planes to put back, each of kv, k, v (one variant each)",
    )
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.smoke:
        smoke()
        return 0
    t0 = time.time()
    if a.tables_compare:
        import codec_matrix as CM

        out = (
            a.json
            if a.json != ROOT / "benchmarks" / "codec_quality.json"
            else ROOT / "benchmarks" / "codec_tables.json"
        )
        CM.tables_comparison(a.models.split(","), a.tables_compare, out)
        print(f"done in {time.time() - t0:.0f} s")
        return 0
    sizes = [int(x) for x in a.exact_first_tokens.split(",") if x]
    planes = [p for p in a.exact_planes.split(",") if p]
    exact = tuple(("first", n, p) for n in sizes for p in planes)
    exact += tuple(("random", n, p) for n in sizes for p in planes if a.exact_random_control)
    if exact and not a.matrix:
        ap.error("--exact-first-tokens needs --matrix")
    if a.matrix:
        import codec_corpus as CC
        import codec_matrix as CM

        out = (
            a.json
            if a.json != ROOT / "benchmarks" / "codec_quality.json"
            else ROOT / "benchmarks" / "codec_matrix.json"
        )
        CM.run_matrix(
            a.models.split(","),
            [t for t in a.matrix_texts.split(",") if t] or list(CC.MATRIX_TEXTS),
            [s for s in a.schemes.split(",") if s] or list(CM.DEFAULT_SCHEMES),
            out,
            a.merge,
            rate_bound=not exact,  # the sink experiment reads record ratios only: no calibration-text run
            exact=exact,
        )
        print(f"done in {time.time() - t0:.0f} s")
        return 0
    run(
        [x for x in a.levels.split(",") if x], a.texts.split(","), not a.no_quality, a.json, not a.no_reference, a.merge
    )
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
