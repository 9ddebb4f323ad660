"""CPU smoke tests of ``lmtier bench ttft`` on the tiny preset (a 2-layer random Llama)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from lmtier.bench import ttft  # noqa: E402


def _run(tmp_path, *extra):
    out = tmp_path / "ttft.json"
    rc = ttft.main(["--device", "cpu", "--preset", "tiny", "--chunk-tokens", "64", "--iters", "2", "--warmup", "1",
                    "--no-redis", "--quiet", "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_smoke_bf16_cpu_and_disk(tmp_path):
    # 100 tokens: a full chunk + a 36-token tail chunk; 200: three full chunks + a tail.
    rc, res = _run(tmp_path, "--lengths", "100,200", "--disk-dir", str(tmp_path / "disk"), "--dd-bytes", str(16 << 20))
    assert rc == 0
    for k in ("system", "model", "geometry", "rows", "break_even", "ceilings", "tolerance", "checks_ok",
              "control_detected", "skipped", "copy_mode", "notes"):
        assert k in res, k
    assert res["checks_ok"] is True
    assert [r["N"] for r in res["rows"]] == [100, 200]
    assert set(res["break_even"]) == {"cpu", "disk", "disk+codec", "redis"}
    assert res["ceilings"]["disk_dd_GBs"].get("read", 0) > 0
    for r in res["rows"]:
        for k in ("recompute_ms", "cpu_ms", "cpu_pct", "load_ms", "fwd_ms", "disk_ms", "disk_pct", "disk_dd_GBs",
                  "disk_limit_pct"):
            assert isinstance(r[k], float) and r[k] > 0, (r["N"], k)
        for tier in ("cpu", "disk"):
            c = r[f"check_{tier}"]
            assert c["kv_exact"] is True, (r["N"], tier)
            assert c["max_abs_diff"] <= ttft.RTOL * c["ref_absmax"], (r["N"], tier, c)
            assert c["cosine"] >= ttft.MIN_COS
        # a wrong-index load is visible in the logits and in the KV comparison
        ctl = r["check_control_wrong_kv"]
        assert ctl["ok"] is False and ctl["kv_exact"] is False and ctl["logits_ok"] is False
    assert res["control_detected"] is True
    assert not any(k.startswith("redis_") for k in res["rows"][0])
    # the disk directory given is left in place but its tier files are gone
    assert (tmp_path / "disk").is_dir()


def test_lean_forward_matches_recompute_fp32(tmp_path):
    # In float32 the lean last-token forward over loaded KV equals transformers' full prefill closely:
    # this pins the forward's math (RoPE position, GQA grouping, scaling), not just the load.
    rc, res = _run(tmp_path, "--lengths", "150", "--dtype", "float32", "--no-disk", "--compare-layouts")
    assert rc == 0
    (r,) = res["rows"]
    c = r["check_cpu"]
    assert c["kv_exact"] is True
    assert c["max_abs_diff"] <= 1e-4 * max(1.0, c["ref_absmax"]), c
    assert r["fwd_contig_ms"] > 0 and r["transpose_ms"] > 0
    assert "disk_ms" not in r


def test_break_even():
    rows = [{"N": 1024, "recompute_ms": 30.0, "cpu_ms": 31.0, "disk_ms": 500.0},
            {"N": 2048, "recompute_ms": 60.0, "cpu_ms": 20.0, "disk_ms": 900.0}]
    assert ttft.break_even(rows, "cpu") == 2048
    assert ttft.break_even(rows, "disk") is None
    assert ttft.break_even(rows, "redis") is None


def test_cli_dispatch(tmp_path, capsys):
    from lmtier import cli

    out = tmp_path / "t.json"
    rc = cli.main(["bench", "ttft", "--device", "cpu", "--preset", "tiny", "--lengths", "70", "--chunk-tokens", "64",
                   "--iters", "1", "--warmup", "0", "--no-disk", "--no-redis", "--quiet", "--json", str(out)])
    assert rc == 0
    assert json.loads(out.read_text())["rows"][0]["N"] == 70
    assert "break-even cpu" in capsys.readouterr().out
