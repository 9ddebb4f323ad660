"""Smoke run of ``lmtier bench remote`` (:mod:`lmtier.bench.remote`) for ``pytest benchmarks/``."""

from __future__ import annotations

import shutil

import pytest

from lmtier.bench.remote import MiB, run


def test_bench_remote_smoke():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    res = run(None, size=1 * MiB, iters=2, rounds=1, rb_n=5, pieces=[256 << 10], inflight=[1, 2])
    names = [r["client"] for r in res["rows"]]
    assert any(n.startswith("raw socket") for n in names)
    for kind in ("direct", "parser"):
        row = next(r for r in res["rows"] if r["client"].startswith("lmtier") and kind in r["client"])
        assert row["get_GBps"] > 0 and row["get_x2_GBps"] > 0 and row["get_%ceil"] > 0
