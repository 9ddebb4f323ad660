"""``lmtier bench transfer --multi-gpu``: every GPU of the node offloading at once.

One process per GPU (any number of GPUs). Each process binds itself to the CPUs of its GPU's NUMA
node (read from ``/sys/bus/pci/devices/<pci id>/numa_node`` and ``/sys/devices/system/node/node<N>/cpulist``;
where the topology cannot be read it stays unbound and says so), then allocates its own pinned pool
(pages are placed on the node of the allocating thread), builds a Llama-3.1-8B-shaped paged cache and
stores/loads batches of 256-token chunks through :class:`lmtier.transfer.CudaTransferEngine`.
All processes start together at a barrier; each reports its GB/s. The same run measures one GPU
alone (the reference for "N x single") and a multi-threaded host memcpy (the host-memory ceiling).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.multiprocessing as mp


def _numa_of_gpu(dev: int) -> tuple[int | None, list[int] | None, str]:
    try:
        props = torch.cuda.get_device_properties(dev)
        if hasattr(props, "pci_bus_id") and isinstance(props.pci_bus_id, int):
            domain, device = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
            bus = f"{domain:04x}:{props.pci_bus_id:02x}:{device:02x}.0"
        else:
            import subprocess

            bus = (
                subprocess.check_output(
                    ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", str(dev)], text=True
                )
                .strip()
                .lower()
            )
            if len(bus.split(":")[0]) == 8:
                bus = bus[4:]  # 00000000:19:00.0 -> 0000:19:00.0
        node = int(open(f"/sys/bus/pci/devices/{bus}/numa_node").read().strip())
        if node < 0:
            return None, None, f"GPU {dev} ({bus}): numa_node -1 (no NUMA information); unbound"
        cpus = _parse_cpulist(open(f"/sys/devices/system/node/node{node}/cpulist").read().strip())
        return node, cpus, f"GPU {dev} ({bus}) on NUMA node {node}, {len(cpus)} CPUs"
    except Exception as e:  # noqa: BLE001 - report and run unbound
        return None, None, f"GPU {dev}: topology unreadable ({type(e).__name__}: {e}); unbound"


def _parse_cpulist(s: str) -> list[int]:
    out: list[int] = []
    for part in s.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def _worker(rank: int, gpus: list[int], args, barrier, results) -> None:
    from lmtier.bench.presets import PRESETS
    from lmtier.layout import KVLayout, make_paged_kv_cache, slot_mapping_from_block_ids
    from lmtier.memory import HostBuffer
    from lmtier.transfer import CudaTransferEngine

    dev = gpus[rank]
    node, cpus, topo = _numa_of_gpu(dev)
    if cpus:
        os.sched_setaffinity(0, cpus)
    torch.cuda.set_device(dev)
    geo = PRESETS[args.model]
    bs, T, C = 16, 256, args.chunks
    num_blocks = int(args.cache_gb * 1e9 // (geo.bytes_per_token() * bs))
    buf, views = make_paged_kv_cache(
        "LBNHC",
        num_layers=geo.num_layers,
        num_blocks=num_blocks,
        block_size=bs,
        num_heads=geo.num_kv_heads,
        head_size=geo.head_size,
        dtype=geo.torch_dtype,
        device=f"cuda:{dev}",
        kind=geo.kind,
    )
    buf.view(torch.int16).random_(-30000, 30000)
    layout = KVLayout.from_layer_views(views, kind=geo.kind)
    cb = layout.chunk_bytes(T)
    host = HostBuffer(C * cb, pinned=True)  # allocated after binding: placed on the local node
    host.tensor.fill_(1)
    hc = [host.view(i * cb, cb) for i in range(C)]
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randperm(num_blocks, generator=gen)[: C * (T // bs)].view(C, T // bs)
    slots = slot_mapping_from_block_ids(ids, block_size=bs, tokens_per_chunk=T)
    st, ld = CudaTransferEngine(layout, T), CudaTransferEngine(layout, T)
    out = {"gpu": dev, "topology": topo}
    for name, fn in (("store", lambda: st.store(slots, hc)), ("load", lambda: ld.load(slots, hc))):
        for _ in range(2):
            fn().synchronize()
        barrier.wait()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn().synchronize()
            times.append(time.perf_counter() - t0)
        barrier.wait()
        out[f"{name}_GBs"] = C * cb / statistics.median(times) / 1e9
    results[rank] = out


def _host_memcpy_gbs(threads: int, gib_per_thread: float = 1.0) -> float:
    import threading

    n = int(gib_per_thread * 2**30)
    bufs = [
        (torch.empty(n, dtype=torch.uint8).fill_(1), torch.empty(n, dtype=torch.uint8).fill_(0)) for _ in range(threads)
    ]
    torch.set_num_threads(1)
    barrier = threading.Barrier(threads + 1)
    done = []

    def run(i):
        src, dst = bufs[i]
        barrier.wait()
        for _ in range(3):
            dst.copy_(src)
        done.append(i)

    ths = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in ths:
        t.start()
    t0 = time.perf_counter()
    barrier.wait()
    for t in ths:
        t.join()
    dt = time.perf_counter() - t0
    return 3 * threads * n * 2 / dt / 1e9  # read + write bytes


def _run(gpus: list[int], args) -> list[dict]:
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    results = manager.dict()
    barrier = ctx.Barrier(len(gpus))
    procs = [ctx.Process(target=_worker, args=(r, gpus, args, barrier, results)) for r in range(len(gpus))]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"worker exited with {p.exitcode}")
    return [results[r] for r in range(len(gpus))]


def main(argv=None) -> int:
    from lmtier.bench.args import bounded_float, bounded_int, output_file
    from lmtier.bench.common import print_table, system_header, write_json
    from lmtier.bench.presets import PRESETS

    p = argparse.ArgumentParser(prog="lmtier bench transfer --multi-gpu", description=__doc__)
    p.add_argument("--gpus", type=bounded_int(min_value=0), default=0, help="number of GPUs (0 = all)")
    p.add_argument("--model", choices=sorted(PRESETS), default="llama-3.1-8b")
    p.add_argument(
        "--chunks", type=bounded_int(min_value=1), default=32, help="chunks per transfer (32 x 32 MiB = 1 GiB)"
    )
    p.add_argument("--iters", type=bounded_int(min_value=1), default=10)
    p.add_argument("--cache-gb", type=bounded_float(above=0), default=20.0)
    p.add_argument("--json", type=output_file, default=None)
    args = p.parse_args(argv)
    n = args.gpus or torch.cuda.device_count()
    gpus = list(range(n))
    single = _run([0], args)[0]
    multi = _run(gpus, args)
    host_threads = max(2, min(os.cpu_count() or 2, 2 * n))
    host = _host_memcpy_gbs(host_threads)
    rows = [{"run": "single", **single}] + [{"run": f"all{n}", **m} for m in multi]
    agg_store = sum(m["store_GBs"] for m in multi)
    agg_load = sum(m["load_GBs"] for m in multi)
    summary = {
        "gpus": n,
        "single_store_GBs": single["store_GBs"],
        "single_load_GBs": single["load_GBs"],
        "aggregate_store_GBs": agg_store,
        "aggregate_load_GBs": agg_load,
        "store_pct_of_n_x_single": 100 * agg_store / (n * single["store_GBs"]),
        "load_pct_of_n_x_single": 100 * agg_load / (n * single["load_GBs"]),
        "host_memcpy_GBs_rw": host,
        "host_memcpy_threads": host_threads,
    }
    for r in rows:
        print(r["run"], r["gpu"], r["topology"])
    print_table(rows, ["run", "gpu", "store_GBs", "load_GBs"])
    print_table(
        [summary],
        [
            "gpus",
            "single_store_GBs",
            "aggregate_store_GBs",
            "store_pct_of_n_x_single",
            "single_load_GBs",
            "aggregate_load_GBs",
            "load_pct_of_n_x_single",
            "host_memcpy_GBs_rw",
        ],
    )
    write_json(args.json, {"system": system_header(), "rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
