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
        assert r["alone_ms"] > 0 and r["contended_ms"] > 0 and r["handoffs"] >= 0
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
