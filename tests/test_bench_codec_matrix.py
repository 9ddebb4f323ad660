"""`lmtier bench codec --matrix` / `--matrix-run` (lmtier.bench.codec_matrix): the matrix table from a
tiny matrix JSON (min / median / max per (model, scheme), the held-out rows), the ratio-vs-quality
plot, clear errors on a missing / foreign JSON or a missing benchmarks/ directory, and a one-cell
matrix measured on SmolLM2 where the model is present."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmtier import cli
from lmtier.bench import codec_matrix as CMX

ROOT = Path(__file__).resolve().parents[1]


def _cell(model, text, scheme, split, ratio, dppl, top1, kl):
    return dict(model=model, text=text, scheme=scheme, split=split, ratio=ratio, dppl_pct=dppl, top1=top1, kl=kl)


CELLS = [
    _cell("m", "a", "default", "tune", 6.0, 1.0, 95.0, 0.010),
    _cell("m", "b", "default", "held-out", 5.8, 3.0, 91.0, 0.030),
    _cell("m", "c", "default", "held-out", 6.2, -0.5, 97.0, 0.020),
    _cell("m", "a", "high", "tune", 4.1, 0.2, 98.0, 0.002),
    _cell("m2", "a", "default", "tune", 5.4, 2.0, 90.0, 0.040),
]


def test_summarize_min_median_max():
    rows = {(r["model"], r["scheme"]): r for r in CMX.summarize(CELLS)}
    d = rows[("m", "default")]
    assert d["n_texts"] == 3 and d["ratio"] == (5.8, 6.0, 6.2) and d["dppl_pct"] == (-0.5, 1.0, 3.0)
    assert d["top1"] == (91.0, 95.0, 97.0) and d["kl"] == (0.01, 0.02, 0.03)
    assert d["held_n"] == 2 and d["held_dppl_pct"] == (-0.5, 1.25, 3.0)
    assert "held_ratio" not in rows[("m", "high")] and rows[("m2", "default")]["n_texts"] == 1


def test_cli_prints_the_table_and_writes_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "m.json", tmp_path / "m.png"
    js.write_text(json.dumps({"cells": CELLS}))
    assert cli.main(["bench", "codec", "--matrix", str(js), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "5 cells" in out
    assert "| m | default | 3 | 5.80 / 6.00 / 6.20× | -0.50 / +1.00 / +3.00 | 91.00 / 95.00 / 97.00 " in out
    assert "| m | high | 1 | 4.10 / 4.10 / 4.10× | +0.20 / +0.20 / +0.20 |" in out
    held = out.split("held-out texts only:")[1]
    assert "| m | default | 2 | 5.80 / 6.00 / 6.20× | -0.50 / +1.25 / +3.00 |" in held and "| m | high" not in held
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out


def test_plot_says_why_not(tmp_path):
    lossless = [dict(c, scheme="lossless") for c in CELLS]
    assert CMX.plot_matrix(CMX.summarize(lossless), tmp_path / "p.png") == "no lossy matrix cells"
    assert not (tmp_path / "p.png").exists()


def test_cli_matrix_errors(tmp_path):
    with pytest.raises(SystemExit, match="cannot read"):
        cli.main(["bench", "codec", "--matrix", str(tmp_path / "none.json")])
    (tmp_path / "x.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="not a codec matrix JSON"):
        cli.main(["bench", "codec", "--matrix", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="needs a source checkout"):
        cli.main(["bench", "codec", "--matrix-run", "--benchmarks-dir", str(tmp_path)])


MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


@pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="SmolLM2-135M not present")
def test_cli_runs_a_one_cell_matrix(tmp_path, capsys, monkeypatch):
    """One (model, text, scheme) cell measured through benchmarks/: lossless, bit-exact (no second
    model run), its ratio the real records' (1.4-1.6x)."""
    monkeypatch.chdir(ROOT)
    js = tmp_path / "run.json"
    argv = ["bench", "codec", "--matrix-run", "--matrix-texts", "code_c", "--matrix-schemes", "lossless"]
    assert cli.main([*argv, "--json", str(js)]) == 0
    cells = json.loads(js.read_text())["cells"]
    assert len(cells) == 1 and cells[0]["bit_identical"] and cells[0]["dppl_pct"] == 0.0
    assert 1.4 < cells[0]["ratio"] < 1.6 and cells[0]["ratio_is_records"]
    assert "| smollm2 | lossless | 1 |" in capsys.readouterr().out
