"""Transfers straight into / out of CPU-pool slots (issues 15, 16): ``CPUPool.hold`` (a slot a late
transfer may still write is never committed nor reused), the manager not offering a held slot to a
later tier, and the Mooncake tier's direct path (``attach_pool``: ``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers``) against a real store — verified in the slot, a record that does not
verify a miss, another size through the bounce region, a call outliving its timeout holding its slot.
The P2P tier's direct READs are tested in tests/test_p2p.py (two processes)."""

from __future__ import annotations

import collections
import os
import threading
import time

import numpy as np
import pytest

from lmtier import record as rec
from lmtier.manager import TierManager
from lmtier.tiers.cpu import CPUPool
from tests.test_fetch_batch import BatchingTier

CHUNK = 3 << 20


def payload(i: int, n: int = CHUNK) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


# ------------------------------------------------------------------------------ payload_checksums


@pytest.mark.parametrize("sizes", [[], [10], [5 << 20], [3 << 20, 3 << 20, 1, 2 << 20, 3 << 20], [100] * 7])
def test_payload_checksums_equal_the_serial_ones(sizes):
    from lmtier.tiers.checksums import payload_checksums

    bufs = [np.random.default_rng(n + j).integers(0, 256, n, dtype=np.uint8) for j, n in enumerate(sizes)]
    views = [memoryview(b) for b in bufs]
    assert payload_checksums(views) == [rec.payload_checksum(v) for v in views]


# ------------------------------------------------------------------------------------ CPUPool.hold


def test_hold_keeps_a_slot_out_of_use_until_unhold():
    pool = CPUPool(2 * 8192, 8192)
    try:
        a = pool.reserve(b"a" * 32)
        base = pool.arena.data_ptr()
        assert pool.writing_slot(base + a.offset, 8192) == a.index
        assert pool.writing_slot(base + a.offset + 4096, 8192) is None, "across two slots"
        assert pool.writing_slot(base - 1, 1) is None and pool.writing_slot(base + 2 * 8192, 1) is None
        pool.hold(a.index)
        assert pool.is_held(base + a.offset + 100) and not pool.is_held(base + 8192 + 1)
        with pytest.raises(RuntimeError, match="held"):
            pool.commit(a, 8192)
        pool.abort(a)  # parked, not freed
        assert pool.counters["held"] == 1 and pool.num_held() == 1
        b = pool.reserve(b"b" * 32)
        assert b is not None and b.index != a.index
        assert pool.reserve(b"c" * 32) is None, "the held slot is not handed out"
        assert pool.usage().used_bytes == 2 * 8192
        pool.unhold(a.index)
        c = pool.reserve(b"c" * 32)
        assert c is not None and c.index == a.index and pool.num_held() == 0
        pool.commit(c, 10)
        assert pool.writing_slot(base + c.offset, 10) is None, "committed: not a direct target"
        with pytest.raises(RuntimeError, match="not being written"):
            pool.hold(c.index)
        with pytest.raises(RuntimeError, match="not held"):
            pool.unhold(c.index)
        pool.abort(b)
    finally:
        pool.close()


def test_held_slot_committed_only_after_unhold():
    pool = CPUPool(8192, 8192)
    try:
        a = pool.reserve(b"a" * 32)
        pool.hold(a.index)
        pool.hold(a.index)
        pool.unhold(a.index)
        with pytest.raises(RuntimeError, match="held"):
            pool.commit(a, 1)
        pool.unhold(a.index)
        pool.commit(a, 1)  # no late writer any more: a normal commit
        assert pool.contains(b"a" * 32)
    finally:
        pool.close()


class HoldingPeer(BatchingTier):
    """A P2P tier whose READ outlived its wait: it holds the caller's slot and returns a miss."""

    name = "p2p"

    def __init__(self, pool: CPUPool) -> None:
        super().__init__()
        self.pool = pool

    def on_index_event(self, ev) -> None:
        pass

    def get_many_into(self, keys, outs):
        with self.lock:
            self.calls.append(len(keys))
        for o in outs:
            idx = self.pool.writing_slot(o.data_ptr(), o.numel())
            if idx is not None:
                self.pool.hold(idx)
        return [None] * len(keys)


def test_manager_never_offers_a_held_slot_to_a_later_tier():
    """The P2P tier left the slot held: the remote tier, which has the chunk, must not be asked to
    fill it (a late READ could overwrite its verified bytes after the scatter started reading)."""
    pool = CPUPool(4 * 8192, 8192)
    peer = HoldingPeer(pool)
    remote = BatchingTier()
    mgr = TierManager(cpu=pool, p2p=peer, remote=remote)
    try:
        k1, k2 = b"1" * 32, b"2" * 32
        remote.put(k1, b"x" * 8192)
        remote.put(k2, b"y" * 8192)
        s1 = pool.reserve(k1)
        staging = bytearray(8192)  # not a pool slot: the peer holds nothing
        assert mgr.fetch_lower_many([k1, k2], [s1.view, staging]) == [None, 8192]
        assert remote.calls == [1], "only the staging buffer went on to the remote tier"
        assert bytes(staging) == b"y" * 8192 and pool.is_held(s1.view.data_ptr())
        pool.abort(s1)
        assert pool.num_held() == 1
    finally:
        mgr.close(persist=False)


# ------------------------------------------------------------------------- Mooncake: direct path


class SpyClient:
    """Wraps the tier's real client: counts the batch calls; ``delay_s`` delays multi-buffer gets."""

    def __init__(self, inner, delay_s: float = 0.0) -> None:
        self.inner = inner
        self.calls: collections.Counter = collections.Counter()
        self.delay_s = delay_s
        self.returned = threading.Event()

    def _count(self, name):
        def call(*a, **kw):
            self.calls[name] += 1
            if name == "batch_get_into_multi_buffers" and self.delay_s:
                time.sleep(self.delay_s)
                try:
                    return self.inner.batch_get_into_multi_buffers(*a, **kw)
                finally:
                    self.returned.set()
            return getattr(self.inner, name)(*a, **kw)

        return call

    def __getattr__(self, name):
        if name.startswith("batch_"):
            return self._count(name)
        return getattr(self.inner, name)


def _tier(store, pool=None, **kw):
    from lmtier.tiers.mooncake import MooncakeSettings, MooncakeTier

    kw.setdefault("timeout_s", 10.0)
    kw.setdefault("bounce_bytes", 64 << 20)
    t = MooncakeTier(store.url, MooncakeSettings(store.master.address, global_segment_size=0), **kw)
    if pool is not None:
        t.attach_pool(pool)
    return t


def _fill(pool: CPUPool, n: int, seed: int) -> tuple[list[bytes], list[bytes], list]:
    keys = [os.urandom(32) for _ in range(n)]
    data = [payload(seed + i) for i in range(n)]
    for k, d in zip(keys, data, strict=True):
        assert pool.put(k, d)
    return keys, data, [pool.acquire(k) for k in keys]


def test_mooncake_direct_round_trip_bit_exact(mooncake_store):
    pool = CPUPool(12 * CHUNK, CHUNK)
    t = _tier(mooncake_store, pool)
    plain = _tier(mooncake_store)  # no pool: the bounce path reads what the direct path stored
    try:
        spy = t._store = SpyClient(t._client())
        keys, data, held = _fill(pool, 5, 10)
        assert t.put_many(keys, [s.memoryview() for s in held]) == [True] * 5
        assert spy.calls["batch_put_from_multi_buffers"] == 1 and spy.calls["batch_put_from"] == 0
        assert t.counters["direct_puts"] == 5
        outs = [bytearray(CHUNK) for _ in keys]
        assert plain.get_many_into(keys, outs) == [CHUNK] * 5 and [bytes(o) for o in outs] == data
        slots = [pool.reserve(os.urandom(32)) for _ in keys]
        assert t.get_many_into(keys, [s.view for s in slots]) == [CHUNK] * 5
        assert spy.calls["batch_get_into_multi_buffers"] == 1 and spy.calls["batch_get_into"] == 0
        assert [s.view.numpy().tobytes() for s in slots] == data and t.counters["direct_gets"] == 5
        # a plain buffer (not a slot) still goes through the bounce region
        assert t.get_many_into(keys[:1], [bytearray(CHUNK)]) == [CHUNK] and spy.calls["batch_get_into"] == 1
        for s in slots:
            pool.abort(s)
        for s in held:
            pool.release(s)
    finally:
        t.close()
        plain.close()
        pool.close()


@pytest.mark.parametrize("damage", ["other_key", "flipped_byte"])
def test_mooncake_direct_record_that_does_not_verify_is_a_miss(mooncake_store, damage):
    pool = CPUPool(6 * CHUNK, CHUNK)
    t = _tier(mooncake_store, pool)
    try:
        keys = [os.urandom(32) for _ in range(3)]
        data = [payload(20 + i) for i in range(3)]
        assert t.put_many(keys, data) == [True] * 3
        client = t._client()
        if damage == "other_key":  # a valid record of another chunk, same size
            bad = rec.encode_header(keys[0], CHUNK, rec.payload_checksum(data[0]), payload_offset=128) + data[0]
        else:
            body = bytearray(data[1])
            body[12345] ^= 1
            bad = rec.encode_header(keys[1], CHUNK, rec.payload_checksum(data[1]), payload_offset=128) + body
        name = "lmtier:" + keys[1].hex()
        assert client.remove(name, True) == 0 and client.put(name, bytes(bad)) == 0
        slots = [pool.reserve(os.urandom(32)) for _ in keys]
        got = t.get_many_into(keys, [s.view for s in slots])
        assert got == [CHUNK, None, CHUNK] and t.counters["direct_gets"] == 3
        assert t.counters["corrupt"] == 1 and t.contains_many(keys) == [True, False, True], "removed"
        assert slots[0].view.numpy().tobytes() == data[0] and slots[2].view.numpy().tobytes() == data[2]
        for s in slots:
            pool.abort(s)
    finally:
        t.close()
        pool.close()


def test_mooncake_direct_value_of_another_size_read_through_the_bounce(mooncake_store):
    pool = CPUPool(4 * CHUNK, CHUNK)
    t = _tier(mooncake_store, pool)
    try:
        spy = t._store = SpyClient(t._client())
        k_short, k_full = os.urandom(32), os.urandom(32)
        short, full = payload(30, CHUNK - 1000), payload(31)
        assert t.put_many([k_short, k_full], [short, full]) == [True, True]
        slots = [pool.reserve(os.urandom(32)) for _ in range(2)]
        assert t.get_many_into([k_short, k_full], [s.view for s in slots]) == [CHUNK - 1000, CHUNK]
        assert slots[0].view.numpy()[: CHUNK - 1000].tobytes() == short and slots[1].view.numpy().tobytes() == full
        assert spy.calls["batch_get_into"] == 1, "the short one again, through the bounce region"
        assert t.counters["corrupt"] == 0 and t.breaker._consecutive == 0 and t.counters["errors"] == 0
        for s in slots:
            pool.abort(s)
    finally:
        t.close()
        pool.close()


def test_mooncake_direct_read_outliving_its_timeout_holds_the_slot(mooncake_store):
    """The client call cannot be cancelled: a slot it reads into stays held (never committed, parked
    once aborted) until the call returns; then it is free again."""
    pool = CPUPool(2 * CHUNK, CHUNK)
    t = _tier(mooncake_store, pool, timeout_s=0.5)
    try:
        k = os.urandom(32)
        assert t.put_many([k], [payload(40)]) == [True]
        spy = t._store = SpyClient(t._client(), delay_s=2.0)
        slot = pool.reserve(os.urandom(32))
        t0 = time.monotonic()
        assert t.get_many_into([k], [slot.view]) == [None]
        assert time.monotonic() - t0 < 1.5 and t.counters["timeouts"] == 1
        assert pool.num_held() == 1
        with pytest.raises(RuntimeError, match="held"):
            pool.commit(slot, CHUNK)
        pool.abort(slot)
        other = pool.reserve(os.urandom(32))
        assert other is not None and other.index != slot.index
        assert pool.reserve(os.urandom(32)) is None, "the held slot is not handed out while the call runs"
        assert spy.returned.wait(10)
        deadline = time.monotonic() + 5
        while pool.num_held() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.num_held() == 0
        again = pool.reserve(os.urandom(32))
        assert again is not None and again.index == slot.index
        pool.abort(other)
        pool.abort(again)
    finally:
        t.close()
        pool.close()


def test_mooncake_manager_attaches_its_pool(mooncake_store):
    """TierManager hands its CPU pool to the remote tier: the write-through sends from the pool slot
    and a promotion reads into one, with no bounce copy."""
    pool = CPUPool(4 * CHUNK, CHUNK)
    t = _tier(mooncake_store)
    mgr = TierManager(cpu=pool, remote=t)
    try:
        k, d = os.urandom(32), payload(50)
        assert mgr.store(k, d, timeout_s=None).result(30) and mgr.flush(30)
        assert t.counters["direct_puts"] == 1 and mgr.counters["stored_remote"] == 1
        assert pool.delete(k)
        out = bytearray(CHUNK)
        assert mgr.retrieve_into(k, out) == CHUNK and bytes(out) == d
        assert t.counters["direct_gets"] == 1 and mgr.counters["promotions"] == 1
    finally:
        mgr.close(persist=False)
