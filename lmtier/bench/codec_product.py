"""KV codec throughput through the product path, per level — the error-bounded levels included (issue 19).

    python -m lmtier.bench.codec_product [--levels default eb_default] [--chunks 8 32] [--device auto|cuda|cpu]
                                         [--preset llama-3.1-8b] [--tokens 256] [--iters 3] [--json out.json]
    python -m lmtier.bench.codec_product --device cpu --preset tiny --chunks 2 --iters 1      # a small CPU run

:mod:`lmtier.bench.codec_kernels` times the native batch kernels of the fixed levels (one launch per
batch, descriptors prebuilt); it cannot time an error-bounded level, whose encoder first chooses a
qmax per (chunk, layer, plane) with torch ops on the chunk's device
(:func:`lmtier.codec.bound.choose_qmax`). This benchmark times what the library runs for each
chunk, one chunk at a time as the tiers do, for a batch of C chunks on one device:

* ``encode``: :func:`lmtier.codec.chunk.encode_chunk` of each chunk resident on the device (choice,
  quantize, rANS encode, record back in host memory) — a CUDA chunk of the KV connector's store;
* ``choose``: :func:`lmtier.codec.bound.choose_qmax` alone (adaptive levels; part of ``encode``);
* ``dev_encode`` (CUDA): :class:`lmtier.codec.encoder.DeviceEncoder` of each chunk from pinned host
  memory (H2D copy + ``encode_chunk``; :class:`lmtier.tiers.codec.CodecTier` with ``encode_device``);
* ``decode``: :meth:`lmtier.codec.decoder.ChunkDecoder.decode` of each record from a decode slot's
  record buffer into a device buffer (what ``CodecTier.get_into`` runs once the record is read).

Median wall time over ``--iters`` after one warm-up; GB/s of bf16 KV (input of encode, output of
decode; the batch's bytes / the batch's time). Same-run ceilings: the fixed ``default`` level through
the same path (in the default ``--levels``) and a memcpy of the batch's bytes on the device
(read + write; on CUDA codec_kernels' own ceiling function, CUDA events). Issue 19's goals:
encode >= 50 GB/s, decode >= 100 GB/s on the GPU. Records use per-stream tables by default (a
Llama-3.1-8B geometry has no shipped tables, and auto-calibration skips the adaptive levels);
``--tables calibrated`` codes with tables fitted by :func:`lmtier.codec.calibrate.calibrate` on a
separate sample. Checks: the DeviceEncoder's records equal ``encode_chunk``'s byte for byte; the
first chunk's device decode equals its CPU decode bit for bit.

Workload: :func:`lmtier.bench.codec.synthetic_kv` (Gaussian with per-channel magnitudes, key
outlier channels, an attention-sink token; seeded) in the ``--preset`` geometry.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from lmtier.bench.args import bounded_int, output_file
from lmtier.bench.common import print_table, system_header, wall_time_ms, write_json
from lmtier.bench.presets import preset, preset_help
from lmtier.codec import bound as B
from lmtier.codec import chunk as CH
from lmtier.codec.decoder import ChunkDecoder
from lmtier.codec.levels import EXPERIMENTAL_LEVELS, LEVELS, get_level

BF16 = torch.bfloat16
COLUMNS = [
    "level",
    "chunks",
    "ratio_bf16",
    "encode_GBps",
    "dev_encode_GBps",
    "decode_GBps",
    "choose_GBps",
    "encode_ms_per_chunk",
    "choose_ms_per_chunk",
    "decode_ms_per_chunk",
]


def kv_batch(c: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """``[C, L, 2, T, H, D]`` bf16 on the CPU: :func:`lmtier.bench.codec.synthetic_kv` in ``shape``
    (for Llama-3.1-8B the data of :func:`lmtier.bench.codec_kernels.kv_like` with the same seed)."""
    from lmtier.bench.codec import synthetic_kv

    nl, _, t, h, d = shape
    return synthetic_kv(c, nl, t, h, d, seed=seed)


def memcpy_gbps(nbytes: int, dev: torch.device, iters: int) -> float:
    """Read + write GB/s of one copy of ``nbytes`` on ``dev``: on CUDA codec_kernels' ceiling (CUDA
    events, median), on the CPU the median wall time of ``copy_``."""
    if dev.type == "cuda":
        from lmtier.bench.codec_kernels import memcpy_ceiling_gbps

        with torch.cuda.device(dev):
            return memcpy_ceiling_gbps(nbytes, max(iters, 5))
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    return 2 * nbytes / wall_time_ms(lambda: b.copy_(a), warmup=2, iters=max(iters, 5)) / 1e6


def tables_for(level: str, shape: tuple[int, ...], mode: str):
    """``None`` (per-stream tables) or tables calibrated on a separate sample."""
    if mode == "none":
        return None
    from lmtier.codec import calibrate as CAL

    tab, _ = CAL.calibrate([kv_batch(1, shape, seed=1234)[0]], level)
    return tab


def bench_level(x: torch.Tensor, level: str, dev: torch.device, iters: int, tables) -> dict:
    """One row: the batch ``x`` (``[C, L, 2, T, H, D]`` bf16, CPU) through the product path on ``dev``."""
    lv = get_level(level)
    c = x.shape[0]
    shape = tuple(int(v) for v in x.shape[1:])
    raw = math.prod(shape) * 2
    nbytes = c * raw
    chunks = list(x.to(dev).unbind(0))
    recs: list[bytes] = [b""] * c

    def encode():
        for i, ch in enumerate(chunks):
            recs[i] = CH.encode_chunk(ch, shape=shape, dtype=BF16, level=lv, tables=tables)

    row: dict = dict(level=level, chunks=c, bf16_MB=nbytes / 1e6, tables="none" if tables is None else "calibrated")
    row["encode_ms"] = wall_time_ms(encode, warmup=1, iters=iters)
    row["record_MB"] = sum(map(len, recs)) / 1e6
    row["ratio_bf16"] = nbytes / sum(map(len, recs))
    if lv.adaptive:
        row["choose_ms"] = wall_time_ms(lambda: [B.choose_qmax(ch, lv) for ch in chunks], warmup=1, iters=iters)
    if dev.type == "cuda":
        from lmtier.codec.encoder import DeviceEncoder

        host = [t.reshape(-1).view(torch.uint8).pin_memory() for t in x.unbind(0)]
        enc = DeviceEncoder(shape=shape, dtype=BF16, level=lv, device=dev)
        drecs: list[bytes] = [b""] * c

        def dev_encode():
            for i, h in enumerate(host):
                drecs[i] = enc.encode(h, tables=tables)

        try:
            row["dev_encode_ms"] = wall_time_ms(dev_encode, warmup=1, iters=iters)
        finally:
            enc.close()
        if drecs != recs:
            raise AssertionError(f"{level}: DeviceEncoder records differ from encode_chunk's")
    dec = ChunkDecoder(shape=shape, dtype=BF16, level=lv, tables=tables, device=dev, max_idle_slots=c)
    slots = [dec.acquire() for _ in range(c)]
    try:
        for s, r in zip(slots, recs):  # the records as the tier reads them: into the slots' buffers
            s.record[: len(r)] = r
        outs = torch.empty((c, *shape), dtype=BF16, device=dev)

        def decode():
            for i, (s, r) in enumerate(zip(slots, recs)):
                dec.decode(s.record[: len(r)], outs[i], slot=s)

        row["decode_ms"] = wall_time_ms(decode, warmup=1, iters=iters)
        want = torch.empty(shape, dtype=BF16)
        CH.decode_chunk(recs[0], want, expected_shape=shape, dtype=BF16, level=lv, tables=tables)
        if not torch.equal(outs[0].cpu().view(torch.int16), want.view(torch.int16)):
            raise AssertionError(f"{level}: the {dev.type} decode differs from the CPU decode")
    finally:
        for s in slots:
            dec.release(s)
        dec.close()
    for k in ("encode", "dev_encode", "decode", "choose"):
        if f"{k}_ms" in row:
            row[f"{k}_GBps"] = nbytes / row[f"{k}_ms"] / 1e6
            row[f"{k}_ms_per_chunk"] = row[f"{k}_ms"] / c
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m lmtier.bench.codec_product",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = [n for n in (*LEVELS, *EXPERIMENTAL_LEVELS) if n != "lossless"] + ["lossless"]
    ap.add_argument("--levels", nargs="+", default=["default", "eb_default"], choices=names)
    ap.add_argument("--chunks", type=bounded_int(min_value=1), nargs="+", default=None, help="chunks per batch")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--preset", default="llama-3.1-8b", help=preset_help())
    ap.add_argument("--tokens", type=bounded_int(min_value=1), default=256, help="tokens per chunk")
    ap.add_argument("--tables", choices=["none", "calibrated"], default="none")
    ap.add_argument("--iters", type=bounded_int(min_value=1), default=3)
    ap.add_argument("--json", type=output_file, default=None)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    on_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    if on_cuda:
        from lmtier import _C

        if not _C.built_with_cuda():
            ap.error("lmtier._C was built without CUDA: the device path would encode on the CPU")
    try:
        g = preset(args.preset)
    except ValueError as e:
        ap.error(str(e))
    shape = (g.num_layers, 2, args.tokens, g.num_kv_heads, g.head_size)
    batches = args.chunks or ([8, 32] if on_cuda else [1])
    header = system_header()
    header.update(
        device=str(dev),
        preset=g.name,
        geometry=dict(L=shape[0], T=shape[2], H=shape[3], D=shape[4], dtype="bf16"),
        tables=args.tables,
        iters=args.iters,
        data="Gaussian, per-channel magnitudes, key outlier channels, sink token (seeded)",
        path="encode_chunk / DeviceEncoder / ChunkDecoder.decode, one chunk at a time",
    )
    print(header, flush=True)
    rows: list[dict] = []
    ceilings: dict[str, float] = {}
    result = dict(system=header, ceilings=ceilings, rows=rows)
    for c in batches:
        x = kv_batch(c, shape, seed=c)
        cap = ceilings[f"memcpy_GBps_{c}"] = memcpy_gbps(c * math.prod(shape) * 2, dev, args.iters)
        print(f"batch {c}: {dev.type} memcpy ceiling (read+write of the bf16 bytes) {cap:.1f} GB/s")
        for level in args.levels:
            row = bench_level(x, level, dev, args.iters, tables_for(level, shape, args.tables))
            rows.append(row)
            print_table([row], COLUMNS)
            write_json(args.json, result)  # a run cut short keeps its rows
    print("== summary")
    print_table(rows, COLUMNS)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
