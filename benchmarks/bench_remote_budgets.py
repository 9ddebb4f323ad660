"""Cost of per-tenant budgets in the Redis tier (issue 18; lmtier.tiers.redis.budget), pytest-benchmark:

    .venv/bin/python -m pytest benchmarks/bench_remote_budgets.py --benchmark-json out/bench_remote_budgets.json

A private ``redis-server`` on loopback (no persistence). ``RedisTier.put`` and ``RedisTier.get_into``
of records of ``size`` payload bytes into a tier of 64 records' capacity: ``off`` = no budgets (one
``SET``, or the pieces + ``RENAME``; Redis evicts by itself, ``allkeys-lru`` at a ``maxmemory`` of
64 records; the same-run baseline), ``on-1`` = ``remote_tenant_share: 0.2``
with one tenant, ``on-4`` = four tenants round robin (once full, puts evict across tenants:
reclaiming borrowed bytes). Puts write new keys (so every put after the 64th evicts, with budgets);
gets read the 64 most recent records in turn (with budgets every 32nd get sends the read-refresh
batch). ``LMTIER_BENCH_SMOKE=1`` keeps only the small size.
"""

from __future__ import annotations

import hashlib
import itertools

import pytest

from lmtier import envs
from lmtier.testing.redis import find_redis_server, start_or_skip
from lmtier.tiers.redis import RedisTier
from lmtier.tiers.redis.resp import HEADER
from lmtier.tiers.tenants import SharedBudgets, TenantShares, tenant_id

SIZES = [16 << 10] if envs.LMTIER_BENCH_SMOKE else [16 << 10, 1 << 20]
BUDGETS = {"off": 0, "on-1": 1, "on-4": 4}
TENANTS = ["default"] + [tenant_id(f"tenant-{i}") for i in range(1, 4)]
RECORDS = 64


def _key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


@pytest.fixture(scope="module")
def server():
    if find_redis_server() is None:
        pytest.skip("redis-server not installed")
    srv = start_or_skip()
    yield srv
    srv.close()


def _tier(srv, budgets: str, size: int) -> RedisTier:
    """A clean database; without budgets Redis evicts by itself (``allkeys-lru``, ``maxmemory`` =
    what it uses empty + about 64 records with their allocator overhead: the deployment without
    budgets), with budgets
    ``noeviction`` without ``maxmemory`` (lmtier evicts)."""
    import redis

    c = redis.Redis.from_url(srv.url)
    c.flushdb()
    if BUDGETS[budgets]:
        c.config_set("maxmemory-policy", "noeviction")
        c.config_set("maxmemory", 0)
    else:
        base = int(c.info("memory")["used_memory"])
        c.config_set("maxmemory-policy", "allkeys-lru")
        c.config_set("maxmemory", base + int(1.5 * RECORDS * (HEADER + size)) + (1 << 20))
    c.close()
    b = None
    if BUDGETS[budgets]:
        b = SharedBudgets(TenantShares(0.2), RECORDS * (HEADER + size))
    return RedisTier(srv.url, timeout_s=5.0, budgets=b)


def _put_kw(budgets: str):
    tenants = itertools.cycle(TENANTS[: BUDGETS[budgets] or 1])
    return (lambda: {"tenant": next(tenants)}) if BUDGETS[budgets] else (lambda: {})


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("budgets", list(BUDGETS))
def test_remote_put(benchmark, server, budgets, size):
    tier = _tier(server, budgets, size)
    payload = bytes(size)
    counter = itertools.count()
    kw = _put_kw(budgets)
    for _ in range(RECORDS):  # full from the first timed put on
        assert tier.put(_key(next(counter)), payload, **kw())

    def op():
        assert tier.put(_key(next(counter)), payload, **kw())

    benchmark(op)
    benchmark.extra_info.update(size=size, budgets=budgets, note="put of a new key into a full tier")
    tier.close()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("budgets", list(BUDGETS))
def test_remote_get(benchmark, server, budgets, size):
    tier = _tier(server, budgets, size)
    kw = _put_kw(budgets)
    for i in range(RECORDS):
        assert tier.put(_key(i), bytes(size), **kw())
    keys = itertools.cycle([_key(i) for i in range(RECORDS)])
    out = bytearray(size)

    def op():
        assert tier.get_into(next(keys), out) == size

    benchmark(op)
    benchmark.extra_info.update(size=size, budgets=budgets, note="get_into of a stored record")
    tier.close()
