"""P2P chunk fetch bandwidth (NIXL over UCX) beside NIXL's raw READ of the same bytes and the Redis
tier, same run.

Usage::

    lmtier bench p2p [--presets smollm2-135m,llama-3.1-8b] [--counts 8,32] [--iters 5]
        [--chunk-tokens 256] [--bounce-mib 256] [--modes direct,bounce] [--no-redis] [--quick]
        [--json out.json]

Starts a private ``redis-server`` (the P2P directory, and the Redis tier's store) and node A, a
:class:`~lmtier.manager.TierManager` with P2P sharing in a child process
(:class:`lmtier.testing.p2p.P2PNode`), whose CPU pool it fills with ``count`` random chunks of
``chunk_tokens`` tokens of the preset's KV geometry (SmolLM2: 5.9 MB, Llama-3.1-8B: 32 MiB) and
publishes. In this process (node B), per preset and count:

* ``raw``: one NIXL READ (``initialize_xfer`` + ``transfer`` + polling ``check_xfer_state``) of the
  same slots of A's registered arena into slots of B's CPU pool reserved for the chunks (the memory
  ``direct`` writes: B's pool arena is registered with this agent too), by a plain ``nixl_agent``
  that loaded A's published metadata: no directory, no checksum, no copy — the ceiling. (Into a
  THP-backed NumPy buffer, the destination before 2026-12-03, the same READ took ~1.4x as long on
  the CPU box: benchmarks/RESULTS.md §3.5.) Its progress thread
  pauses :data:`~lmtier.tiers.p2p.transport.PROGRESS_DELAY_US` between idle polls, as the tier's
  agents do (the wheel's default, 0, busy-polls: that thread would take CPU from the tier's runs). Polled two ways, both
  timed: ``raw_spin`` (``check_xfer_state`` in a tight loop) and ``raw_sleep`` (sleeps of 20 µs
  doubling to 1 ms between polls, as the tier's transport does); the ceiling is the faster one;
* ``direct`` (the product path): :meth:`P2PTier.get_many_into` into slots of B's CPU pool reserved
  for the chunks (what the connector's fetches and the manager's promotions pass): one pipelined
  directory lookup, READs straight into the slots (sub-batches, pipelined), xxh3 of every chunk
  against its entry in the slot;
* ``bounce`` (with ``--modes``): the same into a plain buffer outside the pool — READs into the
  registered bounce region, the copy into the buffer, the xxh3 there;
* ``memcpy``: one host copy (``np.copyto``, one thread) of the same bytes into the same buffer, in
  this process: the memory ceiling of the host, same run;
* ``redis``: :class:`RedisTier` ``get_into`` of the same chunks one after another (the tier manager's
  remote path) against the private redis-server (``--no-redis``: skipped).

The contenders alternate within each iteration, each iteration starting with the next of them
(:func:`~lmtier.bench.common.interleaved`). GB/s = payload bytes / wall time of the whole batch;
median of ``--iters`` after one untimed warm-up; ``%raw`` = ratio of medians to the faster raw
poll, ``pairs`` the median [lowest-highest] of the same-iteration ratios to it
(:func:`~lmtier.bench.common.pairs_summary`; on a shared box the figure to read), ``%raw_best``
the ratio of the fastest iterations (interference only adds time); ``cpu_ms``: CPU time of B and A
during the batch (:func:`~lmtier.bench.common.cpu_seconds`), median. Every fetched byte is compared
with the expected chunk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from lmtier.bench.args import bounded_int, name_list
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
from lmtier.tiers.buffers import address_of

MiB = 1 << 20
TOKEN_ENV = "P2P_BENCH_TOKEN"
MODES = ("direct", "bounce")


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


def _raw_read(
    agent, peer: str, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]], *, sleep: bool
) -> None:
    h = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), peer)
    try:
        state = agent.transfer(h)
        pause = 20e-6
        while state == "PROC":
            if sleep:
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
            state = agent.check_xfer_state(h)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ: {state}")
    finally:
        h.release()


def run_case(
    name: str,
    chunk_tokens: int,
    count: int,
    iters: int,
    bounce_bytes: int,
    redis_url: str,
    *,
    modes: tuple[str, ...] = ("direct",),
    with_redis: bool = True,
) -> dict:
    """One (preset, count) case: node A in a child process, B's tier, the raw agent and the Redis
    tier here; returns the row (GB/s medians, ratios, CPU milliseconds, per-iteration seconds)."""
    from lmtier.keys import Namespace
    from lmtier.remote_url import parse_redis_url
    from lmtier.testing.p2p import P2PNode, fill_chunks
    from lmtier.testing.procs import free_port
    from lmtier.tiers.cpu import CPUPool
    from lmtier.tiers.p2p.directory import Directory
    from lmtier.tiers.p2p.tier import P2PTier
    from lmtier.tiers.p2p.transport import PROGRESS_DELAY_US, import_nixl, new_agent
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
    whos = ["raw_spin", "raw_sleep", *modes, "memcpy"] + (["redis"] if with_redis else [])
    t: dict[str, list[float]] = {w: [] for w in whos}
    cpu: dict[str, list[float]] = {w: [] for w in whos}
    try:
        keys = a.call("fill", count, size, seed, timeout_s=600)
        if keys is None:
            raise RuntimeError("node A could not store and publish its chunks")
        _, expect = fill_chunks(count, size, seed)
        want = np.concatenate(expect)
        del expect
        dst = np.zeros(total, dtype=np.uint8)
        buf_outs = [memoryview(dst[i * size : (i + 1) * size]) for i in range(count)]
        # B's own pool: registered and published like any node's; the direct mode reads into its slots
        pool = CPUPool(count * (size + 4096) + 4096, size, populate="now")
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
        # the tier's progress-thread delay (a busy-polling thread here would slow the tier's runs too)
        raw = new_agent(api, "bench-raw", api.nixl_agent_config(backends=["UCX"]), PROGRESS_DELAY_US)
        raw.register_memory([(pool.arena.data_ptr(), pool.arena.numel(), 0, "")], "DRAM")
        peer = raw.add_remote_agent(rec.metadata)
        peer = peer.decode() if isinstance(peer, bytes) else peer
        remote = [(rec.arena_base + e.offset, e.length, 0) for _, e in entries]
        if with_redis:
            rtier = RedisTier(redis_url, timeout_s=30.0)
            for k, o in zip(keys, np.split(want, count), strict=True):
                assert rtier.put(k, memoryview(o))
        pids = [os.getpid(), a.proc.pid]
        for it in range(1 + iters):
            if it == 1:
                for xs in (*t.values(), *cpu.values()):
                    xs.clear()
            for who in interleaved(whos, it):
                # raw and direct write the same kind of memory: slots of B's pool reserved for the chunks
                into_slots = who == "direct" or who.startswith("raw")
                slots = [pool.reserve(os.urandom(32)) for _ in range(count)] if into_slots else []
                outs = [s.memoryview()[:size] for s in slots] if slots else buf_outs
                local = [(address_of(o), size, 0) for o in outs]
                for o in outs:
                    np.frombuffer(o, dtype=np.uint8)[:] = 0
                c0, t0 = cpu_seconds(pids), time.perf_counter()
                if who.startswith("raw"):
                    _raw_read(raw, peer, local, remote, sleep=who == "raw_sleep")
                    got = [size] * count
                elif who == "memcpy":  # the host's copy ceiling: the same bytes, one thread, this process
                    np.copyto(dst, want)
                    got = [size] * count
                elif who == "redis":
                    got = [rtier.get_into(k, o) for k, o in zip(keys, outs, strict=True)]
                else:
                    got = tier.get_many_into(keys, outs)
                t[who].append(time.perf_counter() - t0)
                c1 = cpu_seconds(pids)
                if c0 is not None and c1 is not None:
                    cpu[who].append(c1 - c0)
                ok = got == [size] * count and all(
                    np.array_equal(np.frombuffer(o, dtype=np.uint8), want[i * size : (i + 1) * size])
                    for i, o in enumerate(outs)
                )
                for s_ in slots:
                    pool.abort(s_)
                assert ok, f"{who}: wrong bytes or misses {got} {dict(tier.counters)}"
        if rtier is not None:
            for k in keys:
                rtier.delete(k)
    finally:
        for obj in (tier, rtier, pool):
            if obj is not None:
                obj.close()
        a.close()
    row: dict = {"preset": name, "chunk_MB": round(size / 1e6, 2), "chunks": count}
    gbps = {w: [total / x / 1e9 for x in xs] for w, xs in t.items()}
    for w, xs in gbps.items():
        row[w + "_GBps"] = _med(xs)
        row[w + "_best_GBps"] = max(xs)
        row[w + "_cpu_ms"] = round(1e3 * _med(cpu[w]), 1) if cpu[w] else None
    best = [max(x, y) for x, y in zip(gbps["raw_spin"], gbps["raw_sleep"], strict=True)]
    row["raw_GBps"] = max(row["raw_spin_GBps"], row["raw_sleep_GBps"])
    row["raw_best_GBps"] = max(best)
    for m in modes:
        r = pair_ratios(gbps[m], best)
        row[f"{m}_%raw"] = 100 * row[f"{m}_GBps"] / row["raw_GBps"]
        row[f"{m}_pairs"] = pairs_summary(r)
        row[f"{m}_%raw_best"] = 100 * row[f"{m}_best_GBps"] / row["raw_best_GBps"]
    row["p2p_%raw"] = row[f"{modes[0]}_%raw"]
    row["seconds"] = t
    row["cpu_seconds"] = cpu
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lmtier bench p2p", description=__doc__.split("\n")[0])
    add_batch_args(ap)
    ap.add_argument("--bounce-mib", type=bounded_int(min_value=2), default=256, help="B's registered bounce region")
    ap.add_argument(
        "--modes",
        type=name_list(MODES),
        default=["direct"],
        help="tier data paths, comma-separated: direct (the product's: into B's pool slots), bounce (a plain buffer)",
    )
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis tier column")
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
                row = run_case(
                    p, a.chunk_tokens, c, a.iters, a.bounce_mib * MiB, redis.url, modes=tuple(a.modes),
                    with_redis=not a.no_redis,
                )  # fmt: skip
                rows.append(row)
                write_json(a.json, {"system": system_header(), "args": vars(a), "rows": rows})  # so far
                m = a.modes[0]
                print(
                    f"  {p} x {c}: raw {row['raw_GBps']:.2f} (spin {row['raw_spin_GBps']:.2f}, sleep "
                    f"{row['raw_sleep_GBps']:.2f}), {m} {row[m + '_GBps']:.2f} ({row[m + '_%raw']:.0f} %, "
                    f"pairs {row[m + '_pairs']}), memcpy {row['memcpy_GBps']:.2f}"
                    + (f", redis {row['redis_GBps']:.2f}" if not a.no_redis else "")
                    + " GB/s",
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
    cols = ["preset", "chunk_MB", "chunks", "raw_spin_GBps", "raw_sleep_GBps"]
    for m in a.modes:
        cols += [f"{m}_GBps", f"{m}_%raw", f"{m}_pairs", f"{m}_%raw_best"]
    cols += ["memcpy_GBps"] + ([] if a.no_redis else ["redis_GBps"])
    cols += [f"{w}_cpu_ms" for w in ("raw_spin", "raw_sleep", *a.modes)]
    print_table(rows, cols)
    write_json(a.json, {"system": sysinfo, "args": vars(a), "rows": rows})
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
