"""Smoke run of the pytest-benchmark suites in benchmarks/ on tiny sizes (each benchmark once,
its correctness checks included), so the suites cannot rot; the real runs are
``pytest benchmarks/`` (see benchmarks/test_bench_cpu_paths.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("pytest_benchmark")


def test_benchmark_suites_smoke(tmp_path):
    env = dict(os.environ, LMTIER_BENCH_SMOKE="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--benchmark-disable",
            "-o",
            f"cache_dir={tmp_path}",
            os.path.join(ROOT, "benchmarks"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    # the CPU-path suites were collected and ran (not silently skipped)
    last = r.stdout.strip().splitlines()[-1]
    assert " passed" in last and "failed" not in last and "error" not in last, tail
    assert int(last.split(" passed")[0].split()[-1]) >= 25, last
