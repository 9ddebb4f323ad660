"""``benchmarks/codec_pca_product.py`` (RESULTS §4.1i): its argument checks, its per-context coding
(every record byte counted, exact tokens and escapes read from the records) and ``--combine``'s
matrix file, which ``lmtier bench codec --matrix`` reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import codec_pca_product as B  # noqa: E402

from lmtier.bench.codec_matrix import load_cells, summarize  # noqa: E402
from lmtier.codec import pca  # noqa: E402


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tune-texts", "nope"], "unknown texts ['nope']"),
        (["--tune-texts", "code_c", "--eval-texts", "code_c,de_man"], "tune and eval texts overlap: ['code_c']"),
        (["--levels", "pca_high,low"], "unknown levels ['low']"),
        (["--extra-cal", "cal_code_py,de_man"], "unknown calibration texts ['de_man']"),
        (["--calibration-ratio", "pca_default"], "--calibration-ratio needs LEVEL=R, got 'pca_default'"),
        (["--calibration-ratio", "low=3"], "--calibration-ratio 'low=3': a PCA level and a ratio above 1"),
        (["--calibration-ratio", "pca_high=1"], "--calibration-ratio 'pca_high=1': a PCA level and a ratio above 1"),
        (["--combine", "out.json"], "--combine needs OUT and at least one JSON"),
        (["--windows", "0"], "--windows and --window-stride must be >= 1, got 0 and 1216"),
    ],
)
def test_usage_errors(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        B.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def _model_and_kv() -> tuple[pca.PCAModel, torch.Tensor]:
    """A model fitted on synthetic correlated KV (L=2, H=2, D=8, one layer per group), and a context of
    100 tokens (one loud token) from the same source."""
    g = torch.Generator().manual_seed(7)
    mix = torch.randn(2, 2, 4, 16, generator=g)

    def kv(t: int) -> torch.Tensor:
        z = torch.randn(2, 2, t, 4, generator=g)
        x = (z @ mix + 0.05 * torch.randn(2, 2, t, 16, generator=g)).reshape(2, 2, t, 2, 8)
        return x.to(torch.bfloat16)

    inv = 1.0 / 10000 ** (np.arange(0, 8, 2) / 8)
    m = pca.fit([kv(400)], [0], inv_freq=inv, layer_group=1, outlier_share=0.01)
    ctx = kv(100)
    ctx[:, :, 60] *= 30
    return m, ctx


def test_code_text_counts_every_record_byte():
    m, ctx = _model_and_kv()
    nbytes, dec, exact, esc, te, td = B.code_text(m, ctx, "pca_default", chunk=32)
    records = [
        pca.encode(ctx[:, :, s : s + 32].contiguous(), start=s, model=m, level="pca_default") for s in range(0, 100, 32)
    ]
    assert nbytes == sum(len(r) for r in records)
    metas = [pca.codec.record_meta(r)[:3] for r in records]
    assert [s for s, _, _ in metas] == [0, 32, 64, 96]
    assert exact == sum(n for _, n, _ in metas) >= 2  # position 0 and the loud token 60
    assert esc == sum(n for _, _, n in metas)
    assert torch.equal(dec, torch.cat([pca.decode(r, model=m) for r in records], 2))
    assert torch.equal(dec[:, :, [0, 60]], ctx[:, :, [0, 60]])
    assert te > 0 and td > 0


def test_combine_writes_one_matrix_file(tmp_path):
    cell = dict(model="m", text="t", scheme="pca_high", split="held-out", ratio=4.2, dppl_pct=0.1, top1=98.0, kl=0.001)
    for i, name in enumerate(("a.json", "b.json")):
        (tmp_path / name).write_text(json.dumps(dict(cells=[{**cell, "text": f"t{i}", "ratio": 4.0 + i}])))
    out = tmp_path / "m.json"
    assert B.main(["--combine", str(out), str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    cells = load_cells(out)
    assert [c["text"] for c in cells] == ["t0", "t1"]
    (row,) = summarize(cells)
    assert row["ratio"] == (4.0, 4.5, 5.0) and row["held_n"] == 2
    assert json.loads(out.read_text())["sources"] == ["a.json", "b.json"]


def test_calibration_only_texts_share_no_document_with_the_matrix():
    """The calibration-only corpus (``--extra-cal``) never holds a matrix text's document: no source
    spec in common, and no man page of the same command (the matrix's are apt-get's)."""
    import codec_corpus as CC

    cal = set(CC.CALIBRATION_TEXTS.values())
    matrix = {spec for spec, _ in CC.MATRIX_TEXTS.values()}
    assert cal and not cal & matrix and not set(CC.CALIBRATION_TEXTS) & set(CC.MATRIX_TEXTS)
    pages = lambda specs: {s.rsplit("/", 1)[-1] for s in specs if s.startswith("man:")}  # noqa: E731
    assert not pages(cal) & pages(matrix)
    for name in CC.CALIBRATION_TEXTS:
        assert CC.source_spec(name) == CC.CALIBRATION_TEXTS[name]
    assert CC.source_spec("de_man") == CC.MATRIX_TEXTS["de_man"][0]


def _window(n, ppl_ref, ppl, top1, kl, bf16, rec):
    d = dict(n_scored=n, ppl_ref=ppl_ref, ppl=ppl, dppl_pct=100 * (ppl / ppl_ref - 1), top1=top1, kl=kl)
    return d | dict(bf16_bytes=bf16, record_bytes=rec, exact=1, escapes=2, rel_err=0.1, encode_s=1.0, decode_s=2.0)


def test_pooled_windows_are_the_metrics_over_all_scored_tokens():
    """--windows: the perplexities over all windows' scored tokens (NLL weighted by tokens), not a
    mean of the windows' Δppl; one window is that window's cell."""
    one = _window(255, 10.0, 10.2, 97.0, 0.002, 8000, 1000)
    c = B.pooled([one])
    assert c["dppl_pct"] == pytest.approx(2.0) and c["ratio"] == 8.0 and c["top1"] == 97.0 and c["n_scored"] == 255
    two = _window(765, 20.0, 19.8, 99.0, 0.001, 16000, 4000)  # three times the tokens, Δppl -1 %
    c = B.pooled([one, two])
    nll = (255 * np.log(10.2) + 765 * np.log(19.8)) / 1020
    nll_ref = (255 * np.log(10.0) + 765 * np.log(20.0)) / 1020
    assert c["dppl_pct"] == pytest.approx(100 * (np.exp(nll - nll_ref) - 1))
    assert c["dppl_pct"] == pytest.approx(100 * ((1.02 * 0.99**3) ** 0.25 - 1))
    assert c["top1"] == pytest.approx(98.5) and c["kl"] == pytest.approx(0.00125) and c["ratio"] == 4.8
    assert (c["exact"], c["escapes"], c["n_scored"], len(c["windows"])) == (2, 4, 1020, 2)
