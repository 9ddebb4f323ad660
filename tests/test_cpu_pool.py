"""Tests for lmtier.tiers.cpu.CPUPool: slots, LRU, refcounts, eviction listeners (write-back), thread safety."""

from __future__ import annotations

import hashlib
import random
import threading

import numpy as np
import pytest
import torch

from lmtier.tiers.base import Eviction, TierUsage
from lmtier.tiers.cpu import SLOT_ALIGN_BYTES, CPUPool, Slot


def K(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=32).digest()


def payload(i: int, n: int) -> bytes:
    return bytes(((i * 31 + j) & 0xFF) for j in range(n)) if n <= 4096 else np.full(n, i & 0xFF, np.uint8).tobytes()


def make_pool(num_slots: int = 4, chunk_bytes: int = 5000, *, on_evict=None, **kw) -> CPUPool:
    """A pool over a plain arena; ``on_evict(key, view)`` is registered as an eviction listener
    (one call per victim, as the tier manager's write-back sees them)."""
    slot = -(-chunk_bytes // 4096) * 4096
    arena = torch.empty(num_slots * slot, dtype=torch.uint8)
    pool = CPUPool(num_slots * slot, chunk_bytes, arena=arena, **kw)
    if on_evict is not None:

        def listener(ev: Eviction) -> None:
            assert ev.tier == "cpu" and ev.payloads is not None and len(ev.keys) == len(ev.payloads) == 1
            for k, v in zip(ev.keys, ev.payloads):
                on_evict(k, v)

        pool.add_eviction_listener(listener)
    return pool


def write(pool: CPUPool, key: bytes, data: bytes) -> Slot:
    s = pool.reserve(key)
    assert s is not None
    s.view[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    pool.commit(s, len(data))
    return s


@pytest.mark.parametrize(
    "chunk_bytes,cap,slots,slot_bytes",
    [(1, 4096, 1, 4096), (4096, 3 * 4096 + 5, 3, 4096), (5000, 10 * 8192, 10, 8192), (8193, 40000, 3, 12288)],
)
def test_geometry(chunk_bytes, cap, slots, slot_bytes):
    pool = CPUPool(cap, chunk_bytes, arena=torch.empty(cap, dtype=torch.uint8))
    assert (pool.num_slots, pool.slot_bytes) == (slots, slot_bytes)
    assert pool.slot_bytes % SLOT_ALIGN_BYTES == 0
    assert pool.usage() == TierUsage(capacity_bytes=slots * slot_bytes, used_bytes=0, num_chunks=0)
    assert pool.usage().capacity_bytes <= cap


@pytest.mark.parametrize(
    "cap,chunk,arena,exc",
    [
        (0, 10, None, ValueError),
        (100, 0, None, ValueError),
        (4095, 10, None, ValueError),
        (8192, 10, torch.empty(4096, dtype=torch.uint8), ValueError),
        (4096, 10, torch.empty(4096, dtype=torch.float32), ValueError),
        (4096, 10, torch.empty(2, 4096, dtype=torch.uint8), ValueError),
        (4096, 10, "arena", ValueError),
    ],
)
def test_bad_construction(cap, chunk, arena, exc):
    with pytest.raises(exc):
        CPUPool(cap, chunk, arena=arena if arena is not None else torch.empty(max(cap, 1), dtype=torch.uint8))


def test_default_arena_is_hostbuffer():
    pytest.importorskip("lmtier._C")
    pool = CPUPool(3 * 4096, 4096)
    assert pool.arena.numel() == 3 * 4096 and pool.arena.data_ptr() % 4096 == 0
    assert pool.put(K(0), b"x" * 100)
    out = bytearray(100)
    assert pool.get_into(K(0), out) == 100 and out == b"x" * 100


def test_roundtrip_and_slot_fields():
    pool = make_pool()
    data = payload(1, 4999)
    write(pool, K(1), data)
    s = pool.acquire(K(1))
    assert s is not None and s.mode == "read" and s.nbytes == 4999
    assert s.offset == s.index * pool.slot_bytes and s.view.numel() == 4999
    assert bytes(s.view.numpy()) == data
    assert bytes(s.memoryview()) == data
    pool.release(s)
    out = torch.zeros(6000, dtype=torch.uint8)
    assert pool.get_into(K(1), out) == 4999 and bytes(out[:4999].numpy()) == data
    assert pool.get_into(K(2), out) is None


def test_reserved_key_invisible_until_commit():
    pool = make_pool()
    s = pool.reserve(K(1))
    assert s is not None
    assert not pool.contains(K(1)) and pool.acquire(K(1)) is None and pool.is_present(K(1))
    assert pool.reserve(K(1)) is None  # being written: nothing to do
    assert pool.usage().num_chunks == 0 and pool.usage().used_bytes == pool.slot_bytes
    pool.commit(s, 10)
    assert pool.contains(K(1)) and pool.reserve(K(1)) is None


def test_abort_frees_and_hides():
    pool = make_pool()
    s = pool.reserve(K(1))
    pool.abort(s)
    assert not pool.contains(K(1)) and not pool.is_present(K(1))
    assert pool.usage().used_bytes == 0
    with pytest.raises(RuntimeError):
        pool.commit(s, 10)
    with pytest.raises(RuntimeError):
        pool.abort(s)


def test_handle_misuse():
    pool = make_pool()
    w = pool.reserve(K(1))
    with pytest.raises(RuntimeError):
        pool.release(w)
    with pytest.raises(ValueError):
        pool.commit(w, 0)
    with pytest.raises(ValueError):
        pool.commit(w, pool.chunk_bytes + 1)
    pool.commit(w, 5)
    r = pool.acquire(K(1))
    with pytest.raises(RuntimeError):
        pool.commit(r, 5)
    pool.release(r)
    with pytest.raises(RuntimeError):
        pool.release(r)
    with pytest.raises(TypeError):
        pool.reserve(b"short")
    with pytest.raises(TypeError):
        pool.acquire("x" * 32)


def test_lru_eviction_order_and_bump():
    pool = make_pool(num_slots=3)
    for i in range(3):
        write(pool, K(i), payload(i, 100))
    pool.release(pool.acquire(K(0)))  # K(0) becomes most recently used
    write(pool, K(3), payload(3, 100))  # evicts K(1)
    assert [pool.contains(K(i)) for i in range(4)] == [True, False, True, True]
    write(pool, K(4), payload(4, 100))  # evicts K(2)
    assert [pool.contains(K(i)) for i in range(5)] == [True, False, False, True, True]
    assert pool.counters["evictions"] == 2
    assert pool.usage().used_bytes == 3 * pool.slot_bytes  # never above capacity


def test_pinned_slots_are_never_reused_and_backpressure():
    pool = make_pool(num_slots=2)
    write(pool, K(0), payload(0, 100))
    write(pool, K(1), payload(1, 100))
    r0, r1 = pool.acquire(K(0)), pool.acquire(K(1))
    assert pool.reserve(K(2)) is None  # everything pinned: back-pressure
    assert pool.counters["reserve_full"] == 1
    assert pool.put(K(2), b"abc") is False
    pool.release(r1)
    w = pool.reserve(K(2))
    assert w is not None and w.index == r1.index and not pool.contains(K(1))
    assert bytes(r0.view[:100].numpy()) == payload(0, 100)
    pool.abort(w)
    pool.release(r0)


def test_delete_pinned_frees_at_last_release():
    pool = make_pool(num_slots=2)
    write(pool, K(0), payload(0, 100))
    r = pool.acquire(K(0))
    assert pool.delete(K(0)) and not pool.contains(K(0)) and not pool.delete(K(0))
    assert pool.usage().used_bytes == pool.slot_bytes  # still held by the reader
    assert bytes(r.view.numpy()) == payload(0, 100)  # reader's bytes are intact
    pool.release(r)
    assert pool.usage() == TierUsage(2 * pool.slot_bytes, 0, 0)
    assert pool.delete(K(9)) is False


def test_put_validation_and_types():
    pool = make_pool(chunk_bytes=100)
    with pytest.raises(ValueError):
        pool.put(K(0), b"")
    with pytest.raises(ValueError):
        pool.put(K(0), b"x" * 101)
    with pytest.raises(TypeError):
        pool.put(K(0), 12345)
    t = torch.arange(25, dtype=torch.float32)  # 100 bytes
    assert pool.put(K(1), t)
    out = torch.empty(25, dtype=torch.float32)
    assert pool.get_into(K(1), out) == 100 and torch.equal(out, t)
    assert pool.put(K(2), np.arange(10, dtype=np.int32))
    buf = bytearray(40)
    assert pool.get_into(K(2), memoryview(buf)) == 40
    assert np.array_equal(np.frombuffer(buf, np.int32), np.arange(10))
    with pytest.raises(ValueError, match="out has"):
        pool.get_into(K(2), bytearray(39))
    with pytest.raises(TypeError):
        pool.get_into(K(2), b"\0" * 40)  # read-only
    assert pool.num_pinned() == 0


def test_eviction_listener_sees_victim_and_runs_unlocked():
    seen = []

    def cb(key, view):
        # The lock must not be held: calling back into the pool must not deadlock.
        assert pool.contains(key)  # still visible during write-back
        r = pool.acquire(K(99))
        assert r is None
        seen.append((key, bytes(view.numpy())))

    pool = make_pool(num_slots=2, on_evict=cb)
    write(pool, K(0), payload(0, 77))
    write(pool, K(1), payload(1, 88))
    write(pool, K(2), payload(2, 99))
    assert seen == [(K(0), payload(0, 77))]
    assert not pool.contains(K(0)) and pool.contains(K(2))


def test_eviction_listener_error_still_evicts():
    def cb(key, view):
        raise OSError("disk full")

    pool = make_pool(num_slots=1, on_evict=cb)
    write(pool, K(0), b"a" * 10)
    write(pool, K(1), b"b" * 10)
    assert pool.contains(K(1)) and not pool.contains(K(0)) and pool.counters["evict_listener_errors"] == 1


def test_eviction_listeners_added_removed_and_told_in_order():
    """Every registered listener hears each eviction (an Eviction with the victim's key and a
    payload view readable during the call); a removed one no longer does; with none the victim is
    dropped at once."""
    a, b = [], []

    def la(ev):
        a.append((ev.tier, ev.keys, bytes(ev.payloads[0].numpy())))

    def lb(ev):
        b.append(ev.keys)

    pool = make_pool(num_slots=1)
    pool.add_eviction_listener(la)
    pool.add_eviction_listener(lb)
    write(pool, K(0), b"a" * 10)
    write(pool, K(1), b"b" * 20)
    assert a == [("cpu", (K(0),), b"a" * 10)] and b == [(K(0),)]
    pool.remove_eviction_listener(la)
    pool.remove_eviction_listener(la)  # not registered: a no-op
    write(pool, K(2), b"c" * 10)
    assert len(a) == 1 and b == [(K(0),), (K(1),)]
    pool.remove_eviction_listener(lb)
    write(pool, K(3), b"d" * 10)
    assert b == [(K(0),), (K(1),)] and pool.contains(K(3)) and pool.counters["evictions"] == 3
    assert pool.forget(K(3)) and not pool.contains(K(3)) and not pool.forget(K(3))


def test_victim_acquired_during_writeback_is_kept():
    holder = {}

    def cb(key, view):
        if key == K(0) and "r" not in holder:
            holder["r"] = pool.acquire(K(0))  # a reader arrives during write-back

    pool = make_pool(num_slots=2, on_evict=cb)
    write(pool, K(0), b"a" * 10)
    write(pool, K(1), b"b" * 10)
    write(pool, K(2), b"c" * 10)  # K(0) is tried first, is hot, so K(1) is evicted
    assert pool.contains(K(0)) and not pool.contains(K(1)) and pool.contains(K(2))
    pool.release(holder["r"])
    assert pool.num_pinned() == 0


def test_victim_deleted_during_writeback():
    def cb(key, view):
        pool.delete(key)

    pool = make_pool(num_slots=1, on_evict=cb)
    write(pool, K(0), b"a" * 10)
    write(pool, K(1), b"b" * 10)
    assert pool.contains(K(1)) and not pool.contains(K(0))
    assert pool.usage().used_bytes == pool.slot_bytes


def test_close_refuses_reservations():
    pool = make_pool()
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.reserve(K(0))


@pytest.mark.parametrize("with_callback", ["none", "writeback"])
def test_concurrent_readers_writers(with_callback):
    """Many threads store/load/delete overlapping keys; every hit returns exactly its bytes,
    memory never exceeds capacity, and the pool drains back to empty."""
    nslots, chunk = 8, 3000
    written_back: dict[bytes, bytes] = {}
    wb_lock = threading.Lock()

    def cb(key, view):
        with wb_lock:
            written_back[key] = bytes(view.numpy())

    pool = make_pool(num_slots=nslots, chunk_bytes=chunk, on_evict=cb if with_callback == "writeback" else None)
    expected = {K(i): payload(i, 1000 + (i * 37) % 2000) for i in range(24)}
    errors: list[str] = []
    max_used = [0]
    stop = threading.Event()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(400):
                i = rng.randrange(24)
                k, data = K(i), expected[K(i)]
                op = rng.random()
                if op < 0.4:
                    s = pool.reserve(k)
                    if s is not None:
                        if rng.random() < 0.2:
                            pool.abort(s)  # cancelled request
                        else:
                            s.view[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                            pool.commit(s, len(data))
                elif op < 0.9:
                    s = pool.acquire(k)
                    if s is not None:
                        got = bytes(s.view.numpy())
                        if got != data:
                            errors.append(f"wrong bytes for {i}")
                        pool.release(s)
                else:
                    pool.delete(k)
                used = pool.usage().used_bytes
                max_used[0] = max(max_used[0], used)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    stop.set()
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert errors == []
    assert max_used[0] <= nslots * pool.slot_bytes
    assert pool.num_pinned() == 0
    for k, v in written_back.items():
        assert v == expected[k]
    for k in list(pool.keys()):
        assert pool.get_into(k, bytearray(chunk)) == len(expected[k])
        assert pool.delete(k)
    assert pool.usage() == TierUsage(nslots * pool.slot_bytes, 0, 0)
    assert pool.reserve(K(0)) is not None


# ---------------------------------------------------------------------------- populated arenas
def _resident_pages(t: torch.Tensor) -> int:
    """Resident pages of a page-aligned tensor (mincore(2))."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    n = (t.numel() + 4095) // 4096
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(t.numel()), vec) == 0
    return sum(v & 1 for v in vec)


@pytest.mark.parametrize("mode", ["now", "background"])
def test_whole_arena_populated(mode):
    """populate="now"/"background": the whole arena is mapped at startup."""
    from lmtier.memory import HostBuffer

    pool = CPUPool(64 * 4096, 4096, populate=mode)
    owner = pool._owner
    assert isinstance(owner, HostBuffer)
    assert owner.populated.wait(30)
    if not owner.pinned:
        assert _resident_pages(pool.arena) == 64


def _wait_populated(pool: CPUPool, n: int) -> None:
    import time

    deadline = time.monotonic() + 30
    while pool.counters["populated_slots"] < n:
        assert time.monotonic() < deadline, pool.counters
        time.sleep(0.01)


def test_populate_ahead_of_use():
    """Default "ahead": a window of POPULATE_AHEAD_BYTES is mapped ahead of the highest slot handed
    out (resident memory grows with use, never-used slots are mapped before a store writes them)."""
    from lmtier.tiers.cpu_populate import POPULATE_AHEAD_BYTES

    slot = 1 << 20
    window = POPULATE_AHEAD_BYTES // slot
    pool = CPUPool(4 * window * slot, slot)  # 4 windows of 1 MiB slots
    if pool.pinned:
        pytest.skip("pinned arenas are mapped by cudaHostAlloc")
    _wait_populated(pool, window)
    assert _resident_pages(pool.arena) == window * slot // 4096
    for i in range(window + 1):  # hand out slots 0..window: >= window slots stay mapped beyond
        s = pool.reserve(K(i))
        pool.commit(s, 1)
    _wait_populated(pool, 2 * window + 1)
    mapped = pool.counters["populated_slots"]
    assert mapped <= 3 * window + 1
    assert _resident_pages(pool.arena[: mapped * slot]) == mapped * slot // 4096
    assert _resident_pages(pool.arena[mapped * slot :]) == 0
    pool.close()


def test_lazy_arena_is_not_populated():
    pool = CPUPool(64 << 20, 4096, populate="lazy")
    if not pool.pinned:
        assert _resident_pages(pool.arena) < 1024


_RECYCLED_HEAP = """
import ctypes, sys
libc = ctypes.CDLL(None)
libc.mallopt(-4, 0)  # M_MMAP_MAX = 0: malloc never maps, every block comes from the heap
libc.mallopt(-1, 1 << 40)  # M_TRIM_THRESHOLD: a freed block stays in the heap, faulted in
libc.malloc.restype = ctypes.c_void_p
block = libc.malloc(96 << 20)
ctypes.memset(block, 0xAB, 96 << 20)
libc.free(ctypes.c_void_p(block))
sys.path.insert(0, sys.argv[1])
import test_cpu_pool as t
from lmtier.tiers.cpu import CPUPool
pool = CPUPool(64 << 20, 4096, populate="lazy")
print(pool.pinned, t._resident_pages(pool.arena), int(pool.arena[: 1 << 20].max()))
"""


def test_lazy_arena_is_a_fresh_mapping_not_recycled_heap():
    """A lazy arena is never a faulted-in block recycled by malloc (the CI failure of stop 22: a
    heap with a free 64+ MiB chunk handed it back, all pages resident and holding old bytes)."""
    import pathlib
    import subprocess
    import sys

    here = str(pathlib.Path(__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", _RECYCLED_HEAP, here], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    if out[0] == "True":
        pytest.skip("pinned arenas are mapped by cudaHostAlloc")
    assert int(out[1]) < 1024  # not resident
    assert int(out[2]) == 0  # zero pages, not the 0xAB of the freed block


def test_populate_keeps_contents():
    from lmtier.memory import HostBuffer, populate

    hb = HostBuffer(1 << 20, pinned=False)
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    hb.tensor.copy_(data)
    assert populate(hb.tensor, piece_bytes=64 << 10)
    assert torch.equal(hb.tensor, data)
    assert populate(hb.tensor[5:4000])  # no whole page inside: nothing to do
    with pytest.raises(ValueError):
        populate(hb.tensor[::2])
    with pytest.raises(ValueError):
        HostBuffer(4096, pinned=False, populate="eager")
