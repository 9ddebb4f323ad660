"""The codec quality matrix (issue 19): texts x levels x models, min / median / max per level.

Driven by ``python benchmarks/codec_quality.py --matrix [--models smollm2,smollm2-d28]
[--schemes ...] [--matrix-texts ...]``; the corpus and the models are in
:mod:`codec_corpus`, the model runs, metrics and rate models in :mod:`codec_quality` (same protocol:
256-token chunks quantized independently, the decoded context KV replaces the bf16-rounded
reference KV, teacher-forced continuation; Δppl, top-1 agreement and KL against that reference).

Per (model, text, scheme) cell: ``ratio`` = bf16 bytes / real record bytes (``encode_chunk``, every
byte; shipped tables where the geometry has them, per-stream tables otherwise) for lmtier levels;
``ratio_bound`` = ideal-coder bits with static tables fitted on the model's calibration text
(:func:`codec_quality.level_rate`); CacheGen (LMCache arithmetic) at its per-chunk entropy bound
(no table cost, its most favourable reading). ``int8_head`` is a plain per-(token, head) absmax
8-bit quantizer (qmax 127, E5M3 scale code, no rotation) in lmtier's arithmetic.
"""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path

import codec_corpus as CC
import codec_quality as CQ
import torch

from lmtier.bench.codec_matrix import format_summary, summarize
from lmtier.codec import levels as L

INT8_HEAD = L.Level(
    "int8_head",
    126,
    k=L.PlaneQuant(L.Granularity.TOKEN_HEAD, (L.LayerGroup(127, frac_num=1, frac_den=1),)),
    v=L.PlaneQuant(L.Granularity.TOKEN_HEAD, (L.LayerGroup(127, frac_num=1, frac_den=1),)),
)
"""Plain per-(token, head) 8-bit quantizer (benchmark reference, no record path)."""

DEFAULT_SCHEMES = ("cachegen", "int8_head", "lossless", "high", "default", "low")


def _level(name: str):
    return INT8_HEAD if name == "int8_head" else L.get_level(name)


def record_bytes(lv, kv: torch.Tensor) -> list[int] | None:
    """Bytes of the real record of each 256-token chunk of ``kv`` (bf16 ``[L, 2, T, H, D]``) under
    level ``lv`` (shipped tables where the geometry has them, per-stream tables otherwise), or None
    for a scheme without a record path (``int8_head``)."""
    from lmtier.codec import calibrate as CAL
    from lmtier.codec import chunk as CH

    if lv.name not in L.LEVELS and lv.name not in L.EXPERIMENTAL_LEVELS:
        return None
    out = []
    for c in CQ.chunk_views(kv):
        tab = CAL.shipped_tables(lv, tuple(c.shape))
        out.append(len(CH.encode_chunk(c, shape=tuple(c.shape), dtype=c.dtype, level=lv, tables=tab)))
    return out


def measure(
    model: str, text: str, scheme: str, cal: torch.Tensor, ref_lp: torch.Tensor, data: dict
) -> tuple[dict, torch.Tensor]:
    """Metrics of one (model, text, scheme) and the decoded context KV (``[L, 2, ctx, H, D]``, the
    dtype the scheme decodes to); ``cal`` = the model's calibration KV (bf16) or None."""
    kv = data["kv_fp32"].to(torch.bfloat16)
    out: dict = dict(model=model, text=text, scheme=scheme, split=CC.MATRIX_TEXTS[text][1])
    if scheme == "cachegen":
        rate, dec = CQ.cachegen_rate_and_decode(kv, kv if cal is None else cal)
        out.update(ratio=rate["ratio"], ratio_bound=rate["ratio"], ratio_as_shipped=rate["ratio_as_shipped"])
    else:
        lv = _level(scheme)
        rec = record_bytes(lv, kv)
        if cal is not None or rec is None:
            rate = CQ.level_rate(lv, kv if cal is None else cal, kv)
            out.update(ratio_bound=rate["ratio"], bits_per_value=rate["bits_per_value"])
        if rec is not None:
            out.update(record_bytes=rec, raw_bytes=kv.numel() * kv.element_size())
        out["ratio"] = out["raw_bytes"] / sum(rec) if rec is not None else rate["ratio"]
        out["ratio_is_records"] = rec is not None
        dec = CQ.decode_level(lv, kv)
    err = CQ.layer_rel_error(kv, dec)
    out.update(k_rel_err=err["k_rel_err_mean"], v_rel_err=err["v_rel_err_mean"])
    out.update(token_errors(kv, dec))
    out.update(_quality(data, kv, dec, ref_lp))
    return out, dec


def cell(model: str, text: str, scheme: str, cal: torch.Tensor, ref_lp: torch.Tensor, data: dict) -> dict:
    """Metrics of one (model, text, scheme) (:func:`measure` without the decoded KV)."""
    return measure(model, text, scheme, cal, ref_lp, data)[0]


def _quality(data: dict, kv: torch.Tensor, dec: torch.Tensor, ref_lp: torch.Tensor) -> dict:
    """Δppl / top-1 / KL of the continuation with context KV ``dec`` against ``ref_lp``."""
    ids_next = data["ids"][data["ctx"] + 1 :]
    if dec.dtype == torch.bfloat16 and torch.equal(dec.view(torch.int16), kv.view(torch.int16)):
        q = CQ.compare(ref_lp, ref_lp, ids_next)
        q["bit_identical"] = True
        return q
    return CQ.compare(ref_lp, CQ.continuation_logprobs(data, dec.float()), ids_next)


# --------------------------------------------------------------------------------------------
# attention-sink experiment (--exact-first-tokens): put the exact KV of some tokens back
# --------------------------------------------------------------------------------------------
RANDOM_EXCLUDE_FIRST = 4
"""Random control positions are drawn from ``[4, ctx)``: never one of the first 4 tokens."""


def exact_positions(kind: str, tokens: int, ctx: int, seed: int) -> torch.Tensor:
    """Sorted int64 positions (of the context) whose exact KV is put back.

    ``kind`` "first": ``0 .. tokens-1`` (the attention sink: only chunk 0 holds them); "random":
    ``tokens`` distinct positions drawn uniformly from ``[RANDOM_EXCLUDE_FIRST, ctx)`` with a
    ``torch.Generator`` seeded by ``seed`` (the control). Raises ValueError on another kind or when
    the context is too short."""
    if tokens < 1 or tokens > ctx - RANDOM_EXCLUDE_FIRST:
        raise ValueError(f"exact tokens {tokens} outside [1, {ctx - RANDOM_EXCLUDE_FIRST}] (ctx {ctx})")
    if kind == "first":
        return torch.arange(tokens, dtype=torch.int64)
    if kind == "random":
        g = torch.Generator().manual_seed(seed)
        pick = torch.randperm(ctx - RANDOM_EXCLUDE_FIRST, generator=g)[:tokens] + RANDOM_EXCLUDE_FIRST
        return pick.sort().values
    raise ValueError(f"unknown exact-token kind {kind!r} (first, random)")


PLANES = {"kv": (0, 1), "k": (0,), "v": (1,)}
"""Which planes of ``[L, 2, T, H, D]`` an exact-token variant puts back (K = 0, V = 1)."""


def put_back_tokens(dec: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor, planes: str = "kv") -> torch.Tensor:
    """A copy of the decoded KV ``dec`` with the ``planes`` (:data:`PLANES`: both, K or V) of every
    layer at ``positions`` (token axis 2 of ``[L, 2, T, H, D]``) replaced by ``kv``'s (the exact bf16
    KV, cast to ``dec``'s dtype, which is exact for bf16 → bf16 / fp32); every other element is
    ``dec``'s, bit for bit. Raises ValueError on a shape mismatch or an unknown ``planes``."""
    if dec.shape != kv.shape:
        raise ValueError(f"decoded KV {tuple(dec.shape)} vs exact KV {tuple(kv.shape)}")
    if planes not in PLANES:
        raise ValueError(f"unknown planes {planes!r} ({', '.join(PLANES)})")
    out = dec.clone()
    for p in PLANES[planes]:
        out[:, p, positions] = kv[:, p, positions].to(dec.dtype)
    return out


def token_errors(kv: torch.Tensor, dec: torch.Tensor) -> dict:
    """Relative L2 error per token (over layers × heads × channels) of K and V: token 0's, the median
    over tokens 1.., and token 0's K / V norm over the median token's (how much of an outlier the
    sink is)."""
    r, d = kv.float(), dec.float()
    out = {}
    for p, name in ((0, "k"), (1, "v")):
        x = r[:, p].transpose(0, 1).reshape(r.shape[2], -1)  # [T, L*H*D]
        e = (d[:, p].transpose(0, 1).reshape(r.shape[2], -1) - x).norm(dim=1) / x.norm(dim=1).clamp_min(1e-30)
        n = x.norm(dim=1)
        out[f"tok0_{name}_rel_err"] = float(e[0])
        out[f"tok_{name}_rel_err_median"] = float(e[1:].median())
        out[f"tok0_{name}_norm_over_median"] = float(n[0] / n[1:].median())
    return out


def exact_cells(base: dict, dec: torch.Tensor, data: dict, ref_lp: torch.Tensor, variants) -> list[dict]:
    """Cells of ``base``'s scheme with the exact KV of some tokens put back into its decode ``dec``.

    ``variants``: (kind, tokens) or (kind, tokens, planes) tuples (:func:`exact_positions`,
    :data:`PLANES`, default "kv"). Each cell's scheme is ``<scheme>+first<S>`` / ``<scheme>+rand<S>``
    (+ ``k`` / ``v`` for one plane); ``exact_bytes`` = S × L × (planes) × H × D × 2 (bf16, what a raw
    side section would carry), ``exact_pct_of_chunk0`` = that over chunk 0's record bytes, and
    ``ratio`` = bf16 bytes / (record bytes + exact_bytes) of the whole context."""
    kv = data["kv_fp32"].to(torch.bfloat16)
    nl, _, ctx, h, hd = kv.shape
    seed0 = zlib.crc32(base["text"].encode())
    cells = []
    for kind, s, *rest in variants:
        planes = rest[0] if rest else "kv"
        pos = exact_positions(kind, s, ctx, seed0 + s)
        fixed = put_back_tokens(dec, kv, pos, planes)
        nbytes = s * nl * len(PLANES[planes]) * h * hd * kv.element_size()
        c = {k: base[k] for k in ("model", "text", "split", "ratio_is_records")}
        tag = f"{'first' if kind == 'first' else 'rand'}{s}{'' if planes == 'kv' else planes}"
        c.update(scheme=f"{base['scheme']}+{tag}", base_scheme=base["scheme"], exact_planes=planes)
        c.update(exact_kind=kind, exact_tokens=s, exact_positions=pos.tolist(), exact_bytes=nbytes)
        c["exact_pct_of_chunk0"] = 100.0 * nbytes / base["record_bytes"][0]
        c["ratio"] = base["raw_bytes"] / (sum(base["record_bytes"]) + nbytes)
        err = CQ.layer_rel_error(kv, fixed)
        c.update(k_rel_err=err["k_rel_err_mean"], v_rel_err=err["v_rel_err_mean"])
        c.update(_quality(data, kv, fixed, ref_lp))
        cells.append(c)
    return cells


SECOND_MODEL_TEXTS = ("prose_mpl", "code_py", "chat_valgrind", "prose_gfdl", "code_c", "de_man")
"""Texts of the second model (3 tune, 3 held-out; CPU time)."""
FEW_TEXTS = {"int8_head": ("prose_mpl", "code_c", "de_man")}
"""Schemes measured on a few texts only (the 8-bit reference sits at the noise floor)."""


def run_matrix(
    models: list[str],
    texts: list[str],
    schemes: list[str],
    out_json: Path | None,
    merge: bool,
    texts_2nd: tuple[str, ...] | None = SECOND_MODEL_TEXTS,
    few_texts: dict | None = None,
    rate_bound: bool = True,
    exact: tuple = (),
) -> dict:
    """Measure every (model, text, scheme) cell, print per-cell lines and the summary, write JSON.
    Models after the first get ``texts_2nd`` (None: all ``texts``); schemes of ``few_texts`` only
    their texts. With ``merge``, cells of ``out_json`` that this run does not re-measure are kept.
    ``rate_bound`` False skips the calibration text (no ideal-coder bound for lmtier levels; the
    8-bit reference's and CacheGen's rate models then fit on the text itself). ``exact``: (kind, tokens)
    pairs; each lmtier-level cell is followed by one cell per pair with the exact KV of those tokens
    put back (:func:`exact_cells`; the attention-sink experiment, RESULTS §4.1d)."""
    few_texts = FEW_TEXTS if few_texts is None else few_texts
    t0 = time.time()
    cells: list[dict] = []
    for model in models:
        # the rate model's static tables: fitted on the first 1,024 tokens of the calibration text
        cal = None  # no calibration text run: ideal-coder bounds only where no records exist
        if rate_bound:
            cal = CQ.get_text("calib", model)["kv_fp32"][:, :, :1024].to(torch.bfloat16).contiguous()
        for text in texts if model == models[0] or not texts_2nd else texts_2nd:
            data = CQ.get_text(text, model)
            ref_lp = CQ.continuation_logprobs(data, data["kv_fp32"].to(torch.bfloat16).float())
            for scheme in schemes:
                if scheme in few_texts and text not in few_texts[scheme]:
                    continue
                c, dec = measure(model, text, scheme, cal, ref_lp, data)
                new = [c] + (exact_cells(c, dec, data, ref_lp, exact) if exact and "record_bytes" in c else [])
                for c in new:
                    c["measured_utc"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
                    cells.append(c)
                    print(
                        f"{model:<12s} {text:<14s} {c['scheme']:<14s} ratio {c['ratio']:5.2f}x "
                        f"(bound {c.get('ratio_bound', 0):5.2f}x) "
                        f"dppl {c['dppl_pct']:+6.2f}% top1 {c['top1']:6.2f}% KL {c['kl']:.5f} "
                        f"ppl_ref {c['ppl_ref']:.2f}"
                        + (f" exact +{c['exact_pct_of_chunk0']:.1f}% of chunk 0" if "exact_bytes" in c else ""),
                        flush=True,
                    )
                if out_json:  # partial results survive an interrupted run
                    out_json.with_suffix(".partial.json").write_text(json.dumps(cells, indent=1))
    if merge and out_json and out_json.exists():
        mine = {(c["model"], c["text"], c["scheme"]) for c in cells}
        old = json.loads(out_json.read_text()).get("cells", [])
        cells = [c for c in old if (c["model"], c["text"], c["scheme"]) not in mine] + cells
    rows = summarize(cells)
    print(format_summary(rows))
    result = dict(
        system=CQ._system(),
        context_tokens=CC.MATRIX_CONTEXT,
        continuation_tokens=CC.MATRIX_CONTINUATION,
        texts={t: dict(source=s, split=sp) for t, (s, sp) in CC.MATRIX_TEXTS.items()},
        models={m: dict(dir=d, kept_layers=k) for m, (d, k) in CC.MODELS.items()},
        cells=cells,
        summary=rows,
        seconds=time.time() - t0,
    )
    if out_json:
        out_json.write_text(json.dumps(result, indent=1))
        print(f"wrote {out_json}")
    return result


TABLES_CALIB_TEXTS = ("prose_mpl", "doc_pydoc", "code_py", "fr_man", "chat_valgrind")
"""The chunks a new namespace's tier stores first (tune split, in this order; the tier calibrates on
the first :data:`lmtier.codec.autotables.CALIBRATION_CHUNKS` of them)."""
TABLES_EVAL_TEXTS = {
    "smollm2": ("prose_gfdl", "code_c", "de_man", "chat_zlib"),
    "smollm2-d28": ("prose_gfdl", "code_c", "de_man"),
}
"""Held-out texts per model for :func:`tables_comparison`."""


def tables_comparison(models: list[str], level: str, out_json: Path | None) -> dict:
    """Ratio (real record bytes) and quality of ``level`` with auto-calibrated tables vs shipped tables
    vs per-stream tables, per model and held-out text (issue 19).

    Auto tables go through the product path: a :class:`lmtier.tiers.codec.CodecTier` with
    ``tables="auto"`` over a :class:`lmtier.tiers.disk.DiskTier` in a temporary directory, shipped
    tables hidden from it (so SmolLM2 is treated as a model lmtier ships nothing for), storing the
    tune texts' chunks first (:data:`TABLES_CALIB_TEXTS`: it calibrates on the first ones), then each
    held-out text's chunks: ratio = bf16 bytes / the record bytes the tier wrote. (The tier's
    calibration thread gets every chunk here — ``QUEUE_CHUNKS`` raised — so the tables are fitted on
    exactly the first chunks.) The chunks are read
    back through the tier; the decoded KV must equal :func:`codec_quality.decode_level` bit for bit
    (entropy tables never change the decoded values), and Δppl / top-1 / KL are measured on it.
    """
    import tempfile
    from unittest import mock

    from lmtier.codec import autotables as AT
    from lmtier.codec import calibrate as CAL
    from lmtier.codec import chunk as CH
    from lmtier.tiers.codec import CodecTier
    from lmtier.tiers.disk import DiskTier

    lv = L.get_level(level)
    t0 = time.time()
    rows = []
    for model in models:
        first = CQ.get_text(TABLES_CALIB_TEXTS[0], model)["kv_fp32"]
        shape = (first.shape[0], 2, CQ.CHUNK_TOKENS, first.shape[3], first.shape[4])
        shipped = CAL.shipped_tables(lv, shape)
        with (
            tempfile.TemporaryDirectory(prefix="lmtier-autotables-") as tmp,
            mock.patch.object(CAL, "shipped_tables", lambda *a: None),
            mock.patch.object(AT, "QUEUE_CHUNKS", 64),  # no chunk skipped: exactly the first ones
        ):
            tier = CodecTier(
                DiskTier([tmp + "/disk"], 4 << 30, io_threads=1),
                shape=shape,
                dtype=torch.bfloat16,
                level=lv,
                tables="auto",
                tables_dir=tmp + "/tables",
                namespace_id=model.replace("-", "_")[:16],
            )
            n = 0
            for text in TABLES_CALIB_TEXTS:
                for c in CQ.chunk_views(CQ.get_text(text, model)["kv_fp32"].to(torch.bfloat16)):
                    tier.put(n.to_bytes(32, "little"), c.contiguous().view(-1).view(torch.uint8))
                    n += 1
            auto = tier.auto_tables
            assert auto.wait(600) and auto.calibrated, f"{model}: {n} calibration chunks, not calibrated"
            print(f"{model}: tier calibrated on the first {auto.chunks} of {n} stored chunks", flush=True)
            for text in TABLES_EVAL_TEXTS[model]:
                data = CQ.get_text(text, model)
                kv = data["kv_fp32"].to(torch.bfloat16)
                raw = rec_auto = rec_ship = rec_ps = 0
                decoded = []
                for c in CQ.chunk_views(kv):
                    k = n.to_bytes(32, "little")
                    n += 1
                    before = tier.counters["record_bytes_out"]
                    assert tier.put(k, c.view(-1).view(torch.uint8))
                    rec_auto += tier.counters["record_bytes_out"] - before
                    raw += c.numel() * 2
                    rec_ps += len(CH.encode_chunk(c, shape=shape, dtype=torch.bfloat16, level=lv))
                    if shipped is not None:
                        rec_ship += len(CH.encode_chunk(c, shape=shape, dtype=torch.bfloat16, level=lv, tables=shipped))
                    out = torch.empty_like(c)
                    assert tier.get_into(k, out.view(-1).view(torch.uint8)) is not None
                    decoded.append(out)
                dec = torch.cat(decoded, dim=2)
                assert torch.equal(dec.view(torch.int16), CQ.decode_level(lv, kv).view(torch.int16))
                ids_next = data["ids"][data["ctx"] + 1 :]
                ref_lp = CQ.continuation_logprobs(data, kv.float())
                q = CQ.compare(ref_lp, CQ.continuation_logprobs(data, dec.float()), ids_next)
                row = dict(
                    model=model,
                    text=text,
                    level=lv.name,
                    ratio_auto=raw / rec_auto,
                    ratio_shipped=raw / rec_ship if shipped is not None else None,
                    ratio_per_stream=raw / rec_ps,
                    **q,
                )
                rows.append(row)
                print(
                    f"{model:<12s} {text:<12s} auto {row['ratio_auto']:.3f}x shipped "
                    f"{row['ratio_shipped'] or float('nan'):.3f}x per-stream {row['ratio_per_stream']:.3f}x "
                    f"dppl {q['dppl_pct']:+.2f}% top1 {q['top1']:.2f}% KL {q['kl']:.4f}",
                    flush=True,
                )
            tier.close()
    result = dict(
        system=CQ._system(),
        level=lv.name,
        calibration_chunks=AT.CALIBRATION_CHUNKS,
        calibration_texts=list(TABLES_CALIB_TEXTS),
        rows=rows,
        seconds=time.time() - t0,
        measured_utc=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )
    if out_json:
        out_json.write_text(json.dumps(result, indent=1))
        print(f"wrote {out_json}")
    return result
