#!/usr/bin/env python3
"""P2P read path A/B in one process: a raw NIXL READ, the tier's read path of another checkout
("old") and this checkout's ("new"), interleaved within each iteration — on a shared box the
same-iteration ratios are far steadier than those of two separate ``lmtier bench p2p`` runs.

Usage (repository root)::

    git archive <commit> | tar -x -C /tmp/old
    PYTHONPATH=. .venv/bin/python benchmarks/p2p_reads_ab.py /tmp/old [--preset smollm2-135m]
        [--count 8] [--iters 31]

Node A (:class:`lmtier.testing.p2p.P2PNode`, a child process) fills its CPU pool with ``count``
256-token chunks of the preset's geometry and publishes them; node B (this process) has one CPU pool
and, on it, two :class:`~lmtier.tiers.p2p.tier.P2PTier` s — one whose read methods are the old
checkout's ``lmtier/tiers/p2p/reads.py`` (its ``PeerReads`` first in the MRO), one this checkout's —
and a plain ``nixl_agent`` (the tier's progress-thread delay) with B's pool registered. Per iteration,
in rotating order: ``raw`` (one READ of A's slots into slots of B's pool reserved for the chunks),
``old`` and ``new`` (``get_many_into`` into such slots: the direct path). Every byte is compared.
Prints GB/s of the medians, % of raw (ratio of medians), the same-iteration ratios to raw (median
[lowest-highest]), and new/old.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import numpy as np

MiB = 1 << 20


def _old_reads(root: str):
    path = os.path.join(root, "lmtier", "tiers", "p2p", "reads.py")
    spec = importlib.util.spec_from_file_location("lmtier_old_p2p_reads", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="root of the other checkout (its lmtier/tiers/p2p/reads.py is 'old')")
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--count", type=int, default=8)
    ap.add_argument("--iters", type=int, default=31)
    a = ap.parse_args()
    from lmtier.bench.p2p import _namespace_fields, _raw_read
    from lmtier.keys import Namespace
    from lmtier.remote_url import parse_redis_url
    from lmtier.testing.p2p import P2PNode, fill_chunks
    from lmtier.testing.procs import free_port
    from lmtier.testing.redis import RedisServer
    from lmtier.tiers.buffers import address_of
    from lmtier.tiers.cpu import CPUPool
    from lmtier.tiers.p2p.directory import Directory
    from lmtier.tiers.p2p.tier import P2PTier
    from lmtier.tiers.p2p.transport import PROGRESS_DELAY_US, import_nixl, new_agent

    old_tier_cls = type("OldP2PTier", (_old_reads(a.old).PeerReads, P2PTier), {})
    fields = _namespace_fields(a.preset, 256)
    ns = Namespace(**fields)
    size, count = ns.chunk_bytes, a.count
    total = size * count
    token = os.urandom(16).hex()
    redis = RedisServer(extra_args=("--proto-max-bulk-len", str(1 << 30))).start()
    values = dict(
        chunk_size=256,
        max_local_cpu_size=(total + count * 4096 + MiB) / 2**30,
        enable_p2p=True,
        p2p_host="127.0.0.1",
        p2p_init_ports=[free_port()],
        p2p_directory_url=redis.url,
        p2p_token_env="P2P_AB_TOKEN",
        p2p_timeout_s=30.0,
    )
    node = P2PNode(values, fields, env={"P2P_AB_TOKEN": token}, start_timeout_s=120)
    tiers = []
    try:
        keys = node.call("fill", count, size, 7, timeout_s=600)
        want = np.concatenate(fill_chunks(count, size, 7)[1])
        endpoint, digest = parse_redis_url(redis.url), ns.digest()[:16]
        pool = CPUPool(count * (size + 4096) + 4096, size, populate="now")
        kw = dict(namespace=digest, token=token.encode(), timeout_s=30.0)
        tiers = [P2PTier(pool, endpoint, node_id="ab-new", **kw), old_tier_cls(pool, endpoint, node_id="ab-old", **kw)]
        d = Directory(endpoint, digest, token=token.encode(), timeout_s=30.0)
        entries = [next(iter(e.items()))[1] for e in d.lookup(keys)]
        rec = d.get_nodes([node.node_id])[node.node_id]
        d.close()
        api = import_nixl()
        raw = new_agent(api, "ab-raw", api.nixl_agent_config(backends=["UCX"]), PROGRESS_DELAY_US)
        raw.register_memory([(pool.arena.data_ptr(), pool.arena.numel(), 0, "")], "DRAM")
        peer = raw.add_remote_agent(rec.metadata)
        peer = peer.decode() if isinstance(peer, bytes) else peer
        remote = [(rec.arena_base + e.offset, e.length, 0) for e in entries]
        whos = ["raw", "old", "new"]
        t: dict[str, list[float]] = {w: [] for w in whos}
        for it in range(1 + a.iters):
            for who in whos[it % 3 :] + whos[: it % 3]:
                slots = [pool.reserve(os.urandom(32)) for _ in range(count)]
                outs = [s.memoryview()[:size] for s in slots]
                for o in outs:
                    np.frombuffer(o, dtype=np.uint8)[:] = 0
                local = [(address_of(o), size, 0) for o in outs]
                t0 = time.perf_counter()
                if who == "raw":
                    _raw_read(raw, peer, local, remote, sleep=False)
                    got = [size] * count
                else:
                    got = tiers[0 if who == "new" else 1].get_many_into(keys, outs)
                dt = time.perf_counter() - t0
                ok = got == [size] * count and all(
                    np.array_equal(np.frombuffer(o, dtype=np.uint8), want[i * size : (i + 1) * size])
                    for i, o in enumerate(outs)
                )
                for s in slots:
                    pool.abort(s)
                assert ok, f"{who}: wrong bytes or misses {got}"
                if it:
                    t[who].append(dt)
        med = {w: statistics.median(xs) for w, xs in t.items()}

        def pairs(num: str, den: str) -> str:
            r = [100 * x / y for x, y in zip(t[num], t[den], strict=True)]
            return f"{statistics.median(r):.0f} [{min(r):.0f}-{max(r):.0f}]"

        cells = "; ".join(
            f"{w} {total / med[w] / 1e9:.2f} GB/s ({100 * med['raw'] / med[w]:.0f} %, pairs {pairs('raw', w)})"
            for w in ("old", "new")
        )
        print(
            f"{a.preset} x {count} ({total / 1e6:.0f} MB), {a.iters} iterations, load {os.getloadavg()[0]:.1f}: "
            f"raw {total / med['raw'] / 1e9:.2f} GB/s; {cells}; new/old speed pairs {pairs('old', 'new')}",
            flush=True,
        )
    finally:
        for tier in tiers:
            tier.close()
        node.close()
        redis.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
