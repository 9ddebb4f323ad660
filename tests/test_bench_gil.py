"""benchmarks/bench_gil.py: every operation runs and is timed alone and beside a busy thread, the
switch interval is restored, bad arguments are usage errors."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gil.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_gil", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_gil_runs_every_local_operation(tmp_path):
    mod = _module()
    before = sys.getswitchinterval()
    out = tmp_path / "gil.json"
    res = mod.main(["--tokens", "32", "--iters", "1", "--intervals", "0.002,0.001",
                    "--ops", "encode,decode,disk_put,disk_get", "--json", str(out)])  # fmt: skip
    assert sys.getswitchinterval() == before
    rows = json.loads(out.read_text())["rows"]
    assert rows == json.loads(json.dumps(res["rows"]))
    assert [(r["op"], r["interval_s"]) for r in rows] == [
        (op, iv) for iv in (0.002, 0.001) for op in ("encode", "decode", "disk_put", "disk_get")
    ]
    for r in rows:
        assert r["alone_ms"] > 0 and r["contended_ms"] > 0
        excess = (r["contended_ms"] - r["alone_ms"]) / 1e3 / r["interval_s"]
        assert r["handoffs"] == pytest.approx(max(0.0, excess))
    assert res["shape"] == (30, 2, 32, 3, 64)


@pytest.mark.parametrize(
    "args, msg",
    [(["--ops", "encode,nope"], "unknown --ops"), (["--intervals", "x"], "must be numbers"),
     (["--intervals", "0"], "must be > 0"), (["--iters", "0"], "--iters")],
)  # fmt: skip
def test_bench_gil_usage_errors(args, msg, capsys):
    with pytest.raises(SystemExit) as e:
        _module().main(args)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_bench_gil_a_get_that_misses_is_an_error(tmp_path):
    """A get_into that misses (the chunk evicted by the puts between the gets) returns None fast:
    timed as is, it read as a fast tier."""
    mod = _module()
    fns, closers = mod.operations((2, 2, 16, 3, 64), ["disk_get"], str(tmp_path))
    try:
        fns["disk_get"]()
        closers[0].delete(b"g" * 32)
        with pytest.raises(RuntimeError, match="disk_get: miss"):
            fns["disk_get"]()
    finally:
        for c in closers:
            c.close()


def test_bench_gil_an_error_in_the_contended_thread_reaches_the_caller():
    calls = []

    def fn():
        calls.append(1)
        if len(calls) > 2:  # the warm-up and the timed call alone pass; the worker thread's fails
            raise OSError("tier failed")

    with pytest.raises(OSError, match="tier failed"):
        _module().alone_and_contended(fn, 1)
