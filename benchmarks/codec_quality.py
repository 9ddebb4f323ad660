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

from codec_rates import (  # noqa: E402
    CHUNK_TOKENS,
    TABLE_PRECISION_BITS,
    cachegen_rate_and_decode,
    chunk_views,  # noqa: F401 (codec_matrix uses it as codec_quality.chunk_views)
    decode_level,
    layer_rel_error,
    level_rate,
    shipped_ratio,
)

from lmtier import envs  # noqa: E402
from lmtier.codec import levels as L  # noqa: E402

MODEL_DIR = ROOT / "models" / "SmolLM2-135M-Instruct"
CACHE_DIR = Path(envs.LMTIER_CODEC_KV_CACHE)

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


def get_text(name: str, model: str = "smollm2", offset: int = 0):
    """Returns dict(ids (context+continuation, int64), ctx, cont, kv_fp32, kv_bf16model, model).

    ``name``: a text of :data:`TEXTS` or of the matrix corpus (``codec_corpus.MATRIX_TEXTS``; those
    have no bf16-model KV: ``kv_bf16model`` is None). ``offset``: a matrix text's window starts at
    its ``offset``-th token (the context is then a fresh sequence at positions 0 ..; 0: the matrix's
    window)."""
    import codec_corpus as CC
    from safetensors.torch import load_file, save_file

    matrix = name not in TEXTS
    if matrix:
        src, ctx, cont = CC.source_spec(name), CC.MATRIX_CONTEXT, CC.MATRIX_CONTINUATION
    else:
        src, ctx, cont = TEXTS[name]
        assert offset == 0, "windows are for matrix texts"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    at = f"@{offset}" if offset else ""
    path = CACHE_DIR / (
        f"{name}.safetensors" if model == "smollm2" and not matrix else f"{model}.{name}{at}.safetensors"
    )
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
    ids = torch.tensor(tok(text).input_ids[offset : offset + ctx + max(cont, 512)], dtype=torch.int64)  # 512 either way
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


def continuation_logprobs(text: dict, kv: torch.Tensor, *, grad: bool = False) -> torch.Tensor:
    """Teacher-forced log-probs [cont, vocab] (fp32) of the continuation, context KV = ``kv``
    (``grad``: differentiable in ``kv``, for a backward pass)."""
    m, _ = load_model(torch.float32, text.get("model", "smollm2"))
    ids = text["ids"]
    ctx = text["ctx"]
    cache = _canonical_to_cache(kv, torch.float32)
    with torch.set_grad_enabled(grad):
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
