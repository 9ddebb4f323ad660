"""Mooncake Store tier store/load bandwidth beside the raw Mooncake client and the Redis tier, same run.

Usage::

    lmtier bench mooncake [--presets smollm2-135m,llama-3.1-8b] [--counts 8,32] [--iters 3]
        [--chunk-tokens 256] [--bounce-mib 256] [--pipeline-depths 1] [--no-redis] [--json out.json]

Starts a private Mooncake Store on 127.0.0.1 (``mooncake_master`` and one standalone
``mooncake_client`` store server that holds the data, :mod:`lmtier.testing.mooncake`) and, unless
``--no-redis``, a private ``redis-server``. The clients under test mount no memory of their own, so
every byte crosses the loopback TCP transport to the store server, as it would cross the network to
another node. For each preset and count, ``count`` chunks of ``chunk_tokens`` tokens of that
preset's KV geometry (SmolLM2: 5.9 MB, Llama-3.1-8B: 32 MiB) are stored and loaded by:

* ``raw``: the official client's ``batch_put_from`` / ``batch_get_into`` of the same payload bytes
  between buffers registered with ``register_buffer`` (one call per batch; no header, no checksum, no
  timeout machinery): the ceiling;
* ``tier``: :meth:`MooncakeTier.put_many` / :meth:`MooncakeTier.get_many_into` — the product path:
  record header, xxh3 on both sides, the copy through the registered bounce region, the worker
  thread with its timeout, the ``batch_is_exist`` confirmation of every put (Mooncake #1817); one
  row per ``--pipeline-depths`` value (the tier's ``pipeline_depth``; its default is 1);
* ``redis``: :class:`RedisTier` ``put`` / ``get_into`` of the same chunks one after another (the tier
  manager's remote path), against the private redis-server.

GB/s = payload bytes / wall time of the whole batch; each figure is the median of ``--iters``
iterations after one untimed warm-up (keys removed between them, untimed). ``%raw`` divides the tier by the raw client.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import time

import numpy as np

from lmtier.bench.args import bounded_int, int_list
from lmtier.bench.common import add_batch_args, batch_scope, print_table, system_header, write_json
from lmtier.bench.presets import preset

MiB = 1 << 20


def _buf(n: int) -> tuple[mmap.mmap, np.ndarray, int]:
    m = mmap.mmap(-1, max(n, 4096))
    a = np.frombuffer(m, dtype=np.uint8)[:n]
    return m, a, ctypes.addressof(ctypes.c_char.from_buffer(m))


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_case(
    store,
    size: int,
    count: int,
    iters: int,
    bounce_bytes: int,
    redis_url: str | None,
    warmup: int = 1,
    pipeline_depth: int = 1,
) -> dict:
    """One (chunk size, count) case after ``warmup`` untimed iterations; returns the row (GB/s
    medians and the per-iteration seconds)."""
    from mooncake.store import MooncakeDistributedStore

    from lmtier.tiers.mooncake import MooncakeSettings, MooncakeTier

    total = size * count
    src_map, src, src_addr = _buf(total)
    dst_map, dst, dst_addr = _buf(total)
    src[:] = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    raw = MooncakeDistributedStore()
    if raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", store.master.address) != 0:
        raise RuntimeError("raw client setup failed")
    assert raw.register_buffer(src_addr, total) == 0 and raw.register_buffer(dst_addr, total) == 0
    settings = MooncakeSettings(store.master.address, global_segment_size=0)
    tier = MooncakeTier(store.url, settings, timeout_s=30.0, bounce_bytes=bounce_bytes, pipeline_depth=pipeline_depth)
    rtier = None
    if redis_url:
        from lmtier.tiers.redis import RedisTier

        rtier = RedisTier(redis_url, timeout_s=30.0)
    views = [memoryview(src[i * size : (i + 1) * size]) for i in range(count)]
    outs = [memoryview(dst[i * size : (i + 1) * size]) for i in range(count)]
    t: dict[str, list[float]] = {
        k: [] for k in ("raw_put", "raw_get", "tier_put", "tier_get", "redis_put", "redis_get")
    }
    try:
        for it in range(warmup + iters):
            if it == warmup:
                for xs in t.values():
                    xs.clear()
            names = [f"bench-raw-{it}-{i}" for i in range(count)]
            ptrs = [src_addr + i * size for i in range(count)]
            t0 = time.perf_counter()
            codes = raw.batch_put_from(names, ptrs, [size] * count)
            t["raw_put"].append(time.perf_counter() - t0)
            assert all(c == 0 for c in codes), codes
            dst[:] = 0
            t0 = time.perf_counter()
            got = raw.batch_get_into(names, [dst_addr + i * size for i in range(count)], [size] * count)
            t["raw_get"].append(time.perf_counter() - t0)
            assert all(g == size for g in got) and np.array_equal(src, dst), got
            raw.batch_remove(names, True)

            keys = [os.urandom(32) for _ in range(count)]
            t0 = time.perf_counter()
            ok = tier.put_many(keys, views)
            t["tier_put"].append(time.perf_counter() - t0)
            assert all(ok), dict(tier.counters)
            dst[:] = 0
            t0 = time.perf_counter()
            got = tier.get_many_into(keys, outs)
            t["tier_get"].append(time.perf_counter() - t0)
            assert all(g == size for g in got) and np.array_equal(src, dst), dict(tier.counters)
            for k in keys:
                tier.delete(k)

            if rtier is not None:
                t0 = time.perf_counter()
                assert all(rtier.put(k, v) for k, v in zip(keys, views))
                t["redis_put"].append(time.perf_counter() - t0)
                dst[:] = 0
                t0 = time.perf_counter()
                assert all(rtier.get_into(k, o) == size for k, o in zip(keys, outs))
                t["redis_get"].append(time.perf_counter() - t0)
                assert np.array_equal(src, dst)
                for k in keys:
                    rtier.delete(k)
    finally:
        tier.close()
        if rtier is not None:
            rtier.close()
        raw.unregister_buffer(src_addr)
        raw.unregister_buffer(dst_addr)
        raw.close()
        del src, dst, views, outs
    row: dict = {"chunk_MB": round(size / 1e6, 2), "chunks": count, "depth": pipeline_depth}
    for k, xs in t.items():
        row[k + "_GBps"] = total / _med(xs) / 1e9 if xs else None
    row["put_%raw"] = 100 * row["tier_put_GBps"] / row["raw_put_GBps"]
    row["get_%raw"] = 100 * row["tier_get_GBps"] / row["raw_get_GBps"]
    row["seconds"] = {k: xs for k, xs in t.items() if xs}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmtier bench mooncake", description=__doc__.split("\n")[0])
    add_batch_args(ap)
    ap.add_argument(
        "--bounce-mib",
        type=bounded_int(min_value=1),
        default=256,
        help="the tier's registered bounce region (its default)",
    )
    ap.add_argument(
        "--pipeline-depths",
        type=int_list(min_value=1),
        default=[1],
        help="the tier's pipeline_depth values, one row each (comma-separated; 1 = one call per batch)",
    )
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis tier rows")
    a = ap.parse_args(argv)
    presets, counts = batch_scope(a)
    from lmtier.testing.mooncake import MooncakeCluster, mooncake_client_importable

    why = mooncake_client_importable()
    if why is not None:
        print(f"lmtier bench mooncake: the mooncake client is not importable ({why}); bash scripts/setup_mooncake.sh")
        return 2
    biggest = max(a.chunk_tokens * preset(p).bytes_per_token() for p in presets) * max(counts)
    segment = int(biggest * 1.5) + 256 * MiB
    redis = None
    if not a.no_redis:
        from lmtier.testing.redis import RedisServer, RedisUnavailable

        try:
            redis = RedisServer(extra_args=("--proto-max-bulk-len", str(1 << 30))).start()
        except RedisUnavailable as e:
            print(f"(no Redis rows: {e})")
    store = MooncakeCluster(servers=1, segment_bytes=segment).start()
    rows = []
    try:
        for p in presets:
            size = a.chunk_tokens * preset(p).bytes_per_token()
            for c in counts:
                for d in a.pipeline_depths:
                    row = run_case(
                        store,
                        size,
                        c,
                        a.iters,
                        a.bounce_mib * MiB,
                        redis.url if redis else None,
                        pipeline_depth=d,
                    )
                    row["preset"] = p
                    rows.append(row)
                    print(
                        f"  {p} x {c} depth {d}: tier put {row['tier_put_GBps']:.2f} "
                        f"get {row['tier_get_GBps']:.2f} GB/s",
                        flush=True,
                    )
    finally:
        store.close()
        if redis is not None:
            redis.close()
    sysinfo = system_header()
    print(f"# {sysinfo}")
    print(
        f"Mooncake Store loopback (tcp, data in a separate store-server process), {a.chunk_tokens}-token chunks, "
        f"median of {a.iters}; GB/s of payload"
    )
    cols = ["preset", "chunk_MB", "chunks", "depth", "raw_put_GBps", "tier_put_GBps", "put_%raw", "redis_put_GBps"]
    cols += ["raw_get_GBps", "tier_get_GBps", "get_%raw", "redis_get_GBps"]
    print_table(rows, cols)
    write_json(a.json, {"system": sysinfo, "args": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
