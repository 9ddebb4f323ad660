"""The vLLM connector's worker loads that overlap the forward, on a real GPU, without vLLM:
layer-by-layer loads (``load_layerwise``, then ``wait_layer`` per layer: what the connector's
``start_load_kv`` / ``wait_for_layer_load`` come down to) issued while the compute stream is still
busy, and the device
decode of codec tiers (records decoded on the GPU into device staging and scattered into the paged
blocks on the decode stream). Same caches, worker and tiers as tests/test_gpu_connector_worker.py
(shared: tests/gpu_worker_cases.py); expected bytes from :mod:`lmtier.reference`, compared bit for bit.

Run: ``pytest -m gpu tests/test_gpu_connector_worker_loads.py`` on a machine with a CUDA device.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

from lmtier.integration.vllm.worker import ConnectorWorker, LoadOp, StoreOp
from lmtier.keys import Namespace, chunk_keys
from lmtier.manager import TierManager
from tests.gpu_worker_cases import (
    CHUNK,
    DST,
    DTYPES,
    HEAD,
    HEADS,
    LAYERS,
    ORDERS,
    SLEEP_CYCLES,
    SPLITS,
    SRC,
    Cache,
    blocks_for,
    cpu_pool,
    disk_tier,
    finish_request,
    make_worker,
    namespace_of,
    random_tokens,
    same_bits,
    stored_through_to_disk,
)

pytestmark = pytest.mark.gpu


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
    w, mgr, rec = make_worker(cache, managers, layers_per_wait=per_wait)
    n = 3 * CHUNK
    ta, tb = random_tokens(n, seed=31), random_tokens(n, seed=32)
    src_a, src_b = blocks_for(cache, SRC, n), blocks_for(cache, DST, n)
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
        assert same_bits(snaps[layer], expect.views[layer]), f"layer {layer} read before its copy landed"
    assert same_bits(cache.buf, expect.buf)
    assert rec.stats["layerwise_loads"] == 2 and rec.stats["loaded_chunks"] == 5
    assert mgr.cpu.num_pinned() == 0 and w.idle()


def test_layerwise_load_from_disk_promotes(tmp_path, managers):
    """A disk hit in a layer-by-layer load: fetched into a reserved pool slot, copied layer by layer,
    committed to the pool (promotion) only after the copy; bit exact."""
    cache = Cache("BLHNC", torch.bfloat16, 32, 16, seed=40)
    w, mgr, rec, toks, src, dst, keys = stored_through_to_disk(cache, managers, tmp_path, seed=41)
    n = len(toks)
    mgr.cpu.delete(keys[1])
    assert mgr.lookup(keys) == ["cpu", "disk"]
    expect = cache.like()
    expect.scatter_ref(dst, 0, n, cache.rows(src, 0, n))
    torch.cuda.synchronize()
    failed, snaps, unsafe = _layerwise_through_busy_stream(w, cache, [LoadOp("r", toks, None, 0, dst)])
    assert failed == {} and unsafe == {}
    for layer in range(LAYERS):
        assert same_bits(snaps[layer], expect.views[layer]), f"layer {layer}"
    assert same_bits(cache.buf, expect.buf)
    assert mgr.lookup(keys) == ["cpu", "cpu"], "the disk chunk was not promoted after the copy"


def test_layerwise_unwaited_layer_is_reported(managers):
    cache = Cache("LBNHC", torch.bfloat16, 16, 16, seed=50)
    w, mgr, rec = make_worker(cache, managers)
    n = 2 * CHUNK
    toks = random_tokens(n, seed=51)
    w.store(StoreOp("s", toks, None, 0, blocks_for(cache, SRC, n)))
    w.poll_stores(block=True)
    dst = blocks_for(cache, DST, n)
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

    return CodecTier(disk_tier(tmp_path), shape=codec_chunk_shape(ns), dtype=ns.kv_dtype, level=level, tables=None)


def _stored_as_codec(cache: Cache, managers, tmp_path, *, seed: int, chunks: int, level: str = "lossless", **kw):
    """A worker over a CPU pool + CodecTier(DiskTier) that stored ``chunks`` chunks from blocks SRC
    (written through as codec records) and then lost them from the pool: every chunk is a disk
    hit. Returns ``(worker, manager, recorder, tokens, src, dst, keys)``."""
    disk = _codec_disk(tmp_path, namespace_of(cache.dtype), level)
    w, mgr, rec, toks, src, dst, keys = stored_through_to_disk(
        cache, managers, tmp_path, seed=seed, chunks=chunks, disk=disk, **kw
    )
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
        assert same_bits(cache.buf, expect.buf)
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
    assert same_bits(snap, expect.buf), "the forward read the blocks before the device scatter"
    assert same_bits(cache.buf, expect.buf), "the device scatter ran before the older write"


def test_device_decode_layerwise_through_busy_stream(tmp_path, managers):
    """Layer-by-layer load of device-decoded chunks (plus one pool hit through the layer engine):
    every layer read right after its ``wait_layer`` holds the loaded data; finish does not block."""
    cache = Cache("LBNHC", torch.bfloat16, 16, 16, seed=64)
    w, mgr, rec, toks, src, dst, keys = _stored_as_codec(cache, managers, tmp_path, seed=65, chunks=3)
    w.store(StoreOp("again", toks[:CHUNK], None, 0, src))  # chunk 0 back into the pool: a host chunk
    finish_request(w, "again")
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
        assert same_bits(snaps[layer], expect.views[layer]), f"layer {layer} read before its copy landed"
    assert same_bits(cache.buf, expect.buf)
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
    assert same_bits(cache.buf, expect.buf), "a failed (or later) chunk was written"
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
    assert same_bits(cache.buf, host_cache.buf)
    hw.close()


def test_decode_on_device_needs_codec_tiers(tmp_path, managers):
    cache = Cache("LBNHC", torch.bfloat16, 16, 16, seed=70)
    ns = namespace_of(cache.dtype)
    mgr = TierManager(cpu=cpu_pool(ns), disk=disk_tier(tmp_path))
    managers.append(mgr)
    with pytest.raises(ValueError, match="codec tier"):
        ConnectorWorker(cache.layout, mgr, chunk_size=CHUNK, block_size=cache.bs, namespace=ns, decode_on="device")
    w = ConnectorWorker(cache.layout, mgr, chunk_size=CHUNK, block_size=cache.bs, namespace=ns)
    assert not w.device_staging and w.decode_stream is None  # auto: raw disk takes the host path
    w.close()


def test_device_decode_pca_level_equals_host_decode(tmp_path, managers):
    """A PCA level (``pca_default``, a PCACodecTier on disk): decode_on "auto" takes the device path for
    it as for the CacheGen levels; the GPU decodes, copied into two reused staging buffers on the decode
    stream, write the bytes of the host path's CPU decode (the PCA decoders are bit-identical), twice."""
    from lmtier.bench import codec_pca as bench
    from lmtier.tiers.codec_pca import PCACodecTier
    from lmtier.tiers.factory import codec_chunk_shape

    cache = Cache("LBNHC", torch.bfloat16, 16, 16, seed=72)
    cache.buf.copy_(torch.randn(cache.buf.shape, generator=torch.Generator().manual_seed(72)).to(cache.buf))
    ns = namespace_of(cache.dtype)
    model = bench.model_for((LAYERS, HEADS, HEAD, 1), 4 * CHUNK * 16)
    disk = PCACodecTier(
        disk_tier(tmp_path), shape=codec_chunk_shape(ns), dtype=ns.kv_dtype, level="pca_default", model=model
    )
    w, mgr, rec, toks, src, dst, keys = stored_through_to_disk(
        cache, managers, tmp_path, seed=73, chunks=3, disk=disk, device_window=2
    )
    for k in keys:
        assert mgr.cpu.delete(k)
    assert w.device_staging and w.decode_stream is not None
    host_cache = cache.like()  # before the loads: the same bytes outside the loaded blocks
    for rnd in range(2):
        if rnd:  # scatters held back: a copy into a reused staging buffer not ordered after them would win
            with torch.cuda.stream(w.decode_stream):
                torch.cuda._sleep(SLEEP_CYCLES // 4)
        assert w.load(LoadOp(f"d{rnd}", toks, None, 0, dst)) == set()
    torch.cuda.synchronize()
    assert rec.stats["device_decoded_chunks"] == 6 and mgr.disk.counters["hits"] == 6
    assert mgr.lookup(keys) == ["disk"] * 3, "device-decoded chunks are not promoted"
    hw = ConnectorWorker(
        host_cache.layout, mgr, chunk_size=CHUNK, block_size=cache.bs, namespace=w.ns, decode_on="host"
    )
    assert not hw.device_staging
    assert hw.load(LoadOp("h", toks, None, 0, dst)) == set()  # CPU decodes (and promotes)
    torch.cuda.synchronize()
    assert same_bits(cache.buf, host_cache.buf)
    assert not same_bits(cache.rows(dst, 0, len(toks)), cache.rows(src, 0, len(toks))), "lossy: not the source bits"
    assert mgr.cpu.num_pinned() == 0 and w.idle()
    hw.close()
