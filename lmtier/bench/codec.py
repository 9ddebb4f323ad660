"""``lmtier bench codec``: per codec level, compression ratio, a quality proxy and encode/decode speed.

Data: real KV when a local model is available — ``--model PATH`` (default
``models/SmolLM2-135M-Instruct`` under the working directory, when present), a prefill through ``transformers``
over a fixed English text (the pydoc text of ``json``, ``re``, ``string``, ``textwrap``), KV cast to
bf16 — else synthetic KV-like data in the ``--model-preset`` geometry (Gaussian, per-channel
magnitudes, outlier key channels, an attention-sink token, seeded). The output says which. Only the
default model falls back to synthetic data when absent or unloadable: a ``--model PATH`` that does not
exist or has no ``config.json`` is a usage error (exit status 2), and one that does not load is an error
naming the path — never a silent synthetic run.

Per level (``lossless``, ``high``, ``default``, ``low``), over ``--chunks`` canonical chunks of
``--chunk-tokens`` tokens, each coded as one record by :func:`lmtier.codec.chunk.encode_chunk`
(quantize + rANS + framing; per-stream tables):

* ``ratio`` = bf16 bytes / record bytes (everything in the record counted);
* reconstruction quality: ``rel_err`` = ||x - x̂|| / ||x|| over all KV, ``snr_db`` = 10 log10(||x||² /
  ||x - x̂||²), and per layer and plane (K, V) the same (``snr_k_min_db`` / ``snr_v_min_db``: the
  worst layer; the plot draws every layer);
* a model-free attention proxy, ``attn_rel_err``: per layer and KV head, softmax(Q K̂ᵀ / √d) V̂ vs
  softmax(Q Kᵀ / √d) V with Q = the chunk's exact keys (causal), relative L2 error of the output —
  how much the decoded KV moves what attention reads, without a model;
* ``encode_GBps`` / ``decode_GBps``: GB/s of bf16 KV through ``encode_chunk`` / ``decode_chunk``
  (median wall time, all chunks; on the GPU when there is one — ``--device``).

Decoded KV is checked against the reference decoder (:func:`lmtier.codec.quant.dequantize`) bit for bit
and ``lossless`` against the input. ``--kernels`` also runs :mod:`lmtier.bench.codec_kernels` (the native
batch kernels alone, GB/s vs the device memcpy ceiling). Quality on the model's outputs (Δ perplexity,
top-1, KL): ``benchmarks/codec_quality.py``; ``--matrix [JSON]`` prints its texts x levels x models
matrix (min / median / max of ratio, Δppl, top-1, KL per level) and ``--plot`` draws ratio against
quality, ``--matrix-run`` measures a small one first (:mod:`lmtier.bench.codec_matrix`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from lmtier.bench.args import bounded_int, model_directory, output_file
from lmtier.bench.common import (
    add_common_args,
    plot_series,
    print_table,
    progress,
    report_plot,
    system_header,
    write_json,
)
from lmtier.bench.presets import preset
from lmtier.config_schema import CODEC_LEVELS

DEFAULT_MODEL = Path("models") / "SmolLM2-135M-Instruct"
"""Relative to the working directory (a source checkout's ``models/``); never looked up next to the package."""
LEVEL_NAMES = list(CODEC_LEVELS)


def synthetic_kv(n_chunks: int, nl: int, t: int, h: int, d: int, seed: int = 0) -> torch.Tensor:
    """``[C, L, 2, T, H, D]`` bf16 KV-like data (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    ch = torch.rand(n_chunks, nl, 2, 1, h, d, generator=g) + 0.05
    ch[:, :, 0, :, :, : max(1, d // 16)] *= 20.0  # outlier key channels
    x = torch.randn(n_chunks, nl, 2, t, h, d, generator=g) * ch
    x[:, :, :, 0] *= 8.0  # sink token
    return x.to(torch.bfloat16)


def _text() -> str:
    import importlib
    import pydoc

    return "\n".join(
        pydoc.render_doc(importlib.import_module(m), renderer=pydoc.plaintext)
        for m in ("json", "re", "string", "textwrap")
    )


def model_kv(model_dir: str, n_chunks: int, t: int) -> tuple[torch.Tensor, str]:
    """KV of a prefill of ``n_chunks * t`` tokens through the local model: ``[C, L, 2, T, H, D]`` bf16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    try:
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    except TypeError:
        m = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="sdpa")
    m.eval()
    ids = tok(_text()).input_ids
    n = n_chunks * t
    if len(ids) < n:
        raise ValueError(f"the text has {len(ids)} tokens < {n}")
    with torch.no_grad():
        cache = m(input_ids=torch.tensor([ids[:n]]), use_cache=True).past_key_values
    layers = []
    for l in range(m.config.num_hidden_layers):
        if hasattr(cache, "layers"):
            k, v = cache.layers[l].keys, cache.layers[l].values
        else:
            k, v = cache.key_cache[l], cache.value_cache[l]
        layers.append(torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)]))  # [2, N, H, D]
    kv = torch.stack(layers)  # [L, 2, N, H, D]
    kv = kv.view(kv.shape[0], 2, n_chunks, t, *kv.shape[3:]).permute(2, 0, 1, 3, 4, 5).contiguous()
    return kv.to(
        torch.bfloat16
    ), f"{Path(model_dir).name}, prefill of {n} tokens of pydoc text (json, re, string, textwrap), KV in bf16"


def snr_db(x: torch.Tensor, err: torch.Tensor) -> float:
    e = float(err.pow(2).sum())
    s = float(x.pow(2).sum())
    return math.inf if e == 0 else 10 * math.log10(s / e)


def attn_rel_err(x: torch.Tensor, y: torch.Tensor) -> float:
    """Model-free attention proxy over chunks ``[C, L, 2, T, H, D]`` (float): relative L2 error of
    causal softmax(K Kᵀ/√d) V with decoded (K̂, V̂) vs exact (queries = exact keys)."""
    c, nl, _, t, h, d = x.shape
    q = x[:, :, 0].permute(0, 1, 3, 2, 4).reshape(c * nl, h, t, d)

    def out(kv):
        k = kv[:, :, 0].permute(0, 1, 3, 2, 4).reshape(c * nl, h, t, d)
        v = kv[:, :, 1].permute(0, 1, 3, 2, 4).reshape(c * nl, h, t, d)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    a, b = out(x), out(y)
    return float((a - b).norm() / a.norm())


def _timed(fn, iters: int, sync) -> float:
    fn()
    sync()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_level(kv: torch.Tensor, level: str, device: torch.device, iters: int) -> dict:
    """One level over all chunks ``kv [C, L, 2, T, H, D]`` (bf16, CPU)."""
    from lmtier.codec import chunk as cchunk
    from lmtier.codec import quant

    c = kv.shape[0]
    shape = tuple(kv.shape[1:])
    dkv = kv.to(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    recs = [cchunk.encode_chunk(dkv[i], shape=shape, dtype=torch.bfloat16, level=level) for i in range(c)]
    out = torch.empty_like(dkv)
    for i in range(c):
        cchunk.decode_chunk(recs[i], out[i], expected_shape=shape, dtype=torch.bfloat16, level=level)
    sync()
    y = out.cpu()
    # bit-exact against the reference decoder (lossless: against the input)
    for i in range(c):
        if level == "lossless":
            ref = kv[i]
        else:
            s, sd = quant.quantize(kv[i], level)
            ref = quant.dequantize(s, sd, level, shape, torch.bfloat16)
        if not torch.equal(y[i], ref):
            raise RuntimeError(f"codec level {level}: chunk {i} decoded differently from the reference")
    enc_s = _timed(
        lambda: [cchunk.encode_chunk(dkv[i], shape=shape, dtype=torch.bfloat16, level=level) for i in range(c)],
        iters,
        sync,
    )
    dec_s = _timed(
        lambda: [
            cchunk.decode_chunk(recs[i], out[i], expected_shape=shape, dtype=torch.bfloat16, level=level)
            for i in range(c)
        ],
        iters,
        sync,
    )
    xf, yf = kv.float(), y.float()
    err = yf - xf
    nbytes = kv.numel() * 2
    per_layer = {"snr_k_db": [], "snr_v_db": []}
    for l in range(shape[0]):
        per_layer["snr_k_db"].append(snr_db(xf[:, l, 0], err[:, l, 0]))
        per_layer["snr_v_db"].append(snr_db(xf[:, l, 1], err[:, l, 1]))
    return {
        "level": level,
        "record_MB": sum(len(r) for r in recs) / 1e6,
        "ratio": nbytes / sum(len(r) for r in recs),
        "rel_err": float(err.norm() / xf.norm()),
        "snr_db": snr_db(xf, err),
        "snr_k_min_db": min(per_layer["snr_k_db"]),
        "snr_v_min_db": min(per_layer["snr_v_db"]),
        "max_abs_err": float(err.abs().max()),
        "attn_rel_err": attn_rel_err(xf, yf),
        "encode_GBps": nbytes / enc_s / 1e9,
        "decode_GBps": nbytes / dec_s / 1e9,
        "encode_ms": enc_s * 1e3,
        "decode_ms": dec_s * 1e3,
        "per_layer": per_layer,
    }


def run(args) -> dict:
    device = torch.device(
        "cuda"
        if (args.device == "auto" and torch.cuda.is_available())
        else ("cpu" if args.device == "auto" else args.device)
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("lmtier bench codec: --device cuda but no CUDA device is available")
    model_dir = None if args.synthetic else (args.model or (str(DEFAULT_MODEL) if DEFAULT_MODEL.is_dir() else None))
    data, why_synth = None, None
    if model_dir:
        try:
            kv, data = model_kv(model_dir, args.chunks, args.chunk_tokens)
        except Exception as e:  # noqa: BLE001 - no transformers / unreadable model
            why = f"{type(e).__name__}: {str(e)[:120]}"
            if args.model:  # asked for by name: measuring synthetic data instead would mislead
                raise SystemExit(f"lmtier bench codec: --model {args.model!r} does not load ({why})") from None
            why_synth = f"model {model_dir} unusable ({why})"  # the default model: synthetic instead
    else:
        why_synth = "--synthetic" if args.synthetic else f"no local model ({DEFAULT_MODEL} absent; --model PATH)"
    if data is None:
        geo = preset(args.model_preset)
        if geo.kind == "mla":
            raise SystemExit(
                f"lmtier bench codec: preset {geo.name} is MLA (one latent plane); the codec codes "
                "K/V planes — pick a K/V preset or --model"
            )
        kv = synthetic_kv(args.chunks, geo.num_layers, args.chunk_tokens, geo.num_kv_heads, geo.head_size)
        data = (
            f"SYNTHETIC KV-like data in the {geo.name} geometry (Gaussian, per-channel magnitudes, outlier key "
            f"channels, sink token) — {why_synth}"
        )
    c, nl, _, t, h, d = kv.shape
    header = system_header()
    print(f"lmtier bench codec: data: {data}")
    print(
        f"  {c} chunks x [L={nl}, 2, T={t}, H={h}, D={d}] bf16 = {kv.numel() * 2 / 1e6:.1f} MB; "
        f"codec on {device.type}; medians of {args.iters}"
    )
    rows = []
    for level in progress(args.levels, desc="codec levels", disable=args.quiet):
        rows.append(bench_level(kv, level, device, args.iters))
    return {
        "bench": "codec",
        "system": header,
        "data": data,
        "synthetic": data.startswith("SYNTHETIC"),
        "device": device.type,
        "geometry": {"chunks": c, "L": nl, "T": t, "H": h, "D": d, "dtype": "bfloat16"},
        "rows": rows,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="lmtier bench codec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--levels", nargs="+", default=LEVEL_NAMES, choices=LEVEL_NAMES)
    p.add_argument("--chunks", type=bounded_int(min_value=1), default=4, help="chunks coded (each one record)")
    p.add_argument("--chunk-tokens", type=bounded_int(min_value=1), default=256)
    p.add_argument(
        "--model",
        type=model_directory,
        default=None,
        help=f"local transformers model directory for real KV (default {DEFAULT_MODEL} when present; "
        "a given PATH must exist and hold config.json)",
    )
    p.add_argument("--synthetic", action="store_true", help="synthetic KV even when a model is present")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--iters", type=bounded_int(min_value=1), default=3)
    p.add_argument("--kernels", action="store_true", help="also run lmtier.bench.codec_kernels (native batch kernels)")
    p.add_argument("--json", type=output_file, default=None)
    m = p.add_argument_group("quality matrix (issue 19; lmtier.bench.codec_matrix)")
    m.add_argument(
        "--matrix",
        nargs="?",
        const="benchmarks/codec_matrix.json",
        default=None,
        metavar="JSON",
        help="print the texts x levels x models matrix (min/median/max of ratio, Δppl, top-1, KL) of a matrix "
        "JSON (default benchmarks/codec_matrix.json) and, with --plot, the ratio-vs-quality plot",
    )
    m.add_argument(
        "--matrix-run",
        action="store_true",
        help="measure a small matrix first (benchmarks/codec_quality.py machinery, the models under models/)",
    )
    m.add_argument("--matrix-models", default="smollm2", help="--matrix-run: models (benchmarks/codec_corpus.MODELS)")
    m.add_argument("--matrix-texts", default="prose_mpl,code_c", help="--matrix-run: texts (codec_corpus.MATRIX_TEXTS)")
    m.add_argument(
        "--matrix-schemes", default="high,default", help="--matrix-run: schemes (levels, cachegen, int8_head)"
    )
    m.add_argument("--benchmarks-dir", default="benchmarks", help="--matrix-run: a source checkout's benchmarks/")
    add_common_args(p)
    args = p.parse_args(argv)
    if args.matrix is not None or args.matrix_run:
        from lmtier.bench.codec_matrix import main_matrix

        return main_matrix(args)
    res = run(args)
    rows = res["rows"]
    print_table(
        rows,
        [
            "level",
            "ratio",
            "rel_err",
            "snr_db",
            "snr_k_min_db",
            "snr_v_min_db",
            "attn_rel_err",
            "max_abs_err",
            "encode_GBps",
            "decode_GBps",
            "encode_ms",
            "decode_ms",
        ],
    )
    print(
        "quality proxy: rel_err/snr over all KV; snr_*_min = worst layer; attn_rel_err = model-free attention "
        "output error (exact keys as queries). Decoded KV bit-identical to the reference decoder: yes"
    )
    write_json(args.json, res)
    if args.plot:
        series = {}
        for r in rows:
            if r["level"] == "lossless":
                continue
            for pl in ("k", "v"):
                series[f"{r['level']} {pl.upper()} (ratio {r['ratio']:.2f})"] = list(
                    enumerate(r["per_layer"][f"snr_{pl}_db"])
                )
        why = plot_series(
            args.plot,
            series,
            title=f"codec SNR per layer ({'synthetic' if res['synthetic'] else 'real'} KV: {res['data'][:60]})",
            xlabel="layer",
            ylabel="SNR (dB)",
        )
        report_plot(args.plot, why)
    rc = 0
    if args.kernels:
        from lmtier.bench import codec_kernels

        rc = codec_kernels.main(["--json", args.json.replace(".json", "_kernels.json")] if args.json else [])
    return rc


if __name__ == "__main__":
    sys.exit(main())
