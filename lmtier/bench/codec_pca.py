"""Throughput of the PCA codec levels through the product path (:func:`lmtier.codec.pca.encode` /
:func:`~lmtier.codec.pca.decode`), on the GPU or the host (issue 19).

    python -m lmtier.bench.codec_pca [--device cuda|cpu] [--geometry 32,8,128[,G]] [--chunks 8]
                                     [--tokens 256] [--iters 3] [--json out.json]
    python -m lmtier.bench.codec_pca --device cpu --geometry 4,2,64,2 --chunks 2 --iters 1   # small

Model: :func:`lmtier.codec.pca.fit` on synthetic KV of *one* layer group (``G`` layers; low-rank
correlated Gaussian plus noise, per-channel scales, keys RoPE-rotated after mixing, an attention sink;
seeded), then the group's data repeated for the ``L / G`` groups (:func:`tiled`): a fit over all
``L`` layers of an 8B-class geometry takes minutes of CPU, and the throughput depends on ``N`` and the
data's statistics, not on which group a basis came from. The chunks come from the same generator.

Per level, for C chunks resident on the device, one chunk at a time as a tier codes them:

* ``encode``: :func:`~lmtier.codec.pca.encode` of each chunk (transform, quantize, rANS, record back
  in host memory); ``forward``: the transform, quantizer and symbols alone
  (:func:`lmtier.codec.pca.codec.chunk_symbols`: the fused kernels on CUDA);
* ``decode``: :func:`~lmtier.codec.pca.decode` of each host record onto the device (each waits for
  the device); ``decode_queued``: :func:`lmtier.codec.pca.codec.decode_queued` of every record, then
  their results (one wait); ``decode_python``: the same with the kernels queued one by one from
  Python (:func:`lmtier.codec.pca.native_decode.enabled` ``(False)``; the product's path is one
  native call per record); ``decode_threads``: ``--decode-threads`` threads (default 4), each decoding
  one record at a time on its own stream and waiting for it, as a PCA tier's I/O threads do (the
  connector's default ``fetch_batch`` of 1);
  ``inverse``: symbols back to KV alone (:func:`lmtier.codec.pca.codec.symbols_to_kv`);
  ``decode_queued_noluts`` / ``decode_threads_noluts``: those with the rANS tables' decode lookups
  turned off (:func:`lmtier.codec.pca.codec.use_run_luts` ``(False)``: the coder builds each table
  run's own);
* ``rans_enc`` / ``rans_dec``: the records' rANS streams alone (:mod:`lmtier.codec.pca.streams`, the
  calls :func:`~lmtier.codec.pca.encode` / :func:`~lmtier.codec.pca.decode` make), symbols on the
  device to host bytes and back; ``rans_dec_noluts``: ``rans_dec`` without the decode lookups.

``G`` (layers per basis) defaults to :func:`lmtier.codec.pca.calibrate.default_layer_group` of the
geometry, as ``python -m lmtier.codec.pca`` picks it (Llama-3.1-8B: ``G = 1``, ``N = 1,024``).

Median wall time over ``--iters`` after one warm-up; GB/s of the chunks' bf16 bytes. ``--profile
FILE`` also writes, per level, the host's Python time of one ``encode`` and one ``decode`` pass (on
CUDA also one ``decode_noluts`` pass, without the rANS decode lookups; cProfile) and
``torch.profiler``'s tables of them (operators and kernels by device time, then by host time, with
call counts): where the time goes. Same-run ceilings: a device memcpy of the batch (read +
write) and the int8 GEMMs of the transform alone (the encoder's four byte products of every (layer
group, K/V), :mod:`lmtier.codec.pca.imatmul`), called one by one (``gemm``) and as the kernels
run them (``gemm_batched``: batches of layer groups, one cuBLAS call each).
Checks: every chunk's CUDA record equals the host encoder's byte for byte, and the first record's
CUDA decode equals its host decode bit for bit, and so does every queued decode. Issue 19's goals:
encode >= 50, decode >= 100 GB/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from lmtier.bench.args import bounded_int, int_list, output_directory, output_file
from lmtier.bench.common import print_table, system_header, wall_time_ms, write_json
from lmtier.codec import pca
from lmtier.codec.pca import codec, imatmul, kernels, native_decode, rope, streams
from lmtier.codec.pca.calibrate import default_layer_group
from lmtier.codec.pca.hf import CalibrationError
from lmtier.codec.pca.levels import PCA_LEVELS

COLUMNS = ["level", "chunks", "ratio", "exact_tok", "escapes", "encode_GBps", "forward_GBps", "rans_enc_GBps",
           "decode_GBps", "decode_queued_GBps", "decode_queued_noluts_GBps", "decode_python_GBps",
           "decode_threads_GBps", "decode_threads_noluts_GBps", "inverse_GBps", "rans_dec_GBps", "rans_dec_noluts_GBps",
           "gemm_GBps", "gemm_batched_GBps", "memcpy_GBps", "identical"]  # fmt: skip
MIN_CALIB_TOKENS = 12288
"""The default calibration's least tokens: at ``3 N`` alone a small ``N`` (1,024 at ``G = 1``) fits
its few tokens, and 17 % of the chunks' tokens then came out loud (exact, raw bytes): not a codec's
operating point (a real calibration uses several thousand tokens of text)."""
RANK = 48
"""Latent factors per (layer, plane) of the synthetic KV."""


def synthetic_kv(geom: tuple[int, int, int, int], tokens: int, start: int, seed: int) -> torch.Tensor:
    """bf16 canonical KV ``[L, 2, T, H, D]`` at positions ``start ..``: layer ``l`` mixes ``RANK``
    latent factors with the mixing of layer ``l % G`` (seed 0), plus 10 % noise; keys rotated by RoPE
    (base 500,000) after mixing; the first position 20 times louder (an attention sink)."""
    nl, h, d, g = geom
    mix_g = torch.Generator().manual_seed(0)
    mix = torch.randn(g, 2, RANK, h * d, generator=mix_g, dtype=torch.float64)
    scale = torch.exp(0.7 * torch.randn(g, 2, h * d, generator=mix_g, dtype=torch.float64))
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(nl, 2, tokens, RANK, generator=gen, dtype=torch.float64) @ mix.repeat(nl // g, 1, 1, 1)
    z = (z + 0.1 * torch.randn(nl, 2, tokens, h * d, generator=gen, dtype=torch.float64)) * scale.repeat(nl // g, 1, 1)[
        :, :, None
    ]
    x = z.reshape(nl, 2, tokens, h, d)
    cos, sin = rope.cos_sin(inv_freq(d), start, tokens)
    x = torch.stack([rope.apply(x[:, 0], cos, sin), x[:, 1]], 1)
    if start == 0:
        x[:, :, 0] *= 20
    return x.to(torch.bfloat16)


def inv_freq(d: int) -> np.ndarray:
    """Llama-3's rotary inverse frequencies (base 500,000) for head size ``d``."""
    return 1.0 / 500000.0 ** (np.arange(0, d, 2, dtype=np.float64) / d)


def tiled(m: pca.PCAModel, reps: int) -> pca.PCAModel:
    """``m`` (of one or more layer groups) repeated ``reps`` times along the layers: a valid model of
    ``reps * L`` layers whose groups share ``m``'s data."""
    t = lambda a: np.ascontiguousarray(np.concatenate([a] * reps))  # noqa: E731
    levels = {
        k: dataclasses.replace(
            v, step=t(v.step), k=t(v.k), f=t(v.f), energy_threshold=t(v.energy_threshold), tables=t(v.tables)
        )  # fmt: skip
        for k, v in m.levels.items()
    }
    return dataclasses.replace(
        m, num_layers=m.num_layers * reps, inv_x_scale=t(m.inv_x_scale), mu_int=t(m.mu_int), e_int=t(m.e_int),
        e_mu=t(m.e_mu), d_int=t(m.d_int), mu_raw=t(m.mu_raw), levels=levels, info={**m.info, "tiled": reps},
    )  # fmt: skip


def model_for(geom: tuple[int, int, int, int], calib_tokens: int, cache_dir: str | None = None) -> pca.PCAModel:
    """:func:`tiled` fit of one layer group on ``calib_tokens`` synthetic tokens (two sequences). The
    one-group fit is kept in ``cache_dir`` (default: the temp folder) and loaded from there next time."""
    nl, h, d, g = geom
    path = Path(cache_dir or tempfile.gettempdir()) / f"lmtier_bench_pca_{h}x{d}g{g}_{calib_tokens}.lmtpca"
    if path.exists():
        m = pca.load(path)
    else:
        half = calib_tokens // 2
        kvs = [synthetic_kv((g, h, d, g), half, 0, 1), synthetic_kv((g, h, d, g), calib_tokens - half, 5000, 2)]
        m = pca.fit(kvs, [0, 5000], inv_freq=inv_freq(d), layer_group=g, name="synthetic one-group fit")
        pca.save(m, path)
    return tiled(m, nl // g)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _gemm_ms(m: pca.PCAModel, chunk: torch.Tensor, iters: int) -> tuple[float, float]:
    """The encoder's int8 GEMMs alone for one chunk (ms, median): ``[xh; xl] @ [eh | el]`` of every
    (layer group, K/V), called one by one and as :mod:`lmtier.codec.pca.kernels` runs them (batches of
    layer groups, one cuBLAS call each; the host: one by one)."""
    a = imatmul.prepared(m, chunk.device)[0]
    t, n8 = chunk.shape[2], a.n8
    x = torch.randint(-128, 128, (m.rows * 2, 2 * t, n8), dtype=torch.int8, device=chunk.device)
    y = torch.empty(m.rows * 2, 2 * t, 2 * a.p8, dtype=torch.int32, device=chunk.device)

    def one_by_one():
        for i in range(x.shape[0]):
            kernels._gemm(x, a, y, i)
        _sync(chunk.device)

    eager = wall_time_ms(one_by_one, warmup=1, iters=iters)
    if chunk.device.type != "cuda":
        return eager, eager

    def batched():
        for r0, r1 in kernels._slices(m.rows, 2 * t, a.p8):
            kernels._gemms(x[2 * r0 : 2 * r1], a, 2 * r0, y[2 * r0 : 2 * r1])
        _sync(chunk.device)

    return eager, wall_time_ms(batched, warmup=1, iters=iters)


def _profile(path: Path, level: str, passes, dev: torch.device) -> None:
    """Append ``torch.profiler``'s tables of each ``(name, fn)`` pass (run once, warm) to ``path``."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with path.open("a") as f:
        for name, fn in passes:  # the host's Python time first (cProfile), then torch.profiler's
            pr = cProfile.Profile()
            pr.runcall(fn)
            text = io.StringIO()
            pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(35)
            f.write(f"==== {level} {name}: host Python time (cProfile, cumulative)\n{text.getvalue()}\n")
            with profile(activities=acts) as prof:
                fn()
            ev = prof.key_averages()
            keys = ("cuda_time_total", "cpu_time_total") if dev.type == "cuda" else ("cpu_time_total",)
            for key in keys:
                table = ev.table(sort_by=key, row_limit=30, max_name_column_width=60)
                f.write(f"==== {level} {name}: by {key}\n{table}\n")


def run(args) -> dict:
    dev = torch.device(args.device)
    geom = tuple(args.geometry)
    nl, h, d, g = geom
    t0 = time.perf_counter()
    m = model_for(geom, args.calib_tokens or max(3 * g * h * d, MIN_CALIB_TOKENS), args.model_cache)
    fit_s = time.perf_counter() - t0
    chunks = [synthetic_kv(geom, args.tokens, i * args.tokens, 100 + i).to(dev) for i in range(args.chunks)]
    gb = sum(c.numel() * c.element_size() for c in chunks) / 1e9
    buf = torch.empty(int(gb * 1e9), dtype=torch.uint8, device=dev)
    memcpy_ms = wall_time_ms(lambda: (buf.clone(), _sync(dev)), warmup=1, iters=args.iters)
    gemm_ms, batched_ms = (x * args.chunks for x in _gemm_ms(m, chunks[0], args.iters))
    pool = ThreadPoolExecutor(args.decode_threads, thread_name_prefix="decode")
    rows = []
    for level in args.levels:
        data = m.levels[level]
        k = torch.from_numpy(data.k).to(dev)
        thr = torch.from_numpy(data.energy_threshold).to(device=dev, dtype=torch.float64)
        starts = [i * args.tokens for i in range(args.chunks)]

        def enc():
            out = [pca.encode(c, start=s, model=m, level=level) for c, s in zip(chunks, starts)]
            _sync(dev)
            return out

        def fwd():
            out = [codec.chunk_symbols(m, c, s, k, thr) for c, s in zip(chunks, starts)]
            _sync(dev)
            return out

        recs = enc()
        fws = fwd()
        f_ = torch.from_numpy(data.f).to(dev)
        t_ = args.tokens

        def dec():
            out = [pca.decode(r, model=m, device=dev) for r in recs]
            _sync(dev)
            return out

        def dec_queued():  # every record queued before the first result: the device's own rate
            out = [p.result() for p in [pca.codec.decode_queued(r, model=m, device=dev) for r in recs]]
            _sync(dev)
            return out

        def noluts(fn):  # the coder builds each table run's decode lookups (the product: built once a table)
            codec.use_run_luts(False)
            try:
                return fn()
            finally:
                codec.use_run_luts(True)

        def dec_python():  # the kernels queued one by one from Python (the product: one native call a record)
            with native_decode.enabled(False):
                return dec_queued()

        def dec_threads():  # as a tier's I/O threads: each decodes one record at a time on its own stream
            out = list(pool.map(lambda r: decode_one(r, m, dev), recs))
            _sync(dev)
            return out

        def inv():
            out = [
                codec.symbols_to_kv(m, sym[..., :t_], e, f_, s, torch.bfloat16) for (sym, _, e), s in zip(fws, starts)
            ]
            _sync(dev)
            return out

        tables = codec._level_arrays(m, level, str(dev)).tables
        t32, r2 = streams.run_length(t_), 2 * m.rows

        def rans_enc():
            return [streams.encode(sym.reshape(r2, -1), tables, t32) for sym, _, _ in fws]

        secs = rans_enc()

        luts = codec._run_luts(m, level, str(dev)) if dev.type == "cuda" else None

        def rans_dec(run_luts=luts):
            out = [streams.decode(s, tables, m.vector_size * t32, dev, run_luts=run_luts) for s in secs]
            _sync(dev)
            return out

        if args.profile:  # on CUDA also the decode without the rANS decode lookups (the host has none)
            passes = (("encode", enc), ("decode", dec))
            if dev.type == "cuda":
                passes += (("decode_noluts", lambda: noluts(dec)),)
            _profile(Path(args.profile), level, passes, dev)
        t = {n: wall_time_ms(fn, warmup=1, iters=args.iters) for n, fn in
             (("encode", enc), ("forward", fwd), ("rans_enc", rans_enc), ("decode", dec), ("inverse", inv),
              ("rans_dec", rans_dec), ("rans_dec_noluts", lambda: rans_dec(None)), ("decode_queued", dec_queued),
              ("decode_queued_noluts", lambda: noluts(dec_queued)), ("decode_python", dec_python),
              ("decode_threads", dec_threads), ("decode_threads_noluts", lambda: noluts(dec_threads)))}  # fmt: skip
        same = True
        if dev.type == "cuda":
            same = all(pca.encode(c.cpu(), start=s, model=m, level=level) == r for c, s, r in zip(chunks, starts, recs))
            same &= bool(torch.equal(pca.decode(recs[0], model=m, device=dev).cpu(), pca.decode(recs[0], model=m)))
            same &= all(torch.equal(a.cpu(), pca.decode(r, model=m)) for a, r in zip(dec_queued(), recs))
            same &= all(torch.equal(a.cpu(), pca.decode(r, model=m)) for a, r in zip(dec_python(), recs))
            same &= all(torch.equal(a.cpu(), pca.decode(r, model=m)) for a, r in zip(noluts(dec_queued), recs))
            same &= all(torch.equal(a.cpu(), pca.decode(r, model=m)) for a, r in zip(dec_threads(), recs))
        metas = [pca.record_meta(r) for r in recs]
        rows.append(
            dict(
                level=level,
                chunks=args.chunks,
                ratio=gb * 1e9 / sum(len(r) for r in recs),
                exact_tok=sum(x.exact_tokens for x in metas),
                escapes=sum(x.escapes for x in metas),
                **{f"{n}_GBps": gb / (ms / 1e3) for n, ms in t.items()},
                **{f"{n}_ms": ms for n, ms in t.items()},
                gemm_GBps=gb / (gemm_ms / 1e3),
                gemm_batched_GBps=gb / (batched_ms / 1e3),
                memcpy_GBps=2 * gb / (memcpy_ms / 1e3),
                identical=same,
            )
        )
    pool.shutdown()
    return dict(
        system=system_header(),
        device=str(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else "cpu",
        geometry=dict(L=nl, H=h, D=d, G=g, N=g * h * d, R=nl // g, tokens=args.tokens),
        fit_s=fit_s,
        gemms=dict(kernels.gemm_stats(), cublas=_cublas(dev)),
        rows=rows,
    )


_local = threading.local()


def decode_one(record: bytes, m: pca.PCAModel, dev: torch.device) -> torch.Tensor:
    """Decode ``record`` on this thread's own stream of ``dev`` (CUDA; made on first use), waiting for
    its result, as :class:`lmtier.tiers.codec_pca.PCACodecTier` decodes one record on an I/O thread."""
    if dev.type != "cuda":
        return pca.decode(record, model=m, device=dev)
    s = _local.__dict__.get("stream")
    if s is None:
        s = _local.stream = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(s):
        return codec.decode_queued(record, model=m, device=dev).result()


def _cublas(dev: torch.device) -> str:
    """The cuBLAS library the CUDA GEMMs use (``lmtier._C.pca.cublas_library``), or why none."""
    if dev.type != "cuda" or not kernels.available():
        return "none: host run"
    from lmtier import _C

    return _C.pca.cublas_library()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--geometry",
        type=int_list(min_value=1),
        default=[32, 8, 128],
        help="L,H,D[,G] (default: Llama-3.1-8B; G: the calibration command's default)",
    )
    ap.add_argument("--levels", nargs="+", choices=sorted(PCA_LEVELS), default=["pca_default", "pca_high"])
    ap.add_argument("--chunks", type=bounded_int(min_value=1), default=8)
    ap.add_argument("--tokens", type=bounded_int(min_value=1), default=256)
    ap.add_argument(
        "--calib-tokens",
        type=bounded_int(min_value=0),
        default=0,
        help=f"calibration tokens (default max(3 N, {MIN_CALIB_TOKENS}))",
    )
    ap.add_argument("--iters", type=bounded_int(min_value=1), default=3)
    ap.add_argument(
        "--decode-threads", type=bounded_int(min_value=1), default=4,
        help="threads of the decode_threads column (a tier's I/O threads; default: %(default)s)",
    )  # fmt: skip
    ap.add_argument("--json", type=output_file, default=None)
    ap.add_argument(
        "--model-cache",
        type=output_directory,
        default=None,
        help="folder of the one-group fits (default: the temp folder; created if missing)",
    )
    ap.add_argument("--profile", type=output_file, default=None, help="append torch.profiler tables here")
    args = ap.parse_args(argv)
    if len(args.geometry) == 3:
        nl, h, d = args.geometry
        try:
            args.geometry = [nl, h, d, default_layer_group(nl, num_kv_heads=h, head_size=d)]
        except CalibrationError as e:
            ap.error(f"--geometry {nl},{h},{d}: {e}")
    if len(args.geometry) != 4 or args.geometry[0] % args.geometry[3]:
        ap.error(f"--geometry needs L,H,D[,G] with G dividing L, got {args.geometry}")
    out = run(args)
    print(f"# {out['device']}  geometry {out['geometry']}  fit {out['fit_s']:.1f} s  GEMMs {out['gemms']}")
    print_table(out["rows"], COLUMNS)
    write_json(args.json, out)
    return 0 if all(r["identical"] for r in out["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
