"""``python -m lmtier.codec.pca`` (`lmtier.codec.pca.calibrate`): on SmolLM2 it writes a model file that
:func:`lmtier.codec.pca.load` reads, of the printed id and both levels, which codes the calibration KV
(token 0 bit for bit, the rest close); every usage error exits 2 with one line, before the model is
loaded where the arguments tell; a failed calibration or fit exits 1 with one line."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from lmtier.codec import pca
from lmtier.codec.pca import calibrate as C
from lmtier.codec.pca import hf as PH
from lmtier.testing.vllm import MODEL_DIR
from tests.test_codec_pca_hf import save_tiny_checkpoint

needs_model = pytest.mark.skipif(
    not (MODEL_DIR / "model.safetensors").exists(), reason=f"SmolLM2-135M not present in {MODEL_DIR}"
)
TEXTS = {  # 439 tokens in all, >= 2*N at G = 1 (N = 192): model run and fit ~25 s on one loaded core
    "tiers.txt": "KV caches are stored in tiers: GPU memory, host memory, local disk and remote stores. The eviction "
    "policy decides which blocks leave the GPU first, and write-back copies them down. " * 4,
    "fib.py": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fib(i) for i in range(20)])\n" * 3,
    "pangrams.txt": "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. Sphinx of "
    "black quartz, judge my vow. Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. " * 2,
}
L, H, D = 30, 3, 64  # SmolLM2-135M: layers, KV heads, head size
REL_BOUND = {"pca_high": 0.05, "pca_default": 0.12}  # measured 0.033 / 0.080 at G = 1 (N = 192 < 439 tokens)


def _write_texts(d) -> list[str]:
    args = []
    for name, text in TEXTS.items():
        (d / name).write_text(text, encoding="utf-8")
        args += ["--text-file", str(d / name)]
    return args


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(exit status, stdout, stderr, model file, the Calibration the command collected)."""
    if not (MODEL_DIR / "model.safetensors").exists():
        pytest.skip(f"SmolLM2-135M not present in {MODEL_DIR}")
    d = tmp_path_factory.mktemp("pca_cal")
    out, err, seen = io.StringIO(), io.StringIO(), []

    def spy(*args, **kw):
        seen.append(collect(*args, **kw))
        return seen[-1]

    collect = PH.collect
    argv = ["--model", str(MODEL_DIR), *_write_texts(d), "--out", str(d / "smol.lmtpca")]
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.setattr(PH, "collect", spy)
        rc = C.main([*argv, "--max-tokens", "256", "--layer-group", "1"])
    return rc, out.getvalue(), err.getvalue(), d / "smol.lmtpca", seen[0]


@needs_model
def test_writes_a_model_file_of_the_printed_id(run):
    rc, out, err, path, cal = run
    assert rc == 0, err
    m = pca.load(path)
    lines = out.splitlines()
    assert len(lines) == 3
    for line, name in zip(lines, ("pca_high", "pca_default")):
        hit = re.fullmatch(rf"{name} +c (\S+)  calibration ratio (\d+\.\d{{3}})x", line)
        assert hit and float(hit[1]) == pytest.approx(m.levels[name].c, rel=1e-5) == pca.PCA_LEVELS[name].c
        assert float(hit[2]) == pytest.approx(m.info["calibration_ratios"][name], abs=5e-4)
    assert 1 < m.info["calibration_ratios"]["pca_high"] < m.info["calibration_ratios"]["pca_default"]
    hit = re.fullmatch(r"model id (0x[0-9a-f]{8}): (\S+) \((\d+) bytes; .*", lines[2])
    assert hit and int(hit[1], 16) == m.model_id and hit[2] == str(path) and int(hit[3]) == path.stat().st_size
    tokens = sum(kv.shape[2] for kv in cal.kv)
    assert 2 * H * D <= tokens < 512 and "error" not in err  # G = 1: N = 192, at least 384 tokens needed
    assert sorted(m.levels) == ["pca_default", "pca_high"]
    assert (m.name, m.num_layers, m.num_heads, m.head_size, m.layer_group) == (MODEL_DIR.name, L, H, D, 1)
    assert np.array_equal(m.inv_freq, cal.inv_freq)
    assert m.info == dict(
        texts=list(TEXTS),
        max_tokens=256,
        metric="model",
        calibration_tokens=tokens,
        outlier_share=0.002,
        calibration_ratios=m.info["calibration_ratios"],
    )


@needs_model
def test_the_file_codes_the_calibration_kv(run):
    rc, _, _, path, cal = run
    assert rc == 0
    m = pca.load(path)
    chunk = cal.kv[0][:, :, :128].contiguous()
    x, err = chunk.float(), {}
    for level in ("pca_high", "pca_default"):
        dec = pca.decode(pca.encode(chunk, start=0, model=m, level=level), model=m)
        assert dec.dtype == torch.bfloat16 and dec.shape == chunk.shape
        assert torch.equal(dec[:, :, 0].view(torch.int16), chunk[:, :, 0].view(torch.int16))  # exact_first
        err[level] = float((dec[:, :, 1:].float() - x[:, :, 1:]).norm() / x[:, :, 1:].norm())
        assert err[level] < REL_BOUND[level], err
    assert err["pca_high"] < err["pca_default"]


def _no_model(*args, **kw):
    raise AssertionError("the model was loaded before a usage error the arguments tell")


USAGE = {  # name: (argv change, message)
    "missing-text": (dict(text="no.txt"), r"--text-file \S+no\.txt: cannot read it \(No such file or directory\)"),
    "text-is-dir": (dict(text="."), r"--text-file \S+: cannot read it \(Is a directory\)"),
    "empty-text": (dict(text="empty.txt"), r"--text-file \S+empty\.txt is empty"),
    "not-utf8": (dict(text="latin1.txt"), r"--text-file \S+latin1\.txt: not UTF-8 \(invalid start byte at byte 3\)"),
    "out-dir-missing": (dict(out="nowhere/m.lmtpca"), r"--out \S+m\.lmtpca: directory \S+nowhere does not exist"),
    "out-is-dir": (dict(out="."), r"--out \S+ is a directory; name the model file to write"),
    "max-tokens": (dict(extra=["--max-tokens", "1"]), r"--max-tokens must be >= 2, got 1"),
    "share-1": (dict(extra=["--outlier-share", "1"]), r"--outlier-share must be in \[0, 1\), got 1\.0"),
    "share-neg": (dict(extra=["--outlier-share", "-0.1"]), r"--outlier-share must be in \[0, 1\), got -0\.1"),
    "group-0": (dict(extra=["--layer-group", "0"]), r"--layer-group must be >= 1, got 0"),
    "group-not-int": (dict(extra=["--layer-group", "six"]), r"argument --layer-group: invalid int value: 'six'"),
    "no-out": (dict(out=None), r"the following arguments are required: --out"),
    "model-missing": (dict(model="nowhere"), r"--model \S+nowhere: no such directory"),
    "model-is-file": (dict(model="a.txt"), r"--model \S+a\.txt: not a directory"),
    "model-no-config": (dict(model="."), r"--model \S+ holds no config\.json: not a transformers checkpoint"),
}  # fmt: skip


def _checkpoint(d, num_layers=L, num_kv_heads=H, head_size=D):
    """``d``/ckpt holding only a Llama ``config.json`` of this geometry (4 query heads per KV head)."""
    config = dict(model_type="llama", num_hidden_layers=num_layers, num_attention_heads=4 * num_kv_heads)
    config.update(num_key_value_heads=num_kv_heads, head_dim=head_size, hidden_size=64)
    (d / "ckpt").mkdir(exist_ok=True)
    (d / "ckpt" / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return d / "ckpt"


def _argv(d, text="a.txt", out="m.lmtpca", extra=(), model="ckpt") -> list[str]:
    """Arguments of a run in ``d``; the model ``d``/ckpt (:func:`_checkpoint`) unless ``model`` names another."""
    (d / "a.txt").write_text("Calibration text.", encoding="utf-8")
    (d / "empty.txt").write_text(" \n", encoding="utf-8")
    (d / "latin1.txt").write_bytes(b"abc\xff")
    if not (d / "ckpt").exists():
        _checkpoint(d)
    argv = ["--model", str(d / model), "--text-file", str(d / "a.txt"), "--text-file", str(d / text), "--no-metric"]
    return argv + (["--out", str(d / out)] if out else []) + list(extra)


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        C.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("usage: python -m lmtier.codec.pca ") and sum("error" in line for line in err) == 1
    return err[-1]


@pytest.mark.parametrize("name", list(USAGE))
def test_usage_errors_exit_2_before_loading(name, tmp_path, capsys, monkeypatch):
    change, message = USAGE[name]
    monkeypatch.setattr(PH, "collect", _no_model)
    line = _usage_error(capsys, _argv(tmp_path, **change))
    assert re.fullmatch(rf"python -m lmtier\.codec\.pca: error: {message}", line), line
    assert not (tmp_path / "m.lmtpca").exists()


def _fake(kv: torch.Tensor):
    """A collect returning a Calibration holding ``kv`` (no model run; no metric: runs use --no-metric)."""
    no_metric = torch.zeros(0, dtype=torch.float64)
    return lambda *a, **kw: PH.Calibration([kv], np.ones(kv.shape[-1] // 2), no_metric, "fake")


def _zeros(num_layers=L, tokens=4, num_kv_heads=H, head_size=D):
    return torch.zeros(num_layers, 2, tokens, num_kv_heads, head_size, dtype=torch.bfloat16)


def test_layer_group_must_divide_the_layers(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(PH, "collect", _no_model)  # config.json tells the layers
    line = _usage_error(capsys, _argv(tmp_path, extra=["--layer-group", "4"]))
    divisors = "[1, 2, 3, 5, 6, 10, 15, 30]"
    assert line.endswith(f"error: --layer-group 4 does not divide the model's 30 layers; use one of {divisors}")
    _checkpoint(tmp_path, num_kv_heads=16, head_size=128)  # H*D = 2048: G <= 4
    line = _usage_error(capsys, _argv(tmp_path, extra=["--layer-group", "4"]))
    assert line.endswith("error: --layer-group 4 does not divide the model's 30 layers; use one of [1, 2, 3]")


def test_layer_group_over_the_vector_limit_is_a_usage_error_naming_the_largest(tmp_path, capsys, monkeypatch):
    assert pca.model.MAX_VECTOR_SIZE == 8192
    monkeypatch.setattr(PH, "collect", _no_model)
    _checkpoint(tmp_path, num_kv_heads=16, head_size=128)
    line = _usage_error(capsys, _argv(tmp_path, extra=["--layer-group", "5"]))
    want = "--layer-group 5: N = G*H*D = 5*16*128 = 10240 values per vector exceed the limit of 8192; the largest "
    assert line.endswith(f"error: {want}allowed layer group is 3"), line


def test_model_too_large_for_any_layer_group_exits_1_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(PH, "collect", _no_model)
    _checkpoint(tmp_path, num_kv_heads=64, head_size=256)
    why = (
        "the model's H*D = 64*256 = 16384 values per layer are too large for the PCA levels: a vector holds "
        "N = G*H*D <= 8192 values, exceeded even at G = 1"
    )
    for extra in ([], ["--layer-group", "1"]):
        assert C.main(_argv(tmp_path, extra=extra)) == 1
        assert capsys.readouterr().err == f"lmtier.codec.pca: error: {why}\n"
    with pytest.raises(PH.CalibrationError, match=re.escape(why)):
        C.default_layer_group(30, num_kv_heads=64, head_size=256)


def test_layer_group_is_checked_again_on_the_collected_kv(tmp_path, capsys, monkeypatch):
    """config.json may not tell the truth (or be readable without transformers): the KV decides."""
    monkeypatch.setattr(PH, "collect", _fake(_zeros(num_layers=28)))
    line = _usage_error(capsys, _argv(tmp_path, extra=["--layer-group", "5"]))  # 5 divides config.json's 30
    assert line.endswith(
        "error: --layer-group 5 does not divide the model's 28 layers; use one of [1, 2, 4, 7, 14, 28]"
    )
    monkeypatch.setattr(PH, "collect", _fake(_zeros(tokens=1, num_kv_heads=64, head_size=256)))
    assert C.main(_argv(tmp_path)) == 1
    assert "the model's H*D = 64*256 = 16384 values per layer are too large" in capsys.readouterr().err


def test_default_layer_group_is_the_divisor_whose_vector_size_is_nearest_1152(tmp_path, capsys, monkeypatch):
    want = {30: 6, 32: 4, 28: 7, 24: 6, 22: 2, 16: 4, 80: 5, 7: 7, 1: 1}  # 32, 16: N 768 and 1536 tie -> G 4
    assert {n: C.default_layer_group(n, num_kv_heads=H, head_size=D) for n in want} == want
    # 8B-class: H*D = 1024 -> N = 1024 at G = 1; H*D = 512: 32 layers -> 2 (N 1024), 27 -> 3 (N 1536 beats 512)
    others = {(32, 8, 128): 1, (30, 16, 128): 1, (30, 32, 256): 1, (32, 4, 128): 2, (27, 4, 128): 3, (26, 2, 64): 13}
    assert {k: C.default_layer_group(k[0], num_kv_heads=k[1], head_size=k[2]) for k in others} == others
    seen = {}

    why = "a fit failure"

    def fit(kvs, starts, **kw):  # the arguments the command fits with, then a fit failure (exit 1)
        seen.update(kw, starts=starts)
        raise RuntimeError(why)

    _checkpoint(tmp_path, num_kv_heads=1, head_size=8)  # G = 30: N = 240 (nearest 1152), 480 tokens needed
    monkeypatch.setattr(PH, "collect", _fake(_zeros(tokens=480, num_kv_heads=1, head_size=8)))
    monkeypatch.setattr(C, "fit", fit)
    assert C.main(_argv(tmp_path, extra=["--max-tokens", "64", "--outlier-share", "0.01"])) == 1
    assert capsys.readouterr().err == f"lmtier.codec.pca: error: {why}\n"
    assert seen["layer_group"] == 30 and seen["starts"] == [0] and seen["metric"] is None
    assert (seen["outlier_share"], seen["name"]) == (0.01, "ckpt")
    assert seen["info"] == dict(texts=["a.txt", "a.txt"], max_tokens=64, metric="none")
    assert not (tmp_path / "m.lmtpca").exists()
    _checkpoint(tmp_path, num_kv_heads=16, head_size=128)  # H*D = 2048: G = 1
    monkeypatch.setattr(PH, "collect", _fake(_zeros(num_kv_heads=16, head_size=128)))
    assert C.main(_argv(tmp_path)) == 1  # too few tokens: the message names G
    assert "for N = G*H*D = 1*16*128 = 2048 values per vector" in capsys.readouterr().err


def test_too_few_calibration_tokens_exit_1_before_the_fit(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(C, "fit", lambda *a, **kw: pytest.fail("fitted on too few tokens"))
    monkeypatch.setattr(PH, "collect", _fake(_zeros(tokens=2303)))  # G = 6: N = 1152
    assert C.main(_argv(tmp_path, extra=["--max-tokens", "2303"])) == 1
    why = (
        "2303 calibration tokens collected (2 texts, --max-tokens 2303) for N = G*H*D = 6*3*64 = 1152 values per "
        "vector; at least 2*N = 2304 are needed (more or longer texts, a larger --max-tokens, a smaller --layer-group)"
    )
    assert capsys.readouterr().err == f"lmtier.codec.pca: error: {why}\n"
    monkeypatch.setattr(PH, "collect", _fake(_zeros(tokens=383)))
    assert C.main(_argv(tmp_path, extra=["--layer-group", "1"])) == 1  # G = 1: N = 192
    assert capsys.readouterr().err.endswith("at least 2*N = 384 are needed (more or longer texts)\n")
    assert not (tmp_path / "m.lmtpca").exists()


def test_too_little_text_for_a_real_model_exits_1_naming_the_tokens(tmp_path, capsys):
    """A real (tiny) checkpoint: 2 layers of 2 KV heads of 8, G = 2, N = 32, 64 tokens needed."""
    save_tiny_checkpoint(tmp_path / "ckpt")
    (tmp_path / "words.txt").write_text(" ".join(f"w{i}" for i in range(90)), encoding="utf-8")
    argv = _argv(tmp_path, text="words.txt", extra=["--max-tokens", "2"])
    assert C.main(argv) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("lmtier.codec.pca: error: 4 calibration tokens collected (2 texts, --max-tokens 2) for ")
    assert err.endswith("N = G*H*D = 2*2*8 = 32 values per vector; at least 2*N = 64 are needed (more or longer "
                        "texts, a larger --max-tokens, a smaller --layer-group)")  # fmt: skip


def test_the_step_is_the_levels_whatever_the_calibration_text(tmp_path, capsys):
    """A real (tiny) checkpoint, G = 2, N = 32, 200 tokens: each level's step is its relative step c
    times the spread, whatever share of the calibration tokens is kept exact (with 99 % exact the
    ratios collapse; they were a search target before, which then had no solution)."""
    save_tiny_checkpoint(tmp_path / "ckpt")
    (tmp_path / "words.txt").write_text(" ".join(f"w{i * 7 % 99}" for i in range(200)), encoding="utf-8")
    argv = ["--model", str(tmp_path / "ckpt"), "--text-file", str(tmp_path / "words.txt")]
    ratios = {}
    for share in (0.002, 0.99):
        out = tmp_path / f"m{share}.lmtpca"
        assert C.main([*argv, "--out", str(out), "--outlier-share", str(share)]) == 0
        m = pca.load(out)
        assert m.layer_group == 2
        assert {n: lv.c for n, lv in m.levels.items()} == {n: lv.c for n, lv in pca.PCA_LEVELS.items()}
        ratios[share] = m.info["calibration_ratios"]
    capsys.readouterr()
    for name in pca.PCA_LEVELS:
        assert ratios[0.99][name] < 1.1 < ratios[0.002][name], ratios


def test_calibration_and_fit_errors_exit_1(tmp_path, capsys, monkeypatch):
    nan = torch.full((L, 2, 384, H, D), float("nan"), dtype=torch.bfloat16)
    monkeypatch.setattr(PH, "collect", _fake(nan))  # the real fit's ValueError
    assert C.main(_argv(tmp_path, extra=["--layer-group", "1"])) == 1
    assert capsys.readouterr().err == "lmtier.codec.pca: error: calibration KV holds NaN or inf\n"
    assert not (tmp_path / "m.lmtpca").exists()


@pytest.mark.parametrize(
    "config, message",
    [
        ("{bad", r"config: OSError: It looks like the config file at '\S+' is not a valid JSON file"),
        ('{"model_type": "nosuch"}', "config: ValueError: The checkpoint .* model type `nosuch`"),
    ],
    ids=["bad-json", "unknown-model-type"],
)
def test_checkpoints_transformers_cannot_load_exit_1_with_one_line(config, message, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(config)
    assert C.main(_argv(tmp_path)) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(rf"lmtier\.codec\.pca: error: {re.escape(str(ckpt))}: cannot load the {message}.*\n", err), err


def test_python_dash_m_reports_a_usage_error_without_a_traceback(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "lmtier.codec.pca", *_argv(tmp_path, text="no.txt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1].startswith("python -m lmtier.codec.pca: error: --text-file ")
