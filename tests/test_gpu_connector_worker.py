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

Layer-by-layer loads and device decode of codec tiers: tests/test_gpu_connector_worker_loads.py; the
shared cache, worker and helpers: tests/gpu_worker_cases.py.

Run: ``pytest -m gpu tests/test_gpu_connector_worker.py`` on a machine with a CUDA device.
"""

from __future__ import annotations

import time

import pytest
import torch

from lmtier.integration.vllm.worker import LoadOp, StoreOp
from lmtier.keys import chunk_keys
from lmtier.manager import TierManager
from tests.gpu_worker_cases import (
    CHUNK,
    DST,
    DTYPES,
    ORDERS,
    SLEEP_CYCLES,
    SPLITS,
    SRC,
    Cache,
    blocks_for,
    disk_tier,
    finish_request,
    make_worker,
    pool_chunk,
    random_tokens,
    same_bits,
    stored_through_to_disk,
    wait_reported,
)

pytestmark = pytest.mark.gpu


# ------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("bs,kbs", SPLITS, ids=["block16", "block32-kernel16"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
@pytest.mark.parametrize("order", ORDERS)
def test_store_then_load_into_other_blocks(order, dtype, bs, kbs, managers):
    cache = Cache(order, dtype, bs, kbs)
    w, mgr, rec = make_worker(cache, managers)
    n = 3 * CHUNK
    toks = random_tokens(n)
    src, dst = blocks_for(cache, SRC, n), blocks_for(cache, DST, n)
    keys = chunk_keys(toks, w.ns)
    torch.cuda.synchronize()

    w.store(StoreOp("r1", toks, None, 0, src))
    assert "r1" in w.pending, "a CUDA store must be asynchronous (committed later)"
    assert not any(mgr.cpu.contains(k) for k in keys), "visible before the copy was polled"
    finish_request(w, "r1")
    assert all(mgr.cpu.contains(k) for k in keys) and not w.pending and w.idle()
    assert rec.stats["stored_chunks"] == 3 and [t for _, _, t in rec.stored] == ["cpu"] * 3
    for ci, k in enumerate(keys):
        assert torch.equal(pool_chunk(mgr, k, w.chunk_bytes), cache.tokens(src, ci * CHUNK, (ci + 1) * CHUNK)), (
            f"chunk {ci} in the pool differs from the reference gather"
        )

    expect = cache.like()
    expect.scatter_ref(dst, 0, n, cache.rows(src, 0, n))
    assert w.load(LoadOp("r2", toks, None, 0, dst)) == set()
    torch.cuda.synchronize()
    assert same_bits(cache.buf, expect.buf), "load wrong, or it wrote outside its destination tokens"
    assert torch.equal(cache.tokens(dst, 0, n), cache.tokens(src, 0, n))
    assert rec.stats["loaded_chunks"] == 3


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp8"])
def test_partial_first_chunk_and_failed_chunk(dtype, managers):
    cache = Cache("LBNHC", dtype, 32, 16)
    w, mgr, rec = make_worker(cache, managers)
    n = 3 * CHUNK
    toks = random_tokens(n, seed=2)
    src, dst = blocks_for(cache, SRC, n), blocks_for(cache, DST, n)
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
    assert same_bits(cache.buf, expect.buf)

    # Chunk 1 missing: chunk 0 loads, chunk 1's blocks and every later block fail, none is written.
    stored0 = cache.rows(src, 0, CHUNK)  # what the pool holds for chunk 0
    cache.randomize(7)  # fresh contents everywhere (the dst blocks hold the loaded data now)
    assert mgr.cpu.delete(keys[1])
    expect = cache.like()
    expect.scatter_ref(dst, 0, CHUNK, stored0)
    failed = w.load(LoadOp("r3", toks, None, 0, dst))
    torch.cuda.synchronize()
    assert failed == set(dst[CHUNK // cache.bs :])
    assert same_bits(cache.buf, expect.buf), "a failed or later chunk was written"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_load_from_disk(mode, tmp_path, managers):
    cache = Cache("BLHNC", torch.bfloat16, 32, 16)
    w, mgr, rec, toks, src, dst, keys = stored_through_to_disk(cache, managers, tmp_path, seed=3)
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
    assert same_bits(cache.buf, expect.buf)
    assert mgr.lookup(keys) == ["cpu", "cpu"]


def test_disk_only_manager(tmp_path, managers):
    """No CPU pool: the store gathers into the pinned scratch buffer synchronously, then writes to disk."""
    cache = Cache("LBNHC", torch.uint8, 16, 16)
    mgr = TierManager(cpu=None, disk=disk_tier(tmp_path))
    w, _, rec = make_worker(cache, managers, mgr)
    n = 2 * CHUNK
    toks = random_tokens(n, seed=4)
    src, dst = blocks_for(cache, SRC, n), blocks_for(cache, DST, n)
    w.store(StoreOp("r1", toks, None, 0, src))
    assert not w.pending and [t for _, _, t in rec.stored] == ["disk", "disk"]
    expect = cache.like()
    expect.scatter_ref(dst, 0, n, cache.rows(src, 0, n))
    assert w.load(LoadOp("r2", toks, None, 0, dst)) == set()
    torch.cuda.synchronize()
    assert same_bits(cache.buf, expect.buf)


# ------------------------------------------------------------------------------ the race
@pytest.mark.parametrize("bs,kbs", SPLITS, ids=["block16", "block32-kernel16"])
@pytest.mark.parametrize("release", ["finished", "preempted"])
def test_store_waits_for_compute_and_keeps_pre_overwrite_data(release, bs, kbs, managers):
    """See the module docstring: the compute stream overwrites the blocks right after vLLM may reuse them."""
    cache = Cache("LBNHC", torch.bfloat16, bs, kbs, seed=10)  # contents A (older than the store)
    before = cache.like(seed=11)  # V: what the compute stream writes just before the store
    after = cache.like(seed=12)  # W: what it writes once the blocks are reused
    w, mgr, rec = make_worker(cache, managers)
    n = 3 * CHUNK
    src, dst = blocks_for(cache, SRC, n), blocks_for(cache, DST, n)
    compute = torch.cuda.Stream()  # vLLM's forward runs on the current stream; not the default one here

    # Warm-up (engine, allocator, pool paths) with other tokens, so the timed store does no first-use work.
    warm = random_tokens(n, seed=99)
    with torch.cuda.stream(compute):
        w.store(StoreOp("warm", warm, None, 0, src))
    w.poll_stores(block=True)
    torch.cuda.synchronize()

    toks = random_tokens(n, seed=5)
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
        wait_reported(w, "r")  # get_transfer_results -> finished_sending; the scheduler frees the blocks
    else:
        w.poll_stores(block=True)  # handle_preemptions, at the start of the step that reuses the blocks
    assert all(mgr.cpu.contains(k) for k in keys) and "r" not in w.pending
    with torch.cuda.stream(compute):
        cache.buf.copy_(after.buf)  # the next step writes other tokens' KV into the reused blocks
    torch.cuda.synchronize()
    assert same_bits(cache.buf, after.buf)

    for ci, k in enumerate(keys):
        got = pool_chunk(mgr, k, w.chunk_bytes)
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
    w, mgr, rec = make_worker(cache, managers)
    n = 3 * CHUNK
    src = blocks_for(cache, SRC, n)
    compute = torch.cuda.Stream()
    torch.cuda.synchronize()
    all_keys = []
    for i in range(rounds):
        toks = random_tokens(n, seed=200 + i)
        all_keys.append(chunk_keys(toks, w.ns))
        with torch.cuda.stream(compute):
            cache.buf.copy_(bank[i].buf)
            w.store(StoreOp(f"r{i}", toks, None, 0, src))
        finish_request(w, f"r{i}")
    torch.cuda.synchronize()
    assert rec.stats["stored_chunks"] == 3 * rounds
    for i, keys in enumerate(all_keys):
        for ci, k in enumerate(keys):
            assert torch.equal(pool_chunk(mgr, k, w.chunk_bytes), bank[i].tokens(src, ci * CHUNK, (ci + 1) * CHUNK)), (
                f"request {i} chunk {ci}"
            )
