"""Mooncake Store tier store/load bandwidth beside the raw Mooncake client and the Redis tier, same run.

Usage::

    lmtier bench mooncake [--presets smollm2-135m,llama-3.1-8b] [--counts 8,32] [--iters 5]
        [--chunk-tokens 256] [--bounce-mib 256] [--pipeline-depths 1] [--modes direct,bounce]
        [--no-redis] [--json out.json]

Starts a private Mooncake Store on 127.0.0.1 (``mooncake_master`` and one standalone
``mooncake_client`` store server that holds the data, :mod:`lmtier.testing.mooncake`) and, unless
``--no-redis``, a private ``redis-server``. The clients under test mount no memory of their own, so
every byte crosses the loopback TCP transport to the store server, as it would cross the network to
another node. For each preset and count, ``count`` chunks of ``chunk_tokens`` tokens of that
preset's KV geometry (SmolLM2: 5.9 MB, Llama-3.1-8B: 32 MiB) live in committed slots of a
:class:`~lmtier.tiers.cpu.CPUPool` (the write-through's source) and are loaded into reserved slots
of the same pool (the connector's promotion targets), as in the product; they are stored and loaded by:

* ``raw``: the official client's ``batch_put_from`` / ``batch_get_into`` of the same payload bytes
  between the same slots, the pool's arena registered with ``register_buffer`` (one call per batch;
  no header, no checksum, no timeout machinery): the ceiling;
* ``direct`` (the product path): :meth:`MooncakeTier.put_many` / :meth:`MooncakeTier.get_many_into`
  of a tier the pool is attached to (:meth:`MooncakeTier.attach_pool`, as the tier manager does):
  record header + xxh3 on both sides, ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``
  (the header through the registered bounce region, the payload straight from/into the slot), the
  worker thread with its timeout, the ``batch_is_exist`` confirmation of every put (Mooncake #1817);
* ``bounce`` (with ``--modes``): the same tier with ``direct=False`` — every payload copied through
  the bounce region (the path of buffers outside the pool, and the only one before);
* ``redis``: :class:`RedisTier` ``put`` / ``get_into`` of the same chunks one after another (the tier
  manager's remote path), against the private redis-server.

Raw and the tiers alternate within each iteration, each iteration starting with the next of them
(:func:`~lmtier.bench.common.interleaved`); each figure is the median of ``--iters`` iterations after
one untimed warm-up (keys removed between them, untimed). GB/s = payload bytes / wall time of the
whole batch; ``%raw`` is the ratio of medians, ``pairs`` the median [lowest-highest] of the
same-iteration ratios (:func:`~lmtier.bench.common.pairs_summary`; on a shared box the figure to
read), ``%raw_best`` the ratio of the fastest iterations (interference only adds time); ``cpu_ms``
is the CPU time of this process, the store server and the master during the batch
(:func:`~lmtier.bench.common.cpu_seconds`), median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from lmtier.bench.args import bounded_int, int_list, name_list
from lmtier.bench.common import (
    add_batch_args,
    batch_scope,
    cpu_seconds,
    interleaved,
    pair_ratios,
    pairs_summary,
    print_table,
    system_header,
    write_json,
)
from lmtier.bench.presets import preset

MiB = 1 << 20
MODES = ("direct", "bounce")


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
    modes: tuple[str, ...] = ("direct",),
) -> dict:
    """One (chunk size, count) case after ``warmup`` untimed iterations; returns the row (GB/s
    medians, ratios, CPU milliseconds and the per-iteration seconds)."""
    from mooncake.store import MooncakeDistributedStore

    from lmtier.tiers.cpu import CPUPool
    from lmtier.tiers.mooncake import MooncakeSettings, MooncakeTier

    total = size * count
    pool = CPUPool(2 * count * (size + 4096), size, populate="now")
    rng = np.random.default_rng(count)
    want = []
    srcs = []
    for _ in range(count):
        k, d = os.urandom(32), rng.integers(0, 256, size, dtype=np.uint8)
        assert pool.put(k, d)
        want.append(d)
        srcs.append(pool.acquire(k))
    views = [s.memoryview() for s in srcs]
    arena, arena_bytes = pool.arena.data_ptr(), pool.num_slots * pool.slot_bytes
    raw = MooncakeDistributedStore()
    if raw.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", store.master.address) != 0:
        raise RuntimeError("raw client setup failed")
    assert raw.register_buffer(arena, arena_bytes) == 0
    settings = MooncakeSettings(store.master.address, global_segment_size=0)
    tiers = {}
    for m in modes:
        tiers[m] = MooncakeTier(
            store.url, settings, timeout_s=30.0, bounce_bytes=bounce_bytes, pipeline_depth=pipeline_depth,
            direct=m == "direct",
        )  # fmt: skip
        tiers[m].attach_pool(pool)
    rtier = None
    if redis_url:
        from lmtier.tiers.redis import RedisTier

        rtier = RedisTier(redis_url, timeout_s=30.0)
    pids = [os.getpid(), store.master.proc.popen.pid, *(s.proc.popen.pid for s in store.servers)]
    whos = ["raw", *modes] + (["redis"] if rtier is not None else [])
    t: dict[str, list[float]] = {f"{w}_{op}": [] for w in whos for op in ("put", "get")}
    cpu: dict[str, list[float]] = {k: [] for k in t}

    def timed(name: str, fn):
        c0, t0 = cpu_seconds(pids), time.perf_counter()
        r = fn()
        dt, c1 = time.perf_counter() - t0, cpu_seconds(pids)
        t[name].append(dt)
        if c0 is not None and c1 is not None:
            cpu[name].append(c1 - c0)
        return r

    try:
        for it in range(warmup + iters):
            if it == warmup:
                for xs in (*t.values(), *cpu.values()):
                    xs.clear()
            for who in interleaved(whos, it):
                dsts = [pool.reserve(os.urandom(32)) for _ in range(count)]
                outs = [d.memoryview() for d in dsts]
                for o in outs:
                    np.frombuffer(o, dtype=np.uint8)[:4096] = 0
                if who == "raw":
                    names = [f"bench-raw-{it}-{i}" for i in range(count)]
                    src_ptrs, dst_ptrs, sizes = [address(v) for v in views], [address(o) for o in outs], [size] * count
                    codes = timed("raw_put", lambda: raw.batch_put_from(names, src_ptrs, sizes))
                    assert all(c == 0 for c in codes), codes
                    got = timed("raw_get", lambda: raw.batch_get_into(names, dst_ptrs, sizes))
                    assert all(g == size for g in got), got
                    raw.batch_remove(names, True)
                elif who == "redis":
                    keys = [os.urandom(32) for _ in range(count)]
                    assert all(timed("redis_put", lambda: [rtier.put(k, v) for k, v in zip(keys, views)]))
                    got = timed("redis_get", lambda: [rtier.get_into(k, o) for k, o in zip(keys, outs)])
                    assert got == [size] * count
                    for k in keys:
                        rtier.delete(k)
                else:
                    tier = tiers[who]
                    keys = [os.urandom(32) for _ in range(count)]
                    assert all(timed(f"{who}_put", lambda: tier.put_many(keys, views))), dict(tier.counters)
                    got = timed(f"{who}_get", lambda: tier.get_many_into(keys, outs))
                    assert got == [size] * count, dict(tier.counters)
                    for k in keys:
                        tier.delete(k)
                for o, w in zip(outs, want, strict=True):
                    assert np.array_equal(np.frombuffer(o, dtype=np.uint8)[:size], w), f"{who}: wrong bytes"
                for d in dsts:
                    pool.abort(d)
    finally:
        for tier in tiers.values():
            tier.close()
        if rtier is not None:
            rtier.close()
        raw.unregister_buffer(arena)
        raw.close()
        for s_ in srcs:
            pool.release(s_)
        pool.close()
    row: dict = {"chunk_MB": round(size / 1e6, 2), "chunks": count, "depth": pipeline_depth}
    gbps = {k: [total / x / 1e9 for x in xs] for k, xs in t.items()}
    for k, xs in gbps.items():
        row[k + "_GBps"] = _med(xs) if xs else None
        row[k + "_best_GBps"] = max(xs) if xs else None
        row[k + "_cpu_ms"] = round(1e3 * _med(cpu[k]), 1) if cpu[k] else None
    for m in modes:
        for op in ("put", "get"):
            r = pair_ratios(gbps[f"{m}_{op}"], gbps[f"raw_{op}"])
            row[f"{m}_{op}_%raw"] = 100 * row[f"{m}_{op}_GBps"] / row[f"raw_{op}_GBps"]
            row[f"{m}_{op}_pairs"] = pairs_summary(r)
            row[f"{m}_{op}_%raw_best"] = 100 * row[f"{m}_{op}_best_GBps"] / row[f"raw_{op}_best_GBps"]
    row["seconds"] = t
    row["cpu_seconds"] = cpu
    return row


def address(mv: memoryview) -> int:
    """Start address of a writable or read-only view (:func:`lmtier.tiers.buffers.address_of`)."""
    from lmtier.tiers.buffers import address_of

    return address_of(mv)


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
    ap.add_argument(
        "--modes",
        type=name_list(MODES),
        default=["direct"],
        help="tier data paths, comma-separated: direct (the product's: straight from/into pool slots), "
        "bounce (direct=False: copies through the bounce region)",
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
                        modes=tuple(a.modes),
                    )
                    row["preset"] = p
                    rows.append(row)
                    write_json(a.json, {"system": system_header(), "args": vars(a), "rows": rows})  # so far
                    m = a.modes[0]
                    print(
                        f"  {p} x {c} depth {d}: raw put {row['raw_put_GBps']:.2f} get {row['raw_get_GBps']:.2f}, "
                        f"{m} put {row[m + '_put_GBps']:.2f} ({row[m + '_put_%raw']:.0f} %) "
                        f"get {row[m + '_get_GBps']:.2f} ({row[m + '_get_%raw']:.0f} %) GB/s",
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
    for op in ("put", "get"):
        cols = ["preset", "chunk_MB", "chunks", "depth", f"raw_{op}_GBps"]
        for m in a.modes:
            cols += [f"{m}_{op}_GBps", f"{m}_{op}_%raw", f"{m}_{op}_pairs", f"{m}_{op}_%raw_best"]
        cols += [f"redis_{op}_GBps"] if redis is not None else []
        cols += [f"{w}_{op}_cpu_ms" for w in ("raw", *a.modes)]
        print_table(rows, cols)
    write_json(a.json, {"system": sysinfo, "args": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
