"""Tests for lmtier.manager: lookup, async store, retrieve with promotion, write-back, helpers."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from lmtier.config import GIB, ConfigError, LMTierConfig
from lmtier.hf import KVCacheStore, pack_kv_chunk, unpack_kv_chunk
from lmtier.keys import Namespace
from lmtier.manager import TierManager
from lmtier.tiers.base import Tier, TierUsage
from lmtier.tiers.cpu import CPUPool


def K(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=32).digest()


def data(i: int, n: int = 3000) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


class MemTierOneByOne(Tier):
    """In-memory Tier for tests (lookups one key at a time); optional failure injection and latency."""

    def __init__(self, name: str, *, fail: bool = False, delay_s: float = 0.0):
        super().__init__()
        self.name = name
        self.fail = fail
        self.delay_s = delay_s
        self.store: dict[bytes, bytes] = {}
        self.lock = threading.Lock()
        self.calls = {"contains": 0, "contains_many": 0, "put": 0, "get": 0}

    def _maybe_fail(self):
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError(f"{self.name} down")

    def contains(self, key):
        self.calls["contains"] += 1
        self._maybe_fail()
        with self.lock:
            return key in self.store

    def get_into(self, key, out):
        self.calls["get"] += 1
        self._maybe_fail()
        with self.lock:
            v = self.store.get(key)
        if v is None:
            return None
        if isinstance(out, torch.Tensor):
            out.reshape(-1).view(torch.uint8)[: len(v)].copy_(torch.frombuffer(bytearray(v), dtype=torch.uint8))
        else:
            memoryview(out).cast("B")[: len(v)] = v
        return len(v)

    def put(self, key, payload):
        self.calls["put"] += 1
        self._maybe_fail()
        if isinstance(payload, torch.Tensor):
            b = bytes(payload.reshape(-1).view(torch.uint8).cpu().numpy())
        else:
            b = bytes(memoryview(payload).cast("B"))
        with self.lock:
            self.store[key] = b
        return True

    def delete(self, key):
        with self.lock:
            return self.store.pop(key, None) is not None

    def forget(self, key):
        return self.delete(key)

    def usage(self):
        with self.lock:
            return TierUsage(0, sum(map(len, self.store.values())), len(self.store))


class MemTier(MemTierOneByOne):
    """:class:`MemTierOneByOne` with a batched ``contains_many`` (one "round trip")."""

    def contains_many(self, keys):
        self.calls["contains_many"] += 1
        self._maybe_fail()
        with self.lock:
            return [k in self.store for k in keys]


def make_pool(num_slots=4, chunk_bytes=4096) -> CPUPool:
    return CPUPool(num_slots * 4096, chunk_bytes, arena=torch.empty(num_slots * 4096, dtype=torch.uint8))


def test_store_retrieve_cpu_roundtrip():
    with TierManager(cpu=make_pool()) as m:
        assert m.store(K(0), data(0)).result(10) is True
        assert m.lookup([K(0), K(1)]) == ["cpu"]
        out = bytearray(4096)
        assert m.retrieve_into(K(0), out) == 3000 and bytes(out[:3000]) == data(0)
        assert m.retrieve(K(1), out) is False
        t = torch.zeros(3000, dtype=torch.uint8)
        assert m.retrieve(K(0), t) and bytes(t.numpy()) == data(0)
        assert m.store(K(0), data(0)).result(10) is True  # already present
        assert m.counters["store_present"] == 1


@pytest.mark.parametrize(
    "payload",
    [
        lambda: torch.arange(750, dtype=torch.float32),
        lambda: np.arange(750, dtype=np.float32),
        lambda: bytearray(np.arange(750, dtype=np.float32).tobytes()),
        lambda: memoryview(np.arange(750, dtype=np.float32).tobytes()),
    ],
    ids=["tensor", "numpy", "bytearray", "memoryview"],
)
def test_store_accepts_tensors_and_buffers(payload):
    with TierManager(cpu=make_pool()) as m:
        assert m.store(K(1), payload()).result(10)
        out = torch.empty(750, dtype=torch.float32)
        assert m.retrieve(K(1), out) and torch.equal(out, torch.arange(750, dtype=torch.float32))


def test_store_and_retrieve_errors():
    m = TierManager(cpu=make_pool(chunk_bytes=100))
    with pytest.raises(ValueError):
        m.store(K(0), b"x" * 101)
    with pytest.raises(ValueError):
        m.store(K(0), b"")
    with pytest.raises(TypeError):
        m.store(b"short", b"x")
    with pytest.raises(TypeError):
        m.store(K(0), 5)
    m.store(K(0), b"x" * 50).result(10)
    with pytest.raises(ValueError, match="out has"):
        m.retrieve(K(0), bytearray(10))
    m.close()
    with pytest.raises(RuntimeError, match="closed"):
        m.store(K(1), b"x")
    with pytest.raises(RuntimeError, match="closed"):
        m.lookup([K(0)])
    m.close()  # idempotent
    with pytest.raises(ValueError):
        TierManager(cpu=None)


def test_lookup_longest_prefix_across_tiers():
    disk, remote = MemTier("disk"), MemTier("remote")
    m = TierManager(cpu=make_pool(), disk=disk, remote=remote)
    m.store(K(0), data(0)).result(10)
    disk.store[K(1)] = data(1)
    remote.store[K(2)] = data(2)
    remote.store[K(3)] = data(3)
    remote.store[K(5)] = data(5)  # after a gap: not part of the prefix
    assert m.lookup([K(i) for i in range(6)]) == ["cpu", "disk", "remote", "remote"]
    assert remote.calls["contains_many"] == 1 and remote.calls["contains"] == 0  # one round trip
    assert m.lookup([K(9), K(0)]) == []
    assert m.lookup([]) == []
    m.close(persist=False)


def test_lookup_remote_without_contains_many_stops_at_first_miss():
    remote = MemTierOneByOne("remote")
    m = TierManager(cpu=make_pool(), remote=remote)
    for i in range(3):
        remote.store[K(i)] = data(i)
    assert m.lookup([K(0), K(1), K(7), K(2)]) == ["remote", "remote"]
    assert remote.calls["contains"] == 3
    m.close()


def test_failing_lower_tiers_are_misses():
    disk, remote = MemTier("disk", fail=True), MemTier("remote", fail=True)
    m = TierManager(cpu=make_pool(), disk=disk, remote=remote)
    assert m.lookup([K(0)]) == []
    assert m.retrieve(K(0), bytearray(4096)) is False
    assert m.store(K(0), data(0)).result(10) is True  # CPU still works
    m.flush(10)
    assert m.counters["remote_put_failures"] == 1 and m.counters["tier_errors"] >= 3
    m.close(persist=False)


def test_remote_write_through_is_async_and_reads_from_cpu():
    remote = MemTier("remote")
    m = TierManager(cpu=make_pool(), remote=remote)
    for i in range(3):
        m.store(K(i), data(i))
    assert m.flush(10)
    assert remote.store == {K(i): data(i) for i in range(3)}
    assert m.cpu.num_pinned() == 0
    m.close()


def test_disk_write_back_on_eviction_and_promotion():
    disk = MemTier("disk")
    pool = make_pool(num_slots=2)
    m = TierManager(cpu=pool, disk=disk)
    for i in range(2):
        m.store(K(i), data(i)).result(10)
    assert disk.store == {}  # write-back, not write-through
    m.store(K(2), data(2)).result(10)  # evicts K(0) -> disk
    assert disk.store == {K(0): data(0)} and m.counters["written_back"] == 1
    assert m.lookup([K(0), K(1), K(2)]) == ["disk", "cpu", "cpu"]
    out = bytearray(4096)
    assert m.retrieve_into(K(0), out) == 3000 and bytes(out[:3000]) == data(0)
    assert m.counters["hits_disk"] == 1 and m.counters["promotions"] == 1
    assert pool.contains(K(0))  # promoted; K(1) was evicted (written back) to make room
    assert disk.store.keys() == {K(0), K(1)}
    assert m.lookup([K(0), K(1), K(2)]) == ["cpu", "disk", "cpu"]
    m.close(persist=True)
    assert disk.store.keys() == {K(0), K(1), K(2)}  # close persisted the CPU-only chunk


def test_no_write_back_evicts_without_writing_in_the_caller():
    """Inside no_write_back a reserve that evicts never writes the victim to disk in this thread: a
    victim the disk holds stays a disk chunk, one it does not is dropped (counted); outside, the
    same eviction writes back as before."""
    disk = MemTier("disk")
    pool = make_pool(num_slots=2)
    m = TierManager(cpu=pool, disk=disk)
    events = []
    m.add_listener(lambda e: events.append((e.kind.name, e.key, e.tier)))
    for i in range(2):
        m.store(K(i), data(i)).result(10)
    disk.store[K(1)] = data(1)  # K(1) written through already, K(0) not
    puts = disk.calls["put"]
    with m.no_write_back():
        for i in (2, 3):  # evicts K(0), then K(1)
            slot = pool.reserve(K(i))
            slot.view[:3000].numpy()[:] = np.frombuffer(data(i), np.uint8)
            m.commit(slot, 3000, promoted=True)
    assert disk.calls["put"] == puts and K(0) not in disk.store
    assert m.counters["write_back_skipped"] == 1 and m.counters["written_back"] == 0
    assert ("EVICTED", K(0), None) in events and ("EVICTED", K(1), "disk") in events
    assert m.lookup([K(0)]) == [] and m.lookup([K(1), K(2), K(3)]) == ["disk", "cpu", "cpu"]
    m.store(K(4), data(4)).result(10)  # a store thread, outside the block: evicts K(2) -> disk
    assert disk.store.get(K(2)) == data(2) and m.counters["written_back"] == 1
    m.close(persist=False)


def test_queued_write_through_does_not_hold_back_new_chunks():
    """A write-through waiting in the queue does not pin its chunk: a store in the step (inside
    no_write_back) evicts it instead of waiting or refusing the new chunk; the write, when its turn
    comes, skips the evicted chunk (counted) and writes the ones still in the pool."""
    gate, running = threading.Event(), threading.Event()

    class SlowDisk(MemTier):
        def put(self, key, payload):
            running.set()
            assert gate.wait(10)
            return super().put(key, payload)

    disk = SlowDisk("disk")
    pool = make_pool(num_slots=2)
    m = TierManager(cpu=pool, disk=disk, store_threads=1)

    def put_in_step(i):
        with m.no_write_back():
            slot = pool.reserve(K(i))
        assert slot is not None, i
        slot.view[:3000].numpy()[:] = np.frombuffer(data(i), np.uint8)
        m.commit(slot, 3000)  # queues the write-through

    put_in_step(0)
    assert running.wait(10)  # K(0)'s write runs (K(0) pinned by it), the only store thread is busy
    put_in_step(1)  # K(1)'s write waits in the queue
    put_in_step(2)  # the pool is full: evicts K(1), not the pinned K(0), and does not wait
    assert m.counters["write_back_skipped"] == 1 and m.lookup([K(1)]) == []
    gate.set()
    assert m.flush(10)
    assert disk.store == {K(0): data(0), K(2): data(2)} and m.counters["disk_skipped_evicted"] == 1
    assert m.lookup([K(0), K(2)]) == ["cpu", "cpu"] and pool.num_pinned() == 0
    m.close(persist=False)


def test_remote_hit_promoted_into_cpu():
    remote = MemTier("remote")
    remote.store[K(5)] = data(5)
    m = TierManager(cpu=make_pool(), remote=remote)
    t = torch.zeros(3000, dtype=torch.uint8)
    assert m.retrieve(K(5), t) and bytes(t.numpy()) == data(5)
    assert m.cpu.contains(K(5)) and m.lookup([K(5)]) == ["cpu"]
    m.close()


def test_backpressure_pinned_pool_falls_back_to_disk():
    disk = MemTier("disk")
    pool = make_pool(num_slots=1)
    m = TierManager(cpu=pool, disk=disk)
    m.store(K(0), data(0)).result(10)
    r = pool.acquire(K(0))  # a reader pins the only slot
    assert m.store(K(1), data(1)).result(10) is True
    assert disk.store.get(K(1)) == data(1) and m.counters["cpu_backpressure"] == 1
    pool.release(r)
    m.close(persist=False)


def test_backpressure_without_lower_tier_drops():
    pool = make_pool(num_slots=1)
    m = TierManager(cpu=pool)
    m.store(K(0), data(0)).result(10)
    r = pool.acquire(K(0))
    assert m.store(K(1), data(1)).result(10) is False
    pool.release(r)
    m.close()


def test_store_queue_bound_drops_without_blocking():
    disk = MemTier("disk", delay_s=0.2)
    m = TierManager(cpu=None, disk=disk, store_threads=1, max_pending_stores=2)
    t0 = time.monotonic()
    futs = [m.store(K(i), data(i)) for i in range(5)]
    assert time.monotonic() - t0 < 0.15  # never blocked the caller
    results = [f.result(10) for f in futs]
    assert results == [True, True, False, False, False]
    assert m.counters["store_dropped_queue_full"] == 3
    # With timeout_s=None the caller waits for room instead of dropping.
    futs = [m.store(K(10 + i), data(i), timeout_s=None) for i in range(3)]
    assert all(f.result(10) for f in futs)
    m.close()


def test_no_cpu_writes_through():
    disk, remote = MemTier("disk"), MemTier("remote")
    m = TierManager(cpu=None, disk=disk, remote=remote)
    assert m.store(K(0), data(0)).result(10)
    assert disk.store[K(0)] == remote.store[K(0)] == data(0)
    out = bytearray(3000)
    assert m.retrieve(K(0), out) and bytes(out) == data(0)
    m.close()


def test_store_in_names_the_tier_that_took_the_chunk():
    """``store_in`` tells the tier its ``STORED`` event names: the pool (new or present), the disk
    tier, the remote tier when the disk write failed, None when every tier failed; ``store`` the
    same as a bool."""
    pool = make_pool(num_slots=1)
    disk, remote = MemTier("disk"), MemTier("remote")
    m = TierManager(cpu=pool, disk=disk, remote=remote)
    assert m.store_in(K(0), data(0)).result(10) == "cpu"
    assert m.store_in(K(0), data(0)).result(10) == "cpu"  # present already
    r = pool.acquire(K(0))  # every slot pinned: written through now
    assert m.store_in(K(1), data(1)).result(10) == "disk"
    disk.put = lambda *a, **k: False
    assert m.store_in(K(2), data(2)).result(10) == "remote" and K(2) in remote.store
    remote.put = lambda *a, **k: False
    assert m.store_in(K(3), data(3)).result(10) is None
    assert m.store(K(4), data(4)).result(10) is False and m.counters["store_dropped"] == 2
    pool.release(r)
    m.close(persist=False)
    m = TierManager(cpu=None, disk=None, remote=MemTier("remote"))
    assert m.store_in(K(0), data(0)).result(10) == "remote"
    assert m.store(K(1), data(1)).result(10) is True
    m.close()


def test_cancelled_store_gives_back_its_room_and_passes_on():
    """A store cancelled while queued does not run and gives back its queue room (``flush`` and
    ``close`` do not wait for it); ``store``'s future of it is cancelled too, and cancelling that
    future cancels the queued store."""
    disk = MemTier("disk", delay_s=0.3)
    m = TierManager(cpu=None, disk=disk, store_threads=1, max_pending_stores=3)
    first = m.store_in(K(0), data(0))  # runs (the only thread, slow tier)
    queued = m.store_in(K(1), data(1))
    told = m.store(K(2), data(2))
    assert queued.cancel() and told.cancel()
    assert first.result(10) == "disk" and m.flush(10)
    assert K(1) not in disk.store and K(2) not in disk.store
    assert [m.store(K(3 + i), data(i)).result(10) for i in range(3)] == [True] * 3  # the room is back
    m.close()


def test_store_future_passes_on_an_exception():
    from lmtier.manager import _stored

    inner = Future()
    out = _stored(inner)
    inner.set_exception(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        out.result(1)
    inner = Future()
    out = _stored(inner)
    assert inner.cancel() and out.cancelled()


def test_concurrent_store_retrieve_same_prefix():
    disk = MemTier("disk")
    pool = make_pool(num_slots=3)
    m = TierManager(cpu=pool, disk=disk, store_threads=3)
    expected = {K(i): data(i, 1000 + 100 * i) for i in range(10)}
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(150):
            i = rng.randrange(10)
            if rng.random() < 0.5:
                m.store(K(i), expected[K(i)], timeout_s=None)
            else:
                buf = bytearray(4096)
                n = m.retrieve_into(K(i), buf)
                if n is not None and bytes(buf[:n]) != expected[K(i)]:
                    errors.append(i)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert m.flush(30)
    assert errors == []
    assert pool.num_pinned() == 0
    assert pool.usage().used_bytes <= pool.num_slots * pool.slot_bytes
    for k, v in disk.store.items():
        assert v == expected[k]
    m.close(persist=False)


def test_from_config_builds_tiers_and_checks_chunk_size(tmp_path):
    ns = Namespace(model="m", num_layers=2, num_kv_heads=2, head_size=8, kv_dtype="float16", chunk_size=16)
    cfg = LMTierConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 64 * 4096 / 2**30})
    made = {}

    def disk_factory(disk_cfg, namespace, gpu_id):
        made["disk"] = (disk_cfg.paths_for(gpu_id), namespace)
        return MemTier("disk")

    m = TierManager.from_config(cfg, ns, arena=torch.empty(64 * 4096, dtype=torch.uint8))
    assert m.cpu.num_slots == 64 and m.cpu.chunk_bytes == ns.chunk_bytes and m.disk is None and m.remote is None
    m.close()
    cfg2 = LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "max_local_cpu_size": 64 * 4096 / 2**30,
            "local_disk": f"file://{tmp_path}/a,file://{tmp_path}/b",
            "max_local_disk_size": 1,
            "local_disk_path_sharding": "by_gpu",
        }
    )
    m = TierManager.from_config(
        cfg2, ns, gpu_id=1, arena=torch.empty(64 * 4096, dtype=torch.uint8), disk_factory=disk_factory
    )
    assert made["disk"] == ((f"{tmp_path}/b",), ns) and m.disk is not None
    m.close(persist=False)
    with pytest.raises(ConfigError, match="chunk_size"):
        TierManager.from_config(LMTierConfig.from_dict({"chunk_size": 32}), ns)
    with pytest.raises(ConfigError, match="max_local_cpu_size"):
        TierManager.from_config(LMTierConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 1e-9}), ns)


def test_from_config_refuses_unusable_tiers_with_config_errors(tmp_path, monkeypatch):
    """Each case used to be a bare ValueError / OSError from inside a tier, or a disk tier that
    silently dropped every store."""
    ns = Namespace(model="m", num_layers=2, num_kv_heads=2, head_size=8, kv_dtype="float16", chunk_size=16)
    no_cpu = {"chunk_size": 16, "local_cpu": False, "max_local_cpu_size": 0}
    with pytest.raises(ConfigError, match="no tier is enabled"):  # was "TierManager: at least one tier"
        TierManager.from_config(LMTierConfig.from_dict(no_cpu), ns)
    record = 4096 + 4096  # header page + the 1 KiB chunk rounded up to a page
    small = {**no_cpu, "local_disk": str(tmp_path / "d"), "max_local_disk_size": (record - 1) / GIB}
    with pytest.raises(ConfigError, match=f"max_local_disk_size=.*cannot hold one record of {record} bytes"):
        TierManager.from_config(LMTierConfig.from_dict(small), ns)
    with TierManager.from_config(LMTierConfig.from_dict({**small, "max_local_disk_size": record / GIB}), ns) as m:
        assert m.store(b"k" * 32, torch.ones(ns.chunk_bytes, dtype=torch.uint8), timeout_s=None).result()
    # a lookups-only P2P tier is a tier: the vLLM scheduler's view of a P2P-only config has no CPU pool
    from lmtier.tiers.p2p import tier as p2p_tier

    monkeypatch.setattr(p2p_tier.P2PTier, "from_config", staticmethod(lambda settings, namespace, cpu: MemTier("p2p")))
    p2p = LMTierConfig.from_dict(
        {"chunk_size": 16, "enable_p2p": True, "p2p_host": "h", "p2p_init_ports": [1]}
        | {"p2p_directory_url": "redis://d", "p2p_allowed_peers": "a"}
    )
    p2p = dataclasses.replace(p2p, cpu=dataclasses.replace(p2p.cpu, enabled=False))
    with TierManager.from_config(p2p, ns) as m:
        assert m.cpu is None and m.p2p is not None
    codec = {**no_cpu, "local_disk": str(tmp_path / "c"), "local_disk_serde": "cachegen", "codec_tables": "none"}
    with pytest.raises(ConfigError, match="cannot hold one codec record of up to"):  # was: every store dropped
        TierManager.from_config(LMTierConfig.from_dict({**codec, "max_local_disk_size": record / GIB}), ns)
    with TierManager.from_config(LMTierConfig.from_dict({**codec, "max_local_disk_size": 4 * record / GIB}), ns) as m:
        assert m.store(b"c" * 32, torch.ones(ns.chunk_bytes, dtype=torch.uint8), timeout_s=None).result()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = LMTierConfig.from_dict({**no_cpu, "local_disk": str(tmp_path / "d2"), "max_local_disk_size": 1})
    cfg = dataclasses.replace(cfg, disk=dataclasses.replace(cfg.disk, paths=(str(blocker / "sub"),)))
    with pytest.raises(ConfigError, match="local_disk=.*cannot use the directory"):  # was NotADirectoryError
        TierManager.from_config(cfg, ns)


def test_real_disk_tier_write_back_and_restart(tmp_path):
    """End to end with lmtier.tiers.disk: evicted chunks survive a restart."""
    pytest.importorskip("lmtier.tiers.disk")
    ns = Namespace(model="m", num_layers=1, num_kv_heads=1, head_size=512, kv_dtype="float32", chunk_size=2)
    assert ns.chunk_bytes == 8192
    cfg = LMTierConfig.from_dict(
        {
            "chunk_size": 2,
            "max_local_cpu_size": 2 * 8192 / 2**30,
            "local_disk": f"file://{tmp_path}",
            "max_local_disk_size": 0.01,
        }
    )
    arena = torch.empty(2 * 8192, dtype=torch.uint8)
    m = TierManager.from_config(cfg, ns, arena=arena)
    for i in range(4):
        assert m.store(K(i), data(i, 8192)).result(30)
    assert m.lookup([K(i) for i in range(4)]) == ["disk", "disk", "cpu", "cpu"]
    m.close(persist=True)
    m2 = TierManager.from_config(cfg, ns, arena=torch.empty(2 * 8192, dtype=torch.uint8))
    assert m2.lookup([K(i) for i in range(4)]) == ["disk"] * 4
    out = torch.empty(8192, dtype=torch.uint8)
    for i in range(4):
        assert m2.retrieve(K(i), out) and bytes(out.numpy()) == data(i, 8192)
    m2.close(persist=False)


# ---- KV helper ------------------------------------------------------------------------------


def _hf_cache(num_layers, heads, seq, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(1, heads, seq, dim, generator=g).to(dtype), torch.randn(1, heads, seq, dim, generator=g).to(dtype))
        for _ in range(num_layers)
    ]


@pytest.mark.parametrize(
    "dtype,name", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.float16, "float16")]
)
def test_pack_unpack_canonical_layout(dtype, name):
    ns = Namespace(model="m", num_layers=3, num_kv_heads=2, head_size=4, kv_dtype=name, chunk_size=5)
    layers = _hf_cache(3, 2, 12, 4, dtype)
    b = pack_kv_chunk(layers, 5, 10)
    assert b.dtype == torch.uint8 and b.numel() == ns.chunk_bytes
    c = unpack_kv_chunk(b, ns)  # [L, 2, T, H, D]
    for li, (k, v) in enumerate(layers):
        assert torch.equal(c[li, 0], k[0, :, 5:10].transpose(0, 1))
        assert torch.equal(c[li, 1], v[0, :, 5:10].transpose(0, 1))
    assert torch.equal(c[1, 1, 2, 0, 3], layers[1][1][0, 0, 7, 3])


def test_kvcachestore_roundtrip_prefix_and_salt():
    ns = Namespace(model="m", num_layers=2, num_kv_heads=2, head_size=8, kv_dtype="bfloat16", chunk_size=4)
    m = TierManager(cpu=CPUPool(16 * 4096, ns.chunk_bytes, arena=torch.empty(16 * 4096, dtype=torch.uint8)))
    store = KVCacheStore(m, ns)
    tokens = list(range(100, 111))  # 2 full chunks + 3 tail tokens
    layers = _hf_cache(2, 2, 11, 8, torch.bfloat16)
    futs = store.store(tokens, layers, cache_salt="t1")
    assert len(futs) == 2 and all(f.result(10) for f in futs)
    assert store.lookup(tokens, cache_salt="t1") == 8
    assert store.lookup(tokens) == 0  # other tenant
    assert store.lookup(tokens[:7], cache_salt="t1") == 4
    n, got = store.retrieve(tokens + [5, 6, 7], cache_salt="t1")
    assert n == 8 and len(got) == 2
    for (k, v), (gk, gv) in zip(layers, got):
        assert gk.shape == (1, 2, 8, 8) and gk.dtype == torch.bfloat16
        assert torch.equal(gk, k[:, :, :8]) and torch.equal(gv, v[:, :, :8])
    assert store.retrieve([1, 2, 3, 4, 5]) == (0, [])
    with pytest.raises(ValueError, match="layers"):
        store.store(tokens, layers[:1])
    with pytest.raises(ValueError, match="namespace wants"):
        store.store(tokens, _hf_cache(2, 2, 11, 8, torch.float32))
    with pytest.raises(ValueError, match="fewer"):
        store.store(tokens, _hf_cache(2, 2, 6, 8, torch.bfloat16))
    m.close()


def test_real_redis_write_through_and_dead_redis_degrades(redis_server):
    """With lmtier.tiers.redis against a real redis-server: async write-through, remote hits after
    the CPU copy is gone, and a killed server turning into bounded-latency misses."""
    pytest.importorskip("lmtier.tiers.redis")
    ns = Namespace(model="m", num_layers=1, num_kv_heads=1, head_size=512, kv_dtype="float32", chunk_size=2)
    cfg = LMTierConfig.from_dict(
        {
            "chunk_size": 2,
            "max_local_cpu_size": 4 * 8192 / 2**30,
            "remote_url": redis_server.url,
            "remote_timeout_s": 0.5,
        }
    )
    m = TierManager.from_config(cfg, ns, arena=torch.empty(4 * 8192, dtype=torch.uint8))
    for i in range(3):
        assert m.store(K(i), data(i, 8192)).result(30)
    assert m.flush(30) and m.counters["stored_remote"] == 3
    for i in range(3):
        assert m.cpu.delete(K(i))
    assert m.lookup([K(0), K(1), K(2), K(3)]) == ["remote"] * 3
    out = torch.empty(8192, dtype=torch.uint8)
    assert m.retrieve(K(1), out) and bytes(out.numpy()) == data(1, 8192)
    assert m.lookup([K(1)]) == ["cpu"]  # promoted
    redis_server.kill()
    t0 = time.monotonic()
    assert m.lookup([K(1), K(0)]) == ["cpu"]
    assert m.retrieve(K(2), out) is False
    assert m.store(K(7), data(7, 8192)).result(30) is True  # CPU still serves
    assert m.flush(30)
    assert time.monotonic() - t0 < 10
    m.close()


# ------------------------------------------------------------------------------------------------
# index events (lmtier.events)


def test_index_events_store_evict_promote_and_listeners():
    """STORED after each store/promotion/commit (visible to lookup when heard), EVICTED "disk" for a
    CPU victim written back, DISK_EVICTED for the disk tier's LRU victims; a failing listener is
    logged and counted, never raised; a removed listener hears nothing."""
    from lmtier.events import IndexEvent
    from lmtier.events import IndexEventKind as E
    from lmtier.tiers.base import Eviction

    disk = MemTier("disk")
    m = TierManager(cpu=make_pool(num_slots=1), disk=disk)
    events: list[IndexEvent] = []

    def listener(ev: IndexEvent) -> None:
        if ev.kind == E.STORED:
            assert m.lookup([ev.key]) == [ev.tier]  # visible when heard
        events.append(ev)

    m.add_listener(listener)
    m.add_listener(lambda ev: 1 / 0)
    assert m.store(K(0), data(0)).result(10)
    assert m.store(K(1), data(1), timeout_s=None).result(10)
    assert events == [
        IndexEvent(E.STORED, K(0), "cpu"),
        IndexEvent(E.EVICTED, K(0), "disk"),
        IndexEvent(E.STORED, K(1), "cpu"),
    ]
    assert disk.store[K(0)] == data(0) and m.counters["listener_errors"] == 3
    events.clear()
    out = bytearray(4096)
    assert m.retrieve_into(K(0), out) == 3000  # promoted: K(1) evicted (written back), K(0) stored
    assert events == [IndexEvent(E.EVICTED, K(1), "disk"), IndexEvent(E.STORED, K(0), "cpu")]
    events.clear()
    disk._notify_evicted(Eviction("disk", (K(7), K(8))))  # what a disk tier's LRU reports
    assert events == [IndexEvent(E.DISK_EVICTED, K(7), None), IndexEvent(E.DISK_EVICTED, K(8), None)]
    events.clear()
    slot = m.cpu.reserve(K(2))  # a caller filling a slot itself (the vLLM connector)
    slot.view[:5].copy_(torch.arange(5, dtype=torch.uint8))
    m.commit(slot, 5)
    assert events == [IndexEvent(E.EVICTED, K(0), "disk"), IndexEvent(E.STORED, K(2), "cpu")]
    m.flush(timeout_s=10)
    assert disk.store[K(2)] == bytes(range(5))  # written through by commit (publish)
    m.remove_listener(listener)
    events.clear()
    assert m.store(K(3), data(3), timeout_s=None).result(10) and events == []
    m.close(persist=False)
    assert not m.cpu.has_eviction_listeners() and not disk.has_eviction_listeners()


def test_index_events_without_disk_or_cpu():
    """Without a disk a CPU victim is EVICTED with tier None; without a CPU pool a store is STORED
    in the tier that took it."""
    from lmtier.events import IndexEvent
    from lmtier.events import IndexEventKind as E

    events: list[IndexEvent] = []
    with TierManager(cpu=make_pool(num_slots=1)) as m:
        m.add_listener(events.append)
        m.store(K(0), data(0)).result(10)
        m.store(K(1), data(1), timeout_s=None).result(10)
    assert events == [
        IndexEvent(E.STORED, K(0), "cpu"),
        IndexEvent(E.EVICTED, K(0), None),
        IndexEvent(E.STORED, K(1), "cpu"),
    ]
    events.clear()
    remote = MemTier("remote")
    with TierManager(cpu=None, disk=MemTier("disk", fail=True), remote=remote) as m:
        m.add_listener(events.append)
        assert m.store(K(2), data(2)).result(10)
    assert events == [IndexEvent(E.STORED, K(2), "remote")]
    events.clear()
    with TierManager(cpu=None, disk=MemTier("disk")) as m:
        m.add_listener(events.append)
        assert m.store(K(3), data(3)).result(10)
    assert events == [IndexEvent(E.STORED, K(3), "disk")]
