"""KV codec throughput and ratio (issue 5): native quantize + rANS encode, rANS decode + dequantize.

    python -m lmtier.bench.codec_kernels [--chunks 8 32] [--levels lossless high default low]
                                               [--iters 20] [--cpu] [--json out/bench_codec.json]
    LMTIER_BENCH_SMOKE=1 python -m lmtier.bench.codec_kernels          # tiny sizes
    (also ``lmtier bench codec --kernels``)

Workload: Llama-3.1-8B geometry (L=32, K/V, H=8, D=128, bf16), batches of 256-token chunks of
real-ish KV (Gaussian with per-channel magnitudes, key outlier channels, an attention-sink token,
seeded). Per quantized level, the shipped framing: symbols coded as one rANS stream per (chunk,
layer, plane) *switching tables* per run of T symbols (one table per (layer, plane, head, channel),
or per channel pair where the set would exceed 65,535 tables — Llama-3.1-8B), calibrated by
:func:`lmtier.codec.calibrate.calibrate` on a *different* sample; the scale codes one stream per
(chunk, layer, plane) with a calibrated table per (layer, plane). ``--no-switching``: the previous
framing (one static table per (layer, plane), scale codes with their own table). Lossless: hi plane
with a table per (layer, plane), lo plane (side) with its own table.

GPU (CUDA-event medians of the native calls, descriptors prebuilt = the hot path):
  encode = kvquant quantize (1 launch) + rANS encode of symbols and side (1 batch call);
  decode = rANS decode (1 batch call) + kvquant dequantize (1 launch);
throughput in GB/s of bf16 KV (input for encode, output for decode), each half also alone; the
device memcpy ceiling (read + write of the bf16 bytes) from the same run. Goals: decode + dequantize
>= 100 GB/s, encode >= 50 GB/s. Without a GPU (or with --cpu) the same on the CPU (wall medians).

Comparisons on the same KV: ``cachegen_ref`` (CacheGen's bins and per-token scales, torch reference
quantizer; ratio through our coder, quantize not timed) and zstd (``zstandard``, level 3, CPU, one
thread) on the split byte planes of the lossless level. Ratio = bf16 bytes / all coded bytes.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from lmtier import envs
from lmtier.bench.args import bounded_int, output_file
from lmtier.bench.common import event_time_ms, print_table, system_header, wall_time_ms, write_json
from lmtier.codec import native as N
from lmtier.codec import quant as Q
from lmtier.codec import rans
from lmtier.codec.levels import CACHEGEN_REF, LEVELS, get_level

SMOKE = envs.LMTIER_BENCH_SMOKE
L, H, D, T = 32, 8, 128, 256


def kv_like(c: int, nl: int, t: int, seed: int) -> torch.Tensor:
    """[C, L, 2, T, H, D] bf16 real-ish KV."""
    g = torch.Generator().manual_seed(seed)
    ch = torch.rand(c, nl, 2, 1, H, D, generator=g) + 0.05
    ch[:, :, 0, :, :, :8] *= 20.0  # key outlier channels
    x = torch.randn(c, nl, 2, t, H, D, generator=g) * ch
    x[:, :, :, 0] *= 8.0  # sink token
    return x.to(torch.bfloat16)


def calibrate(level, nl: int, t: int) -> np.ndarray:
    """Static tables [L*2, 256] from a separate sample (reference quantizer)."""
    x = kv_like(1, nl, t, seed=1234)[0]
    sym, _ = Q.quantize(x, level)
    lv = get_level(level)
    qk = lv.k.qmax_table(nl) if not lv.lossless else [127] * nl
    qv = lv.v.qmax_table(nl) if not lv.lossless else [127] * nl
    tabs = []
    for l_ in range(nl):
        for p, q in ((0, qk[l_]), (1, qv[l_])):
            a = 256 if lv.lossless else 2 * q + 1
            tabs.append(rans.table_from_symbols(sym[l_, p].reshape(-1).numpy(), alphabet_size=a))
    return np.stack(tabs)


def median_event_ms(fn, stream, iters: int, warmup: int = 2) -> float:
    return event_time_ms(fn, stream, warmup=warmup, iters=iters)


def median_wall_ms(fn, iters: int, warmup: int = 1) -> float:
    return wall_time_ms(fn, warmup=warmup, iters=iters)


def memcpy_ceiling_gbps(nbytes: int, iters: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        ms = median_event_ms(lambda: b.copy_(a), s, iters)
    return 2 * nbytes / ms / 1e6


def switching_tables(level, nl: int, t: int):
    """(tables [N, 256], symbol table base per (layer, plane) [L*2], symbol run length, scale table per
    (layer, plane) [L*2]) from lmtier.codec.calibrate on a separate sample."""
    from lmtier.codec import calibrate as CAL

    x = kv_like(1, nl, t, seed=1234)[0]
    tab, _ = CAL.calibrate([x], level)
    sec = tab.section_tables.reshape(nl, 3)
    return (
        tab.tables,
        sec[:, :2].reshape(-1),
        int(tab.section_runs[0]) * t,
        (sec[:, 2:3] + np.arange(2)[None, :]).reshape(-1),
    )


class Case:
    """Buffers and prebuilt descriptors of one (level, batch) on one device."""

    def __init__(self, x: torch.Tensor, level: str, tables, dev: torch.device, seg_log2: int):
        c, nl, _, t, h, d = x.shape
        shape = (nl, 2, t, h, d)
        self.level, self.shape, self.n_chunks, self.dev, self.seg_log2 = level, shape, c, dev, seg_log2
        self.x = x.to(dev).contiguous()
        self.sym = torch.empty((c, N.symbol_bytes(shape)), dtype=torch.uint8, device=dev)
        self.side = torch.empty((c, N.side_bytes(level, shape)), dtype=torch.uint8, device=dev)
        self.y = torch.empty_like(self.x)
        self.status = torch.zeros(c, dtype=torch.int32, device=dev)
        self.qbatch = N.make_batch(self.x, list(self.sym.unbind(0)), list(self.side.unbind(0)))
        self.dbatch = N.make_batch(self.y, list(self.sym.unbind(0)), list(self.side.unbind(0)))
        # rANS streams: per (chunk, layer, plane) symbols then side
        sym_rows = self.sym.view(c * nl * 2, -1)
        side_rows = self.side.view(c * nl * 2, -1)
        self.streams = [*sym_rows.unbind(0), *side_rows.unbind(0)]
        n = len(self.streams)
        if isinstance(tables, tuple):  # table switching (switching_tables)
            tables, base, run, scale_ids = tables
            self.ids = [int(base[i % (nl * 2)]) for i in range(c * nl * 2)] + [
                int(scale_ids[i % (nl * 2)]) for i in range(c * nl * 2)
            ]
            self.runs = [run] * (c * nl * 2) + [0] * (c * nl * 2)
        else:  # static table l*2+p for the symbols, own tables for the side
            self.ids = [i % (nl * 2) for i in range(c * nl * 2)] + [rans.ADAPTIVE_TABLE] * (c * nl * 2)
            self.runs = [0] * n
        self.total = sum(int(s.numel()) for s in self.streams)
        self.tables = tables
        on_cuda = dev.type == "cuda"

        def mk(nbytes: int) -> torch.Tensor:
            return torch.empty(nbytes, dtype=torch.uint8, device=dev)

        self.out = mk(rans.max_batch_encoded_bytes(n, self.total, seg_log2))
        self.scratch = mk(rans.encode_scratch_bytes(n, self.total, seg_log2))
        self.offsets = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        self.rstatus = torch.zeros(n, dtype=torch.int32, device=dev)
        self.lens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.dscratch = mk(rans.decode_scratch_bytes(n)) if on_cuda else None
        if on_cuda:
            self.tdev = torch.from_numpy(tables.view(np.uint8).reshape(-1).copy()).to(dev)
            ed = np.zeros(n, rans.ENCODE_DESC)
            ed["src"] = [s.data_ptr() for s in self.streams]
            ed["num_symbols"] = [s.numel() for s in self.streams]
            ed["table_id"] = self.ids
            ed["run_len"] = self.runs
            self.edesc = torch.from_numpy(ed.view(np.uint8).copy()).to(dev)

    # --- GPU hot path: native calls only -----------------------------------------------------
    def quantize(self, stream):
        N.quantize_batch(self.qbatch, self.level, status=self.status, stream=stream.cuda_stream)

    def encode(self, stream):
        R = rans._R
        R.encode(
            True,
            self.edesc.data_ptr(),
            len(self.streams),
            self.tdev.data_ptr(),
            self.tables.shape[0],
            self.seg_log2,
            self.out.data_ptr(),
            self.out.numel(),
            self.offsets.data_ptr(),
            self.rstatus.data_ptr(),
            self.scratch.data_ptr(),
            self.scratch.numel(),
            0,
            stream.cuda_stream,
        )

    def prepare_decode(self):
        off = self.offsets.cpu().numpy()
        self.encoded_bytes = int(off[-1])
        n = len(self.streams)
        dd = np.zeros(n, rans.DECODE_DESC)
        dd["src"] = self.out.data_ptr() + off[:-1]
        dd["src_bytes"] = np.diff(off)
        dd["dst"] = [s.data_ptr() for s in self.streams]
        dd["dst_capacity"] = [s.numel() for s in self.streams]
        self.ddesc = torch.from_numpy(dd.view(np.uint8).copy()).to(self.dev)

    def decode(self, stream):
        rans._R.decode(
            True,
            self.ddesc.data_ptr(),
            len(self.streams),
            self.tdev.data_ptr(),
            self.tables.shape[0],
            self.lens.data_ptr(),
            self.rstatus.data_ptr(),
            self.dscratch.data_ptr(),
            self.dscratch.numel(),
            0,
            stream.cuda_stream,
        )

    def dequantize(self, stream):
        N.dequantize_batch(self.dbatch, self.level, status=self.status, stream=stream.cuda_stream)


def run_gpu(case: Case, iters: int) -> dict:
    s = torch.cuda.Stream()
    torch.cuda.synchronize()
    q_ms = median_event_ms(lambda: case.quantize(s), s, iters)
    N.check_status(case.status, "quantize")
    e_ms = median_event_ms(lambda: case.encode(s), s, iters)
    assert not case.rstatus.cpu().numpy().any()
    qe_ms = median_event_ms(lambda: (case.quantize(s), case.encode(s)), s, iters)
    case.prepare_decode()
    ref_sym = case.sym.clone()
    d_ms = median_event_ms(lambda: case.decode(s), s, iters)
    assert not case.rstatus.cpu().numpy().any() and torch.equal(case.sym, ref_sym), "rANS round trip"
    dq_ms = median_event_ms(lambda: case.dequantize(s), s, iters)
    N.check_status(case.status, "dequantize")
    ddq_ms = median_event_ms(lambda: (case.decode(s), case.dequantize(s)), s, iters)
    return dict(quant_ms=q_ms, rans_enc_ms=e_ms, encode_ms=qe_ms, rans_dec_ms=d_ms, dequant_ms=dq_ms, decode_ms=ddq_ms)


def run_cpu(case: Case, iters: int, threads: int) -> dict:
    st = np.zeros(len(case.streams), np.int32)
    off = np.zeros(len(case.streams) + 1, np.int64)
    out = case.out.numpy()
    scratch = case.scratch.numpy()
    streams = [s.numpy() for s in case.streams]

    def q():
        N.quantize_batch(case.qbatch, case.level, status=case.status, num_threads=threads)

    def e():
        rans.encode_into(
            streams,
            case.ids,
            case.tables,
            out=out,
            offsets=off,
            status=st,
            scratch=scratch,
            seg_log2=case.seg_log2,
            num_threads=threads,
            run_lens=case.runs,
        )

    q_ms = median_wall_ms(q, iters)
    N.check_status(case.status, "quantize")
    e_ms = median_wall_ms(e, iters)
    assert not st.any()
    case.encoded_bytes = int(off[-1])
    srcs = [out[off[i] : off[i + 1]] for i in range(len(streams))]
    dst = [np.empty_like(s) for s in streams]
    lens = np.zeros(len(streams), np.int64)
    d_ms = median_wall_ms(
        lambda: rans.decode_into(srcs, case.tables, outs=dst, out_lengths=lens, status=st, num_threads=threads), iters
    )
    assert not st.any() and all(np.array_equal(a, b) for a, b in zip(dst, streams))
    dq_ms = median_wall_ms(
        lambda: N.dequantize_batch(case.dbatch, case.level, status=case.status, num_threads=threads), iters
    )
    N.check_status(case.status, "dequantize")
    return dict(
        quant_ms=q_ms,
        rans_enc_ms=e_ms,
        encode_ms=q_ms + e_ms,
        rans_dec_ms=d_ms,
        dequant_ms=dq_ms,
        decode_ms=d_ms + dq_ms,
    )


def cachegen_ratio(x: torch.Tensor, seg_log2: int) -> float:
    """CacheGen's reference scheme (level cachegen_ref, torch reference quantizer) through our coder."""
    c, nl = x.shape[0], x.shape[1]
    tables = calibrate("cachegen_ref", nl, x.shape[3])
    streams, ids = [], []
    for i in range(c):
        sym, side = Q.quantize(x[i], "cachegen_ref")
        for r, row in enumerate(sym.reshape(nl * 2, -1).numpy()):
            streams.append(row)
            ids.append(r)
        streams.append(side.numpy())
        ids.append(rans.ADAPTIVE_TABLE)
    enc = rans.encode(streams, ids, tables, seg_log2=seg_log2)
    return x.numel() * 2 / enc.nbytes


def zstd_planes(x: torch.Tensor) -> dict | None:
    try:
        import zstandard
    except ImportError:
        return None
    hi, lo = [], []
    for i in range(x.shape[0]):
        s, sd = Q.quantize(x[i], "lossless")
        hi.append(s.numpy().tobytes())
        lo.append(sd.numpy().tobytes())
    hi_b, lo_b = b"".join(hi), b"".join(lo)
    cctx = zstandard.ZstdCompressor(level=3)
    t0 = time.perf_counter()
    ch, cl = cctx.compress(hi_b), cctx.compress(lo_b)
    t1 = time.perf_counter()
    dctx = zstandard.ZstdDecompressor()
    assert dctx.decompress(ch) == hi_b and dctx.decompress(cl) == lo_b
    t2 = time.perf_counter()
    nb = x.numel() * 2
    return dict(
        ratio_bf16=nb / (len(ch) + len(cl)),
        hi_ratio=len(hi_b) / len(ch),
        lo_ratio=len(lo_b) / len(cl),
        enc_GBps=nb / (t1 - t0) / 1e9,
        dec_GBps=nb / (t2 - t1) / 1e9,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lmtier bench codec --kernels", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--chunks",
        type=bounded_int(min_value=1),
        nargs="+",
        default=None,
        help="chunks per batch (default 8 32 GPU, 1 CPU)",
    )
    ap.add_argument("--levels", nargs="+", default=list(LEVELS), choices=[*LEVELS, CACHEGEN_REF.name])
    ap.add_argument(
        "--seg-log2",
        type=bounded_int(min_value=rans.MIN_SEG_LOG2, max_value=rans.MAX_SEG_LOG2),
        default=rans.DEFAULT_SEG_LOG2,
    )
    ap.add_argument("--iters", type=bounded_int(min_value=1), default=None)
    ap.add_argument("--threads", type=bounded_int(min_value=0), default=0, help="CPU threads (0: all, up to 16)")
    ap.add_argument("--cpu", action="store_true", help="benchmark the CPU path even when CUDA is available")
    ap.add_argument("--no-compare", action="store_true", help="skip the cachegen_ref / zstd comparisons")
    ap.add_argument(
        "--no-switching",
        action="store_true",
        help="previous framing: one static table per (layer, plane) instead of table switching",
    )
    ap.add_argument("--json", type=output_file, default=None)
    args = ap.parse_args(argv)
    on_cuda = torch.cuda.is_available() and not args.cpu
    dev = torch.device("cuda" if on_cuda else "cpu")
    nl, t = (2, 32) if SMOKE else (L, T)
    batches = args.chunks or ([8, 32] if on_cuda else [1])
    if SMOKE:
        batches = [2]
    iters = 2 if SMOKE else (args.iters or (20 if on_cuda else 3))
    header = system_header()
    header.update(
        device=dev.type,
        geometry=dict(L=nl, H=H, D=D, T=t, dtype="bf16"),
        seg_log2=args.seg_log2,
        iters=iters,
        data="Gaussian, per-channel magnitudes, key outlier channels, sink token (seeded)",
    )
    print(header)
    rows, comparisons = [], []
    ceiling = None
    for c in batches:
        x = kv_like(c, nl, t, seed=c)
        nbytes = x.numel() * 2
        if on_cuda and ceiling is None:
            ceiling = memcpy_ceiling_gbps(nbytes, iters)
        for level in args.levels:
            switching = not args.no_switching and not get_level(level).lossless
            tabs = switching_tables(level, nl, t) if switching else calibrate(level, nl, t)
            case = Case(x, level, tabs, dev, args.seg_log2)
            r = run_gpu(case, iters) if on_cuda else run_cpu(case, iters, args.threads)
            row = dict(
                level=level,
                chunks=c,
                switching=switching,
                bf16_MB=nbytes / 1e6,
                encoded_MB=case.encoded_bytes / 1e6,
                ratio_bf16=nbytes / case.encoded_bytes,
                **r,
            )
            for k in ("quant", "rans_enc", "encode", "rans_dec", "dequant", "decode"):
                row[f"{k}_GBps"] = nbytes / row[f"{k}_ms"] / 1e6
            rows.append(row)
            del case
        if not args.no_compare and c == batches[0]:
            comparisons.append(
                dict(scheme="cachegen_ref (our coder)", chunks=c, ratio_bf16=cachegen_ratio(x, args.seg_log2))
            )
            z = zstd_planes(x)
            comparisons.append(
                dict(scheme="zstd-3 split byte planes (CPU, 1 thread)", chunks=c, **(z or {}))
                if z
                else dict(scheme="zstd: zstandard not installed", chunks=c)
            )
    cols = [
        "level",
        "chunks",
        "ratio_bf16",
        "encode_GBps",
        "decode_GBps",
        "quant_GBps",
        "rans_enc_GBps",
        "rans_dec_GBps",
        "dequant_GBps",
        "encode_ms",
        "decode_ms",
    ]
    print_table(rows, cols)
    if comparisons:
        print_table(comparisons, sorted({k for r in comparisons for k in r}, key=lambda k: (k != "scheme", k)))
    if ceiling is not None:
        print(f"device memcpy ceiling (read+write of the bf16 bytes): {ceiling:.1f} GB/s")
    write_json(args.json, dict(system=header, memcpy_ceiling_GBps=ceiling, rows=rows, comparisons=comparisons))
    return 0


if __name__ == "__main__":
    sys.exit(main())
