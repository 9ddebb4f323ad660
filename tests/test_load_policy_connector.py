"""The load policy inside LMTierConnector, against vLLM's real ``Scheduler`` (the fake model runner
of lmtier.testing.scheduler_harness: real paged KV buffer, every read checked).

Deterministic: the decisions come from configured inputs (``prefill_tokens_per_s``,
``load_prior_gbps`` with ``load_min_samples`` too high for measurements to replace them) or from
load samples the test feeds the scheduler's policy; what the measurements themselves do is in
tests/test_load_policy.py (library) and tests/test_load_policy_e2e.py (a real engine, a throttled disk).
"""

from __future__ import annotations

import pytest

from lmtier.integration.vllm.stats import process_decision_totals
from lmtier.testing.scheduler_harness import CHUNK, Harness, hit_of, prompt
from lmtier.testing.vllm import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require_vllm()


NEVER = 10**9  # load_min_samples: the configured inputs decide throughout
FIXED = {"load_policy": "auto", "prefill_tokens_per_s": 1e6, "load_min_samples": NEVER, "load_probe_s": 0}
SLOW_DISK = {**FIXED, "load_prior_gbps": {"disk": 1e-6}}
FAST_DISK = {**FIXED, "load_prior_gbps": {"disk": 1e3}}
# Harness KV: 2 layers x K,V x 1 head x 8 x 4 bytes = 128 bytes/token; at 1e6 tokens/s break-even is
# 0.128 GB/s: a 1 kB/s disk is far below it, a 1 TB/s one far above.


def _decisions_since(before: dict) -> dict:
    now = process_decision_totals()
    return {
        t: {k: v - before.get(t, {}).get(k, 0) for k, v in row.items() if v != before.get(t, {}).get(k, 0)}
        for t, row in now.items()
        if row != before.get(t, {})
    }


def _cold_then_disk_only(h: Harness, n_prompts: int = 3, length: int = 70) -> tuple[list, list[str]]:
    ps = [prompt(40 + i, length) for i in range(n_prompts)]
    refs = [h.add(p) for p in ps]
    h.run()
    h.drop_cpu()  # the chunks are on disk only now
    h.step()  # a scheduler in another process learns of the evictions with the next worker metadata
    h.loads.clear()
    return ps, refs


@pytest.mark.parametrize("split", [False, True], ids=["shared", "split"])
def test_disk_below_breakeven_is_recomputed_not_loaded(make, split):
    h = make(extra=SLOW_DISK, split=split)
    ps, refs = _cold_then_disk_only(h)
    before = process_decision_totals()
    rids = h.rerun(ps, refs)  # outputs identical to the cold (computed) run
    assert h.loads == [], "no load may be issued for chunks on a disk below break-even"
    asked = [r for rid, _, r in h.lookups if rid in rids]
    assert asked and all(r == (0, False) for r in asked)
    assert _decisions_since(before) == {"disk": {"skipped": 3 * hit_of(70) // CHUNK}}
    pol = h.conn.connector_scheduler.policy
    assert not pol.loads("disk") and pol.loads("cpu")
    # The recomputed chunks were stored again, into the CPU pool: the next hits load from there.
    rids2 = h.rerun(ps, refs)
    assert sorted((op.req_id, len(op.token_ids)) for op in h.loads) == sorted((r, hit_of(70)) for r in rids2)
    h.check_clean()


@pytest.mark.parametrize("split", [False, True], ids=["shared", "split"])
def test_disk_above_breakeven_is_loaded_and_measured(make, split):
    h = make(extra=FAST_DISK, split=split)
    ps, refs = _cold_then_disk_only(h)
    before = process_decision_totals()
    rids = h.rerun(ps, refs)
    assert sorted((op.req_id, len(op.token_ids)) for op in h.loads) == sorted((r, hit_of(70)) for r in rids)
    assert _decisions_since(before) == {"disk": {"loaded": 3 * hit_of(70) // CHUNK}}
    # the worker's load samples reached the scheduler (worker metadata; another process when split)
    tiers = h.conn.connector_scheduler.policy.snapshot()["tiers"]
    assert tiers["disk"]["samples"] > 0 and tiers["disk"]["path"] == "raw" and tiers["disk"]["loads"] == 1
    assert tiers["cpu"]["samples"] > 0 and tiers["cpu"]["path"] == "scatter"
    h.check_clean()


def test_always_loads_a_disk_below_breakeven(make):
    h = make(extra={**SLOW_DISK, "load_policy": "always"})
    ps, refs = _cold_then_disk_only(h, n_prompts=2)
    before = process_decision_totals()
    h.rerun(ps, refs)
    assert len(h.loads) == 2
    assert _decisions_since(before) == {"disk": {"loaded": 2 * hit_of(70) // CHUNK}}
    h.check_clean()


def test_claim_stops_at_the_first_slow_chunk(make):
    """A prefix [cpu, cpu, disk, disk] with the disk below break-even: the two CPU chunks load, the
    rest is recomputed (and stored into the pool, so the next time all four load from it)."""
    # 1000 tokens/s: break-even 128 kB/s, far below what the pool's copies measure, far above 128 B/s
    h = make(
        extra={
            "load_policy": "auto",
            "prefill_tokens_per_s": 1e3,
            "load_min_samples": 1,
            "load_probe_s": 0,
            "sync_disk_load_mib": 0,
        }
    )
    long = prompt(7, 140)  # 4 whole chunks before the last token
    short = long[: 2 * CHUNK] + prompt(8, 30)  # shares the first 2 chunks
    r0 = h.add(long)
    h.run()
    h.drop_cpu()
    h.add(short)
    h.run()  # loads its 2 chunks from disk into the pool (promotion)
    pol = h.conn.connector_scheduler.policy
    pol.add_load_samples([("disk", "raw", 128, 1.0)] * 20)  # the disk measures 128 B/s now
    pol.refresh()
    assert not pol.loads("disk")
    h.loads.clear()
    before = process_decision_totals()
    r2 = h.rerun([long], [r0])[0]
    assert [(op.req_id, len(op.token_ids), op.is_async) for op in h.loads] == [(r2, 2 * CHUNK, False)]
    assert _decisions_since(before) == {"cpu": {"loaded": 2}, "disk": {"skipped": 2}}
    h.loads.clear()
    r3 = h.rerun([long], [r0])[0]
    assert [(op.req_id, len(op.token_ids)) for op in h.loads] == [(r3, 4 * CHUNK)]
    h.check_clean()


def test_prefill_rate_is_measured_from_the_steps(make):
    h = make(extra={"load_policy": "auto", "load_min_samples": 1})
    for i in range(3):
        h.add(prompt(60 + i, 100))
    h.run()
    snap = h.conn.connector_scheduler.policy.snapshot()
    assert snap["prefill_tokens_per_s"] > 0 and snap["breakeven_gbps"] == pytest.approx(
        snap["prefill_tokens_per_s"] * 128 / 1e9
    )
    h.check_clean()


@pytest.mark.parametrize("split", [False, True], ids=["shared", "split"])
def test_slow_disk_chunks_load_from_a_faster_copy_in_redis(make, redis_url, split):
    """Chunks written back to a disk below break-even and written through to Redis (above it): the
    scheduler claims them from Redis and the worker never reads the disk."""
    h = make(extra={**FIXED, "load_prior_gbps": {"disk": 1e-6, "remote": 1e3}}, split=split, remote=redis_url)
    ps, refs = _cold_then_disk_only(h)
    m = h.worker.connector_worker.manager
    hits0 = (m.counters["hits_disk"], m.counters["hits_remote"])
    before = process_decision_totals()
    rids = h.rerun(ps, refs)
    want = sorted((r, hit_of(70), ("disk",), True) for r in rids)  # remote chunks load asynchronously
    assert sorted((op.req_id, len(op.token_ids), op.skip_tiers, op.is_async) for op in h.loads) == want
    n = 3 * hit_of(70) // CHUNK
    assert (m.counters["hits_disk"] - hits0[0], m.counters["hits_remote"] - hits0[1]) == (0, n)
    assert _decisions_since(before) == {"remote": {"loaded": n}}
    h.check_clean()
