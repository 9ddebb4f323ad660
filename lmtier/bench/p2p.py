"""P2P chunk fetch bandwidth (NIXL over UCX) beside NIXL's raw READ of the same bytes and the Redis
tier, same run.

Usage::

    lmtier bench p2p [--presets smollm2-135m,llama-3.1-8b] [--counts 8,32] [--iters 3]
        [--chunk-tokens 256] [--bounce-mib 256] [--no-redis] [--quick] [--json out.json]

Starts a private ``redis-server`` (the P2P directory, and the Redis tier's store) and node A, a
:class:`~lmtier.manager.TierManager` with P2P sharing in a child process
(:class:`lmtier.testing.p2p.P2PNode`), whose CPU pool it fills with ``count`` random chunks of
``chunk_tokens`` tokens of the preset's KV geometry (SmolLM2: 5.9 MB, Llama-3.1-8B: 32 MiB) and
publishes. In this process (node B), per preset and count:

* ``raw``: one NIXL READ (``initialize_xfer`` + ``transfer`` + polling ``check_xfer_state``) of the
  same slots of A's registered arena into a registered buffer, by a plain ``nixl_agent`` that loaded
  A's published metadata: no directory, no checksum, no copy — the ceiling;
* ``p2p``: :meth:`P2PTier.get_many_into` — the product path: one pipelined directory lookup, READs
  into the registered bounce region (sub-batches of half of it, pipelined), xxh3 verification
  against each entry, the copy into the caller's buffers;
* ``redis``: :class:`RedisTier` ``put`` / ``get_into`` of the same chunks one after another (the tier
  manager's remote path) against the private redis-server (load only is compared).

GB/s = payload bytes / wall time of the whole batch; median of ``--iters`` after one untimed warm-up.
``%raw`` = p2p / raw. Every fetched byte is compared with the expected chunk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from lmtier.bench.args import bounded_int
from lmtier.bench.common import add_batch_args, batch_scope, print_table, system_header, write_json
from lmtier.bench.presets import preset

MiB = 1 << 20
TOKEN_ENV = "P2P_BENCH_TOKEN"


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _namespace_fields(name: str, chunk_tokens: int) -> dict:
    p = preset(name)
    return dict(
        model=f"bench-p2p-{name}",
        num_layers=p.num_layers,
        num_kv_heads=p.num_kv_heads,
        head_size=p.head_size,
        kv_dtype=p.dtype,
        kv_planes=p.num_planes,
        chunk_size=chunk_tokens,
    )


def _raw_read(agent, peer: str, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]]) -> None:
    h = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), peer)
    try:
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ: {state}")
    finally:
        h.release()


def run_case(name: str, chunk_tokens: int, count: int, iters: int, bounce_bytes: int, redis_url: str) -> dict:
    """One (preset, count) case: node A in a child process, B's tier, the raw agent and the Redis
    tier here; returns the row (GB/s medians and per-iteration seconds)."""
    from lmtier.keys import Namespace
    from lmtier.remote_url import parse_redis_url
    from lmtier.testing.p2p import P2PNode, fill_chunks
    from lmtier.testing.procs import free_port
    from lmtier.tiers.cpu import CPUPool
    from lmtier.tiers.p2p.directory import Directory
    from lmtier.tiers.p2p.tier import P2PTier
    from lmtier.tiers.p2p.transport import import_nixl
    from lmtier.tiers.redis import RedisTier

    fields = _namespace_fields(name, chunk_tokens)
    ns = Namespace(**fields)
    size = ns.chunk_bytes
    total = size * count
    token = os.urandom(16).hex()
    values = dict(
        chunk_size=chunk_tokens,
        max_local_cpu_size=(total + count * 4096 + MiB) / 2**30,
        enable_p2p=True,
        p2p_host="127.0.0.1",
        p2p_init_ports=[free_port()],
        p2p_directory_url=redis_url,
        p2p_token_env=TOKEN_ENV,
        p2p_timeout_s=30.0,
    )
    a = P2PNode(values, fields, env={TOKEN_ENV: token}, start_timeout_s=120)
    seed = count * 1000 + chunk_tokens
    endpoint = parse_redis_url(redis_url)
    digest = ns.digest()[:16]
    pool = tier = rtier = raw = None
    try:
        keys = a.call("fill", count, size, seed, timeout_s=600)
        if keys is None:
            raise RuntimeError("node A could not store and publish its chunks")
        _, expect = fill_chunks(count, size, seed)
        want = np.concatenate(expect)
        del expect
        dst = np.zeros(total, dtype=np.uint8)
        outs = [memoryview(dst[i * size : (i + 1) * size]) for i in range(count)]
        pool = CPUPool(size + 4096, size, populate="lazy")  # B's own (empty) pool: registered, published
        tier = P2PTier(
            pool, endpoint, namespace=digest, node_id="bench-b", token=token.encode(), timeout_s=30.0,
            bounce_bytes=bounce_bytes,
        )  # fmt: skip
        # The raw ceiling: the same slots of A's arena, from the directory's entries.
        d = Directory(endpoint, digest, token=token.encode(), timeout_s=30.0)
        entries = [next(iter(e.items())) for e in d.lookup(keys)]
        node_id = entries[0][0]
        rec = d.get_nodes([node_id])[node_id]
        d.close()
        api = import_nixl()
        raw = api.nixl_agent("bench-raw", api.nixl_agent_config(backends=["UCX"]))
        raw.register_memory([(dst.ctypes.data, total, 0, "")], "DRAM")
        peer = raw.add_remote_agent(rec.metadata)
        peer = peer.decode() if isinstance(peer, bytes) else peer
        local = [(dst.ctypes.data + i * size, size, 0) for i in range(count)]
        remote = [(rec.arena_base + e.offset, e.length, 0) for _, e in entries]
        rtier = RedisTier(redis_url, timeout_s=30.0)
        for k, o in zip(keys, np.split(want, count), strict=True):
            assert rtier.put(k, memoryview(o))
        t: dict[str, list[float]] = {k: [] for k in ("raw", "p2p", "redis")}
        for it in range(1 + iters):
            if it == 1:
                for xs in t.values():
                    xs.clear()
            dst[:] = 0
            t0 = time.perf_counter()
            _raw_read(raw, peer, local, remote)
            t["raw"].append(time.perf_counter() - t0)
            assert np.array_equal(dst, want), "raw READ: wrong bytes"
            dst[:] = 0
            t0 = time.perf_counter()
            got = tier.get_many_into(keys, outs)
            t["p2p"].append(time.perf_counter() - t0)
            assert got == [size] * count and np.array_equal(dst, want), dict(tier.counters)
            dst[:] = 0
            t0 = time.perf_counter()
            assert all(rtier.get_into(k, o) == size for k, o in zip(keys, outs, strict=True))
            t["redis"].append(time.perf_counter() - t0)
            assert np.array_equal(dst, want)
        for k in keys:
            rtier.delete(k)
    finally:
        for obj in (tier, rtier, pool):
            if obj is not None:
                obj.close()
        a.close()
    row: dict = {"preset": name, "chunk_MB": round(size / 1e6, 2), "chunks": count}
    for k, xs in t.items():
        row[k + "_GBps"] = total / _med(xs) / 1e9
    row["p2p_%raw"] = 100 * row["p2p_GBps"] / row["raw_GBps"]
    row["seconds"] = t
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmtier bench p2p", description=__doc__.split("\n")[0])
    add_batch_args(ap)
    ap.add_argument("--bounce-mib", type=bounded_int(min_value=2), default=256, help="B's registered bounce region")
    a = ap.parse_args(argv)
    presets, counts = batch_scope(a)
    from lmtier.testing.p2p import nixl_missing
    from lmtier.testing.redis import RedisServer, RedisUnavailable

    why = nixl_missing()
    if why is not None:
        print(f"lmtier bench p2p: NIXL is not importable ({why}); bash scripts/setup_nixl.sh")
        return 2
    try:
        redis = RedisServer(extra_args=("--proto-max-bulk-len", str(1 << 30))).start()
    except RedisUnavailable as e:
        print(f"lmtier bench p2p: needs redis-server for the directory: {e}")
        return 2
    rows = []
    try:
        for p in presets:
            for c in counts:
                row = run_case(p, a.chunk_tokens, c, a.iters, a.bounce_mib * MiB, redis.url)
                rows.append(row)
                print(
                    f"  {p} x {c}: raw {row['raw_GBps']:.2f}, p2p {row['p2p_GBps']:.2f} "
                    f"({row['p2p_%raw']:.0f} %), redis {row['redis_GBps']:.2f} GB/s",
                    flush=True,
                )
    finally:
        redis.close()
    sysinfo = system_header()
    print(f"# {sysinfo}")
    print(
        f"P2P fetch over NIXL/UCX (loopback, node A in a child process), {a.chunk_tokens}-token chunks, "
        f"median of {a.iters}; GB/s of payload"
    )
    print_table(rows, ["preset", "chunk_MB", "chunks", "raw_GBps", "p2p_GBps", "p2p_%raw", "redis_GBps"])
    write_json(a.json, {"system": sysinfo, "args": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
