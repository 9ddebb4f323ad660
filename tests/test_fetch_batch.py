"""Batched lower-tier fetches: ``Tier.get_many_into`` / ``batches_gets``, ``CodecTier`` and
``TierManager.fetch_lower_many`` over a batching tier, the connector's ``ChunkFetcher`` groups
(host and device modes), and the Mooncake tier's pipelined sub-batches against a real store."""

from __future__ import annotations

import collections
import os
import threading

import numpy as np
import pytest
import torch

from lmtier.integration.vllm.worker import LoadOp, StoreOp
from lmtier.keys import chunk_keys
from lmtier.manager import TierManager
from lmtier.tiers.base import Tier, TierUsage
from lmtier.tiers.codec import CodecTier
from lmtier.tiers.cpu import CPUPool
from lmtier.tiers.factory import codec_chunk_shape
from tests.test_connector_worker import CHUNK, Cache, _ns, _same_bits, _tokens, _worker


class BatchingTier(Tier):
    """An in-memory remote tier whose ``get_many_into`` is one call (recorded in ``calls``)."""

    name = "remote"

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[bytes, bytes] = {}
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def contains(self, key):
        return bytes(key) in self.data

    def get_into(self, key, out):
        return self.get_many_into([key], [out])[0]

    def get_many_into(self, keys, outs):
        with self.lock:
            self.calls.append(len(keys))
        res = []
        for k, o in zip(keys, outs, strict=True):
            v = self.data.get(bytes(k))
            dst = o.view(-1).view(torch.uint8) if isinstance(o, torch.Tensor) else memoryview(o).cast("B")
            if v is None or len(v) > len(dst):
                res.append(None)
                continue
            if isinstance(o, torch.Tensor):
                dst[: len(v)].copy_(torch.frombuffer(bytearray(v), dtype=torch.uint8))
            else:
                dst[: len(v)] = v
            res.append(len(v))
        return res

    def put(self, key, payload):
        self.data[bytes(key)] = (
            bytes(memoryview(payload).cast("B"))
            if not isinstance(payload, torch.Tensor)
            else (payload.contiguous().view(torch.uint8).numpy().tobytes())
        )
        return True

    def delete(self, key):
        return self.data.pop(bytes(key), None) is not None

    def forget(self, key):
        return False

    def usage(self):
        return TierUsage(1 << 30, sum(map(len, self.data.values())), len(self.data))


class PlainTier(BatchingTier):
    """The same storage without a batched read (the base class's default ``get_many_into``)."""

    def get_into(self, key, out):
        return BatchingTier.get_many_into(self, [key], [out])[0]

    get_many_into = Tier.get_many_into


def test_default_get_many_into_and_batches_gets():
    t = PlainTier()
    t.put(b"a" * 32, b"xyz")
    outs = [bytearray(3), bytearray(3)]
    assert t.get_many_into([b"a" * 32, b"b" * 32], outs) == [3, None] and outs[0] == b"xyz"
    assert t.calls == [1, 1], "one get_into per key"
    assert not t.batches_gets() and BatchingTier().batches_gets()
    with pytest.raises(ValueError, match="2 keys, 1 outs"):
        t.get_many_into([b"a" * 32, b"b" * 32], [bytearray(3)])
    pool = CPUPool(1 << 20, 4096)
    assert not pool.batches_gets()
    pool.close()


def test_codec_tier_batches_only_over_a_batching_inner():
    ns = _ns(torch.bfloat16)
    shape = codec_chunk_shape(ns)
    chunks = [torch.randint(0, 256, (ns.chunk_bytes,), dtype=torch.uint8) for _ in range(5)]
    keys = [os.urandom(32) for _ in chunks]
    for inner, batched in ((BatchingTier(), True), (PlainTier(), False)):
        ct = CodecTier(inner, shape=shape, dtype=ns.kv_dtype, level="lossless", tables=None)
        assert ct.batches_gets() is batched
        assert all(ct.put(k, c) for k, c in zip(keys, chunks, strict=True))
        inner.delete(ct.inner_key(keys[2]))  # a miss in the middle
        inner.calls.clear()
        outs = [torch.zeros(ns.chunk_bytes, dtype=torch.uint8) for _ in chunks]
        got = ct.get_many_into(keys, outs)
        assert got == [ns.chunk_bytes, ns.chunk_bytes, None, ns.chunk_bytes, ns.chunk_bytes]
        assert all(torch.equal(o, c) for i, (o, c) in enumerate(zip(outs, chunks, strict=True)) if i != 2)
        assert not outs[2].any(), "a miss leaves its out untouched"
        assert inner.calls == ([5] if batched else [1] * 5)
        assert ct.counters["hits"] == 4 and ct.counters["misses"] == 1


def test_manager_fetch_lower_many_disk_then_one_remote_call(tmp_path):
    from lmtier.tiers.disk import DiskTier

    disk = DiskTier([str(tmp_path / "d")], 16 << 20, sync="none")
    remote = BatchingTier()
    mgr = TierManager(cpu=None, disk=disk, remote=remote)
    try:
        keys = [os.urandom(32) for _ in range(6)]
        vals = [os.urandom(8192) for _ in range(6)]
        for i in (0, 3):
            assert disk.put(keys[i], vals[i])
        for i in (1, 2, 4):
            remote.put(keys[i], vals[i])
        outs = [bytearray(8192) for _ in range(6)]
        assert mgr.fetch_lower_many(keys, outs) == [8192] * 5 + [None]
        assert [bytes(o) for o in outs[:5]] == vals[:5]
        assert remote.calls == [4], "the disk's misses in one remote call"
        assert mgr.counters["hits_disk"] == 2 and mgr.counters["hits_remote"] == 3 and mgr.counters["misses"] == 1
        assert mgr.fetch_lower(keys[4], bytearray(8192)) == 8192 and remote.calls[-1] == 1
        with pytest.raises(ValueError, match="2 keys, 1 outs"):
            mgr.fetch_lower_many(keys[:2], outs[:1])
    finally:
        mgr.close(persist=False)


def _remote_worker(cache, remote, *, decode_on="host", window=None, pool_slots=16, fetch_batch=4):
    """A ConnectorWorker (2 I/O threads, groups of ``fetch_batch`` chunks: 4, not the default) over a
    CPU pool of ``pool_slots`` chunks and ``remote``."""
    ns = _ns(cache.dtype)
    mgr = TierManager(cpu=CPUPool(pool_slots * (ns.chunk_bytes + 4096), ns.chunk_bytes), remote=remote)
    w, _, _ = _worker(cache, mgr, io_threads=2, decode_on=decode_on, device_window=window, fetch_batch=fetch_batch)
    return w, mgr, ns


def _store_10_chunks_remote_only(w, mgr, cache, ns, seed: int):
    """Store 10 chunks through ``w`` (written through to the remote tier), then drop them from the
    CPU pool; returns (token ids, source blocks, keys)."""
    n = 10 * CHUNK
    toks = _tokens(n, seed=seed)
    src = list(range(n // cache.bs))
    w.store(StoreOp("r1", toks, None, 0, src))
    assert mgr.flush(timeout_s=30)
    keys = chunk_keys(toks, ns)
    assert all(mgr.remote.contains(k) for k in keys)
    for k in keys:
        assert mgr.cpu.delete(k)
    return toks, src, keys


@pytest.mark.parametrize("missing", [None, 6])
def test_host_mode_groups_remote_fetches(missing):
    """10 chunks only in a batching remote tier: fetched in groups of ``fetch_batch`` (4), bit-exact,
    promoted into the pool; a chunk missing from the remote fails it and every later block only."""
    cache = Cache("cpu_slab", "LBHNC", torch.float32, 16, 16, logical_blocks=80)
    remote = BatchingTier()
    w, mgr, ns = _remote_worker(cache, remote)
    try:
        assert w._fetcher.group == 4
        toks, src, keys = _store_10_chunks_remote_only(w, mgr, cache, ns, 31)
        if missing is not None:
            remote.delete(keys[missing])
        remote.calls.clear()
        dst = list(range(40, 80))
        expect = cache.clone()
        good = 10 if missing is None else missing
        expect.scatter_ref(dst, 0, good * CHUNK, cache.ref_rows(src, 0, good * CHUNK))
        failed = w.load(LoadOp("r2", toks, None, 0, dst))
        assert failed == (set() if missing is None else set(dst[missing * CHUNK // cache.bs :]))
        assert _same_bits(cache.buf, expect.buf)
        assert sorted(remote.calls) == [2, 4, 4], "three groups of <= 4 chunks"
        promoted = [mgr.cpu.contains(k) for k in keys]
        assert promoted == [i != missing for i in range(10)]
        assert mgr.cpu.num_pinned() == 0 and not mgr.cpu._pending
    finally:
        w.close()
        mgr.close(persist=False)


def test_host_mode_groups_p2p_fetches_without_a_remote_tier():
    """A P2P-only setup (no remote tier): the batching P2P tier serves the pool's misses, so they
    are fetched in groups of ``fetch_batch`` too (they used to go one chunk per I/O task)."""
    cache = Cache("cpu_slab", "LBHNC", torch.float32, 16, 16, logical_blocks=80)
    peer = BatchingTier()  # stands in for P2PTier: a batched get_many_into
    w1, mgr1, ns = _remote_worker(cache, peer)
    try:
        toks, src, keys = _store_10_chunks_remote_only(w1, mgr1, cache, ns, 33)
    finally:
        w1.close()
        mgr1.close(persist=False)
    peer.name = "p2p"
    peer.on_index_event = lambda ev: None  # the P2P tier's publisher hook
    mgr = TierManager(cpu=CPUPool(16 * (ns.chunk_bytes + 4096), ns.chunk_bytes), p2p=peer)
    w, _, _ = _worker(cache, mgr, io_threads=2, fetch_batch=4)
    try:
        assert mgr.remote is None and w._fetcher.group == 4
        peer.calls.clear()
        dst = list(range(40, 80))
        expect = cache.clone()
        expect.scatter_ref(dst, 0, 10 * CHUNK, cache.ref_rows(src, 0, 10 * CHUNK))
        assert w.load(LoadOp("r2", toks, None, 0, dst)) == set()
        assert _same_bits(cache.buf, expect.buf)
        assert sorted(peer.calls) == [2, 4, 4], "three groups of <= 4 chunks, not ten single fetches"
        assert mgr.counters["hits_p2p"] == 10 and all(mgr.cpu.contains(k) for k in keys)
    finally:
        w.close()
        mgr.close(persist=False)


def test_device_mode_groups_within_the_window():
    """Device-staging mode (CPU "device") over CodecTier(batching remote): groups of <= 4 chunks,
    never more than ``window`` staging buffers, bit-exact."""
    cache = Cache("kv", "LBNHC", torch.bfloat16, 16, 16, logical_blocks=80)
    ns = _ns(cache.dtype)
    remote = BatchingTier()
    ct = CodecTier(remote, shape=codec_chunk_shape(ns), dtype=ns.kv_dtype, level="lossless", tables=None)
    w, mgr, _ = _remote_worker(cache, ct, decode_on="device", window=8)
    try:
        assert w.device_staging and w._fetcher.group == 4
        toks, src, _ = _store_10_chunks_remote_only(w, mgr, cache, ns, 32)
        n = 10 * CHUNK
        remote.calls.clear()
        dst = list(range(40, 80))
        expect = cache.clone()
        expect.scatter_ref(dst, 0, n, cache.ref_rows(src, 0, n))
        assert w.load(LoadOp("r2", toks, None, 0, dst)) == set()
        assert _same_bits(cache.buf, expect.buf)
        assert sum(remote.calls) == 10 and max(remote.calls) <= 4 and len(remote.calls) <= 5, remote.calls
        assert mgr.counters["load_device_staging_allocs"] <= 8
        assert w._fetcher._dev_staging.in_use == 0
    finally:
        w.close()
        mgr.close(persist=False)


# ---------------------------------------------------------------- Mooncake: pipelined sub-batches


class CountingClient:
    """Wraps the tier's real client and counts its batch calls (test spy)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: collections.Counter = collections.Counter()
        self.sizes: list[int] = []

    def batch_get_into(self, names, ptrs, sizes):
        self.calls["batch_get_into"] += 1
        self.sizes.append(len(names))
        return self.inner.batch_get_into(names, ptrs, sizes)

    def batch_put_from(self, names, ptrs, sizes):
        self.calls["batch_put_from"] += 1
        return self.inner.batch_put_from(names, ptrs, sizes)

    def batch_is_exist(self, names):
        self.calls["batch_is_exist"] += 1
        return self.inner.batch_is_exist(names)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_mooncake_pipelined_batches_exact(mooncake_store, depth):
    from lmtier.tiers.mooncake import MooncakeSettings, MooncakeTier

    t = MooncakeTier(
        mooncake_store.url,
        MooncakeSettings(mooncake_store.master.address, global_segment_size=0),
        timeout_s=10.0,
        bounce_bytes=64 << 20,
        pipeline_depth=depth,
    )
    try:
        spy = CountingClient(t._client())
        t._store = spy
        n, size = 12, 3 << 20  # 36 MiB: sub-batches of 9 MiB (3 records) when pipelined
        keys = [os.urandom(32) for _ in range(n)]
        data = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes() for i in range(n)]
        assert t.put_many(keys, data) == [True] * n
        assert spy.calls["batch_is_exist"] == 1, "one confirmation for the whole put_many"
        assert spy.calls["batch_put_from"] == (1 if depth == 1 else 4)
        t.delete(keys[5])
        outs = [bytearray(size) for _ in range(n)]
        got = t.get_many_into(keys, outs)
        assert got == [size if i != 5 else None for i in range(n)]
        assert all(bytes(outs[i]) == data[i] for i in range(n) if i != 5)
        assert spy.sizes == ([n] if depth == 1 else [3, 3, 3, 3])
        assert t.counters["hits"] == n - 1 and t.counters["misses"] == 1 and t.counters["corrupt"] == 0
    finally:
        t.close()


def test_mooncake_pipelined_corrupt_record_is_a_miss_and_removed(mooncake_store):
    from lmtier.tiers.mooncake import MooncakeSettings, MooncakeTier

    t = MooncakeTier(
        mooncake_store.url,
        MooncakeSettings(mooncake_store.master.address, global_segment_size=0),
        timeout_s=10.0,
        bounce_bytes=64 << 20,
    )
    try:
        n, size = 8, 3 << 20
        keys = [os.urandom(32) for _ in range(n)]
        data = [os.urandom(size) for _ in range(n)]
        assert all(t.put_many(keys, data))
        # replace record 6 with record 1's value (a valid record of another key)
        client = t._client()
        outs = [bytearray(size) for _ in range(n)]
        assert t.get_many_into([keys[1]], [outs[1]]) == [size]
        from lmtier import record as rec

        other = rec.encode_header(keys[1], size, rec.payload_checksum(data[1]), payload_offset=128) + data[1]
        assert client.remove("lmtier:" + keys[6].hex(), True) == 0
        assert client.put("lmtier:" + keys[6].hex(), other) == 0
        got = t.get_many_into(keys, outs)
        assert got == [size if i != 6 else None for i in range(n)]
        assert t.counters["corrupt"] == 1 and t.contains_many(keys) == [i != 6 for i in range(n)]
        assert all(bytes(outs[i]) == data[i] for i in range(n) if i != 6)
    finally:
        t.close()
