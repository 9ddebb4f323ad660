"""`lmtier bench` CLI: --model-preset and --plot on every subcommand, the codec quality proxy, and
`all` skipping what the machine lacks with a line saying so (tiny sizes, CPU)."""

from __future__ import annotations

import json

import pytest

from lmtier import cli
from lmtier.bench import codec as bcodec
from lmtier.bench.common import PRESETS, preset

pytest.importorskip("matplotlib")


def _png(path) -> bool:
    return path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_presets_cover_the_issue():
    assert {"llama-3.1-8b", "llama-3.1-70b-tp8", "qwen2.5-7b", "deepseek-v3-mla"} <= set(PRESETS)
    assert preset("Llama-3.1-8B").bytes_per_token() == 32 * 2 * 8 * 128 * 2
    assert preset("deepseek-v3-mla").bytes_per_token() == 61 * 576 * 2
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("gpt-5")


def test_codec_synthetic_quality_proxy_and_plot(tmp_path):
    js, png = tmp_path / "c.json", tmp_path / "c.png"
    rc = cli.main(["bench", "codec", "--synthetic", "--model-preset", "qwen2.5-7b", "--chunks", "1",
                   "--chunk-tokens", "32", "--iters", "1", "--levels", "lossless", "high", "low",
                   "--quiet", "--json", str(js), "--plot", str(png)])
    assert rc == 0 and _png(png)
    res = json.loads(js.read_text())
    assert res["synthetic"] is True and res["data"].startswith("SYNTHETIC") and "qwen2.5-7b" in res["data"]
    assert res["geometry"]["L"] == 28 and res["geometry"]["H"] == 4
    rows = {r["level"]: r for r in res["rows"]}
    assert rows["lossless"]["rel_err"] == 0 and rows["lossless"]["attn_rel_err"] == 0
    # more compression, more error: the proxy orders the levels
    assert 1.0 < rows["lossless"]["ratio"] < rows["high"]["ratio"] < rows["low"]["ratio"]
    assert 0 < rows["high"]["rel_err"] < rows["low"]["rel_err"] < 0.5
    assert rows["high"]["snr_db"] > rows["low"]["snr_db"] > 5
    assert 0 < rows["high"]["attn_rel_err"] < rows["low"]["attn_rel_err"]
    assert len(rows["high"]["per_layer"]["snr_k_db"]) == 28
    assert rows["high"]["encode_GBps"] > 0 and rows["high"]["decode_GBps"] > 0


def test_codec_rejects_mla_for_synthetic(tmp_path):
    with pytest.raises(SystemExit, match="MLA"):
        bcodec.main(["--synthetic", "--model-preset", "deepseek-v3-mla", "--chunks", "1", "--quiet"])


def test_attn_proxy_is_zero_for_exact_and_positive_for_noise():
    import torch

    x = bcodec.synthetic_kv(1, 2, 16, 2, 16).float()
    assert bcodec.attn_rel_err(x, x) == 0.0
    assert bcodec.attn_rel_err(x, x + 0.1 * torch.randn_like(x)) > 0


def test_transfer_cpu_plot_and_preset(tmp_path):
    js, png = tmp_path / "t.json", tmp_path / "t.png"
    rc = cli.main(["bench", "transfer", "--device", "cpu", "--batches", "1", "--cache-gb", "0.05",
                   "--model-preset", "llama-3.1-70b-tp8", "--quiet", "--json", str(js), "--plot", str(png)])
    assert rc == 0 and _png(png)
    res = json.loads(js.read_text())
    assert res["geometry"]["name"] == "llama-3.1-70b-tp8"
    assert res["rows"][0]["gather_GBs"] > 0


def test_disk_plot_and_preset(tmp_path):
    js, png = tmp_path / "d.json", tmp_path / "d.png"
    rc = cli.main(["bench", "disk", "--dir", str(tmp_path / "d"), "--model-preset", "smollm2-135m", "--count", "2",
                   "--rounds", "1", "--threads", "2", "--sync", "none", "--inflight", "2", "--quiet",
                   "--json", str(js), "--plot", str(png)])
    assert rc == 0 and _png(png)
    res = json.loads(js.read_text())
    assert res["chunk_bytes"] == 256 * preset("smollm2-135m").bytes_per_token() // 4096 * 4096
    assert res["inflight_rows"][0]["inflight"] == 2


def test_all_skips_with_a_line(monkeypatch, capsys):
    calls = []
    import lmtier.bench.codec
    import lmtier.bench.transfer

    monkeypatch.setattr(lmtier.bench.transfer, "main", lambda a: calls.append(("transfer", a)) or 0)
    monkeypatch.setattr(lmtier.bench.codec, "main", lambda a: calls.append(("codec", a)) or 0)
    monkeypatch.setattr(cli, "_script", lambda name, a: calls.append((name, a)) or 0)
    monkeypatch.setattr(cli, "_has_gpu", lambda: False)
    monkeypatch.setattr(cli, "_redis_available", lambda: None)
    assert cli.main(["bench", "all", "--model-preset", "qwen2.5-7b", "--plot-dir", "/tmp/x"]) == 0
    out = capsys.readouterr().out
    assert "skipping remote — no Redis" in out and "skipping ttft — no GPU" in out and "skipping rans" in out
    names = [c[0] for c in calls]
    assert names == ["transfer", "disk", "codec"]
    for _, a in calls:
        assert "--model-preset" in a and "qwen2.5-7b" in a and any(x.endswith(".png") for x in a)
    assert "ttft: skipped (no GPU)" in out
