"""The product's per-chunk operations alone and beside a thread that keeps the GIL busy.

In a vLLM worker, lmtier's load, write-through and encode threads share the GIL with the engine's
main thread, which is busy in Python most of the time (scheduling, sampling, the model runner's host
work; a decode step of an eager 8B model is host-bound, benchmarks/RESULTS.md §10). Every call that
releases the GIL (a torch operation, a socket ``recv_into``, a file read, a native call, an xxh3
update) must then wait for the GIL to come back: up to ``sys.getswitchinterval()`` (5 ms by
default) per hand-off. This benchmark times each operation alone and beside such a thread (a pure
Python loop), for one or more switch intervals, and reports the excess as hand-offs
(excess / interval).

Operations (the code the tiers run; one chunk each): ``encode`` / ``decode`` —
:func:`lmtier.codec.chunk.encode_chunk` / ``decode_chunk`` of a KV chunk on the CPU (level
``default``); ``disk_put`` / ``disk_get`` — :class:`lmtier.tiers.disk.tier.DiskTier` of a record;
``redis_put`` / ``redis_get`` — :class:`lmtier.tiers.redis.tier.RedisTier` on a private loopback
``redis-server`` (skipped without one). Ceiling: the same operation alone, same run.

    python benchmarks/bench_gil.py [--preset smollm2-135m] [--intervals 0.005,0.0005] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmtier.bench.presets import preset  # noqa: E402
from lmtier.codec import chunk as CH  # noqa: E402

OPS = ("encode", "decode", "disk_put", "disk_get", "redis_put", "redis_get")


def median_s(fn: Callable[[], object], n: int) -> float:
    """Median wall seconds of ``n`` calls of ``fn``."""
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def alone_and_contended(fn: Callable[[], object], n: int) -> tuple[float, float]:
    """(median seconds alone, median seconds in a second thread while a third spins in Python)."""
    fn()
    alone = median_s(fn, n)
    stop = threading.Event()

    def spin() -> None:
        a = 0
        while not stop.is_set():
            a += 1

    got: list[float] = []
    failed: list[BaseException] = []

    def work() -> None:
        try:
            got.append(median_s(fn, n))
        except BaseException as e:  # re-raised in the caller's thread
            failed.append(e)

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
    finally:
        stop.set()
        spinner.join()
    if failed:
        raise failed[0]
    return alone, got[0]


def _hit(n: int | None, what: str) -> int:
    """``n`` (bytes a tier's ``get_into`` read); a miss is an error, not a fast operation to time."""
    if n is None:
        raise RuntimeError(f"{what}: miss (the chunk was evicted or never stored)")
    return n


def operations(shape: tuple[int, ...], ops: list[str], workdir: str) -> tuple[dict[str, Callable[[], object]], list]:
    """The operations to time (name -> zero-argument callable) and what to close afterwards."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 2).to(torch.bfloat16)
    rec = CH.encode_chunk(x, shape=shape, dtype=torch.bfloat16, level="default")
    out = torch.empty(shape, dtype=torch.bfloat16)
    payload = np.frombuffer(rec, np.uint8).copy()
    buf = np.empty(payload.size, np.uint8)
    fns: dict[str, Callable[[], object]] = {}
    closers: list = []
    if "encode" in ops:
        fns["encode"] = lambda: CH.encode_chunk(x, shape=shape, dtype=torch.bfloat16, level="default", num_threads=1)
    if "decode" in ops:
        fns["decode"] = lambda: CH.decode_chunk(
            rec, out, expected_shape=shape, dtype=torch.bfloat16, level="default", num_threads=1
        )
    if {"disk_put", "disk_get"} & set(ops):
        from lmtier.tiers.disk.tier import DiskTier

        disk = DiskTier(workdir, capacity_bytes=max(1 << 28, 64 * payload.size))
        closers.append(disk)
        disk.put(b"g" * 32, payload)
        if "disk_put" in ops:
            fns["disk_put"] = lambda: disk.put(os.urandom(32), payload)
        if "disk_get" in ops:
            fns["disk_get"] = lambda: _hit(disk.get_into(b"g" * 32, buf), "disk_get")
    if {"redis_put", "redis_get"} & set(ops):
        from lmtier.testing.redis import RedisServer, RedisUnavailable
        from lmtier.tiers.redis.tier import RedisTier

        try:
            server = RedisServer().start()
        except (RedisUnavailable, FileNotFoundError, OSError) as e:
            print(f"redis: skipped ({e})", flush=True)
        else:
            closers.append(server)
            tier = RedisTier(server.url, timeout_s=5.0)
            closers.insert(0, tier)
            tier.put(b"r" * 32, payload)
            if "redis_put" in ops:
                fns["redis_put"] = lambda: tier.put(b"p" * 32, payload)
            if "redis_get" in ops:
                fns["redis_get"] = lambda: _hit(tier.get_into(b"r" * 32, buf), "redis_get")
    return fns, closers


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="smollm2-135m", help="KV geometry (lmtier.bench.presets)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    ap.add_argument("--intervals", default="0.005,0.0005", help="sys.setswitchinterval values (s), comma-separated")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    ops = [o for o in a.ops.split(",") if o]
    bad = sorted(set(ops) - set(OPS))
    if bad:
        ap.error(f"unknown --ops {bad}; known: {', '.join(OPS)}")
    try:
        intervals = [float(v) for v in a.intervals.split(",") if v]
    except ValueError:
        ap.error(f"--intervals must be numbers, got {a.intervals!r}")
    if not intervals or min(intervals) <= 0 or a.iters < 1 or a.tokens < 1:
        ap.error("--intervals must be > 0, --iters and --tokens >= 1")
    geo = preset(a.preset)
    shape = (geo.num_layers, 2, a.tokens, geo.num_kv_heads, geo.head_size)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shape": shape, "rows": []}
    old = sys.getswitchinterval()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/var/tmp")) as workdir:
        fns, closers = operations(shape, ops, workdir)
        try:
            print(f"chunk {shape} bf16; {len(fns)} operations; median of {a.iters}", flush=True)
            for iv in intervals:
                sys.setswitchinterval(iv)
                for name, fn in fns.items():
                    alone, busy = alone_and_contended(fn, a.iters)
                    row = {"op": name, "interval_s": iv, "alone_ms": alone * 1e3, "contended_ms": busy * 1e3,
                           "handoffs": max(0.0, (busy - alone) / iv)}  # fmt: skip
                    res["rows"].append(row)
                    print(f"interval {iv * 1e3:5.2f} ms  {name:10s} alone {alone * 1e3:8.1f} ms  beside a busy thread "
                          f"{busy * 1e3:8.1f} ms  (~{row['handoffs']:.0f} hand-offs)", flush=True)  # fmt: skip
        finally:
            sys.setswitchinterval(old)
            for c in closers:
                c.close()
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
