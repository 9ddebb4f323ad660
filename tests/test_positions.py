"""Chunk positions (``Tier.takes_position``, ``Eviction.positions``) carried to the tiers that take
them: the CPU pool's slots, every path of the tier manager into a disk or remote ``put``, and the
vLLM connector's stores and promotions (position = chunk index x chunk size).

The lower tiers are in-memory fakes recording what each ``put`` received; a tier whose ``put`` has
no ``position`` parameter stands for every tier that does not take positions.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from lmtier.hf import KVCacheStore
from lmtier.integration.vllm.worker import LoadOp, StoreOp
from lmtier.keys import Namespace, chunk_keys
from lmtier.manager import TierManager
from lmtier.tiers.base import Eviction, check_position
from lmtier.tiers.cpu import CPUPool
from tests.test_connector_worker import CHUNK, GEOMS, Cache, _blocks, _ns, _tokens, _wait_loads, _worker
from tests.test_manager import MemTierOneByOne

CHUNK_BYTES = 5000


def K(i: int) -> bytes:
    return hashlib.blake2b(f"pos-{i}".encode(), digest_size=32).digest()


def data(i: int, n: int = CHUNK_BYTES) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def pool(num_slots: int) -> CPUPool:
    slot = -(-CHUNK_BYTES // 4096) * 4096
    return CPUPool(num_slots * slot, CHUNK_BYTES, arena=torch.empty(num_slots * slot, dtype=torch.uint8))


class PlainTier(MemTierOneByOne):
    """An in-memory tier whose ``put`` takes no keyword at all (as tiers without positions or budgets)."""


class PositionTier(PlainTier):
    """A tier that takes positions (as :class:`lmtier.tiers.codec_pca.PCACodecTier`): records
    ``(key, position)`` of every put and, like it, refuses a chunk of unknown position."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.puts: list[tuple[bytes, int | None]] = []

    def takes_position(self) -> bool:
        return True

    def put(self, key, payload, *, position=None):
        with self.lock:
            self.puts.append((key, position))
        if position is None:
            return False
        return super().put(key, payload)


# ------------------------------------------------------------------------------ the CPU pool
def test_check_position():
    assert check_position(None, "x") is None
    assert check_position(0, "x") == 0 and check_position(4096, "x") == 4096
    for bad in (-1, True, False, 1.0, "3", np.int64(3)):
        with pytest.raises(ValueError, match=r"where: position must be None or an int >= 0"):
            check_position(bad, "where")


def test_pool_keeps_positions_on_write_and_read_handles():
    p = pool(4)
    w = p.reserve(K(0), position=512)
    assert w is not None and w.position == 512
    w.view[:10].fill_(7)
    p.commit(w, 10)
    r = p.acquire(K(0))
    assert r is not None and r.position == 512
    p.release(r)
    assert p.put(K(1), data(1), position=0)
    assert p.put(K(2), data(2))  # no position: unknown
    for k, want in ((K(1), 0), (K(2), None)):
        r = p.acquire(k)
        assert r.position == want
        p.release(r)
    w = p.reserve(K(3))
    assert w.position is None
    p.abort(w)


def test_pool_forgets_a_freed_slots_position():
    """A slot reused by a chunk of unknown position does not inherit the previous chunk's."""
    p = pool(1)
    assert p.put(K(0), data(0), position=256)
    assert p.delete(K(0))
    assert p.put(K(1), data(1))
    r = p.acquire(K(1))
    assert r.index == 0 and r.position is None
    p.release(r)
    w = p.reserve(K(2), position=64)  # evicts K(1), no listener
    assert w is not None and w.index == 0 and w.position == 64
    p.abort(w)
    assert p.put(K(3), data(3))
    r = p.acquire(K(3))
    assert r.position is None, "an aborted reservation's position leaked"
    p.release(r)


def test_pool_eviction_names_the_victims_position():
    p = pool(2)
    seen: list[tuple] = []

    def listener(ev: Eviction) -> None:  # payload views are readable only during the call
        seen.append((ev.keys, ev.positions, [bytes(v.numpy()) for v in ev.payloads]))

    p.add_eviction_listener(listener)
    assert p.put(K(0), data(0), position=128)
    assert p.put(K(1), data(1))
    assert p.put(K(2), data(2), position=0)  # evicts K(0) (LRU)
    assert p.put(K(3), data(3), position=384)  # evicts K(1)
    assert seen == [((K(0),), (128,), [data(0)]), ((K(1),), (None,), [data(1)])]


@pytest.mark.parametrize("bad", [-1, True, 2.5, "0"])
def test_pool_refuses_a_bad_position(bad):
    p = pool(2)
    with pytest.raises(ValueError, match=r"CPUPool.reserve: position"):
        p.reserve(K(0), position=bad)
    with pytest.raises(ValueError, match=r"CPUPool.reserve: position"):
        p.put(K(0), data(0), position=bad)
    assert not p.is_present(K(0)) and p.usage().used_bytes == 0, "a refused reservation took a slot"


# ------------------------------------------------------------------------------ the tier manager
class BudgetPositionTier(PositionTier):
    """A remote tier with budgets that also takes positions: its put takes both keywords."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.tenants: list[str] = []

    @property
    def tenant_budgets(self):
        return object()  # anything but None: budgets on

    def put(self, key, payload, *, tenant, position=None):
        with self.lock:
            self.tenants.append(tenant)
        return super().put(key, payload, position=position)


def _manager(managers, *, slots: int | None, disk=None, remote=None) -> TierManager:
    m = TierManager(cpu=pool(slots) if slots else None, disk=disk, remote=remote)
    managers.append(m)
    return m


def _no_errors(m: TierManager) -> None:
    assert m.counters["tier_errors"] == 0 and m.counters["store_errors"] == 0, dict(m.counters)


def test_direct_store_without_a_pool(managers):
    disk, remote = PositionTier("disk"), PositionTier("remote")
    m = _manager(managers, slots=None, disk=disk, remote=remote)
    assert m.store(K(0), data(0), timeout_s=None, position=256).result(10)
    assert m.store(K(1), data(1), timeout_s=None, position=0).result(10)
    assert disk.puts == remote.puts == [(K(0), 256), (K(1), 0)]
    assert disk.store[K(0)] == remote.store[K(0)] == data(0)
    # Unknown position: both tiers refuse it, the store is dropped (not an error).
    assert not m.store(K(2), data(2), timeout_s=None).result(10)
    assert disk.puts[-1] == remote.puts[-1] == (K(2), None) and K(2) not in disk.store
    assert m.counters["store_dropped"] == 1
    _no_errors(m)


def test_direct_store_when_every_slot_is_pinned(managers):
    """The pool is full of pinned chunks (back-pressure): the store goes straight to the lower
    tiers, with its position."""
    disk = PositionTier("disk")
    m = _manager(managers, slots=1, disk=disk)
    assert m.store(K(0), data(0), timeout_s=None, position=64).result(10)
    pin = m.cpu.acquire(K(0))
    try:
        assert m.store(K(1), data(1), timeout_s=None, position=128).result(10)
    finally:
        m.cpu.release(pin)
    assert m.counters["cpu_backpressure"] == 1
    assert disk.puts == [(K(1), 128)]
    _no_errors(m)


def test_commit_writes_through_with_the_slots_position(managers):
    """A slot the caller filled (the connector's path): commit -> publish -> the disk and remote
    write jobs read the position from the pool."""
    disk, remote = PositionTier("disk"), PositionTier("remote")
    m = _manager(managers, slots=4, disk=disk, remote=remote)
    for i, pos in ((0, 768), (1, None)):
        s = m.cpu.reserve(K(i), position=pos)
        s.view[:CHUNK_BYTES].copy_(torch.frombuffer(bytearray(data(i)), dtype=torch.uint8))
        m.commit(s, CHUNK_BYTES)
    assert m.flush(timeout_s=10)
    assert sorted(disk.puts, key=str) == sorted(remote.puts, key=str) == sorted([(K(0), 768), (K(1), None)], key=str)
    assert disk.store == remote.store == {K(0): data(0)}
    assert m.counters["stored_disk"] == m.counters["stored_remote"] == 1
    assert m.counters["disk_put_failures"] == m.counters["remote_put_failures"] == 1  # the unknown position
    _no_errors(m)


def test_store_into_the_pool_writes_through_to_remote(managers):
    remote = PositionTier("remote")
    m = _manager(managers, slots=4, remote=remote)
    assert m.store(K(0), data(0), timeout_s=None, position=1024).result(10)
    assert m.flush(timeout_s=10)
    assert remote.puts == [(K(0), 1024)]
    r = m.cpu.acquire(K(0))
    assert r.position == 1024
    m.cpu.release(r)
    _no_errors(m)


def test_eviction_writes_back_with_the_victims_position(managers):
    disk = PositionTier("disk")
    m = _manager(managers, slots=2, disk=disk)
    for i in range(4):
        assert m.store(K(i), data(i), timeout_s=None, position=64 * i if i != 1 else None).result(10)
    assert m.flush(timeout_s=10)
    # K(0) and K(1) were evicted (LRU) by K(2) and K(3); K(1)'s position was unknown: refused.
    assert disk.puts == [(K(0), 0), (K(1), None)]
    assert disk.store == {K(0): data(0)}
    assert m.counters["written_back"] == 1 and m.counters["write_back_failures"] == 1
    _no_errors(m)


def test_close_persists_with_each_chunks_position(managers):
    disk = PositionTier("disk")
    m = TierManager(cpu=pool(4), disk=disk)
    for i in range(3):
        assert m.store(K(i), data(i), timeout_s=None, position=32 * (i + 1)).result(10)
    m.close(persist=True)
    assert sorted(disk.puts) == sorted([(K(0), 32), (K(1), 64), (K(2), 96)])
    assert disk.store == {K(i): data(i) for i in range(3)}


def test_promotion_keeps_the_position_for_its_write_back(managers):
    """A remote hit promoted into the pool by retrieve(position=) is written back to disk with that
    position when the pool evicts it; one retrieved without a position reaches the disk tier as
    unknown (refused there)."""
    disk, remote = PositionTier("disk"), PlainTier("remote")
    m = _manager(managers, slots=1, disk=disk, remote=remote)
    remote.store[K(0)] = data(0)
    remote.store[K(1)] = data(1)
    out = bytearray(CHUNK_BYTES)
    assert m.retrieve_into(K(0), out, position=512) == CHUNK_BYTES and bytes(out) == data(0)
    assert m.counters["promotions"] == 1 and m.cpu.contains(K(0))
    assert m.retrieve(K(1), out)  # evicts K(0): written back at 512; K(1) promoted, position unknown
    assert disk.puts == [(K(0), 512)] and disk.store == {K(0): data(0)}
    assert m.store(K(2), data(2), timeout_s=None, position=0).result(10)  # evicts K(1)
    assert disk.puts == [(K(0), 512), (K(1), None)] and K(1) not in disk.store
    with pytest.raises(ValueError, match="TierManager.retrieve_into: position"):
        m.retrieve_into(K(0), out, position=-512)
    _no_errors(m)


def test_tiers_without_positions_never_get_the_keyword(managers):
    """Every path into a lower tier's put, with positions named, over tiers whose put takes no
    keyword: nothing fails (a ``position=`` there would be a TypeError, counted as a tier error).
    Flushed after each step, so the LRU order (and which chunk each reservation evicts) is fixed."""
    disk, remote = PlainTier("disk"), PlainTier("remote")
    m = _manager(managers, slots=2, disk=disk, remote=remote)
    assert m.store(K(0), data(0), timeout_s=None, position=0).result(10)  # pool + write-through to remote
    assert m.flush(timeout_s=10)
    s = m.cpu.reserve(K(1), position=64)
    s.view[:CHUNK_BYTES].copy_(torch.frombuffer(bytearray(data(1)), dtype=torch.uint8))
    m.commit(s, CHUNK_BYTES)  # write-through to disk and remote
    assert m.flush(timeout_s=10)
    assert m.store(K(2), data(2), timeout_s=None, position=128).result(10)  # evicts K(0): write-back
    assert m.flush(timeout_s=10)
    assert set(disk.store) == {K(0), K(1)} and set(remote.store) == {K(0), K(1), K(2)}
    remote.store[K(5)] = data(5)
    assert m.retrieve(K(5), bytearray(CHUNK_BYTES), position=320)  # promotion, evicting K(1) (on disk)
    m.close(persist=True)  # K(2) and K(5) written back
    assert set(disk.store) == {K(0), K(1), K(2), K(5)}
    assert (m.counters["written_back"], m.counters["stored_disk"], m.counters["promotions"]) == (3, 1, 1)
    direct = _manager(managers, slots=None, disk=PlainTier("disk"), remote=PlainTier("remote"))
    assert direct.store(K(3), data(3), timeout_s=None, position=192).result(10)
    assert set(direct.disk.store) == set(direct.remote.store) == {K(3)}
    _no_errors(m)
    _no_errors(direct)


def test_remote_with_budgets_and_positions_gets_both(managers):
    remote = BudgetPositionTier("remote")
    m = _manager(managers, slots=None, remote=remote)
    assert m.store(K(0), data(0), timeout_s=None, tenant="t1", position=64).result(10)
    m2 = _manager(managers, slots=2, remote=BudgetPositionTier("remote"))
    assert m2.store(K(1), data(1), timeout_s=None, tenant="t2", position=128).result(10)
    assert m2.flush(timeout_s=10)
    assert (remote.puts, remote.tenants) == ([(K(0), 64)], ["t1"])
    assert (m2.remote.puts, m2.remote.tenants) == ([(K(1), 128)], ["t2"])
    _no_errors(m)
    _no_errors(m2)


def test_store_refuses_a_bad_position(managers):
    m = _manager(managers, slots=None, disk=PositionTier("disk"))
    for bad in (-64, True, 64.0):
        with pytest.raises(ValueError, match="TierManager.store: position"):
            m.store(K(0), data(0), position=bad)
    assert m.disk.puts == []


# ------------------------------------------------------------------------------ the vLLM connector
# Its worker over a real paged CPU cache (tests/test_connector_worker.py's helpers): chunk ci of a
# request is stored, and promoted, at position ci * CHUNK.


def _connector_manager(managers, ns, *, pool_slots: int | None, disk=None, remote=None) -> TierManager:
    cpu = CPUPool(pool_slots * (ns.chunk_bytes + 4096), ns.chunk_bytes) if pool_slots else None
    m = TierManager(cpu=cpu, disk=disk, remote=remote)
    managers.append(m)
    return m


@pytest.mark.parametrize("first_chunk", [0, 1])
def test_storer_reserves_and_writes_through_at_chunk_positions(first_chunk, managers):
    cache = Cache(*GEOMS[2])
    ns = _ns(cache.dtype)
    disk, remote = PositionTier("disk"), PositionTier("remote")
    m = _connector_manager(managers, ns, pool_slots=8, disk=disk, remote=remote)
    w, _, rec = _worker(cache, m)
    toks = _tokens(3 * CHUNK, seed=21)
    src = _blocks(cache, list(range(24)), 3 * CHUNK)
    w.store(StoreOp("r1", toks, None, first_chunk, src))
    assert m.flush(timeout_s=30)
    keys = chunk_keys(toks, ns)
    want = [(keys[ci], ci * CHUNK) for ci in range(first_chunk, 3)]
    assert sorted(disk.puts) == sorted(remote.puts) == sorted(want)
    for k, pos in want:
        r = m.cpu.acquire(k)
        assert r.position == pos
        assert disk.store[k] == bytes(r.view.numpy()) == bytes(cache.tokens(src, pos, pos + CHUNK).numpy())
        m.cpu.release(r)
    _no_errors(m)


def test_storer_without_a_pool_stores_at_chunk_positions(managers):
    cache = Cache(*GEOMS[0])
    ns = _ns(cache.dtype)
    disk = PositionTier("disk")
    m = _connector_manager(managers, ns, pool_slots=None, disk=disk)
    w, _, rec = _worker(cache, m)
    toks = _tokens(3 * CHUNK, seed=22)
    src = _blocks(cache, list(range(24)), 3 * CHUNK)
    w.store(StoreOp("r1", toks, None, 1, src))
    keys = chunk_keys(toks, ns)
    assert disk.puts == [(keys[1], CHUNK), (keys[2], 2 * CHUNK)]
    assert disk.store[keys[2]] == bytes(cache.tokens(src, 2 * CHUNK, 3 * CHUNK).numpy())
    assert {t for _, _, t in rec.stored} == {"disk"} and rec.stats["stored_chunks"] == 2
    _no_errors(m)


@pytest.mark.parametrize("how", ["sync", "async", "layerwise"])
def test_promotions_keep_chunk_positions(how, managers):
    """Chunks 1 and 2 only in the remote tier: the load promotes them into pool slots reserved at
    1 * CHUNK and 2 * CHUNK; close(persist) writes them back to a disk tier that takes positions
    with those positions (chunk 0 is on disk already: its write-through)."""
    cache = Cache(*GEOMS[0], logical_blocks=32)
    ns = _ns(cache.dtype)
    disk, remote = PositionTier("disk"), PlainTier("remote")
    m = _connector_manager(managers, ns, pool_slots=8, disk=disk, remote=remote)
    w, _, rec = _worker(cache, m)
    toks = _tokens(3 * CHUNK, seed=23)
    src, dst = list(range(12)), list(range(12, 24))
    w.store(StoreOp("r1", toks, None, 0, src))
    assert m.flush(timeout_s=30)
    keys = chunk_keys(toks, ns)
    assert set(remote.store) == set(keys)
    for k in keys[1:]:  # the disk lost them, the pool evicted them: only the remote tier holds them
        assert m.cpu.delete(k)
        del disk.store[k]
    disk.puts.clear()
    assert m.lookup(keys) == ["cpu", "remote", "remote"]
    op = LoadOp("r2", toks, None, 0, dst, is_async=how == "async")
    if how == "sync":
        assert w.load(op) == set()
    elif how == "async":
        w.start_load(op)
        assert _wait_loads(w) == ({"r2"}, set())
    else:
        assert w.load_layerwise([op]) == {}
        for layer in range(cache.layout.num_layers):
            w.wait_layer(layer)
        assert w.finish_layerwise() == {}
    assert torch.equal(cache.tokens(dst, 0, 3 * CHUNK), cache.tokens(src, 0, 3 * CHUNK))
    assert m.counters["promotions"] == 2 and m.cpu.num_pinned() == 0
    for ci, k in enumerate(keys):
        r = m.cpu.acquire(k)
        assert r.position == ci * CHUNK
        m.cpu.release(r)
    w.close()
    m.close(persist=True)
    assert sorted(disk.puts) == sorted([(keys[1], CHUNK), (keys[2], 2 * CHUNK)])
    assert disk.store[keys[2]] == remote.store[keys[2]]
    _no_errors(m)


# ------------------------------------------------------------------------------ lmtier.hf.KVCacheStore
def test_kvcachestore_stores_and_promotes_at_chunk_positions(managers):
    """KVCacheStore.store: chunk c at c * chunk_size (direct to disk and remote without a pool);
    retrieve promotes remote hits at those positions (close(persist) writes them to a disk tier
    that takes positions)."""
    ns = Namespace(model="m", num_layers=2, num_kv_heads=2, head_size=8, kv_dtype="bfloat16", chunk_size=4)
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(1, 2, 11, 8, generator=g).bfloat16(), torch.randn(1, 2, 11, 8, generator=g).bfloat16())]
    layers.append((layers[0][1].clone(), layers[0][0].clone()))
    tokens = list(range(100, 111))  # 2 full chunks + 3 tail tokens
    keys = chunk_keys(tokens, ns)
    disk, remote = PositionTier("disk"), PositionTier("remote")
    m = _manager(managers, slots=None, disk=disk, remote=remote)
    assert all(f.result(10) for f in KVCacheStore(m, ns).store(tokens, layers))
    assert sorted(disk.puts) == sorted(remote.puts) == sorted([(keys[0], 0), (keys[1], 4)])  # two store threads
    _no_errors(m)

    disk2 = PositionTier("disk")
    m2 = TierManager(
        cpu=CPUPool(4 * 4096, ns.chunk_bytes, arena=torch.empty(4 * 4096, dtype=torch.uint8)), disk=disk2, remote=remote
    )
    managers.append(m2)
    n, got = KVCacheStore(m2, ns).retrieve(tokens)
    assert n == 8 and torch.equal(got[1][0], layers[1][0][:, :, :8])
    assert m2.counters["promotions"] == 2
    m2.close(persist=True)
    assert sorted(disk2.puts) == sorted([(keys[0], 0), (keys[1], 4)])
