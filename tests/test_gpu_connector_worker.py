"""The vLLM connector's worker data path (ConnectorWorker) on a real GPU, without vLLM.

Real CUDA KV caches in vLLM 0.33's layouts (one shared buffer, ``[B, H, N, 2D]`` views per layer in
physical orders LBNHC / BLHNC; bf16 and fp8 stored as uint8; block size 16, and kernel-block
splitting: vLLM blocks of 32 tokens over kernel blocks of 16). Stores and loads go through
:class:`lmtier.integration.vllm.worker.ConnectorWorker` exactly as ``LMTierConnector``'s hooks call it
(``store`` = ``wait_for_save``, ``finished_sending`` = ``get_transfer_results``,
``poll_stores(block=True)`` = ``handle_preemptions``, ``load`` = ``start_load_kv``). Tiers: a CPU pool
(pinned, as in production) and, in some tests, a DiskTier in a temporary directory. No Redis.
Expected bytes come from :mod:`lmtier.reference` (plain PyTorch indexing), compared bit for bit.

The race test and the ordering contract it checks
-------------------------------------------------
A CUDA store records an event on the *current (compute) stream* when ``store`` is called and reads
the blocks on the transfer engine's side streams after that event; the chunk becomes visible
(committed) only once the copy's own event completed. This gives two guarantees:

1. the store sees every write queued on the compute stream before ``store`` — even a write that is
   still waiting behind a long kernel when ``store`` returns;
2. nothing queued on the compute stream *after* ``store`` is ordered after the copy. The design
   does not need that ordering because vLLM never overwrites a stored block before the worker says
   so: a finished request's blocks stay allocated until ``finished_sending`` reports it
   (``request_finished`` returns True for requests with CUDA stores), and a preempted request's
   blocks are reused only in a step whose ``handle_preemptions`` (``poll_stores(block=True)``)
   waited for the copies. Decode tokens of a running request go to other slots.

So the race test queues ``_sleep`` + "write the known values" on a non-default compute stream,
issues the store while the sleep still runs (checking that it returned at once, that nothing is
visible yet and that the request is not reported), then follows vLLM's rule — wait for the report
(finished request) or ``poll_stores(block=True)`` (preemption) — and overwrites the blocks on the
compute stream right away. The stored chunks must equal the values written before the store
(guarantee 1: not the older contents) and must not change with the overwrite; loading them into
other blocks gives the pre-overwrite values back. A store that ignored the compute stream would
read the older contents; one that committed before its copy completed would be reported (and
visible) while the sleep still runs.

Run: ``pytest -m gpu tests/test_gpu_connector_worker.py`` on a machine with a CUDA device.
"""

from __future__ import annotations

import collections
import gc
import time

import pytest
import torch

from lmtier import reference
from lmtier.integration.vllm.worker import ConnectorWorker, LoadOp, StoreOp
from lmtier.keys import Namespace, chunk_keys
from lmtier.layout import KVLayout, make_paged_kv_cache
from lmtier.manager import TierManager
from lmtier.tiers.cpu import CPUPool

pytestmark = pytest.mark.gpu

LAYERS, HEADS, HEAD = 6, 8, 128
CHUNK = 64
LOGICAL_BLOCKS = 24
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of GPU time at H200 clocks
_NS_DTYPE = {torch.bfloat16: "bfloat16", torch.uint8: "fp8_e4m3"}

ORDERS = ["LBNHC", "BLHNC"]
DTYPES = [torch.bfloat16, torch.uint8]  # uint8 = an fp8 cache as vLLM hands it over
SPLITS = [(16, 16), (32, 16)]  # (vLLM block size, kernel block size)

SRC = [3, 17, 5, 0, 9, 12, 21, 8, 15, 2, 19, 6]
DST = [20, 1, 14, 7, 22, 4, 11, 23, 10, 16, 13, 18]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


class Cache:
    """A CUDA paged KV cache of ``LOGICAL_BLOCKS`` vLLM blocks in one buffer of physical ``order``."""

    def __init__(self, order="LBNHC", dtype=torch.bfloat16, bs=16, kbs=16, *, seed=0):
        self.order, self.dtype, self.bs, self.kbs = order, dtype, bs, kbs
        self.kernel_blocks = LOGICAL_BLOCKS * (bs // kbs)
        self.buf, self.views = self._alloc()
        self.randomize(seed)
        self.layout = KVLayout.from_layer_views(self.views, kind="kv")

    def _alloc(self):
        return make_paged_kv_cache(
            self.order,
            num_layers=LAYERS,
            num_blocks=self.kernel_blocks,
            block_size=self.kbs,
            num_heads=HEADS,
            head_size=HEAD,
            dtype=self.dtype,
            device="cuda",
            kind="kv",
        )

    def randomize(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        n = self.buf.numel() * self.buf.element_size()
        self.buf.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))

    def like(self, seed: int | None = None) -> Cache:
        """Another buffer of the same geometry: random (``seed``) or a copy of this one."""
        c = object.__new__(Cache)
        c.__dict__.update(self.__dict__)
        c.buf, c.views = self._alloc()
        if seed is None:
            c.buf.copy_(self.buf)
        else:
            c.randomize(seed)
        c.layout = KVLayout.from_layer_views(c.views, kind="kv")
        return c

    def slots(self, block_ids, start: int, stop: int) -> torch.Tensor:
        t = torch.arange(start, stop)
        return (torch.as_tensor(block_ids)[t // self.bs] * self.bs + t % self.bs).view(1, -1)

    def rows(self, block_ids, start: int, stop: int) -> torch.Tensor:
        """Reference canonical rows ``[1, L, 2, T, H, D]`` of tokens ``[start, stop)``."""
        return reference.gather_ref(self.views, self.slots(block_ids, start, stop), kind="kv")

    def tokens(self, block_ids, start: int, stop: int) -> torch.Tensor:
        return _bytes(self.rows(block_ids, start, stop)).cpu()

    def scatter_ref(self, block_ids, start: int, stop: int, rows: torch.Tensor) -> None:
        reference.scatter_ref(self.views, self.slots(block_ids, start, stop), rows, kind="kv")


class Recorder:
    def __init__(self):
        self.stats: collections.Counter = collections.Counter()
        self.stored: list[tuple[bytes, bytes, str]] = []

    def stat(self, name, value=1):
        self.stats[name] += value

    def on_stored(self, key, key0, tier):
        self.stored.append((key, key0, tier))


def _ns(dtype) -> Namespace:
    return Namespace(
        model="test-gpu-worker",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_size=HEAD,
        kv_dtype=_NS_DTYPE[dtype],
        chunk_size=CHUNK,
    )


def _pool(ns: Namespace, slots: int = 40) -> CPUPool:
    return CPUPool(slots * (ns.chunk_bytes + 4096), ns.chunk_bytes)  # pinned arena (a CUDA device is present)


def _disk(tmp_path):
    from lmtier.tiers.disk import DiskTier

    return DiskTier([str(tmp_path / "disk")], 256 << 20, sync="none", use_kvikio="never")


def _worker(cache: Cache, managers, manager=None, **kw):
    ns = _ns(cache.dtype)
    mgr = manager or TierManager(cpu=_pool(ns))
    managers.append(mgr)
    rec = Recorder()
    w = ConnectorWorker(
        cache.layout,
        mgr,
        chunk_size=CHUNK,
        block_size=cache.bs,
        namespace=ns,
        on_stat=rec.stat,
        on_stored=rec.on_stored,
        **kw,
    )
    assert w.is_cuda and w.store_engine is not None
    return w, mgr, rec


def _tokens(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=g).tolist()


def _blocks(cache: Cache, ids: list[int], ntok: int) -> list[int]:
    return ids[: -(-ntok // cache.bs)]


def _wait_reported(w: ConnectorWorker, rid: str, timeout_s: float = 30.0) -> None:
    """Poll ``finished_sending`` (as ``get_transfer_results`` does each step) until ``rid`` is reported."""
    deadline = time.monotonic() + timeout_s
    while rid not in w.finished_sending():
        assert time.monotonic() < deadline, f"{rid} never reported in finished_sending"
        time.sleep(0.001)


def _finish(w: ConnectorWorker, rid: str) -> None:
    """The request finished (``request_finished`` -> True): wait until the worker releases its blocks."""
    if rid not in w.finished_sending([rid]):
        _wait_reported(w, rid)


def _pool_chunk(mgr: TierManager, key: bytes, nbytes: int) -> torch.Tensor:
    slot = mgr.cpu.acquire(key)
    assert slot is not None, "chunk not in the CPU pool"
    try:
        return slot.view[:nbytes].clone()
    finally:
        mgr.cpu.release(slot)


# ------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("bs,kbs", SPLITS, ids=["block16", "block32-kernel16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("order", ORDERS)
def test_store_then_load_into_other_blocks(order, dtype, bs, kbs, managers):
    cache = Cache(order, dtype, bs, kbs)
    w, mgr, rec = _worker(cache, managers)
    n = 3 * CHUNK
    toks = _tokens(n)
    src, dst = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    keys = chunk_keys(toks, w.ns)
    torch.cuda.synchronize()

    w.store(StoreOp("r1", toks, None, 0, src))
    assert "r1" in w.pending, "a CUDA store must be asynchronous (committed later)"
    assert not any(mgr.cpu.contains(k) for k in keys), "visible before the copy was polled"
    _finish(w, "r1")
    assert all(mgr.cpu.contains(k) for k in keys) and not w.pending and w.idle()
    assert rec.stats["stored_chunks"] == 3 and [t for _, _, t in rec.stored] == ["cpu"] * 3
    for ci, k in enumerate(keys):
        assert torch.equal(_pool_chunk(mgr, k, w.chunk_bytes), cache.tokens(src, ci * CHUNK, (ci + 1) * CHUNK)), (
            f"chunk {ci} in the pool differs from the reference gather"
        )

    expect = cache.like()
    expect.scatter_ref(dst, 0, n, cache.rows(src, 0, n))
    assert w.load(LoadOp("r2", toks, None, 0, dst)) == set()
    torch.cuda.synchronize()
    assert _same_bits(cache.buf, expect.buf), "load wrong, or it wrote outside its destination tokens"
    assert torch.equal(cache.tokens(dst, 0, n), cache.tokens(src, 0, n))
    assert rec.stats["loaded_chunks"] == 3


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
def test_partial_first_chunk_and_failed_chunk(dtype, managers):
    cache = Cache("LBNHC", dtype, 32, 16)
    w, mgr, rec = _worker(cache, managers)
    n = 3 * CHUNK
    toks = _tokens(n, seed=2)
    src, dst = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    w.store(StoreOp("r1", toks, None, 0, src))
    w.poll_stores(block=True)
    keys = chunk_keys(toks, w.ns)
    assert all(mgr.cpu.contains(k) for k in keys)

    # start_token inside chunk 0 (vLLM holds the first block): tokens before it stay as they were.
    start = cache.bs
    expect = cache.like()
    expect.scatter_ref(dst, start, n, cache.rows(src, start, n))
    assert w.load(LoadOp("r2", toks, None, start, dst)) == set()
    torch.cuda.synchronize()
    assert _same_bits(cache.buf, expect.buf)

    # Chunk 1 missing: chunk 0 loads, chunk 1's blocks and every later block fail, none is written.
    stored0 = cache.rows(src, 0, CHUNK)  # what the pool holds for chunk 0
    cache.randomize(7)  # fresh contents everywhere (the dst blocks hold the loaded data now)
    assert mgr.cpu.delete(keys[1])
    expect = cache.like()
    expect.scatter_ref(dst, 0, CHUNK, stored0)
    failed = w.load(LoadOp("r3", toks, None, 0, dst))
    torch.cuda.synchronize()
    assert failed == set(dst[CHUNK // cache.bs :])
    assert _same_bits(cache.buf, expect.buf), "a failed or later chunk was written"


def _stored_through_to_disk(cache: Cache, managers, tmp_path, *, seed: int):
    """A worker over a CPU pool + DiskTier that stored 2 chunks of ``_tokens(2 * CHUNK, seed)`` from
    blocks SRC and wrote them through to disk. Returns ``(worker, manager, recorder, tokens, src
    blocks, dst blocks, keys)``."""
    ns = _ns(cache.dtype)
    mgr = TierManager(cpu=_pool(ns), disk=_disk(tmp_path))
    w, _, rec = _worker(cache, managers, mgr)
    n = 2 * CHUNK
    toks = _tokens(n, seed=seed)
    src, dst = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    keys = chunk_keys(toks, ns)
    w.store(StoreOp("stored", toks, None, 0, src))
    _finish(w, "stored")
    assert mgr.flush(timeout_s=60)
    assert all(mgr.disk.contains(k) for k in keys), "publish did not write the chunks through to disk"
    return w, mgr, rec, toks, src, dst, keys


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_load_from_disk(mode, tmp_path, managers):
    cache = Cache("BLHNC", torch.bfloat16, 32, 16)
    w, mgr, rec, toks, src, dst, keys = _stored_through_to_disk(cache, managers, tmp_path, seed=3)
    n = len(toks)
    for k in keys:
        mgr.cpu.delete(k)
    assert mgr.lookup(keys) == ["disk", "disk"]
    expect = cache.like()
    expect.scatter_ref(dst, 0, n, cache.rows(src, 0, n))
    op = LoadOp("r2", toks, None, 0, dst, is_async=mode == "async")
    if mode == "sync":
        assert w.load(op) == set()
    else:
        w.start_load(op)
        deadline = time.monotonic() + 30
        done: set[str] = set()
        while w.async_loads:
            d, f = w.poll_loads()
            assert not f
            done |= d
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert done == {"r2"}
    torch.cuda.synchronize()
    assert _same_bits(cache.buf, expect.buf)
    assert mgr.lookup(keys) == ["cpu", "cpu"]


def test_disk_only_manager(tmp_path, managers):
    """No CPU pool: the store gathers into the pinned scratch buffer synchronously, then writes to disk."""
    cache = Cache("LBNHC", torch.uint8, 16, 16)
    mgr = TierManager(cpu=None, disk=_disk(tmp_path))
    w, _, rec = _worker(cache, managers, mgr)
    n = 2 * CHUNK
    toks = _tokens(n, seed=4)
    src, dst = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    w.store(StoreOp("r1", toks, None, 0, src))
    assert not w.pending and [t for _, _, t in rec.stored] == ["disk", "disk"]
    expect = cache.like()
    expect.scatter_ref(dst, 0, n, cache.rows(src, 0, n))
    assert w.load(LoadOp("r2", toks, None, 0, dst)) == set()
    torch.cuda.synchronize()
    assert _same_bits(cache.buf, expect.buf)


# ------------------------------------------------------------------------------ the race
@pytest.mark.parametrize("bs,kbs", SPLITS, ids=["block16", "block32-kernel16"])
@pytest.mark.parametrize("release", ["finished", "preempted"])
def test_store_waits_for_compute_and_keeps_pre_overwrite_data(release, bs, kbs, managers):
    """See the module docstring: the compute stream overwrites the blocks right after vLLM may reuse them."""
    cache = Cache("LBNHC", torch.bfloat16, bs, kbs, seed=10)  # contents A (older than the store)
    before = cache.like(seed=11)  # V: what the compute stream writes just before the store
    after = cache.like(seed=12)  # W: what it writes once the blocks are reused
    w, mgr, rec = _worker(cache, managers)
    n = 3 * CHUNK
    src, dst = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    compute = torch.cuda.Stream()  # vLLM's forward runs on the current stream; not the default one here

    # Warm-up (engine, allocator, pool paths) with other tokens, so the timed store does no first-use work.
    warm = _tokens(n, seed=99)
    with torch.cuda.stream(compute):
        w.store(StoreOp("warm", warm, None, 0, src))
    w.poll_stores(block=True)
    torch.cuda.synchronize()

    toks = _tokens(n, seed=5)
    keys = chunk_keys(toks, w.ns)
    want = [before.tokens(src, ci * CHUNK, (ci + 1) * CHUNK) for ci in range(3)]
    older = [cache.tokens(src, ci * CHUNK, (ci + 1) * CHUNK) for ci in range(3)]
    assert all(not torch.equal(a, b) for a, b in zip(want, older))
    torch.cuda.synchronize()

    with torch.cuda.stream(compute):
        torch.cuda._sleep(SLEEP_CYCLES)  # a long forward ...
        cache.buf.copy_(before.buf)  # ... that ends by writing the KV the store must see
        written = torch.cuda.Event()
        written.record()
        t0 = time.perf_counter()
        w.store(StoreOp("r", toks, None, 0, src))  # wait_for_save
        issue_s = time.perf_counter() - t0
        visible_early = [mgr.cpu.contains(k) for k in keys]
        pending_early = "r" in w.pending
        reported_early = "r" in w.finished_sending(["r"] if release == "finished" else [])
        still_running = not written.query()
    assert still_running, (
        f"the compute stream finished before the checks (store took {issue_s:.3f} s): "
        "store() blocked on the compute stream, or SLEEP_CYCLES is too short here"
    )
    assert pending_early and not any(visible_early), "committed before the copy completed"
    assert not reported_early, "blocks released while the store still had to read them"

    # vLLM's rule: blocks are reused only after the worker released them.
    if release == "finished":
        _wait_reported(w, "r")  # get_transfer_results -> finished_sending; the scheduler frees the blocks
    else:
        w.poll_stores(block=True)  # handle_preemptions, at the start of the step that reuses the blocks
    assert all(mgr.cpu.contains(k) for k in keys) and "r" not in w.pending
    with torch.cuda.stream(compute):
        cache.buf.copy_(after.buf)  # the next step writes other tokens' KV into the reused blocks
    torch.cuda.synchronize()
    assert _same_bits(cache.buf, after.buf)

    for ci, k in enumerate(keys):
        got = _pool_chunk(mgr, k, w.chunk_bytes)
        assert not torch.equal(got, older[ci]), f"chunk {ci}: the store did not wait for the compute stream"
        assert torch.equal(got, want[ci]), f"chunk {ci} is not the data written before the store"

    # And it loads back as the pre-overwrite values, into other blocks.
    assert w.load(LoadOp("r2", toks, None, 0, dst)) == set()
    torch.cuda.synchronize()
    assert torch.equal(cache.tokens(dst, 0, n), before.tokens(src, 0, n))


def test_back_to_back_stores_with_block_reuse(managers):
    """Eight requests in a row reuse the same blocks: each is written on the compute stream, stored,
    released through finished_sending, and overwritten by the next at once; every stored chunk must
    hold its own request's values."""
    cache = Cache("BLHNC", torch.bfloat16, 32, 16, seed=20)
    rounds = 8
    bank = [cache.like(seed=100 + i) for i in range(rounds)]
    w, mgr, rec = _worker(cache, managers)
    n = 3 * CHUNK
    src = _blocks(cache, SRC, n)
    compute = torch.cuda.Stream()
    torch.cuda.synchronize()
    all_keys = []
    for i in range(rounds):
        toks = _tokens(n, seed=200 + i)
        all_keys.append(chunk_keys(toks, w.ns))
        with torch.cuda.stream(compute):
            cache.buf.copy_(bank[i].buf)
            w.store(StoreOp(f"r{i}", toks, None, 0, src))
        _finish(w, f"r{i}")
    torch.cuda.synchronize()
    assert rec.stats["stored_chunks"] == 3 * rounds
    for i, keys in enumerate(all_keys):
        for ci, k in enumerate(keys):
            assert torch.equal(_pool_chunk(mgr, k, w.chunk_bytes), bank[i].tokens(src, ci * CHUNK, (ci + 1) * CHUNK)), (
                f"request {i} chunk {ci}"
            )


# ------------------------------------------------------------------------------ layer-by-layer loads
def _layerwise_through_busy_stream(w: ConnectorWorker, cache: Cache, ops_: list[LoadOp]):
    """Run ``load_layerwise`` while the compute stream is still busy (a long kernel queued first), then
    on that stream, per layer: ``wait_layer(l)`` and a snapshot of layer ``l`` (what that layer's
    attention would read). Returns (failed, snapshots, finish result)."""
    w.prepare_layerwise()  # as the connector does at registration: the engine is not built inside the window
    # The snapshots' buffers and copy kernel exist before the window: under CUDA's lazy module
    # loading the first launch of a kernel waits for the device's queued work (the sleep below).
    snaps = [v.clone() for v in cache.views[:LAYERS]]
    # No garbage collection inside the window: freeing earlier tests' pinned buffers (cudaHostUnregister
    # / cudaFreeHost, implicitly synchronizing) would make the host wait for the busy stream, which is
    # not lmtier's code stalling (the suite saw random cases fail that way).
    gc.collect()
    gc.disable()
    try:
        return _in_busy_window(w, cache, ops_, snaps)
    finally:
        gc.enable()


def _in_busy_window(w: ConnectorWorker, cache: Cache, ops_: list[LoadOp], snaps: list[torch.Tensor]):
    torch.cuda.synchronize()
    compute = torch.cuda.Stream()
    slept = torch.cuda.Event()
    with torch.cuda.stream(compute):
        # The copies are ordered after this kernel, which must outlast load_layerwise: the check
        # below is on the kernel itself (the snapshots queued after it finish fast, proving nothing).
        # A worker's first load spends 0.5-0.9 s in load_layerwise on the H200 (one-time costs of
        # the fetch path), hence ~2 s.
        torch.cuda._sleep(4 * SLEEP_CYCLES)
        slept.record(compute)
        t0 = time.perf_counter()
        failed = w.load_layerwise(ops_)
        t_load = time.perf_counter() - t0
        assert w.layerwise_in_flight
        for layer in range(LAYERS):
            w.wait_layer(layer)
            snaps[layer].copy_(cache.views[layer])
        t_waits = time.perf_counter() - t0 - t_load
        busy = not slept.query()
    assert busy, (
        "the kernel the copies wait for finished before the per-layer waits were queued (SLEEP_CYCLES too "
        f"short, or the host stalled): load_layerwise {t_load:.3f} s, waits + snapshots {t_waits:.3f} s"
    )
    t0 = time.perf_counter()
    unsafe = w.finish_layerwise()  # finish_forward / wait_for_save, after the forward is queued
    assert time.perf_counter() - t0 < 0.05, "finish_layerwise blocked the host on the copies"
    assert not w.idle(), "chunks released while the copies may still read them"
    torch.cuda.synchronize()
    w.drain_layerwise()  # (finished_sending does this each step) the copies are done: release
    return failed, snaps, unsafe


@pytest.mark.parametrize("per_wait", [1, 4], ids=["1-layer-events", "4-layer-events"])
@pytest.mark.parametrize("bs,kbs", SPLITS, ids=["block16", "block32-kernel16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("order", ORDERS)
def test_layerwise_load_bit_exact_per_layer(order, dtype, bs, kbs, per_wait, managers):
    """Two requests in one layer-by-layer load (one from a start token inside chunk 0, one whose
    chunk 2 is missing): each layer read on the compute stream right after its ``wait_layer`` holds
    the loaded data already; the whole cache equals the reference; failed blocks as ``load``."""
    cache = Cache(order, dtype, bs, kbs, seed=30)
    w, mgr, rec = _worker(cache, managers, layers_per_wait=per_wait)
    n = 3 * CHUNK
    ta, tb = _tokens(n, seed=31), _tokens(n, seed=32)
    src_a, src_b = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    w.store(StoreOp("sa", ta, None, 0, src_a))
    w.store(StoreOp("sb", tb, None, 0, src_b))
    w.poll_stores(block=True)
    assert mgr.cpu.delete(chunk_keys(tb, w.ns)[2])
    # Destinations: a's into b's source blocks, b's into a's (the pool is the source, not the cache).
    dst_a, dst_b = src_b, src_a
    start = bs
    expect = cache.like()
    expect.scatter_ref(dst_a, start, n, cache.rows(src_a, start, n))
    expect.scatter_ref(dst_b, 0, 2 * CHUNK, cache.rows(src_b, 0, 2 * CHUNK))
    torch.cuda.synchronize()

    failed, snaps, unsafe = _layerwise_through_busy_stream(
        w, cache, [LoadOp("a", ta, None, start, dst_a), LoadOp("b", tb, None, 0, dst_b)]
    )
    assert failed == {"b": set(dst_b[2 * CHUNK // bs :])}
    assert unsafe == {}
    for layer in range(LAYERS):
        assert _same_bits(snaps[layer], expect.views[layer]), f"layer {layer} read before its copy landed"
    assert _same_bits(cache.buf, expect.buf)
    assert rec.stats["layerwise_loads"] == 2 and rec.stats["loaded_chunks"] == 5
    assert mgr.cpu.num_pinned() == 0 and w.idle()


def test_layerwise_load_from_disk_promotes(tmp_path, managers):
    """A disk hit in a layer-by-layer load: fetched into a reserved pool slot, copied layer by layer,
    committed to the pool (promotion) only after the copy; bit exact."""
    cache = Cache("BLHNC", torch.bfloat16, 32, 16, seed=40)
    w, mgr, rec, toks, src, dst, keys = _stored_through_to_disk(cache, managers, tmp_path, seed=41)
    n = len(toks)
    mgr.cpu.delete(keys[1])
    assert mgr.lookup(keys) == ["cpu", "disk"]
    expect = cache.like()
    expect.scatter_ref(dst, 0, n, cache.rows(src, 0, n))
    torch.cuda.synchronize()
    failed, snaps, unsafe = _layerwise_through_busy_stream(w, cache, [LoadOp("r", toks, None, 0, dst)])
    assert failed == {} and unsafe == {}
    for layer in range(LAYERS):
        assert _same_bits(snaps[layer], expect.views[layer]), f"layer {layer}"
    assert _same_bits(cache.buf, expect.buf)
    assert mgr.lookup(keys) == ["cpu", "cpu"], "the disk chunk was not promoted after the copy"


def test_layerwise_unwaited_layer_is_reported(managers):
    cache = Cache("LBNHC", torch.bfloat16, 16, 16, seed=50)
    w, mgr, rec = _worker(cache, managers)
    n = 2 * CHUNK
    toks = _tokens(n, seed=51)
    w.store(StoreOp("s", toks, None, 0, _blocks(cache, SRC, n)))
    w.poll_stores(block=True)
    dst = _blocks(cache, DST, n)
    assert w.load_layerwise([LoadOp("r", toks, None, 0, dst)]) == {}
    for layer in range(LAYERS - 1):
        w.wait_layer(layer)
    assert w.finish_layerwise() == {"r": set(dst)}
    w.drain_layerwise(block=True)
    assert mgr.cpu.num_pinned() == 0 and w.idle()


# ------------------------------------------------------------------------------ device decode (codec tiers)
def _codec_disk(tmp_path, ns: Namespace, level: str):
    from lmtier.tiers.codec import CodecTier
    from lmtier.tiers.factory import codec_chunk_shape

    return CodecTier(_disk(tmp_path), shape=codec_chunk_shape(ns), dtype=ns.kv_dtype, level=level, tables=None)


def _stored_as_codec(cache: Cache, managers, tmp_path, *, seed: int, chunks: int, level: str = "lossless", **kw):
    """A worker over a CPU pool + CodecTier(DiskTier) that stored ``chunks`` chunks from blocks SRC
    (written through as codec records) and then lost them from the pool: every chunk is a disk
    hit. Returns ``(worker, manager, recorder, tokens, src, dst, keys)``."""
    ns = _ns(cache.dtype)
    mgr = TierManager(cpu=_pool(ns), disk=_codec_disk(tmp_path, ns, level))
    w, _, rec = _worker(cache, managers, mgr, **kw)
    n = chunks * CHUNK
    toks = _tokens(n, seed=seed)
    src, dst = _blocks(cache, SRC, n), _blocks(cache, DST, n)
    keys = chunk_keys(toks, ns)
    w.store(StoreOp("stored", toks, None, 0, src))
    _finish(w, "stored")
    assert mgr.flush(timeout_s=60)
    assert all(mgr.disk.contains(k) for k in keys), "the chunks were not written through as codec records"
    for k in keys:
        assert mgr.cpu.delete(k)
    rec.stored.clear()
    return w, mgr, rec, toks, src, dst, keys


def _run_async(w: ConnectorWorker, op: LoadOp) -> tuple[set[str], set[str]]:
    op.is_async = True
    w.start_load(op)
    deadline = time.monotonic() + 60
    done: set[str] = set()
    failed: set[str] = set()
    while w.async_loads:
        d, f = w.poll_loads()
        done |= d
        failed |= f
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return done, failed


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_device_decode_load_bit_exact_bounded_not_promoted(mode, tmp_path, managers):
    """Codec records on disk, a CUDA cache: decode_on "auto" picks the device path; every chunk is
    decoded on the GPU into at most ``device_window`` (2) device staging buffers (sync: 3 chunks)
    and scattered device -> paged blocks on the decode stream; bit exact (lossless), nothing
    promoted into the pool, no staging allocated by a second load."""
    cache = Cache("LBNHC", torch.bfloat16, 16, 16, seed=60)  # 3 chunks of 64 tokens = the 12 blocks of SRC
    w, mgr, rec, toks, src, dst, keys = _stored_as_codec(cache, managers, tmp_path, seed=61, chunks=3, device_window=2)
    assert w.device_staging and w.decode_stream is not None
    n = len(toks)
    expect = cache.like()
    expect.scatter_ref(dst, 0, n, cache.rows(src, 0, n))
    torch.cuda.synchronize()
    for rnd in range(2):
        op = LoadOp(f"r{rnd}", toks, None, 0, dst)
        if mode == "sync":
            assert w.load(op) == set()
        else:
            assert _run_async(w, op) == ({f"r{rnd}"}, set())
        torch.cuda.synchronize()
        assert _same_bits(cache.buf, expect.buf)
        if rnd == 0:
            allocs = mgr.counters["load_device_staging_allocs"]
    if mode == "sync":
        assert allocs <= 2 and mgr.counters["load_device_staging_allocs"] == allocs
    assert rec.stats["device_decoded_chunks"] == 6 and mgr.disk.counters["hits"] == 6
    assert mgr.lookup(keys) == ["disk"] * 3 and not rec.stored, "device-decoded chunks are not promoted"
    assert mgr.counters["load_staging_allocs"] == 0, "no host staging on the device path"
    assert mgr.cpu.num_pinned() == 0 and w.idle()


def test_device_decode_waits_for_the_compute_stream(tmp_path, managers):
    """The device scatter is ordered after the compute stream's earlier work, without blocking the
    host on it: a write over the whole cache queued (behind a long kernel) before ``load`` must not
    land after the load, and ``load`` returns while the kernel still runs."""
    cache = Cache("BLHNC", torch.bfloat16, 32, 16, seed=62)
    w, mgr, rec, toks, src, dst, keys = _stored_as_codec(cache, managers, tmp_path, seed=63, chunks=2)
    n = len(toks)
    assert w.load(LoadOp("warm", toks, None, 0, dst)) == set()  # staging and pointer tables exist now
    rows = cache.rows(src, 0, n)
    expect = cache.like()
    expect.buf.fill_(7)
    expect.scatter_ref(dst, 0, n, rows)
    torch.cuda.synchronize()
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(SLEEP_CYCLES // 4)
        cache.buf.fill_(7)  # an older writer of these blocks, still queued
        assert w.load(LoadOp("r", toks, None, 0, dst)) == set()
        busy = compute.query() is False
        snap = cache.buf.clone()  # what the forward (on the compute stream, after load) reads
    assert busy, "load blocked the host on the compute stream (or SLEEP_CYCLES too short)"
    torch.cuda.synchronize()
    assert _same_bits(snap, expect.buf), "the forward read the blocks before the device scatter"
    assert _same_bits(cache.buf, expect.buf), "the device scatter ran before the older write"


def test_device_decode_layerwise_through_busy_stream(tmp_path, managers):
    """Layer-by-layer load of device-decoded chunks (plus one pool hit through the layer engine):
    every layer read right after its ``wait_layer`` holds the loaded data; finish does not block."""
    cache = Cache("LBNHC", torch.bfloat16, 16, 16, seed=64)
    w, mgr, rec, toks, src, dst, keys = _stored_as_codec(cache, managers, tmp_path, seed=65, chunks=3)
    w.store(StoreOp("again", toks[:CHUNK], None, 0, src))  # chunk 0 back into the pool: a host chunk
    _finish(w, "again")
    assert mgr.lookup(keys) == ["cpu", "disk", "disk"]
    n = len(toks)
    expect = cache.like()
    expect.scatter_ref(dst, 0, n, cache.rows(src, 0, n))
    before = cache.rows(dst, 0, n)
    assert w.load(LoadOp("warm", toks, None, 0, dst)) == set()  # staging buffers and pointer tables exist now
    cache.scatter_ref(dst, 0, n, before)
    torch.cuda.synchronize()
    failed, snaps, unsafe = _layerwise_through_busy_stream(w, cache, [LoadOp("r", toks, None, 0, dst)])
    assert failed == {} and unsafe == {}
    for layer in range(LAYERS):
        assert _same_bits(snaps[layer], expect.views[layer]), f"layer {layer} read before its copy landed"
    assert _same_bits(cache.buf, expect.buf)
    assert rec.stats["device_decoded_chunks"] == 4 and rec.stats["loaded_chunks"] == 6
    assert mgr.cpu.num_pinned() == 0 and w.idle()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_device_decode_corrupt_record_is_a_miss(mode, tmp_path, managers):
    """A corrupt record (chunk 1 of 3) on the device path: sync loads write chunk 0 and fail chunk
    1's blocks onwards, async loads write nothing and report failure; the record is deleted."""
    cache = Cache("LBNHC", torch.bfloat16, 16, 16, seed=66)
    w, mgr, rec, toks, src, dst, keys = _stored_as_codec(cache, managers, tmp_path, seed=67, chunks=3)
    inner, ikey = mgr.disk.inner, mgr.disk.inner_key(keys[1])
    buf = bytearray(mgr.disk.max_record_bytes + 8192)
    nrec = inner.get_into(ikey, buf)
    assert nrec is not None
    bad = bytearray(buf[:nrec])
    bad[nrec // 2] ^= 0xFF
    assert inner.delete(ikey) and inner.put(ikey, bytes(bad))
    expect = cache.like()
    op = LoadOp("r", toks, None, 0, dst)
    if mode == "sync":
        expect.scatter_ref(dst, 0, CHUNK, cache.rows(src, 0, CHUNK))
        assert w.load(op) == set(dst[CHUNK // cache.bs :])
    else:
        assert _run_async(w, op) == ({"r"}, {"r"})
    torch.cuda.synchronize()
    assert _same_bits(cache.buf, expect.buf), "a failed (or later) chunk was written"
    assert mgr.disk.counters["corrupt_deleted"] == 1 and not mgr.disk.contains(keys[1])
    assert mgr.cpu.num_pinned() == 0 and w.idle()


def test_device_decode_lossy_equals_host_decode(tmp_path, managers):
    """Level ``default`` (lossy): the GPU decode on the worker's device path writes the same bytes as
    the CPU decode of its host path (the codec's decoders are bit-identical)."""
    cache = Cache("LBNHC", torch.bfloat16, 16, 16, seed=68)
    cache.buf.copy_(torch.randn(cache.buf.shape, generator=torch.Generator().manual_seed(68)).to(cache.buf))
    w, mgr, rec, toks, src, dst, keys = _stored_as_codec(cache, managers, tmp_path, seed=69, chunks=2, level="default")
    host_cache = cache.like()
    hw = ConnectorWorker(
        host_cache.layout, mgr, chunk_size=CHUNK, block_size=cache.bs, namespace=w.ns, decode_on="host"
    )
    assert not hw.device_staging
    assert w.load(LoadOp("d", toks, None, 0, dst)) == set()
    assert hw.load(LoadOp("h", toks, None, 0, dst)) == set()
    torch.cuda.synchronize()
    assert _same_bits(cache.buf, host_cache.buf)
    hw.close()


def test_decode_on_device_needs_codec_tiers(tmp_path, managers):
    cache = Cache("LBNHC", torch.bfloat16, 16, 16, seed=70)
    ns = _ns(cache.dtype)
    mgr = TierManager(cpu=_pool(ns), disk=_disk(tmp_path))
    managers.append(mgr)
    with pytest.raises(ValueError, match="codec tier"):
        ConnectorWorker(cache.layout, mgr, chunk_size=CHUNK, block_size=cache.bs, namespace=ns, decode_on="device")
    w = ConnectorWorker(cache.layout, mgr, chunk_size=CHUNK, block_size=cache.bs, namespace=ns)
    assert not w.device_staging and w.decode_stream is None  # auto: raw disk takes the host path
    w.close()
