"""Per-tenant budgets of the CPU pool (lmtier.tiers.tenants, issue 18): tenant A filling the pool
cannot evict tenant B below B's share; borrowing and reclaim; back-pressure when every chunk is
protected; budgets off = the plain LRU; per-tenant counters and hit rates; tenant ids."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch

from lmtier.keys import KeyScope, LoraScope
from lmtier.tiers.base import Eviction
from lmtier.tiers.cpu import CPUPool
from lmtier.tiers.tenants import DEFAULT_TENANT, TenantLedger, TenantShares, tenant_id

A, B, C = tenant_id("tenant-a"), tenant_id("tenant-b"), tenant_id("tenant-c")
SLOT = 4096


def K(tenant: str, i: int) -> bytes:
    return hashlib.blake2b(f"{tenant}/{i}".encode(), digest_size=32).digest()


def pool_of(num_slots: int = 10, tenants: TenantShares | None = None, *, listener=None) -> CPUPool:
    pool = CPUPool(num_slots * SLOT, SLOT, arena=torch.empty(num_slots * SLOT, dtype=torch.uint8), tenants=tenants)
    if listener is not None:
        pool.add_eviction_listener(listener)
    return pool


def put(pool: CPUPool, tenant: str, i: int) -> bool:
    return pool.put(K(tenant, i), bytes([i & 0xFF]) * 100, tenant=tenant)


def held(pool: CPUPool, tenant: str) -> int:
    return sum(1 for i in range(1000) if pool.contains(K(tenant, i)))


def test_tenant_id():
    assert tenant_id(None) == tenant_id("") == tenant_id(b"") == tenant_id(KeyScope()) == DEFAULT_TENANT
    t = tenant_id("salt-1")
    assert len(t) == 16 and int(t, 16) >= 0 and t == tenant_id(b"salt-1")
    assert tenant_id(KeyScope(cache_salt="salt-1", lora=LoraScope("x", 1, "/p"))) == t  # the salt alone
    assert tenant_id("salt-2") != t
    assert "salt-1" not in t
    with pytest.raises(TypeError):
        tenant_id(1)


@pytest.mark.parametrize("with_listener", [False, True])
def test_a_fills_pool_cannot_evict_b_below_share(with_listener):
    """B (share 0.3 = 3 slots) stores 3 chunks; A (share 0.5) stores 50: B keeps all 3, A keeps its
    7 most recent, and every eviction was A's own (counted)."""
    seen: list[bytes] = []
    listener = (lambda ev: seen.extend(ev.keys)) if with_listener else None
    pool = pool_of(10, TenantShares(0.0, ((A, 0.5), (B, 0.3))), listener=listener)
    for i in range(3):
        assert put(pool, B, i)
    for i in range(50):
        assert put(pool, A, i)
    assert [pool.contains(K(B, i)) for i in range(3)] == [True] * 3
    assert [i for i in range(50) if pool.contains(K(A, i))] == list(range(43, 50))
    st = pool.tenant_stats()
    assert st[B]["held_bytes"] == 3 * SLOT and st[B]["guaranteed_bytes"] == 3 * SLOT
    assert st[B]["evicted_by_others"] == 0 and st[A]["evicted_others"] == 0
    assert st[A]["evicted_by_self"] == 43 and st[A]["commits"] == 50 and st[A]["held_bytes"] == 7 * SLOT
    if with_listener:
        assert seen == [K(A, i) for i in range(43)]


def test_borrow_and_reclaim():
    """B borrows free slots beyond its share; A under its share reclaims them (B's oldest first)
    but never below B's share; A at its share recycles its own; a tenant without a share takes
    one borrowed slot and then recycles it."""
    pool = pool_of(10, TenantShares(0.0, ((A, 0.5), (B, 0.3))))
    for i in range(6):  # B borrows 3 slots (6 > g=3): the pool has room
        assert put(pool, B, i)
    for i in range(4):  # free slots
        assert put(pool, A, i)
    assert held(pool, B) == 6
    assert put(pool, A, 4)  # A (4 < g=5) reclaims B's oldest
    assert not pool.contains(K(B, 0)) and held(pool, B) == 5 and held(pool, A) == 5
    assert put(pool, A, 5)  # A at its share: its own LRU
    assert not pool.contains(K(A, 0)) and held(pool, B) == 5
    assert put(pool, C, 0)  # C (g=0): held 0 >= 0, nothing of its own -> a borrower's LRU (B's)
    assert not pool.contains(K(B, 1)) and held(pool, B) == 4
    assert put(pool, C, 1)  # C now recycles its own
    assert not pool.contains(K(C, 0)) and held(pool, B) == 4
    st = pool.tenant_stats()
    assert st[B]["evicted_by_others"] == 2 and st[A]["evicted_others"] == 1 and st[C]["evicted_others"] == 1
    # Reclaim stops at B's share: A keeps storing, B keeps 3 + what A does not need.
    for i in range(6, 40):
        assert put(pool, A, i)
    assert held(pool, B) == 4  # A at share (5) recycles its own: B keeps its last borrowed slot
    assert all(pool.contains(K(B, i)) for i in (2, 3, 4, 5))


def test_reclaim_takes_the_oldest_borrowed_chunk_across_tenants():
    pool = pool_of(10, TenantShares(0.2, ()))  # every tenant: 2 slots
    for t, i in ((A, 0), (B, 0), (A, 1), (B, 1), (A, 2), (B, 2), (A, 3), (B, 3), (A, 4), (B, 4)):
        assert put(pool, t, i)
    assert pool.acquire(K(A, 0)) is not None  # pinned: not evictable
    s = pool.acquire(K(B, 0))
    pool.release(s)  # B0 most recently used
    assert put(pool, C, 0)  # LRU evictable borrowed chunk: A1 (A0 pinned)
    assert not pool.contains(K(A, 1))
    assert put(pool, DEFAULT_TENANT, 0)  # default tenant (share 0.2, held 0): next oldest, B1
    assert not pool.contains(K(B, 1))


def test_denied_when_every_chunk_is_within_its_share():
    pool = pool_of(10, TenantShares(0.0, ((A, 0.5), (B, 0.5))))
    for i in range(5):
        assert put(pool, A, i) and put(pool, B, i)
    assert pool.reserve(K(C, 0), tenant=C) is None
    assert not put(pool, C, 1)
    assert pool.counters["reserve_budget"] == 2 and pool.tenant_stats()[C]["denied"] == 2
    assert held(pool, A) == held(pool, B) == 5


def test_oversubscribed_shares_recycle_own():
    """Default share 0.5 for three tenants (1.5 pools): B under its share, no borrower -> B's own LRU."""
    pool = pool_of(10, TenantShares(0.5, ()))
    for i in range(5):
        assert put(pool, A, i)
    assert put(pool, C, 0)
    for i in range(4):
        assert put(pool, B, i)
    assert put(pool, B, 4)
    assert not pool.contains(K(B, 0)) and held(pool, A) == 5 and held(pool, C) == 1
    assert pool.reserve(K(DEFAULT_TENANT, 0)) is None  # default tenant: nothing of its own, nobody over share


def test_budgets_off_is_plain_lru_and_ignores_tenant():
    pool = pool_of(10)
    for i in range(3):
        assert put(pool, B, i)
    for i in range(10):
        assert put(pool, A, i)
    assert held(pool, B) == 0 and held(pool, A) == 10
    assert pool.tenant_stats() == {} and pool.tenant_budgets is None


def test_single_tenant_same_order_as_budgets_off():
    """Budgets on with one tenant evict exactly what the plain pool evicts (random workload)."""
    rng = random.Random(7)
    on = pool_of(8, TenantShares(0.25, ()))
    off = pool_of(8)
    for step in range(2000):
        i = rng.randrange(40)
        if rng.random() < 0.5:
            a, b = on.acquire(K(A, i)), off.acquire(K(A, i))
            assert (a is None) == (b is None), step
            if a is not None:
                on.release(a)
                off.release(b)
        else:
            assert put(on, A, i) == put(off, A, i)
        assert on.keys() == off.keys(), step


def test_delete_pinned_and_abort_keep_accounting():
    pool = pool_of(4, TenantShares(0.5, ()))
    assert put(pool, A, 0) and put(pool, A, 1)
    s = pool.acquire(K(A, 0))
    assert pool.delete(K(A, 0))
    assert pool.tenant_stats()[A]["held_bytes"] == 2 * SLOT  # pinned after delete: still held
    pool.release(s)
    w = pool.reserve(K(B, 0), tenant=B)
    assert pool.tenant_stats()[B]["held_bytes"] == SLOT
    pool.abort(w)
    st = pool.tenant_stats()
    assert st[A]["held_bytes"] == SLOT and st[B]["held_bytes"] == 0
    assert pool.usage().used_bytes == SLOT


def test_reader_during_write_back_keeps_victim():
    """A reader pinning the victim during write-back keeps it; the next victim follows the rules."""
    pool_box: list[CPUPool] = []
    grabbed: list = []

    def listener(ev: Eviction) -> None:
        if not grabbed:
            grabbed.append(pool_box[0].acquire(ev.keys[0]))

    pool = pool_of(4, TenantShares(0.0, ((A, 0.5),)), listener=listener)
    pool_box.append(pool)
    for i in range(2):
        assert put(pool, A, i)
    for i in range(2):
        assert put(pool, B, i)  # B borrows (g=0)
    assert put(pool, A, 2)  # A at share: its own LRU A0 -> a reader grabs it -> next: A1
    assert pool.contains(K(A, 0)) and not pool.contains(K(A, 1)) and held(pool, B) == 2
    pool.release(grabbed[0])
    st = pool.tenant_stats()
    assert st[A]["evicted_by_self"] == 1 and st[A]["held_bytes"] == 2 * SLOT


def test_ledger_invariant_random():
    """Random stores / reads / deletes of four tenants: no tenant is evicted for another while at or
    below its guarantee; held counts equal the pool's contents."""
    shares = TenantShares(0.1, ((A, 0.4), (B, 0.2)))
    pool = pool_of(20, shares)
    ledger = pool._ledger
    assert isinstance(ledger, TenantLedger)
    rng = random.Random(3)
    tenants = [A, B, C, DEFAULT_TENANT]
    real_evicted = ledger.evicted

    def checked(idx: int, writer: str) -> None:
        owner = ledger.owner[idx]
        if owner != writer:
            assert ledger.held[owner] > ledger.guarantee(owner)
        real_evicted(idx, writer)

    ledger.evicted = checked  # type: ignore[method-assign]  # test-only spy
    pins = []
    for _ in range(3000):
        t = rng.choice(tenants)
        i = rng.randrange(30)
        r = rng.random()
        if r < 0.6:
            put(pool, t, i)
        elif r < 0.85:
            s = pool.acquire(K(t, i))
            if s is not None:
                pins.append(s)
        elif r < 0.95 and pins:
            pool.release(pins.pop(rng.randrange(len(pins))))
        else:
            pool.delete(K(t, i))
    for s in pins:
        pool.release(s)
    st = pool.tenant_stats()
    for t in tenants:
        assert st.get(t, {"held_bytes": 0})["held_bytes"] == held(pool, t) * SLOT


def test_shares_validation():
    with pytest.raises(ValueError, match="more than 1"):
        TenantShares(0.0, ((A, 0.6), (B, 0.5)))
    with pytest.raises(ValueError, match="unique"):
        TenantShares(0.0, ((A, 0.1), (A, 0.1)))
    with pytest.raises(ValueError, match="unique"):
        TenantShares(0.0, (("salt", 0.1),))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        TenantShares(1.5, ())


# ---- configuration ------------------------------------------------------------------------------


def test_config_off_by_default():
    from lmtier.config import LMTierConfig, load_config

    assert LMTierConfig.from_dict({}).cpu.tenants is None
    assert load_config(env={}).cpu.tenants is None
    d = LMTierConfig.from_dict({}).to_dict()
    assert d["cpu_tenant_share"] is None and d["cpu_tenant_shares"] is None


def test_config_keys_and_env():
    from lmtier.config import LMTierConfig, load_config

    cfg = LMTierConfig.from_dict({"cpu_tenant_share": 0.2, "cpu_tenant_shares": f"default=0.1, {A.upper()}=0.5"})
    assert cfg.cpu.tenants == TenantShares(0.2, (("default", 0.1), (A, 0.5)))
    assert LMTierConfig.from_dict(cfg.to_dict()).cpu.tenants == cfg.cpu.tenants
    only = LMTierConfig.from_dict({"cpu_tenant_shares": f"{B}=1"}).cpu.tenants
    assert only == TenantShares(0.0, ((B, 1.0),)) and only.share_of(A) == 0.0
    env = {"LMTIER_CPU_TENANT_SHARE": "0.25", "LMTIER_CPU_TENANT_SHARES": f"{A}=0.5"}
    assert load_config(env=env).cpu.tenants == TenantShares(0.25, ((A, 0.5),))
    assert load_config(env={"LMTIER_CPU_TENANT_SHARES": "none"}).cpu.tenants is None


@pytest.mark.parametrize(
    "values,key,why",
    [
        ({"cpu_tenant_share": 1.5}, "cpu_tenant_share", r"\[0, 1\]"),
        ({"cpu_tenant_share": -0.1}, "cpu_tenant_share", r"\[0, 1\]"),
        ({"cpu_tenant_share": "half"}, "cpu_tenant_share", "must be a number"),
        ({"cpu_tenant_share": True}, "cpu_tenant_share", "must be a number"),
        ({"cpu_tenant_shares": 0.5}, "cpu_tenant_shares", "must be a string"),
        ({"cpu_tenant_shares": "my-salt=0.5"}, "cpu_tenant_shares", "16 hex digits"),
        ({"cpu_tenant_shares": f"{A}"}, "cpu_tenant_shares", "tenant_id=fraction"),
        ({"cpu_tenant_shares": f"{A}=x"}, "cpu_tenant_shares", "not a number"),
        ({"cpu_tenant_shares": f"{A}=1.5"}, "cpu_tenant_shares", r"\[0, 1\]"),
        ({"cpu_tenant_shares": f"{A}=nan"}, "cpu_tenant_shares", r"\[0, 1\]"),
        ({"cpu_tenant_shares": f"{A}=0.2,{A}=0.1"}, "cpu_tenant_shares", "listed twice"),
        ({"cpu_tenant_shares": f"{A}=0.6,{B}=0.5"}, "cpu_tenant_shares", "more than 1"),
        ({"cpu_tenant_shares": f"{A}=0.5,"}, "cpu_tenant_shares", "tenant_id=fraction"),
    ],
)
def test_config_errors_name_the_key(values, key, why):
    from lmtier.config import ConfigError, LMTierConfig

    with pytest.raises(ConfigError, match=why) as e:
        LMTierConfig.from_dict(values)
    assert f"{key}=" in str(e.value)


def test_config_bad_env_names_the_variable():
    from lmtier.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="LMTIER_CPU_TENANT_SHARE"):
        load_config(env={"LMTIER_CPU_TENANT_SHARE": "lots"})


def test_salt_never_in_config_or_stats():
    from lmtier.config import LMTierConfig

    cfg = LMTierConfig.from_dict({"cpu_tenant_shares": f"{tenant_id('secret-salt')}=0.5"})
    assert "secret-salt" not in repr(cfg) and "secret-salt" not in str(cfg.to_dict())


# ---- the tier manager -------------------------------------------------------------------------


def test_manager_from_config_tenant_hit_rates():
    """The manager builds the pool with the configured budgets, stores per tenant and reports
    per-tenant hits / misses (hit rates) beside the pool's usage and evictions."""
    from lmtier.config import LMTierConfig
    from lmtier.keys import Namespace, chunk_keys
    from lmtier.manager import TierManager

    ns = Namespace(model="m", num_layers=1, num_kv_heads=1, head_size=64, kv_dtype="float16", chunk_size=16)
    assert ns.chunk_bytes == 4096
    cfg = LMTierConfig.from_dict(
        {"chunk_size": 16, "max_local_cpu_size": 10 * SLOT / 2**30, "cpu_tenant_shares": f"{B}=0.3"}
    )
    with TierManager.from_config(cfg, ns) as m:
        assert m.cpu is not None and m.cpu.tenant_budgets == cfg.cpu.tenants and m.cpu.num_slots == 10
        kb = chunk_keys(list(range(3 * 16)), ns, cache_salt="tenant-b")
        ka = chunk_keys(list(range(1000, 1000 + 20 * 16)), ns, cache_salt="tenant-a")
        for k in kb:
            assert m.store(k, bytes(4096), tenant=tenant_id("tenant-b"), timeout_s=None).result()
        for k in ka:
            assert m.store(k, bytes(4096), tenant=tenant_id("tenant-a"), timeout_s=None).result()
        out = bytearray(4096)
        assert [m.retrieve(k, out, tenant=B) for k in kb] == [True] * 3
        got_a = [m.retrieve(k, out, tenant=A) for k in ka]
        assert got_a == [False] * 13 + [True] * 7
        st = m.tenant_stats()
        assert st[B]["hits_cpu"] == 3 and st[B].get("misses", 0) == 0 and st[B]["held_bytes"] == 3 * SLOT
        assert st[A]["hits_cpu"] == 7 and st[A]["misses"] == 13 and st[A]["evicted_by_self"] == 13
        assert m.retrieve(kb[0], out)  # no tenant named: not counted per tenant
        assert m.tenant_stats()[B]["hits_cpu"] == 3


# ---- connector stats --------------------------------------------------------------------------


def test_connector_stats_per_tenant():
    pytest.importorskip("vllm")
    from lmtier.integration.vllm.stats import LMTierStats, StatsSink, process_tenant_totals, process_totals

    before = process_tenant_totals().get(A, {}).get("hit_tokens", 0)
    sink = StatsSink()
    assert sink.take() is None
    sink.add_tenant(A, "lookup_tokens", 512)
    sink.add_tenant(A, "hit_tokens", 256)
    sink.add_tenant(A, "held_bytes", 3 * SLOT)
    st = sink.take()
    assert st is not None and sink.take() is None
    other = LMTierStats({"tenants": {A: {"held_bytes": 5 * SLOT, "evicted_by_others": 2}, B: {"commits": 1}}})
    st.aggregate(other)
    assert st.data["tenants"][A] == {
        "lookup_tokens": 512,
        "hit_tokens": 256,
        "held_bytes": 5 * SLOT,
        "evicted_by_others": 2,
    }
    assert st.reduce()[f"lmtier_tenant_{A}_hit_rate"] == 0.5
    assert process_tenant_totals()[A]["hit_tokens"] == before + 256
    assert "tenants" not in process_totals()  # numeric counters only, as before
