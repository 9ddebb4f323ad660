"""CPU-side store microbenchmarks (pytest-benchmark): chunk keys, CPU pool, tier manager.

    .venv/bin/python -m pytest benchmarks/bench_store_cpu.py --benchmark-json out/bench_store_cpu.json

Goals (issue 3): lookup keys for a 32K-token prompt under 1 ms; pool operations in microseconds;
store/retrieve of a 32 MiB chunk near memcpy speed (the copy ceiling is measured in the same run,
``test_memcpy_ceiling_32mib``). Declared bytes and GB/s are in each benchmark's ``extra_info``.
Set ``LMTIER_BENCH_SMOKE=1`` for a tiny-size smoke run.
"""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest
import torch

from lmtier import envs
from lmtier.keys import Namespace, chunk_keys
from lmtier.manager import TierManager
from lmtier.tiers.cpu import CPUPool
from lmtier.tiers.tenants import TenantShares, tenant_id

SMOKE = envs.LMTIER_BENCH_SMOKE
PROMPT_TOKENS = 1024 if SMOKE else 32 * 1024
CHUNK_BYTES = (1 << 20) if SMOKE else (32 << 20)
NS = Namespace(model="bench", num_layers=32, num_kv_heads=8, head_size=128, kv_dtype="bfloat16", chunk_size=256)


def _key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def _gbps(benchmark, nbytes: int) -> float | None:
    """GB/s from the median time (None under --benchmark-disable)."""
    stats = getattr(benchmark, "stats", None)
    return nbytes / stats.stats.median / 1e9 if stats is not None else None


def _arena(nbytes: int):
    try:
        from lmtier.memory import HostBuffer

        return HostBuffer(nbytes)
    except ImportError:  # compiled module not built yet
        return torch.empty(nbytes, dtype=torch.uint8)


@pytest.mark.parametrize("kind", ["list", "numpy", "torch"])
def test_chunk_keys_32k(benchmark, kind):
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int64)
    tokens = {"list": toks.tolist(), "numpy": toks, "torch": torch.from_numpy(toks)}[kind]
    keys = benchmark(chunk_keys, tokens, NS, cache_salt="tenant")
    assert len(keys) == PROMPT_TOKENS // 256
    benchmark.extra_info.update(tokens=PROMPT_TOKENS, input=kind)


# Tenant budgets (lmtier.tiers.tenants): "off" (default; the ceiling), one tenant, and four tenants
# (shares 0.2 each, the writer / reader cycling through them: evictions reclaim borrowed slots).
BUDGETS = {"off": (None, 1), "on-1": (TenantShares(0.2), 1), "on-4": (TenantShares(0.2), 4)}
TENANTS = ["default"] + [tenant_id(f"tenant-{i}") for i in range(1, 4)]


@pytest.mark.parametrize("budgets", list(BUDGETS))
def test_pool_reserve_commit(benchmark, budgets):
    shares, n = BUDGETS[budgets]
    pool = CPUPool(64 * 4096, 4096, arena=_arena(64 * 4096), tenants=shares)
    counter = itertools.count()
    tenants = itertools.cycle(TENANTS[:n])

    def op():
        s = pool.reserve(_key(next(counter)), tenant=next(tenants))  # evicts once full
        pool.commit(s, 4096)

    benchmark(op)
    benchmark.extra_info.update(
        chunk_bytes=4096, budgets=budgets, note="reserve + commit without payload copy, with eviction"
    )


@pytest.mark.parametrize("budgets", list(BUDGETS))
def test_pool_acquire_release(benchmark, budgets):
    shares, n = BUDGETS[budgets]
    pool = CPUPool(64 * 4096, 4096, arena=_arena(64 * 4096), tenants=shares)
    for i in range(64):
        pool.put(_key(i), b"x" * 4096, tenant=TENANTS[i % n])
    keys = itertools.cycle([_key(i) for i in range(64)])

    def op():
        pool.release(pool.acquire(next(keys)))

    benchmark(op)
    benchmark.extra_info.update(budgets=budgets)


def test_memcpy_ceiling_32mib(benchmark):
    src = torch.ones(CHUNK_BYTES, dtype=torch.uint8)
    dst = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
    benchmark(dst.copy_, src)
    benchmark.extra_info.update(bytes=CHUNK_BYTES, gb_per_s=_gbps(benchmark, CHUNK_BYTES))


@pytest.fixture(scope="module")
def manager():
    slots = 4
    pool = CPUPool(slots * CHUNK_BYTES, CHUNK_BYTES, arena=_arena(slots * CHUNK_BYTES))
    m = TierManager(cpu=pool, store_threads=1)
    yield m
    m.close()


def test_manager_store_32mib(benchmark, manager):
    data = torch.full((CHUNK_BYTES,), 7, dtype=torch.uint8)
    counter = itertools.count(10_000)

    def op():
        assert manager.store(_key(next(counter)), data, timeout_s=None).result()

    benchmark(op)
    benchmark.extra_info.update(bytes=CHUNK_BYTES, gb_per_s=_gbps(benchmark, CHUNK_BYTES))


def test_manager_retrieve_32mib(benchmark, manager):
    data = torch.full((CHUNK_BYTES,), 9, dtype=torch.uint8)
    assert manager.store(_key(1), data, timeout_s=None).result()
    out = torch.empty(CHUNK_BYTES, dtype=torch.uint8)

    def op():
        assert manager.retrieve(_key(1), out)

    benchmark(op)
    assert torch.equal(out, data)
    benchmark.extra_info.update(bytes=CHUNK_BYTES, gb_per_s=_gbps(benchmark, CHUNK_BYTES))


@pytest.mark.parametrize("what", ["lookup", "keys+lookup"])
def test_manager_lookup_32k_all_hits(benchmark, what):
    """Longest-prefix lookup of a 32K-token prompt whose chunks are all in the CPU pool
    (``keys+lookup`` includes hashing the token list: the whole scheduler-side cost)."""
    tokens = list(range(PROMPT_TOKENS))
    keys = chunk_keys(tokens, NS)
    pool = CPUPool(len(keys) * 4096, 4096, arena=torch.empty(len(keys) * 4096, dtype=torch.uint8))
    for k in keys:
        pool.put(k, b"x")
    m = TierManager(cpu=pool)
    fn = (lambda: m.lookup(keys)) if what == "lookup" else (lambda: m.lookup(chunk_keys(tokens, NS)))
    res = benchmark(fn)
    assert res == ["cpu"] * len(keys)
    benchmark.extra_info.update(chunks=len(keys), tokens=PROMPT_TOKENS)
    m.close()
