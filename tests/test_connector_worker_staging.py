"""ConnectorWorker's staging pools and device-decode path against real CPU paged caches (the
caches, geometries and helpers of tests/test_connector_worker.py): codec records decoded into
staging buffers (bit exact, bounded, never promoted), a corrupt record is a miss, staging reused
without a pool, the ``decode_on`` modes."""

from __future__ import annotations

import pytest
import torch

from lmtier.integration.vllm.worker import ConnectorWorker, LoadOp, StoreOp
from lmtier.manager import TierManager
from lmtier.tiers.cpu import CPUPool
from tests.test_connector_worker import (
    CHUNK,
    GEOMS,
    LAYERS,
    Cache,
    Recorder,
    _disk_manager,
    _ns,
    _same_bits,
    _stored_on_disk,
    _tokens,
    _wait_loads,
    _worker,
)


# ------------------------------------------------------------------------------ staging pools, device decode path
def _codec_worker(
    tmp_path, cache, n_chunks, *, seed, level="lossless", decode_on="device", window=2, io_threads=2, pool_slots=8
):
    """A worker over CPU pool + disk wrapped in a CodecTier, ``n_chunks`` stored (written through as
    codec records), with ``decode_on`` (on a CPU cache "device" runs the device-staging pipeline
    with host buffers)."""
    from lmtier.tiers.codec import CodecTier
    from lmtier.tiers.factory import codec_chunk_shape

    ns = _ns(cache.dtype)
    return _stored_on_disk(
        tmp_path,
        cache,
        n_chunks,
        seed=seed,
        pool_slots=pool_slots,
        wrap_disk=lambda disk: CodecTier(
            disk, shape=codec_chunk_shape(ns), dtype=ns.kv_dtype, level=level, tables=None
        ),
        decode_on=decode_on,
        device_window=window,
        io_threads=io_threads,
    )


def _load(w: ConnectorWorker, op: LoadOp, mode: str):
    """Run ``op`` as a sync, layer-by-layer or async load; returns the failed blocks (sync,
    layerwise) or ``(finished, failed)`` (async)."""
    if mode == "sync":
        return w.load(op)
    if mode == "layerwise":
        failed = w.load_layerwise([op]).get(op.req_id, set())
        for layer in range(LAYERS):
            w.wait_layer(layer)
        assert w.finish_layerwise() == {}
        w.drain_layerwise(block=True)
        return failed
    op.is_async = True
    w.start_load(op)
    return _wait_loads(w)


@pytest.mark.parametrize("mode", ["sync", "layerwise", "async"])
def test_device_staging_load_bit_exact_bounded_not_promoted(mode, tmp_path, managers):
    """decode_on="device": chunks 0, 2, 3 and 5 of 6 only on disk as codec records are fetched and
    decoded into device staging buffers (here the CPU "device") — at most ``device_window`` of
    them (sync, layer-by-layer loads), reused by the next load — and scattered from there,
    bit-exact; pool hits (1, 4) take the host path; nothing is promoted into the pool."""
    cache = Cache("kv", "LBNHC", torch.bfloat16, 16, 16, logical_blocks=48)
    w, mgr, rec, toks, src, keys = _codec_worker(tmp_path, cache, 6, seed=21)
    managers.append(mgr)
    assert w.device_staging and w.decode_stream is None
    disk_only = (0, 2, 3, 5)
    for i in disk_only:
        assert mgr.cpu.delete(keys[i])
    dst = list(range(24, 48))
    expect = cache.clone()
    expect.scatter_ref(dst, 0, 6 * CHUNK, cache.ref_rows(src, 0, 6 * CHUNK))
    rec.stored.clear()
    for rnd in range(2):
        got = _load(w, LoadOp(f"r{rnd}", toks, None, 0, dst), mode)
        assert got == (({f"r{rnd}"}, set()) if mode == "async" else set())
        assert _same_bits(cache.buf, expect.buf)
        if rnd == 0:
            allocs = mgr.counters["load_device_staging_allocs"]
    if mode != "async":
        assert allocs <= 2 and mgr.counters["load_device_staging_allocs"] == allocs, "device staging is reused"
    # async loads hold every chunk until poll_loads scatters them; the pool keeps ``window`` idle
    assert w._fetcher._dev_staging.in_use == 0 and len(w._fetcher._dev_staging._free) <= 2
    assert rec.stats["loaded_chunks"] == 12 and rec.stats["device_decoded_chunks"] == 8
    assert rec.stats["load_failures"] == 0 and mgr.disk.counters["hits"] == 8
    assert not rec.stored and not any(mgr.cpu.contains(keys[i]) for i in disk_only), "not promoted"
    assert mgr.cpu.num_pinned() == 0 and not mgr.cpu._pending and w.idle()


@pytest.mark.parametrize("mode", ["sync", "layerwise", "async"])
def test_device_staging_corrupt_record_is_a_miss(mode, tmp_path, managers):
    """A corrupt codec record (chunk 2 of 4) on the device path: sync / layer-by-layer loads write
    chunks 0-1 and fail chunk 2's blocks onwards, async loads write nothing and report failure;
    the record is deleted, every staging buffer and pool slot given back."""
    cache = Cache("kv", "LBNHC", torch.bfloat16, 16, 16, logical_blocks=32)
    w, mgr, rec, toks, src, keys = _codec_worker(tmp_path, cache, 4, seed=22, window=1)
    managers.append(mgr)
    for k in keys:
        assert mgr.cpu.delete(k)
    inner, ikey = mgr.disk.inner, mgr.disk.inner_key(keys[2])
    buf = bytearray(mgr.disk.max_record_bytes + 8192)
    n = inner.get_into(ikey, buf)
    assert n is not None
    bad = bytearray(buf[:n])
    bad[n // 2] ^= 0xFF
    assert inner.delete(ikey) and inner.put(ikey, bytes(bad))
    dst = list(range(16, 32))
    expect = cache.clone()
    if mode == "async":
        assert _load(w, LoadOp("r2", toks, None, 0, dst), mode) == ({"r2"}, {"r2"})
    else:
        expect.scatter_ref(dst, 0, 2 * CHUNK, cache.ref_rows(src, 0, 2 * CHUNK))
        assert _load(w, LoadOp("r2", toks, None, 0, dst), mode) == set(dst[2 * CHUNK // cache.bs :])
    assert _same_bits(cache.buf, expect.buf), "a failed (or later) chunk was written"
    assert rec.stats["load_failures"] == 1 and mgr.disk.counters["corrupt_deleted"] == 1
    assert not mgr.disk.contains(keys[2])
    assert w._fetcher._dev_staging.in_use == 0 and mgr.cpu.num_pinned() == 0 and not mgr.cpu._pending


def test_device_staging_unwaited_layer_reports_device_chunks(tmp_path, managers):
    """A layer-by-layer load whose chunks all came through device staging (no host part) still
    reports its blocks when the forward skipped a layer's wait."""
    cache = Cache("kv", "LBNHC", torch.bfloat16, 16, 16, logical_blocks=16)
    w, mgr, rec, toks, src, keys = _codec_worker(tmp_path, cache, 2, seed=23)
    managers.append(mgr)
    for k in keys:
        assert mgr.cpu.delete(k)
    dst = list(range(8, 16))
    assert w.load_layerwise([LoadOp("r2", toks, None, CHUNK // 2, dst)]) == {}
    w.wait_layer(0)
    assert w.finish_layerwise() == {"r2": set(dst[CHUNK // 2 // cache.bs :])}
    assert rec.stats["device_decoded_chunks"] == 2


def test_decode_on_modes():
    cache = Cache(*GEOMS[2])
    with pytest.raises(ValueError, match="decode_on"):
        ConnectorWorker(
            cache.layout,
            TierManager(cpu=CPUPool(1 << 20, 4096)),
            chunk_size=CHUNK,
            block_size=cache.bs,
            namespace=_ns(cache.dtype),
            decode_on="gpu",
        )
    w, mgr, _ = _worker(cache)  # auto on a CPU cache: the host path
    assert not w.device_staging and w.decode_stream is None
    mgr.close(persist=False)


@pytest.mark.parametrize("mode", ["layerwise", "async"])
def test_host_staging_reused_without_a_pool(mode, tmp_path, managers):
    """No CPU pool: a load holding all its 6 disk chunks at once (layer-by-layer, async) stages them
    in host buffers that the next load reuses — the old pool kept only ``io_threads`` (2) of them
    and allocated the other 4 again on every load (fails on the old code)."""
    cache = Cache(*GEOMS[0], logical_blocks=48)
    ns = _ns(cache.dtype)
    mgr = _disk_manager(tmp_path, ns, cpu=False)
    managers.append(mgr)
    rec = Recorder()
    w = ConnectorWorker(
        cache.layout, mgr, chunk_size=CHUNK, block_size=cache.bs, namespace=ns, on_stat=rec.stat, io_threads=2
    )
    toks = _tokens(6 * CHUNK, seed=24)
    src = list(range(6 * CHUNK // cache.bs))
    w.store(StoreOp("r1", toks, None, 0, src))
    dst = list(range(24, 48))
    expect = cache.clone()
    expect.scatter_ref(dst, 0, 6 * CHUNK, cache.ref_rows(src, 0, 6 * CHUNK))
    got = _load(w, LoadOp("r2", toks, None, 0, dst), mode)
    assert got == (({"r2"}, set()) if mode == "async" else set()) and _same_bits(cache.buf, expect.buf)
    allocs = mgr.counters["load_staging_allocs"]
    assert allocs == 6
    got = _load(w, LoadOp("r3", toks, None, 0, dst), mode)
    assert got == (({"r3"}, set()) if mode == "async" else set()) and _same_bits(cache.buf, expect.buf)
    assert mgr.counters["load_staging_allocs"] == allocs, "staging buffers are reused across loads"
