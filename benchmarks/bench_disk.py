"""Smoke run of ``lmtier bench disk`` (:mod:`lmtier.bench.disk`) for ``pytest benchmarks/``."""

from __future__ import annotations

from lmtier.bench.disk import MiB, run


def test_bench_disk_smoke(tmp_path):
    res = run(str(tmp_path), size=1 * MiB, count=2, threads=[2], syncs=["data"], rounds=1, inflight=[2])
    assert all(r["store_GBps"] > 0 and r["load_GBps"] > 0 for r in res["rows"])
    assert res["inflight_rows"][0]["load_GBps"] > 0 and res["inflight_rows"][0]["odirect_par_GBps"] > 0
