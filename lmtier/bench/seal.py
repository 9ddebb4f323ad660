"""Cost of sealed remote records: store/load GB/s through the Redis tier with the record checksum
only, with authentication (GMAC) and with authentication + encryption (AES-256-GCM), same run.

Usage::

    lmtier bench seal [--presets smollm2-135m,llama-3.1-8b] [--chunks 8] [--threads 1,2] [--iters 3]
        [--chunk-tokens 256] [--redis-url URL] [--quick] [--json out.json]

Part 1, primitives (no Redis): GB/s of the candidate MACs and ciphers over one chunk in memory, one
thread and ``--threads`` threads (each hashing its own chunk: it shows whether the GIL is released)
— xxh3-64 (the record checksum), keyed BLAKE2b-256 and HMAC-SHA256 (hashlib), GMAC (AES-256-GCM
with the chunk as associated data, what ``SealMode.AUTHENTICATE`` uses), AES-256-GCM encrypt and
decrypt (``cryptography``), and a plain memory copy (``np.copyto``, as the sealer copies) — plus the product's
:class:`~lmtier.tiers.seal.tier.Sealer` ``seal_into``/``open_into`` in both modes.

Part 2, the tier: ``count`` chunks of ``chunk_tokens`` tokens of a preset's KV geometry, stored with
``put`` and loaded with ``get_into`` by ``threads`` callers at once (the tier manager's remote threads),
through

* ``checksum``: :class:`~lmtier.tiers.redis.RedisTier` alone (record header + xxh3) — the ceiling;
* ``mac``: :class:`~lmtier.tiers.seal.tier.SealedTier` (``SealMode.AUTHENTICATE``) over it;
* ``encrypt``: :class:`~lmtier.tiers.seal.tier.SealedTier` (``SealMode.ENCRYPT``) over it;

against a private ``redis-server`` (or ``--redis-url``). The three settings alternate within each
iteration, in an order rotated from one iteration to the next; each figure is the median over
``--iters`` iterations after one untimed warm-up.
GB/s = payload bytes / wall time of the batch; ``%ceil`` divides by ``checksum`` of the same run.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import xxhash

from lmtier import envs
from lmtier.bench.args import bounded_int, int_list, name_list, output_file, ping_redis, redis_url
from lmtier.bench.common import print_table, system_header, write_json
from lmtier.bench.presets import PRESETS, preset

MiB = 1 << 20
SETTINGS = ("checksum", "mac", "encrypt")


def _rate(fn: Callable[[int], object], nbytes: int, threads: int, iters: int) -> float:
    """GB/s of ``threads`` threads each calling ``fn(thread index)`` ``iters`` times (median of 3)."""
    out = []
    for _ in range(3):
        ts = [threading.Thread(target=lambda j=j: [fn(j) for _ in range(iters)]) for j in range(threads)]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        out.append(threads * iters * nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(out)


def primitives(size: int, threads: int, iters: int) -> list[dict]:
    """Rows ``{primitive, GBps_1, GBps_N, scaling}`` over ``size``-byte chunks (see the module doc)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from lmtier.tiers.seal.keys import KeyRing, SealKey
    from lmtier.tiers.seal.tier import Sealer, SealMode

    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(threads)]
    key = os.urandom(32)
    aead = AESGCM(key)
    nonce = os.urandom(12)
    ct = [bytearray(size + 16) for _ in range(threads)]
    pt = [bytearray(size) for _ in range(threads)]
    for j in range(threads):
        aead.encrypt_into(nonce, data[j], b"ad", ct[j])
    ring = KeyRing.of(SealKey.from_bytes(key, source="bench"))
    sealers = {m: Sealer(ring, mode=m) for m in SealMode}
    sealed = {m: [bytearray(Sealer.sealed_bytes(size)) for _ in range(threads)] for m in SealMode}
    k32 = bytes(32)
    for m, s in sealers.items():
        for j in range(threads):
            s.seal_into(memoryview(sealed[m][j]), memoryview(data[j]), k32)
    cases: dict[str, Callable[[int], object]] = {
        "xxh3-64 (record checksum)": lambda j: xxhash.xxh3_64_intdigest(data[j]),
        "BLAKE2b-256 keyed": lambda j: hashlib.blake2b(data[j], key=key, digest_size=32).digest(),
        "HMAC-SHA256": lambda j: hmac.new(key, data[j], "sha256").digest(),
        "GMAC (AES-GCM, data as AAD)": lambda j: aead.encrypt(nonce, b"", data[j]),
        "AES-256-GCM encrypt_into": lambda j: aead.encrypt_into(nonce, data[j], b"ad", ct[j]),
        "AES-256-GCM decrypt_into": lambda j: aead.decrypt_into(nonce, ct[j], b"ad", pt[j]),
        "memory copy (np.copyto)": lambda j: np.copyto(
            np.frombuffer(pt[j], np.uint8), np.frombuffer(data[j], np.uint8)
        ),
        "Sealer.seal_into mac": lambda j: sealers[SealMode.AUTHENTICATE].seal_into(
            memoryview(sealed[SealMode.AUTHENTICATE][j]), memoryview(data[j]), k32
        ),
        "Sealer.open_into mac": lambda j: sealers[SealMode.AUTHENTICATE].open_into(
            memoryview(sealed[SealMode.AUTHENTICATE][j]), memoryview(pt[j]), k32
        ),
        "Sealer.seal_into encrypt": lambda j: sealers[SealMode.ENCRYPT].seal_into(
            memoryview(sealed[SealMode.ENCRYPT][j]), memoryview(data[j]), k32
        ),
        "Sealer.open_into encrypt": lambda j: sealers[SealMode.ENCRYPT].open_into(
            memoryview(sealed[SealMode.ENCRYPT][j]), memoryview(pt[j]), k32
        ),
    }
    rows = []
    for name, fn in cases.items():
        fn(0)
        one = _rate(fn, size, 1, iters)
        many = _rate(fn, size, threads, iters) if threads > 1 else one
        rows.append({"primitive": name, "GBps_1": one, f"GBps_{threads}": many, "scaling": many / one})
    return rows


def _tiers(url: str) -> dict[str, object]:
    from lmtier.tiers.redis import RedisTier
    from lmtier.tiers.seal.keys import KeyRing, SealKey
    from lmtier.tiers.seal.tier import SealedTier, SealMode

    ring = KeyRing.of(SealKey.from_bytes(os.urandom(32), source="bench"))
    ns = os.urandom(16)

    def redis_tier():
        return RedisTier(url, timeout_s=30.0, max_connections=16)

    return {
        "checksum": redis_tier(),
        "mac": SealedTier(redis_tier(), ring, namespace=ns, mode=SealMode.AUTHENTICATE),
        "encrypt": SealedTier(redis_tier(), ring, namespace=ns, mode=SealMode.ENCRYPT),
    }


def _parallel(threads: int, count: int, fn: Callable[[int], object]) -> float:
    """Seconds for ``threads`` threads to call ``fn(i)`` for every ``i < count`` (split evenly)."""
    ts = [threading.Thread(target=lambda j=j: [fn(i) for i in range(j, count, threads)]) for j in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def run_case(url: str, size: int, count: int, threads: int, iters: int, warmup: int = 1) -> dict:
    """One (chunk size, count, threads) case over the three settings; returns the row."""
    src = np.random.default_rng(1).integers(0, 256, size * count, dtype=np.uint8)
    dst = np.zeros_like(src)
    views = [memoryview(src[i * size : (i + 1) * size]) for i in range(count)]
    outs = [memoryview(dst[i * size : (i + 1) * size]) for i in range(count)]
    tiers = _tiers(url)
    t: dict[str, list[float]] = {f"{s}_{op}": [] for s in SETTINGS for op in ("put", "get")}
    try:
        for it in range(warmup + iters):
            for s in SETTINGS[it % 3 :] + SETTINGS[: it % 3]:  # rotated: no setting always goes first
                tier = tiers[s]
                keys = [os.urandom(32) for _ in range(count)]
                ok = [False] * count
                got = [None] * count

                def put(i, tier=tier, keys=keys, ok=ok):
                    ok[i] = tier.put(keys[i], views[i])

                def get(i, tier=tier, keys=keys, got=got):
                    got[i] = tier.get_into(keys[i], outs[i])

                tp = _parallel(threads, count, put)
                dst[:] = 0
                tg = _parallel(threads, count, get)
                assert all(ok) and all(g == size for g in got) and np.array_equal(src, dst), (s, ok, got)
                for k in keys:
                    tier.delete(k)
                if it >= warmup:
                    t[f"{s}_put"].append(tp)
                    t[f"{s}_get"].append(tg)
    finally:
        for tier in tiers.values():
            tier.close()
    total = size * count
    row: dict = {"chunk_MB": round(size / 1e6, 2), "chunks": count, "threads": threads}
    for k, xs in t.items():
        row[k + "_GBps"] = total / statistics.median(xs) / 1e9
    for s in SETTINGS[1:]:
        for op in ("put", "get"):
            row[f"{s}_{op}_%ceil"] = 100 * row[f"{s}_{op}_GBps"] / row[f"checksum_{op}_GBps"]
    row["seconds"] = t
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmtier bench seal", description=__doc__.split("\n")[0])
    ap.add_argument("--presets", type=name_list(PRESETS), default=["smollm2-135m", "llama-3.1-8b"])
    ap.add_argument("--chunks", type=bounded_int(min_value=1), default=8, help="chunks per batch")
    ap.add_argument("--threads", type=int_list(min_value=1), default=[1, 2], help="concurrent callers")
    ap.add_argument("--chunk-tokens", type=bounded_int(min_value=1), default=256)
    ap.add_argument("--iters", type=bounded_int(min_value=1), default=3)
    ap.add_argument(
        "--redis-url", type=redis_url, default=None, help="an existing Redis (default: a private redis-server)"
    )
    ap.add_argument("--quick", action="store_true", help="SmolLM2, 4 chunks, 1 thread count, 1 iteration")
    ap.add_argument("--json", type=output_file)
    a = ap.parse_args(argv)
    if a.redis_url:
        ping_redis(ap.prog, a.redis_url)
    presets, threads = a.presets, a.threads
    if a.quick or envs.LMTIER_BENCH_SMOKE:
        presets, threads, a.chunks, a.iters = presets[:1], threads[-1:], 4, 1
    size0 = a.chunk_tokens * preset(presets[0]).bytes_per_token()
    prim = primitives(size0, max(threads), iters=2 if a.quick else 5)
    srv = None
    url = a.redis_url
    if url is None:
        from lmtier.testing.redis import RedisServer, RedisUnavailable

        try:
            srv = RedisServer(extra_args=("--proto-max-bulk-len", str(1 << 30))).start()
        except RedisUnavailable as e:
            print(f"lmtier bench seal: no redis-server ({e}); pass --redis-url")
            return 2
        url = srv.url
    rows = []
    try:
        for p in presets:
            size = a.chunk_tokens * preset(p).bytes_per_token()
            for th in threads:
                row = run_case(url, size, a.chunks, th, a.iters)
                row["preset"] = p
                rows.append(row)
                print(
                    f"  {p} x {a.chunks}, {th} thread(s): get checksum {row['checksum_get_GBps']:.2f} "
                    f"mac {row['mac_get_GBps']:.2f} encrypt {row['encrypt_get_GBps']:.2f} GB/s",
                    flush=True,
                )
    finally:
        if srv is not None:
            srv.close()
    sysinfo = system_header()
    print(f"# {sysinfo}")
    print(f"Primitives over one {size0 / 1e6:.2f} MB chunk ({presets[0]}), in memory, median of 3; GB/s")
    print_table(prim, list(prim[0]))
    print(f"Redis tier, {a.chunk_tokens}-token chunks, median of {a.iters}; GB/s of payload; %ceil = of checksum")
    cols = ["preset", "chunk_MB", "chunks", "threads"]
    cols += [f"{s}_put_GBps" for s in SETTINGS] + ["mac_put_%ceil", "encrypt_put_%ceil"]
    cols += [f"{s}_get_GBps" for s in SETTINGS] + ["mac_get_%ceil", "encrypt_get_%ceil"]
    print_table(rows, cols)
    write_json(a.json, {"system": sysinfo, "args": vars(a), "primitives": prim, "rows": rows})
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
