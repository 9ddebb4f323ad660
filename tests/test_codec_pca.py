"""The transform-coding experiment (`benchmarks/codec_pca.py`, RESULTS §4.1f): RoPE is Hugging
Face's and is undone exactly, the basis is orthonormal and sorted, decoding unquantized coefficients
gives the KV back, the error is at most half a step per coefficient, escapes are charged and a
coefficient too large for one is refused, the metric weighs the error as ``e^T M e``, the exact first
tokens are put back and charged exactly, and the fitted scheme hits its ratio."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import codec_pca as P  # noqa: E402


def _rope_tables(tokens: int, d: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(tokens, dtype=torch.float64)[:, None] * inv[None]
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def _kv(tokens: int = 512, nl: int = 2, h: int = 2, d: int = 16, seed: int = 3) -> torch.Tensor:
    """bf16 [L, 2, T, H, D] of low rank (4 latent factors) + small noise, keys rotated by RoPE."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(nl, 2, tokens, 4, generator=g, dtype=torch.float64)
    mix = torch.randn(nl, 2, 4, h * d, generator=g, dtype=torch.float64)
    x = (z @ mix + 0.05 * torch.randn(nl, 2, tokens, h * d, generator=g, dtype=torch.float64)).reshape(
        nl, 2, tokens, h, d
    )
    cos, sin = _rope_tables(tokens, d)
    x[:, 0] = P.rope(x[:, 0], cos, sin)
    return x.to(torch.bfloat16)


def test_rope_is_hugging_face_llamas_and_its_inverse_is_exact():
    from transformers.models.llama.configuration_llama import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2)
    cos_hf, sin_hf = LlamaRotaryEmbedding(cfg)(torch.zeros(1, 64, 16), torch.arange(64)[None])
    k = torch.randn(1, 2, 64, 16)  # HF layout [B, H, T, D]
    _, k_hf = apply_rotary_pos_emb(k, k, cos_hf, sin_hf)
    ours = P.rope(k[0].transpose(0, 1).double(), cos_hf[0].double(), sin_hf[0].double())  # [T, H, D]
    assert torch.allclose(ours.float(), k_hf[0].transpose(0, 1), atol=1e-6)
    cos, sin = _rope_tables(64)
    assert torch.allclose(cos.float(), cos_hf[0], atol=1e-6) and torch.allclose(sin.float(), sin_hf[0], atol=1e-6)
    k = torch.randn(3, 64, 2, 16, dtype=torch.float64)
    back = P.rope(P.rope(k, cos, sin), cos, sin, inverse=True)
    assert torch.allclose(back, k, atol=1e-12)
    assert not torch.allclose(P.rope(k, cos, sin), k)


def test_basis_is_orthonormal_sorted_and_finds_the_low_rank():
    kv = _kv()
    cos, sin = _rope_tables(kv.shape[2])
    b = P.Basis([kv], cos, sin, undo_rope=True)
    eye = torch.eye(b.u.shape[-1], dtype=torch.float64)
    assert torch.allclose(b.u.transpose(-1, -2) @ b.u, eye.expand_as(b.u), atol=1e-10)
    assert bool((b.var[..., :-1] >= b.var[..., 1:] - 1e-12).all())
    # 4 latent factors: the first 4 components hold nearly all the energy once RoPE is undone
    share = b.var[..., :4].sum(-1) / b.var.sum(-1)
    assert float(share.min()) > 0.98
    kept = P.Basis([kv], cos, sin, undo_rope=False)
    assert float((kept.var[:, 0, :4].sum(-1) / kept.var[:, 0].sum(-1)).max()) < 0.9  # RoPE spreads K


def test_decode_of_exact_coefficients_is_the_kv_and_error_is_half_a_step():
    kv = _kv()
    cos, sin = _rope_tables(kv.shape[2])
    b = P.Basis([kv], cos, sin, undo_rope=True)
    y = b.coeffs(kv)
    back = b.kv((y.transpose(2, 3) @ b.u.transpose(2, 3)) + b.mu[:, :, None], kv.shape)
    assert torch.equal(back.view(torch.int16), kv.view(torch.int16))
    step = torch.tensor([[0.05, 0.2], [0.1, 0.3]], dtype=torch.float64)
    q = b.quantize(kv, step)
    assert bool(((q * step[:, :, None, None] - y).abs() <= step[:, :, None, None] / 2 + 1e-12).all())
    err = (b.vectors(b.decode(q, step, kv.shape)) - b.vectors(kv)).pow(2).mean((2, 3))
    assert bool((err <= step**2 / 4 + 5e-5).all())  # + the final bf16 rounding (~1e-5 here)
    assert float(err[0, 0]) < float(err[1, 1])  # the finer step, the smaller error


def test_symbols_escape_large_values_and_charge_them():
    q = torch.tensor([[[[0, -127, 127, 128, -400, 32767]]]])
    s, esc = P.symbols(q)
    assert s.tolist() == [[127, 0, 254, 255, 255, 255]] and esc == 3
    with pytest.raises(ValueError, match="does not fit an escape"):
        P.symbols(torch.tensor([[[[1, 32768]]]]))
    kv = _kv(tokens=256)
    cos, sin = _rope_tables(256)
    b = P.Basis([kv], cos, sin, undo_rope=True)
    step = torch.full((2, 2), 0.01, dtype=torch.float64)  # coarse enough for 16-bit escapes
    fine = P.PCAScheme(b, step, [kv])
    bits, esc = fine.bits(kv)
    s, e = P.symbols(b.quantize(kv, step))
    assert esc == e > 0 and bits == pytest.approx(fine.model.bits(s)[0] + P.ESCAPE_BITS * e)
    with pytest.raises(ValueError):  # a step so fine that the coefficients overflow an escape
        P.PCAScheme(b, torch.full((2, 2), 1e-6, dtype=torch.float64), [kv])


def test_metric_weighs_the_error():
    kv = _kv()
    cos, sin = _rope_tables(kv.shape[2])
    n = kv.shape[3] * kv.shape[4]
    g = torch.Generator().manual_seed(5)
    a = torch.randn(2, 2, n, n, generator=g, dtype=torch.float64)
    metric = a @ a.transpose(-1, -2) + n * torch.eye(n, dtype=torch.float64)
    b = P.Basis([kv], cos, sin, undo_rope=True, metric=metric)
    plain = P.Basis([kv], cos, sin, undo_rope=True)
    e = torch.randn(2, 2, 5, n, generator=g, dtype=torch.float64)
    x = plain.vectors(kv)[:, :, :5]
    xw = x @ b.sqrt_m
    # squared norm in the weighted space = e^T M e, and the inverse undoes the weighting
    lhs = ((x + e) @ b.sqrt_m - xw).pow(2).sum(-1)
    rhs = torch.einsum("lpti,lpij,lptj->lpt", e, metric, e)
    assert torch.allclose(lhs, rhs, rtol=1e-9)
    assert torch.allclose(xw @ b.inv_sqrt_m, x, atol=1e-9)


def test_exact_first_tokens_are_put_back_and_counted():
    kv = _kv(tokens=256)
    cos, sin = _rope_tables(256)
    b = P.Basis([kv], cos, sin, undo_rope=True)
    step = torch.full((2, 2), 0.5, dtype=torch.float64)
    s0 = P.PCAScheme(b, step, [kv])
    s2 = P.PCAScheme(b, step, [kv], exact_first=2)
    _, d0, _ = s0.run(kv)
    r2, d2, _ = s2.run(kv)
    assert torch.equal(d2[:, :, :2].view(torch.int16), kv[:, :, :2].view(torch.int16))
    assert not torch.equal(d0[:, :, :2].view(torch.int16), kv[:, :, :2].view(torch.int16))
    assert torch.equal(d2[:, :, 2:].view(torch.int16), d0[:, :, 2:].view(torch.int16))
    q = b.quantize(kv, step)
    sym, esc = P.symbols(q[..., 2:])
    assert s2.bits(kv)[0] == pytest.approx(16.0 * kv[:, :, :2].numel() + s2.model.bits(sym)[0] + P.ESCAPE_BITS * esc)
    assert r2 == pytest.approx(kv.numel() * 16 / s2.bits(kv)[0])


def test_fit_scheme_reaches_the_ratio():
    kv = _kv(tokens=512)
    cos, sin = _rope_tables(512)
    b = P.Basis([kv], cos, sin, undo_rope=True)
    for target in (4.0, 8.0):
        s, c = P.fit_scheme(b, b.rms, [kv], target)
        assert torch.equal(s.step, c * b.rms)  # the c returned is the one of the scheme
        assert s.run(kv)[0] == pytest.approx(target, rel=0.006)
    with pytest.raises(RuntimeError, match="no step reaches"):
        P.fit_scheme(b, b.rms, [kv], 1e5)  # beyond what dropping every component gives


def test_coefficients_of_a_new_tensor_are_its_own():
    # a freed tensor's address can be reused by the next one of the same shape: the remembered
    # tensors are kept alive (so no new tensor can take their address) and matched by identity
    import gc
    import weakref

    kv = _kv(tokens=256)
    cos, sin = _rope_tables(256)
    b = P.Basis([kv], cos, sin, undo_rope=True)
    t = _kv(tokens=256, seed=9)
    ref = weakref.ref(t)
    b.remember([t])
    y = b.coeffs(t)
    del t
    gc.collect()
    assert ref() is not None and b.coeffs(ref()) is y
    for seed in (4, 5, 6):
        other = _kv(tokens=256, seed=seed)
        assert torch.equal(b.coeffs(other), b._transform(other))
        assert not torch.equal(b.coeffs(other), y)
        del other
    t = ref()
    b.forget([t])  # dropped: computed afresh (a new tensor, equal values)
    assert b.coeffs(t) is not y and torch.equal(b.coeffs(t), y)


MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


@pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="SmolLM2-135M not present")
def test_model_metric_of_smollm2():
    """K: diagonal per KV head, equal on each RoPE pair, from the queries of the 3 heads sharing it;
    V: the output projection's Gram matrix of those heads (symmetric, positive definite)."""
    import codec_quality as CQ

    m = P.model_metric("smollm2", ["code_c"])
    nl, n = 30, 3 * 64
    assert m.shape == (nl, 2, n, n)
    k, v = m[:, 0], m[:, 1]
    assert torch.equal(k, torch.diag_embed(torch.diagonal(k, dim1=-2, dim2=-1)))
    dk = torch.diagonal(k, dim1=-2, dim2=-1).reshape(nl, 3, 2, 32)
    assert torch.allclose(dk[:, :, 0], dk[:, :, 1]) and bool((dk > 0).all())
    assert torch.equal(v[:, :64, 64:], torch.zeros(nl, 64, 128, dtype=v.dtype))  # heads do not mix
    model, _ = CQ.load_model(torch.float32, "smollm2")
    wo = model.model.layers[7].self_attn.o_proj.weight.detach().double()[:, 3 * 64 : 6 * 64]  # query heads 3-5
    gram = sum(wo[:, j * 64 : (j + 1) * 64].T @ wo[:, j * 64 : (j + 1) * 64] for j in range(3))
    assert torch.allclose(v[7, 64:128, 64:128], gram)
    assert float(torch.linalg.eigvalsh(v[7]).min()) > 0


def test_layer_groups_round_trip_and_share_a_basis():
    kv = _kv(tokens=256, nl=4)
    cos, sin = _rope_tables(256)
    b = P.Basis([kv], cos, sin, undo_rope=True, group=2)
    x = b.vectors(kv)
    assert x.shape == (2, 2, 256, 2 * 32) and b.u.shape == (2, 2, 64, 64)
    one = P.Basis([kv], cos, sin, undo_rope=True).vectors(kv)
    assert torch.equal(x[1, 0, :, 32:], one[3, 0])  # group 1 holds layers 2 and 3, in order
    assert torch.equal(b.kv(x, kv.shape).view(torch.int16), kv.view(torch.int16))
    g = torch.Generator().manual_seed(2)
    a = torch.randn(4, 2, 32, 32, generator=g, dtype=torch.float64)
    wb = P.Basis([kv], cos, sin, undo_rope=True, metric=a @ a.transpose(-1, -2) + 32 * torch.eye(32), group=2)
    assert torch.equal(wb.kv(wb.vectors(kv), kv.shape).view(torch.int16), kv.view(torch.int16))


def test_record_bytes_are_real_rans_streams_near_the_bound():
    from lmtier.codec import rans

    kv = _kv(tokens=512)
    cos, sin = _rope_tables(512)
    b = P.Basis([kv], cos, sin, undo_rope=True)
    s = P.PCAScheme(b, 0.3 * b.rms, [kv], exact_first=1)
    bits, esc = s.bits(kv)
    nbytes = s.record_bytes(kv)
    # the real streams cost at least the static tables' cross-entropy (no fallback) minus rounding, and
    # their framing stays small next to the payload here
    assert 0.9 * bits / 8 < nbytes < 1.3 * bits / 8
    # the first chunk's first stream decodes back to its symbols with the same tables
    q = b.quantize(kv, s.step)[..., :256]
    sym, _ = P.symbols(q)
    n = q.shape[2]
    one = sym.reshape(q.shape[0] * 2, -1)[0].numpy()
    batch = rans.encode([one], table_ids=0, tables=s._tables, run_lens=256)
    back = rans.decode(batch, s._tables, lengths=[one.size])
    assert bytes(np.asarray(back[0])) == one.tobytes() and n == 32


def test_cli_refuses_bad_options_before_any_model_work(capsys):
    for argv, msg in (
        (["--eval-texts", "nope"], "unknown texts ['nope']"),
        (["--tune-texts", "code_c,xx"], "unknown texts ['xx']"),
        (["--cal-tokens", "0"], "--cal-tokens must be >= 1"),
        (["--layer-group", "0"], "--layer-group 0 must be >= 1"),
        (["--weights", "rel,foo"], "unknown --weights ['foo']"),
        (["--levels", "nosuch"], "nosuch"),
        (["--rounding", "0.6"], "--rounding offsets must be in (0, 0.5]"),
        (["--rounding", "0"], "--rounding offsets must be in (0, 0.5]"),
        (["--scope", "token"], "invalid choice: 'token'"),
        (["--int-gemm", "30"], "--int-gemm 30 must be in 2..24"),
        (["--int-gemm", "16", "--scope", "head"], "with --scope layer"),
        (["--int-matrix-bits", "1"], "--int-matrix-bits must be one or two widths in 2..16"),
        (["--int-matrix-bits", "8,16,4"], "--int-matrix-bits must be one or two widths"),
        (["--token-classes", "-1"], "--token-classes must be >= 0"),
        (["--outliers", "1"], "--outliers shares must be in [0, 1)"),
        (["--token-classes", "0,8", "--records"], "and 0 with --records"),
    ):
        with pytest.raises(SystemExit) as e:
            P.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv


def test_head_scope_has_one_basis_per_head_and_round_trips():
    kv = _kv(tokens=256, nl=4)
    cos, sin = _rope_tables(256)
    b = P.Basis([kv], cos, sin, undo_rope=True, group=2, scope="head")
    x = b.vectors(kv)
    assert x.shape == (2 * 2, 2, 256, 2 * 16) and b.u.shape == (4, 2, 32, 32)
    one = P.Basis([kv], cos, sin, undo_rope=True).vectors(kv)  # [L, 2, T, H * D]
    # row 3 = layer group 1, head 1: layers 2 and 3's head-1 channels, in order
    assert torch.equal(x[3, 1, :, :16], one[2, 1, :, 16:]) and torch.equal(x[3, 1, :, 16:], one[3, 1, :, 16:])
    assert torch.equal(b.kv(x, kv.shape).view(torch.int16), kv.view(torch.int16))
    # the steps' shape is the layer group's: equal for both heads, the mean of their variances
    assert torch.equal(b.rms[0], b.rms[1]) and torch.equal(b.rms[2], b.rms[3])
    assert torch.allclose(b.rms[0].pow(2), b.var[:2].mean(-1).mean(0))
    q = b.quantize(kv, 0.2 * b.rms)
    dec = b.decode(q, 0.2 * b.rms, kv.shape)
    err = (b.vectors(dec) - x).pow(2).mean((2, 3))
    assert bool((err <= (0.2 * b.rms) ** 2 / 4 + 5e-5).all())
    with pytest.raises(ValueError, match="scope must be"):
        P.Basis([kv], cos, sin, undo_rope=True, scope="token")


def test_dead_zone_rounding_zeroes_more_and_bounds_the_error():
    kv = _kv(tokens=256)
    cos, sin = _rope_tables(256)
    b = P.Basis([kv], cos, sin, undo_rope=True)
    step = 0.3 * b.rms
    y = b.coeffs(kv) / step[:, :, None, None]
    near = b.quantize(kv, step)
    dz = b.quantize(kv, step, rounding=0.2)
    assert torch.equal(near, torch.round(y).to(torch.int64))
    assert torch.equal(dz, (torch.sign(y) * torch.floor(y.abs() + 0.2)).to(torch.int64))
    assert int((dz == 0).sum()) > int((near == 0).sum())
    assert bool((dz.abs() <= near.abs()).all())  # never away from zero
    assert float((dz - y).abs().max()) <= 0.8 + 1e-12  # at most (1 - rounding) steps
    s = P.PCAScheme(b, step, [kv], rounding=0.2)
    assert torch.equal(s._quantize(kv), dz) and s.bits(kv)[0] < P.PCAScheme(b, step, [kv]).bits(kv)[0]


def test_integer_transform_is_exact_integer_arithmetic_and_close_to_the_float_one():
    from codec_pca_int import IntBasis

    kv = _kv(tokens=256, nl=4)
    cos, sin = _rope_tables(256)
    g = torch.Generator().manual_seed(2)
    a = torch.randn(4, 2, 32, 32, generator=g, dtype=torch.float64)
    metric = a @ a.transpose(-1, -2) + 32 * torch.eye(32)
    fb = P.Basis([kv], cos, sin, undo_rope=True, metric=metric, group=2)
    ib = IntBasis([kv], cos, sin, undo_rope=True, metric=metric, group=2)
    assert ib.e_int.abs().max() == 127 and torch.equal(ib.e_int, ib.e_int.round())
    # the float64 GEMM of the integers is the int64 one: every partial sum is an exact integer
    x = torch.round(ib.vectors(kv, weighted=False) / ib.sx[:, :, None, None]) - ib.mu_int[:, :, None]
    assert torch.equal((x @ ib.e_int).to(torch.int64), x.to(torch.int64) @ ib.e_int.to(torch.int64))
    # coefficients within ~1 % of the float basis' (int8 matrices), decode error near half a step
    yf, yi = fb.coeffs(kv), ib.coeffs(kv)
    assert float((yi - yf).norm() / yf.norm()) < 0.02
    step = 0.2 * fb.rms
    err = (ib.vectors(ib.decode(ib.quantize(kv, step), step, kv.shape)) - ib.vectors(kv)).pow(2).mean((2, 3))
    assert bool((err <= 1.2 * step**2 / 4 + 5e-4).all())
    assert ib.clamped == 0  # the calibration KV itself stays within its peak
    louder = (kv.float() * 4).to(torch.bfloat16)  # beyond the calibration's peak: clamped, and counted
    ib.coeffs(louder)
    assert ib.clamped > 0
    # a remembered tensor is transformed (and its clamps counted) once, however often it is quantized
    before = ib.clamped
    ib.remember([louder])
    once = ib.clamped
    ib.quantize(louder, step), ib.quantize(louder, step)
    assert once == 2 * before and ib.clamped == once and fb.clamped is None
    with pytest.raises(ValueError, match="scope='layer' only"):
        IntBasis([kv], cos, sin, undo_rope=True, scope="head")
    with pytest.raises(ValueError, match="x_bits must be"):
        IntBasis([kv], cos, sin, undo_rope=True, x_bits=40)
    with pytest.raises(ValueError, match="m_bits and d_bits must be"):
        IntBasis([kv], cos, sin, undo_rope=True, m_bits=17)
    # wider matrices: closer to the float basis
    wide = IntBasis([kv], cos, sin, undo_rope=True, metric=metric, group=2, m_bits=16)
    assert wide.e_int.abs().max() == 32767
    assert float((wide.coeffs(kv) - yf).norm()) < 0.1 * float((yi - yf).norm())
    mixed = IntBasis([kv], cos, sin, undo_rope=True, metric=metric, group=2, m_bits=8, d_bits=16)
    assert torch.equal(mixed.e_int, ib.e_int) and torch.equal(mixed.d_int, wide.d_int)


def test_one_token_class_is_the_static_coder_and_classes_split_loud_tokens():
    import codec_pca_classes as PC
    import codec_rates as CR

    g = torch.Generator().manual_seed(5)
    loud = (torch.arange(600) % 2 == 0).expand(2, 2, 1, 600)  # [R, 2, 1, T]: every other token 8x louder
    q = torch.round(torch.randn(2, 2, 24, 600, generator=g) * torch.where(loud, 8.0, 1.0)).to(torch.int64)
    q[0, 0, 0, 5] = 300  # an escape: symbol 255, raw bits charged by the caller
    tune, held = q[..., :400], q[..., 400:]
    one = PC.ClassCoder([tune], 1)
    sym, _ = P.symbols(tune)  # the plain static tables of the same streams, 12-bit, all 256 symbols
    freq = CR.normalize_table(CR.stream_counts([sym]), torch.ones(sym.shape[0], 256, dtype=torch.bool))
    assert one.bits(held) == pytest.approx(float(CR.static_bits(P.symbols(held)[0], freq).sum()), rel=1e-12)
    two = PC.ClassCoder([tune], 2)
    cls = two.classify(held)
    assert torch.equal(cls.bool(), loud[..., 400:].squeeze(2).expand_as(cls))  # the energy separates them
    assert two.bits(held) < 0.92 * one.bits(held)  # side information included
    # the class is side information: a token's class changes the cost of its symbols only
    assert PC.ClassCoder([tune, tune], 2).bits(held) == pytest.approx(two.bits(held), rel=1e-3)
    with pytest.raises(ValueError, match="classes must be >= 1"):
        PC.ClassCoder([tune], 0)
    with pytest.raises(ValueError, match="shapes disagree"):
        PC.ClassCoder([tune, tune[:, :, :5]], 2)


def test_token_classes_change_the_rate_not_the_decode():
    kv = _kv(tokens=512)
    cos, sin = _rope_tables(512)
    b = P.Basis([kv], cos, sin, undo_rope=True)
    step = 0.3 * b.rms
    plain = P.PCAScheme(b, step, [kv], exact_first=1)
    k4 = P.PCAScheme(b, step, [kv], exact_first=1, classes=4)
    r0, d0, e0 = plain.run(kv)
    r4, d4, e4 = k4.run(kv)
    assert torch.equal(d0.view(torch.int16), d4.view(torch.int16)) and e0 == e4
    q = b.quantize(kv, step)[..., 1:]
    assert k4.bits(kv)[0] == pytest.approx(16.0 * kv[:, :, :1].numel() + k4.classes.bits(q), rel=1e-12)
    assert r4 != r0
    with pytest.raises(ValueError, match="real bytes of the class coder"):
        k4.record_bytes(kv)
    s, c = P.fit_scheme(b, b.rms, [kv], 6.0, exact_first=1, classes=4)
    assert s.classes is not None and s.run(kv)[0] == pytest.approx(6.0, rel=0.006)


def test_outlier_tokens_are_exact_charged_raw_and_found_by_their_energy():
    kv = _kv(tokens=512)
    loud = [77, 300, 301]
    x = kv.double()
    x[:, :, loud] *= 12.0  # louder in every layer and plane (keys stay RoPE-rotated: a scalar commutes)
    kv = x.to(torch.bfloat16)
    cos, sin = _rope_tables(512)
    b = P.Basis([kv], cos, sin, undo_rope=True)
    step = 0.3 * b.rms
    plain = P.PCAScheme(b, step, [kv], exact_first=1)
    out = P.PCAScheme(b, step, [kv], exact_first=1, outliers=4 / 511)  # the tune split's loudest 4 of 511
    mask = out.exact_tokens(kv)
    assert mask[[0, *loud]].all() and int(mask.sum()) == 5  # token 0, the 3 loud ones, the next loudest
    assert bool((plain.exact_tokens(kv) == (torch.arange(512) < 1)).all())
    _, d0, _ = plain.run(kv)
    r, d, _ = out.run(kv)
    assert torch.equal(d[:, :, mask].view(torch.int16), kv[:, :, mask].view(torch.int16))
    assert torch.equal(d[:, :, ~mask].view(torch.int16), d0[:, :, ~mask].view(torch.int16))
    q = b.quantize(kv, step)
    coded = 0.0
    for c, keep in zip(P.PCAScheme._chunks(q), P.PCAScheme._chunks(~mask)):
        sym, esc = P.symbols(c[..., keep])
        coded += out.model.bits(sym)[0] + P.ESCAPE_BITS * esc
    assert out.bits(kv)[0] == pytest.approx(16.0 * 5 * kv[:, :, :1].numel() + coded, rel=1e-12)
    assert r == pytest.approx(kv.numel() * 16 / out.bits(kv)[0])
    s, _ = P.fit_scheme(b, b.rms, [kv], 5.0, exact_first=1, outliers=4 / 511)
    assert s.threshold is not None and s.run(kv)[0] == pytest.approx(5.0, rel=0.006)
    with pytest.raises(ValueError, match="outliers must be in"):
        P.PCAScheme(b, step, [kv], outliers=1.0)
