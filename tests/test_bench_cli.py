"""`lmtier bench` CLI: --model-preset and --plot on every subcommand, the codec quality proxy, and
`all` skipping what the machine lacks with a line saying so (tiny sizes, CPU)."""

from __future__ import annotations

import json

import pytest

from lmtier import cli
from lmtier.bench import codec as bcodec
from lmtier.bench.presets import PRESETS, preset

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
    rc = cli.main(
        [
            "bench",
            "codec",
            "--synthetic",
            "--model-preset",
            "qwen2.5-7b",
            "--chunks",
            "1",
            "--chunk-tokens",
            "32",
            "--iters",
            "1",
            "--levels",
            "lossless",
            "high",
            "low",
            "--quiet",
            "--json",
            str(js),
            "--plot",
            str(png),
        ]
    )
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
    rc = cli.main(
        [
            "bench",
            "transfer",
            "--device",
            "cpu",
            "--batches",
            "1",
            "--cache-gb",
            "0.05",
            "--model-preset",
            "llama-3.1-70b-tp8",
            "--quiet",
            "--json",
            str(js),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0 and _png(png)
    res = json.loads(js.read_text())
    assert res["geometry"]["name"] == "llama-3.1-70b-tp8"
    assert res["rows"][0]["gather_GBs"] > 0


def test_disk_plot_and_preset(tmp_path):
    js, png = tmp_path / "d.json", tmp_path / "d.png"
    rc = cli.main(
        [
            "bench",
            "disk",
            "--dir",
            str(tmp_path / "d"),
            "--model-preset",
            "smollm2-135m",
            "--count",
            "2",
            "--rounds",
            "1",
            "--threads",
            "2",
            "--sync",
            "none",
            "--inflight",
            "2",
            "--quiet",
            "--json",
            str(js),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0 and _png(png)
    res = json.loads(js.read_text())
    assert res["chunk_bytes"] == 256 * preset("smollm2-135m").bytes_per_token() // 4096 * 4096
    assert res["inflight_rows"][0]["inflight"] == 2


def test_all_skips_with_a_line(monkeypatch, capsys):
    import importlib

    calls = []
    for name in ("transfer", "disk", "remote", "codec", "rans", "ttft"):
        mod = importlib.import_module(cli.SUBCOMMANDS[name])
        monkeypatch.setattr(mod, "main", lambda a, name=name: calls.append((name, a)) or 0)
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


def test_every_subcommand_is_an_importable_module():
    # issue 14: `lmtier bench disk|remote|rans` ran benchmarks/bench_*.py by path (runpy), which a wheel
    # does not have; every subcommand is now a module of lmtier.bench with main(argv) -> int.
    import importlib

    assert set(cli.SUBCOMMANDS) == {"transfer", "disk", "remote", "mooncake", "codec", "rans", "ttft"}
    for name, module in cli.SUBCOMMANDS.items():
        assert module.startswith("lmtier.bench."), name
        assert callable(importlib.import_module(module).main), name
        assert cli.subcommand_main(name) is importlib.import_module(module).main


def test_bench_package_imports_neither_the_cli_nor_runpy():
    # issue 14: lmtier.cli <-> lmtier.bench.codec was an import cycle (codec's --kernels imported the
    # CLI's runpy helper); nothing under lmtier/bench may import lmtier.cli or run files by path.
    import ast
    import pathlib

    import lmtier.bench

    root = pathlib.Path(lmtier.bench.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) > 8
    for f in [*files, pathlib.Path(cli.__file__)]:
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for n in names:
                assert n != "runpy" and not n.startswith("lmtier.cli"), (f.name, n)


def test_subcommands_run_outside_the_checkout(tmp_path):
    # issue 14: from an installed package (no benchmarks/ or scripts/ next to it) `lmtier bench disk`
    # must run; before, it printed "benchmarks/bench_disk.py not found" and returned 2.
    import os
    import shutil
    import subprocess
    import sys

    import lmtier

    site = tmp_path / "site"
    shutil.copytree(os.path.dirname(lmtier.__file__), site / "lmtier", ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    js = work / "d.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmtier.cli",
            "bench",
            "disk",
            "--dir",
            str(work / "d"),
            "--size-mib",
            "1",
            "--count",
            "1",
            "--rounds",
            "1",
            "--threads",
            "1",
            "--sync",
            "none",
            "--inflight",
            "1",
            "--quiet",
            "--json",
            str(js),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    assert json.loads(js.read_text())["rows"]
    for sub in ("remote", "rans", "ttft"):
        r = subprocess.run(
            [sys.executable, "-m", "lmtier.cli", "bench", sub, "--help"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0 and f"lmtier bench {sub}" in r.stdout, (sub, r.stderr[-1000:])


@pytest.mark.parametrize(
    "argv,rc", [(["--help"], 0), (["-h"], 0), (["bench", "--help"], 0), ([], 2), (["bench"], 2), (["frobnicate"], 2)]
)
def test_cli_help_exits_zero_and_usage_errors_two(argv, rc, capsys):
    """``lmtier --help`` is a request (usage on stdout, exit 0; it used to exit 2); a missing or unknown
    command is a usage error (usage on stderr, exit 2)."""
    from lmtier import cli

    assert cli.main(argv) == rc
    out, err = capsys.readouterr()
    assert "lmtier bench" in (out if rc == 0 else err)
