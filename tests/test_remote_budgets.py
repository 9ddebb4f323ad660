"""Per-tenant budgets in the Redis tier (issue 18; lmtier.tiers.redis.budget) against a real
redis-server: tenant A filling the tier cannot evict tenant B below B's share; borrowing, reclaim,
denial, LRU by reads; two nodes racing for the same tenant keep the accounting exact; records
deleted behind lmtier's back are reconciled; start-up checks of the server's eviction policy;
the tier manager passes the chunk's tenant through; configuration keys and their errors."""

from __future__ import annotations

import hashlib
import logging
import re

import pytest

from lmtier.config import GIB, ConfigError, LMTierConfig, load_config
from lmtier.testing.redis import start_or_skip
from lmtier.tiers.tenants import DEFAULT_TENANT, SharedBudgets, TenantShares, tenant_id

redis = pytest.importorskip("redis")
from lmtier.tiers.redis import RedisTier  # noqa: E402
from lmtier.tiers.redis.resp import HEADER  # noqa: E402
from tests.threads import run_in_threads  # noqa: E402

A, B, C = tenant_id("tenant-a"), tenant_id("tenant-b"), tenant_id("tenant-c")
S = 1000  # payload bytes of every test record
R = HEADER + S  # bytes one record holds in Redis (what budgets count)
PREFIX = b"lmtier:"


def K(tenant: str, i: int) -> bytes:
    return hashlib.blake2b(f"{tenant}/{i}".encode(), digest_size=32).digest()


def data(i: int, n: int = S) -> bytes:
    return bytes([i & 0xFF]) * n


def budgets(default: float = 0.0, records: int = 10, **shares: float) -> SharedBudgets:
    """Shares by tenant variable name (A/B/C) of a tier holding ``records`` test records."""
    ids = {"A": A, "B": B, "C": C}
    return SharedBudgets(TenantShares(default, tuple((ids[k], v) for k, v in shares.items())), records * R)


def tier(srv, b: SharedBudgets, **kw) -> RedisTier:
    return RedisTier(srv.url, timeout_s=5.0, budgets=b, **kw)


def held(t: RedisTier, tenant: str, n: int = 200) -> list[int]:
    """Which of ``tenant``'s records 0..n-1 the store holds."""
    flags = t.contains_many([K(tenant, i) for i in range(n)])
    return [i for i, f in enumerate(flags) if f]


def check_accounting(srv) -> dict[str, int]:
    """Compare the accounting with the records in the server (read directly); returns used bytes
    per tenant. Every record is accounted once, to one tenant, with its real length; every
    accounting entry has its record; the sums match; no temporary key is left."""
    c = redis.Redis.from_url(srv.url)
    try:
        names = [n for n in c.scan_iter(match=PREFIX + b"*", count=1000)]
        records = {n[len(PREFIX) :]: c.strlen(n) for n in names if re.fullmatch(rb"[0-9a-f]{64}", n[len(PREFIX) :])}
        assert not [n for n in names if b".tmp." in n], "a temporary key was left behind"
        own = {k: v.split() for k, v in c.hgetall(PREFIX + b"tb:own").items()}
        assert set(own) == set(records)
        per: dict[str, int] = {}
        for hexname, (t, size) in own.items():
            assert int(size) == records[hexname]
            per[t.decode()] = per.get(t.decode(), 0) + int(size)
            assert c.zscore(PREFIX + b"tb:lru:" + t, hexname) is not None
        used = {k.decode(): int(v) for k, v in c.hgetall(PREFIX + b"tb:used").items()}
        assert used == per
        assert int(c.get(PREFIX + b"tb:total") or 0) == sum(per.values())
        for t in per:
            assert c.zcard(PREFIX + b"tb:lru:" + t.encode()) == sum(1 for v in own.values() if v[0].decode() == t)
        return used
    finally:
        c.close()


# ------------------------------------------------------------------------------------ the policy
@pytest.mark.parametrize("piece_bytes", [1 << 20, 4096])  # one SET / a record in SETRANGE pieces
def test_a_filling_the_tier_cannot_evict_b_below_its_share(redis_server, piece_bytes):
    """Capacity 10 records; B (share 0.3) writes 3, A (share 0.5) writes 50: B keeps all 3, A its 7
    most recent, every eviction was A's own."""
    n = 5000 if piece_bytes == 4096 else S  # larger than a piece: the pipelined path
    rb = HEADER + n
    b = SharedBudgets(TenantShares(0.0, ((A, 0.5), (B, 0.3))), 10 * rb)
    t = tier(redis_server, b, piece_bytes=piece_bytes)
    for i in range(3):
        assert t.put(K(B, i), data(i, n), tenant=B)
    for i in range(50):
        assert t.put(K(A, i), data(i, n), tenant=A)
    assert held(t, B) == [0, 1, 2]
    assert held(t, A) == list(range(43, 50))
    out = bytearray(n)
    assert t.get_into(K(B, 1), out) == n and bytes(out) == data(1, n)
    st = t.tenant_stats()
    assert st[A]["commits"] == 50 and st[A]["evicted_by_self"] == 43 and st[A]["evicted_others"] == 0
    assert st[B]["evicted_by_others"] == 0 and st[B]["held_bytes"] == 3 * rb == st[B]["guaranteed_bytes"]
    assert check_accounting(redis_server) == {A: 7 * rb, B: 3 * rb}
    u = t.budget_usage()
    assert u[A]["records"] == 7 and u[B]["records"] == 3 and u["*"]["total_bytes"] == 10 * rb
    t.close()


def test_borrow_then_reclaim_oldest_borrowed_first(redis_server):
    """A (no share) borrows the whole tier; B (share 0.3) then writes 5: it reclaims A's 3 oldest
    records and, being over its share, recycles its own after that; A keeps 7."""
    t = tier(redis_server, budgets(B=0.3))
    for i in range(10):
        assert t.put(K(A, i), data(i), tenant=A)
    for i in range(5):
        assert t.put(K(B, i), data(i), tenant=B)
    assert held(t, A) == list(range(3, 10))
    assert held(t, B) == [2, 3, 4]
    st = t.tenant_stats()
    assert st[B]["evicted_others"] == 3 and st[A]["evicted_by_others"] == 3 and st[B]["evicted_by_self"] == 2
    assert check_accounting(redis_server) == {A: 7 * R, B: 3 * R}


def test_reclaim_takes_the_oldest_among_borrowers_and_stops_at_their_share(redis_server):
    """A and B (shares 0.2 each) borrow 5 records each, B's older; C (share 0.6) writes 6: the
    victims are B's 3 oldest, then A's 3 oldest, leaving each its 2; then C recycles its own."""
    t = tier(redis_server, budgets(A=0.2, B=0.2, C=0.6))
    for i in range(5):
        assert t.put(K(B, i), data(i), tenant=B)
    for i in range(5):
        assert t.put(K(A, i), data(i), tenant=A)
    for i in range(6):
        assert t.put(K(C, i), data(i), tenant=C)
    assert held(t, B) == [3, 4] and held(t, A) == [3, 4]  # B's 3 oldest first (older), then A's
    assert held(t, C) == list(range(6))
    for i in range(6, 20):  # C over its share from now on: recycles its own; A/B keep >= 2
        assert t.put(K(C, i), data(i), tenant=C)
    assert len(held(t, A)) >= 2 and len(held(t, B)) >= 2
    assert check_accounting(redis_server)[B] == 2 * R


def test_denied_when_every_record_is_within_its_share(redis_server):
    """Shares oversubscribed (0.5 each, three tenants): A and B fill the tier within their shares;
    C has nothing of its own to recycle and may take nothing: its put is denied, nothing deleted."""
    t = tier(redis_server, budgets(default=0.5))
    for i in range(5):
        assert t.put(K(A, i), data(i), tenant=A) and t.put(K(B, i), data(i), tenant=B)
    assert not t.put(K(C, 0), data(0), tenant=C)
    assert t.counters["budget_denied"] == 1 and t.tenant_stats()[C]["denied"] == 1
    assert held(t, A) == list(range(5)) and held(t, B) == list(range(5)) and held(t, C) == []
    assert check_accounting(redis_server) == {A: 5 * R, B: 5 * R}


def test_reads_refresh_the_lru_order(redis_server):
    """A over its share recycles its least recently *used* record: a record read recently survives."""
    t = tier(redis_server, budgets(A=0.5))
    t.budget.touch_batch = 1  # send every hit at once (deterministic)
    for i in range(10):
        assert t.put(K(A, i), data(i), tenant=A)
    assert t.get_into(K(A, 0), bytearray(S)) == S
    assert t.put(K(A, 10), data(10), tenant=A)
    assert held(t, A, 11) == [0, *range(2, 11)]  # 1 went, not the re-read 0
    assert t.budget.counters["touch_batches"] == 1


def test_overwrite_and_delete_keep_the_accounting(redis_server):
    t = tier(redis_server, budgets(A=0.5))
    assert t.put(K(A, 0), data(0), tenant=A) and t.put(K(A, 0), data(1), tenant=A)
    assert check_accounting(redis_server) == {A: R}
    assert t.put(K(A, 1), data(1, 3 * S), tenant=A)  # another size
    assert check_accounting(redis_server) == {A: R + HEADER + 3 * S}
    assert t.delete(K(A, 0)) and not t.delete(K(A, 0))
    assert check_accounting(redis_server) == {A: HEADER + 3 * S}
    # A corrupt record is deleted by the read, with its accounting.
    c = redis.Redis.from_url(redis_server.url)
    c.setrange(PREFIX + K(A, 1).hex().encode(), HEADER + 5, b"\xff")
    assert t.get_into(K(A, 1), bytearray(3 * S)) is None and t.counters["corrupt"] == 1
    assert check_accounting(redis_server) == {}
    c.close()


def test_tenant_argument_is_checked(redis_server):
    t = tier(redis_server, budgets(A=0.5))
    with pytest.raises(ValueError, match="tenant"):
        t.put(K(A, 0), data(0), tenant="my salt")
    assert t.put(K(A, 0), data(0))  # the default tenant
    assert check_accounting(redis_server) == {DEFAULT_TENANT: R}


def test_budgets_off_leave_no_accounting(redis_server):
    t = RedisTier(redis_server.url)
    assert t.tenant_budgets is None and t.tenant_stats() == {} and t.budget_usage() is None
    assert t.put(K(A, 0), data(0)) and t.put(K(A, 0), data(0), tenant=A)
    c = redis.Redis.from_url(redis_server.url)
    assert [n for n in c.scan_iter(match=PREFIX + b"tb:*")] == []
    c.close()


# ------------------------------------------------------------------------------- several nodes
def test_two_nodes_racing_for_one_tenant_keep_the_accounting_exact(redis_server):
    """Two tiers (two nodes), two threads each, write A's records 0..29 (overwrites race too) and
    B's 0..2, capacity 10 records: afterwards every record is accounted exactly once, the sums
    match, A and B never went over the capacity, and B kept its share."""
    b = budgets(A=0.4, B=0.3)
    nodes = [tier(redis_server, b, max_connections=4), tier(redis_server, b, max_connections=4)]
    for i in range(3):
        assert nodes[0].put(K(B, i), data(i), tenant=B)

    def writer(node: RedisTier, seed: int) -> None:
        for j in range(150):
            i = (j * 7 + seed) % 30
            node.put(K(A, i), data(i + seed), tenant=A)

    run_in_threads(writer, [(nodes[k % 2], k) for k in range(4)])
    used = check_accounting(redis_server)
    assert used[B] == 3 * R and held(nodes[1], B) == [0, 1, 2]
    assert sum(used.values()) <= 10 * R and used[A] == 7 * R
    commits = sum(n.tenant_stats()[A]["commits"] for n in nodes)
    assert commits == 600  # nothing denied: A always had its own records to recycle
    for n in nodes:
        n.close()


def test_a_node_dying_mid_write_leaves_no_accounting(redis_server):
    """A node that wrote a record's pieces under its temporary key and died before the commit
    script: nothing is accounted and nothing visible; the temporary key expires by itself."""
    t = tier(redis_server, budgets(A=0.5))
    assert t.put(K(A, 0), data(0), tenant=A)
    c = redis.Redis.from_url(redis_server.url)
    tmp = b"{" + PREFIX + K(A, 1).hex().encode() + b"}.tmp.deadbeef"
    c.set(tmp, b"x" * R, ex=300)  # what the dead node's pipeline got through
    assert not t.contains(K(A, 1))
    assert c.ttl(tmp) > 0
    c.delete(tmp)
    assert check_accounting(redis_server) == {A: R}
    c.close()


def test_records_deleted_behind_lmtiers_back_are_reconciled(redis_server):
    """Records gone by TTL, by Redis's eviction or an operator's DEL leave accounting entries:
    the reconcile pass removes them, and eviction removes those it meets (counted)."""
    t = tier(redis_server, budgets(A=0.5, B=0.3))
    for i in range(3):
        assert t.put(K(B, i), data(i), tenant=B)
    for i in range(7):
        assert t.put(K(A, i), data(i), tenant=A)
    c = redis.Redis.from_url(redis_server.url)
    c.delete(PREFIX + K(B, 0).hex().encode(), PREFIX + K(B, 1).hex().encode())
    assert t.reconcile_budgets() == 2
    assert check_accounting(redis_server) == {A: 7 * R, B: R}
    # A's oldest deleted behind lmtier's back; once the tier is full again A's put meets it as
    # its victim: un-accounted, no real record evicted.
    c.delete(PREFIX + K(A, 0).hex().encode())
    for i in (7, 8, 9):
        assert t.put(K(A, i), data(i), tenant=A)
    assert held(t, A) == list(range(1, 10))
    assert t.budget.counters["reconciled"] == 3 and t.tenant_stats()[A]["evicted_by_self"] == 0
    assert check_accounting(redis_server) == {A: 9 * R, B: R}
    # TTL: the record's expiry is set by the script.
    t2 = tier(redis_server, budgets(A=0.5, B=0.3), ttl_s=3600)
    assert t2.put(K(C, 0), data(0), tenant=C)
    assert 0 < c.ttl(PREFIX + K(C, 0).hex().encode()) <= 3600
    c.close()


def test_scripts_reload_after_a_flush(redis_server):
    t = tier(redis_server, budgets(A=0.5))
    assert t.put(K(A, 0), data(0), tenant=A)
    c = redis.Redis.from_url(redis_server.url)
    c.script_flush()
    loads = t.budget.counters["script_loads"]
    assert t.put(K(A, 1), data(1), tenant=A) and t.delete(K(A, 0))
    assert t.budget.counters["script_loads"] > loads
    assert check_accounting(redis_server) == {A: R}
    c.close()


def test_server_down_at_start(redis_server):
    """The scripts are not loaded yet: the first put sends the commit script itself (EVAL), then loads them."""
    redis_server.kill()
    t = tier(redis_server, budgets(A=0.5))
    assert t.budget.counters["script_loads"] == 0
    redis_server.restart()
    assert t.put(K(A, 0), data(0), tenant=A) and t.put(K(A, 1), data(1), tenant=A)
    assert t.budget.counters["script_loads"] == 1
    assert check_accounting(redis_server) == {A: 2 * R}
    t.close()


# ------------------------------------------------------------------------------- start-up checks
def test_startup_warns_about_allkeys_policy_and_small_maxmemory(caplog):
    srv = start_or_skip(extra_args=("--maxmemory-policy", "allkeys-lru"), maxmemory=1 << 20)
    try:
        with caplog.at_level(logging.WARNING, "lmtier.tiers.remote"):
            t = tier(srv, SharedBudgets(TenantShares(0.5), 2 << 20))
        text = caplog.text
        assert "allkeys-lru" in text and "noeviction" in text
        assert "below remote_tenant_capacity" in text
        t.close()
    finally:
        srv.close()


def test_startup_is_quiet_with_noeviction_and_warns_on_other_settings(redis_server, caplog):
    with caplog.at_level(logging.WARNING, "lmtier.tiers.remote"):
        t1 = tier(redis_server, budgets(A=0.5))
        assert caplog.text == ""
        t2 = tier(redis_server, budgets(A=0.4))
    assert "other settings" in caplog.text
    t1.close()
    t2.close()


def test_startup_without_config_command(caplog):
    """Managed services refuse CONFIG: lmtier says what to check and carries on."""
    srv = start_or_skip(extra_args=("--rename-command", "CONFIG", ""))
    try:
        with caplog.at_level(logging.INFO, "lmtier.tiers.remote"):
            t = tier(srv, budgets(A=0.5))
        assert "cannot read the server's maxmemory-policy" in caplog.text
        assert t.put(K(A, 0), data(0), tenant=A)
        t.close()
    finally:
        srv.close()


def test_budgets_refused_with_redis_cluster():
    with pytest.raises(ValueError, match="Cluster"):
        RedisTier("redis-cluster://127.0.0.1:1,127.0.0.1:2", budgets=budgets(A=0.5))


# ------------------------------------------------------------------------------- tier manager
def test_manager_passes_the_tenant_to_the_remote_tier(redis_server):
    """Stores (``store(tenant=)``) and slots the caller fills (``reserve(tenant=)`` + ``commit``)
    are written through for their tenant; ``tenant_stats`` reports the remote counts."""
    import torch

    from lmtier.manager import TierManager
    from lmtier.tiers.cpu import CPUPool

    pool = CPUPool(8 * 4096, 4096, arena=torch.empty(8 * 4096, dtype=torch.uint8))
    with TierManager(cpu=pool, remote=tier(redis_server, budgets(A=0.5, B=0.3))) as m:
        assert m.store(K(A, 0), data(0), tenant=A).result()
        slot = pool.reserve(K(B, 0), tenant=B)
        slot.view[:S].copy_(torch.frombuffer(bytearray(data(1)), dtype=torch.uint8))
        m.commit(slot, S)
        assert m.flush(10.0)
        assert check_accounting(redis_server) == {A: R, B: R}
        st = m.tenant_stats()
        assert st[A]["remote_commits"] == 1 and st[B]["remote_commits"] == 1
        assert st[B]["remote_guaranteed_bytes"] == int(0.3 * 10 * R)


def test_decorators_forward_the_tenant(redis_server):
    from lmtier.tiers.seal import KeyRing, SealKey
    from lmtier.tiers.seal.tier import OVERHEAD_BYTES, SealedTier

    ring = KeyRing.of(SealKey.from_bytes(bytes(range(32)), source="test"))
    s = SealedTier(tier(redis_server, budgets(A=0.5)), ring)
    assert s.tenant_budgets is not None
    assert s.put(K(A, 0), data(0), tenant=A)
    assert check_accounting(redis_server) == {A: R + OVERHEAD_BYTES}
    assert s.tenant_stats()[A]["commits"] == 1
    assert s.get_into(K(A, 0), bytearray(S)) == S


# ------------------------------------------------------------------------------- configuration
def test_config_keys():
    url = "redis://127.0.0.1:6379/0"
    cfg = LMTierConfig.from_dict(
        {"remote_url": url, "remote_tenant_share": 0.1, "remote_tenant_shares": f"{A}=0.5", "remote_tenant_capacity": 2}
    )
    assert cfg.remote.tenants == SharedBudgets(TenantShares(0.1, ((A, 0.5),)), 2 * GIB)
    assert cfg.remote.tenants.guaranteed_bytes(A) == GIB and cfg.remote.tenants.guaranteed_bytes(B) == int(0.2 * GIB)
    assert LMTierConfig.from_dict(cfg.to_dict() | {"remote_url": url}).remote.tenants == cfg.remote.tenants
    assert LMTierConfig.from_dict({"remote_url": url}).remote.tenants is None
    env = {
        "LMTIER_REMOTE_URL": url,
        "LMTIER_REMOTE_TENANT_SHARES": f"{B}=0.25",
        "LMTIER_REMOTE_TENANT_CAPACITY": "0.5",
    }
    assert load_config(env=env).remote.tenants == SharedBudgets(TenantShares(0.0, ((B, 0.25),)), GIB // 2)


@pytest.mark.parametrize(
    "values,key,why",
    [
        ({"remote_tenant_share": 0.2}, "remote_tenant_share", "needs remote_tenant_capacity"),
        ({"remote_tenant_shares": f"{A}=0.2"}, "remote_tenant_shares", "needs remote_tenant_capacity"),
        ({"remote_tenant_capacity": 1}, "remote_tenant_capacity", "needs remote_tenant_share"),
        ({"remote_tenant_share": 0.2, "remote_tenant_capacity": 0}, "remote_tenant_capacity", "positive"),
        ({"remote_tenant_share": 0.2, "remote_tenant_capacity": -1}, "remote_tenant_capacity", "positive"),
        ({"remote_tenant_share": 0.2, "remote_tenant_capacity": float("inf")}, "remote_tenant_capacity", "finite"),
        ({"remote_tenant_share": 1.5, "remote_tenant_capacity": 1}, "remote_tenant_share", r"\[0, 1\]"),
        ({"remote_tenant_shares": "salt=0.5", "remote_tenant_capacity": 1}, "remote_tenant_shares", "16 hex"),
        (
            {"remote_tenant_shares": f"{A}=0.6,{B}=0.5", "remote_tenant_capacity": 1},
            "remote_tenant_shares",
            "more than 1",
        ),
        ({"remote_tenant_capacity": "big"}, "remote_tenant_capacity", "must be a number"),
    ],
)
def test_config_errors_name_the_key(values, key, why):
    with pytest.raises(ConfigError, match=why) as e:
        LMTierConfig.from_dict({"remote_url": "redis://127.0.0.1:6379/0", **values})
    assert f"{key}=" in str(e.value)


@pytest.mark.parametrize(
    "url,why",
    [("mooncakestore://127.0.0.1:50051/", "Mooncake"), ("redis-cluster://127.0.0.1:7000,127.0.0.1:7001", "Cluster")],
)
def test_config_refuses_budgets_where_they_cannot_hold(url, why):
    with pytest.raises(ConfigError, match=why) as e:
        LMTierConfig.from_dict({"remote_url": url, "remote_tenant_share": 0.2, "remote_tenant_capacity": 1})
    assert "remote_tenant_share=" in str(e.value)


def test_config_without_remote_url_warns(caplog):
    with caplog.at_level(logging.WARNING, "lmtier.config"):
        cfg = LMTierConfig.from_dict({"remote_tenant_share": 0.2, "remote_tenant_capacity": 1})
    assert cfg.remote.tenants is None and "remote_tenant_share=0.2 without remote_url" in caplog.text
