"""``pytest benchmarks/`` collects the ``test_*.py`` suites here and also this directory's
``bench_store_cpu.py`` and ``bench_remote_budgets.py`` (pytest-benchmark cases), ``bench_disk.py``
and ``bench_remote.py`` (tiny smoke runs of ``lmtier bench disk`` / ``remote``); the other
``bench_*.py`` are scripts only.
``LMTIER_BENCH_SMOKE=1`` shrinks the sizes."""

from __future__ import annotations

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_COLLECT = {"bench_store_cpu.py", "bench_disk.py", "bench_remote.py", "bench_remote_budgets.py"}
sys.path.insert(0, os.path.dirname(_HERE))


def pytest_collect_file(file_path, parent):
    # (a file named on the command line is collected by pytest itself: do not add it twice)
    if (
        file_path.name in _COLLECT
        and os.path.dirname(str(file_path)) == _HERE
        and not parent.session.isinitpath(file_path)
    ):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
