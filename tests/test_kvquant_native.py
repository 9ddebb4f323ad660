"""Native CPU quantize / dequantize (lmtier.codec.native, csrc/kvquant_cpu.cpp) against the torch
reference lmtier.codec.quant: byte-identical symbols and side data, bit-identical decoded values,
the documented error bound, hostile symbols and unrepresentable KV rejected per chunk."""

from __future__ import annotations

import pytest
import torch

from lmtier.codec import native as N
from lmtier.codec import quant as Q
from lmtier.codec.levels import get_level

LEVELS = ["high", "default", "low"]
ALL_LEVELS = ["lossless", *LEVELS]
DTYPES = [torch.bfloat16, torch.float16]
# [L, 2, T, H, D]: odd T, T = 1, one head, D = 64 / 128 (+ 32, 256 and small CPU-only head sizes)
SHAPES = [
    (3, 2, 37, 3, 64),
    (5, 2, 1, 2, 64),
    (2, 2, 256, 2, 128),
    (2, 2, 5, 1, 128),
    (1, 2, 64, 8, 128),
    (2, 2, 33, 2, 32),
    (1, 2, 7, 2, 256),
]
SMALL_D_SHAPES = [(2, 2, 9, 3, 8), (1, 2, 4, 1, 1), (1, 2, 3, 2, 16)]
KINDS = ["gauss", "kv_like", "zeros"]


def make(shape, dtype, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    nl, _, t, h, d = shape
    if kind == "gauss":
        return (torch.randn(shape, generator=g) * 2.0).to(dtype)
    if kind == "zeros":  # zero tokens, heads and a zero layer inside real-ish data
        x = torch.randn(shape, generator=g)
        x[:, :, ::3] = 0.0
        x[..., 0, :] = 0.0 if h > 1 else x[..., 0, :]
        x[0] = 0.0
        return x.to(dtype)
    ch = torch.rand(nl, 2, 1, h, d, generator=g) + 0.05
    ch[:, 0, :, :, : max(1, d // 16)] *= 20.0  # key outlier channels
    x = torch.randn(shape, generator=g) * ch
    if t > 1:
        x[:, :, 0] *= 8.0  # attention-sink-like first token
    x[:, :, -1, 0] = 0.0  # an all-zero row
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def check_identical(chunks, level, dtype, num_threads=2):
    shape = tuple(chunks[0].shape)
    syms, sides = N.quantize(chunks, level, num_threads=num_threads)
    outs = N.dequantize(syms, sides, level, shape, dtype, num_threads=num_threads)
    for i, x in enumerate(chunks):
        s_ref, sd_ref = Q.quantize(x, level)
        assert torch.equal(syms[i].reshape(s_ref.shape), s_ref), f"chunk {i}: symbols differ"
        assert torch.equal(sides[i], sd_ref), f"chunk {i}: side differs"
        y_ref = Q.dequantize(s_ref, sd_ref, level, shape, dtype)
        assert torch.equal(bits(outs[i]), bits(y_ref)), f"chunk {i}: dequantized values differ"
    return syms, sides, outs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_identical_to_reference(level, shape, dtype, kind):
    chunks = [make(shape, dtype, kind, seed) for seed in range(2)]
    check_identical(chunks, level, dtype)


@pytest.mark.parametrize("shape", SMALL_D_SHAPES, ids=str)
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_small_head_sizes_cpu(level, shape):
    check_identical([make(shape, torch.bfloat16, "kv_like")], level, torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("level", LEVELS)
def test_round_trip_within_documented_bound(level, dtype):
    shape = (4, 2, 45, 3, 128)
    x = make(shape, dtype, "kv_like", 3)
    (sym,), (side,) = N.quantize([x], level)
    (y,) = N.dequantize([sym], [side], level, shape, dtype)
    bound = Q.error_bound(side, level, shape)
    err = (y.float() - x.float()).abs()
    ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    slack = y.float().abs() * ulp + 2.0**-24  # output cast
    slack = slack + x.float().abs().amax(dim=-1, keepdim=True) * shape[-1] * 2.0**-22  # forward fp32 FWHT
    assert bool((err <= bound + slack).all()), float((err - bound - slack).max())
    zero_rows = x.float().abs().amax(dim=-1) == 0
    assert bool((y.float().abs().amax(dim=-1)[zero_rows] == 0).all()), "all-zero rows must decode to zeros"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lossless_every_bit_pattern(dtype):
    shape = (2, 2, 67, 2, 64)
    u = torch.randint(-(2**15), 2**15, shape, dtype=torch.int32, generator=torch.Generator().manual_seed(5))
    u.view(-1)[: 2**16] = torch.arange(-(2**15), 2**15, dtype=torch.int32)[: u.numel()]  # NaN, inf, -0, subnormals
    x = u.to(torch.int16).view(dtype)
    syms, sides, outs = check_identical([x], "lossless", dtype)
    assert torch.equal(bits(outs[0]), bits(x))


def test_batch_views_threads_and_determinism():
    shape = (3, 2, 29, 2, 64)
    batch = torch.stack([make(shape, torch.bfloat16, "kv_like", s) for s in range(5)])  # [C, L, 2, T, H, D]
    s1, d1 = N.quantize(batch, "default", num_threads=1)
    s2, d2 = N.quantize(list(batch.unbind(0)), "default", num_threads=3)
    for a, b, c, e in zip(s1, s2, d1, d2):
        assert torch.equal(a, b) and torch.equal(c, e)
    check_identical(list(batch.unbind(0)), "default", torch.bfloat16, num_threads=4)


def test_cross_dtype_decode_matches_reference():
    shape = (2, 2, 16, 2, 64)
    x = make(shape, torch.bfloat16, "kv_like")
    (s,), (sd,) = N.quantize([x], "high")
    (y,) = N.dequantize([s], [sd], "high", shape, torch.float16)
    assert torch.equal(bits(y), bits(Q.dequantize(s, sd, "high", shape, torch.float16)))


@pytest.mark.parametrize("level", LEVELS)
def test_hostile_symbols_rejected_naming_chunk(level):
    shape = (3, 2, 11, 2, 64)
    chunks = [make(shape, torch.bfloat16, "gauss", s) for s in range(3)]
    syms, sides = N.quantize(chunks, level)
    qmax = get_level(level).v.qmax_table(shape[0])[2]
    bad = syms[1].clone()
    bad[2, 1, 1, 5, 3] = 2 * qmax + 1  # layer 2, V plane: just above the alphabet
    with pytest.raises(Q.CodecInputError, match="chunk 1: symbol"):
        N.dequantize([syms[0], bad, syms[2]], sides, level, shape)
    with pytest.raises(Q.CodecInputError):
        Q.dequantize(bad, sides[1], level, shape)
    # the largest legal symbol is accepted
    ok = syms[2].clone()
    ok[0, 0, 0, 0, 0] = 2 * get_level(level).k.qmax_table(shape[0])[0]
    N.dequantize([ok], [sides[2]], level, shape)
    bad2 = syms[0].clone()
    bad2.fill_(255)
    with pytest.raises(Q.CodecInputError, match="chunk 0"):
        N.dequantize([bad2], [sides[0]], level, shape)


@pytest.mark.parametrize("level", LEVELS)
def test_unrepresentable_kv_rejected(level):
    shape = (2, 2, 8, 2, 64)
    good = make(shape, torch.float16, "gauss")
    for val, what in (
        (float("nan"), "KV contains NaN or inf"),
        (float("inf"), "KV contains NaN"),
        (-float("inf"), "KV contains NaN"),
    ):
        x = good.clone()
        x[1, 0, 3, 1, 7] = val
        with pytest.raises(Q.CodecInputError, match=f"chunk 1: {what}"):
            N.quantize([good, x], level)
        with pytest.raises(Q.CodecInputError):
            Q.quantize(x, level)
    # |KV| beyond the E5M3 range (bf16 can hold it): scale range error in both
    x = good.to(torch.bfloat16)
    x[0, 1, 2, 0, :] = 3.0e38
    with pytest.raises(Q.CodecInputError, match="chunk 0: KV magnitude"):
        N.quantize([x], level)
    with pytest.raises(Q.CodecInputError):
        Q.quantize(x, level)
    # lossless stores anything
    check_identical([x], "lossless", torch.bfloat16)


def test_scale_range_edge_matches_reference():
    # rows whose absmax / qmax straddles the largest and smallest E5M3 scales
    shape = (1, 2, 6, 1, 64)
    for level in LEVELS:
        q = get_level(level).k.qmax_table(1)[0]
        x = torch.zeros(shape)
        x[0, :, 0, 0, 0] = 28672.0 * q / 64 * 0.999  # just inside the range after the rotation
        x[0, :, 1, 0, 0] = 2.0**-20  # below the smallest scale -> code 1
        x[0, :, 2, 0, :] = 1e-3
        x[0, :, 3, 0, ::2] = -7.5
        xb = x.to(torch.bfloat16)
        check_identical([xb], level, torch.bfloat16)


def test_empty_and_zero_tokens():
    assert N.quantize([], "default") == ([], [])
    shape = (2, 2, 0, 2, 64)
    x = torch.zeros(shape, dtype=torch.bfloat16)
    syms, sides = N.quantize([x], "default")
    assert syms[0].numel() == 0 and sides[0].numel() == 0
    (y,) = N.dequantize(syms, sides, "default", shape)
    assert tuple(y.shape) == shape


def test_unsupported_levels_and_geometry():
    x = make((2, 2, 4, 1, 64), torch.bfloat16, "gauss")
    assert not N.supported("cachegen_ref", x.shape)
    with pytest.raises(ValueError, match="not implemented natively"):
        N.quantize([x], "cachegen_ref")
    y = make((1, 2, 4, 1, 48), torch.bfloat16, "gauss")
    with pytest.raises(ValueError):
        N.quantize([y], "default")
    check_identical([y], "lossless", torch.bfloat16)  # any head size for lossless
    with pytest.raises(TypeError):
        N.quantize([x.float()], "default")
    with pytest.raises(Q.CodecInputError, match="side"):
        syms, sides = N.quantize([x], "default")
        N.dequantize(syms, [sides[0][:-1]], "default", x.shape)


def test_sizes_match_reference():
    for level in ALL_LEVELS:
        for shape in SHAPES:
            nl = shape[0]
            assert N.side_bytes(level, shape) == nl * sum(Q.side_sizes(level, shape))
            assert N.symbol_bytes(shape) == torch.Size(Q.symbol_shape(shape)).numel()
            if level != "lossless":
                assert (N.qmax_table(level, nl) == Q.zero_symbols(level, nl).numpy()).all()


def test_bench_codec_smoke_cpu(tmp_path, monkeypatch):
    from lmtier.bench import codec_kernels as mod

    monkeypatch.setattr(mod, "SMOKE", True)  # what LMTIER_BENCH_SMOKE=1 sets at import
    assert mod.main(["--cpu", "--levels", "lossless", "default", "--json", str(tmp_path / "b.json")]) == 0
