"""`lmtier.bench.codec_pca` on the host (the GPU run: scripts/gpu_run.sh step pcacodec): its synthetic
model is a valid tiled fit, it codes through the product path and reports real ratios and counts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmtier.bench import codec_pca as bench
from lmtier.codec import pca


def test_tiled_model_repeats_the_groups_data(tmp_path):
    m = bench.model_for((2, 2, 16, 2), 200, str(tmp_path))
    t = bench.tiled(m, 3)
    assert (t.num_layers, t.rows) == (6, 3) and t.model_id != m.model_id
    for name in ("e_int", "d_int", "mu_raw", "inv_x_scale"):
        a, b = getattr(m, name), getattr(t, name)
        assert all(np.array_equal(b[i], a[0]) for i in range(3))
    kv = bench.synthetic_kv((6, 2, 16, 2), 32, 64, 5)
    rec = pca.encode(kv, start=64, model=t, level="pca_default")
    out = pca.decode(rec, model=t)
    assert out.shape == kv.shape and (out.float() - kv.float()).abs().max() < kv.float().abs().max()
    assert list(tmp_path.glob("*.lmtpca")), "the one-group fit is cached"


def test_bench_runs_on_the_host(tmp_path):
    out = tmp_path / "r.json"
    rc = bench.main(["--device", "cpu", "--geometry", "4,2,32,2", "--chunks", "2", "--tokens", "64", "--iters", "1",
                     "--calib-tokens", "400", "--json", str(out), "--model-cache", str(tmp_path)])  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["geometry"]["N"] == 128 and [r["level"] for r in res["rows"]] == ["pca_default", "pca_high"]
    for r in res["rows"]:
        assert r["identical"] and r["chunks"] == 2 and r["ratio"] > 1.5 and r["exact_tok"] >= 1
        assert r["encode_GBps"] > 0 and r["decode_GBps"] > 0 and r["memcpy_GBps"] > 0
        assert r["rans_enc_GBps"] > 0 and r["rans_dec_GBps"] > 0 and r["gemm_GBps"] > 0
        assert r["gemm_batched_GBps"] == r["gemm_GBps"], "the host runs no batched GEMM: the same timing"
        assert r["decode_threads_GBps"] > 0
    assert torch.equal(bench.synthetic_kv((2, 2, 16, 2), 8, 0, 1), bench.synthetic_kv((2, 2, 16, 2), 8, 0, 1))


def test_decode_one_decodes_as_the_codec_does(tmp_path):
    m = bench.model_for((2, 2, 16, 2), 200, str(tmp_path))
    kv = bench.synthetic_kv((2, 2, 16, 2), 32, 64, 5)
    rec = pca.encode(kv, start=64, model=m, level="pca_default")
    assert torch.equal(bench.decode_one(rec, m, torch.device("cpu")), pca.decode(rec, model=m))


def test_profile_writes_each_levels_tables(tmp_path):
    prof = tmp_path / "p.txt"
    rc = bench.main(["--device", "cpu", "--geometry", "2,2,32,2", "--chunks", "1", "--tokens", "32", "--iters", "1",
                     "--calib-tokens", "200", "--model-cache", str(tmp_path), "--profile", str(prof)])  # fmt: skip
    assert rc == 0
    heads = [line for line in prof.read_text().splitlines() if line.startswith("==== ")]
    assert heads == [
        f"==== {lv} {p}: {what}"
        for lv in ("pca_default", "pca_high")
        for p in ("encode", "decode")
        for what in ("host Python time (cProfile, cumulative)", "by cpu_time_total")
    ]
    assert "pca/codec.py" in prof.read_text(), "the host profile names the codec's functions"


def test_layer_group_defaults_to_the_calibration_commands(monkeypatch):
    """``--geometry L,H,D`` takes G from default_layer_group, as ``python -m lmtier.codec.pca`` does."""
    seen = []

    def run(args):
        seen.append(list(args.geometry))
        return dict(device="cpu", geometry={}, fit_s=0.0, gemms={}, rows=[dict(identical=True)])

    monkeypatch.setattr(bench, "run", run)
    assert bench.main(["--device", "cpu", "--geometry", "32,8,128"]) == 0
    assert bench.main(["--device", "cpu", "--geometry", "30,3,64"]) == 0
    assert seen == [[32, 8, 128, 1], [30, 3, 64, 6]]
    with pytest.raises(SystemExit):  # H*D too large for any G: a usage error, not a traceback
        bench.main(["--device", "cpu", "--geometry", "30,64,256"])
    assert len(seen) == 2
