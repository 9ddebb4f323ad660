"""Reference quantizer of the KV codec (lmtier.codec.quant / levels): bounds, exactness, format."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from lmtier.codec import levels as L
from lmtier.codec import quant as Q

QUANT_LEVELS = ["high", "default", "low", "cachegen_ref"]
ALL_LEVELS = ["lossless", *QUANT_LEVELS]
DTYPES = [torch.bfloat16, torch.float16]
# [L, 2, T, H, D]: odd T, one token, one head, head sizes 64 and 128, more layers than groups
SHAPES = [(3, 2, 37, 3, 64), (30, 2, 1, 3, 64), (4, 2, 256, 1, 128), (2, 2, 5, 2, 64), (1, 2, 256, 8, 128)]

G, T = L.Granularity, L.Transform
# extra levels exercising every granularity and the Hadamard transform
EXTRA = [
    L.Level("t_head", 200, k=L.PlaneQuant(G.HEAD, L._all(63)), v=L.PlaneQuant(G.TOKEN, L._all(3))),
    L.Level(
        "t_hadamard",
        201,
        k=L.PlaneQuant(G.TOKEN_HEAD, L._third(15, 7), T.HADAMARD),
        v=L.PlaneQuant(G.CHANNEL, L._all(7), T.HADAMARD),
    ),
]


def kv_like(shape, dtype=torch.bfloat16, seed=0):
    """Real-like KV: per-channel magnitudes with a few outlier channels, a sink token, zeros."""
    g = torch.Generator().manual_seed(seed)
    nl, _, t, h, d = shape
    ch = torch.rand(nl, 2, 1, h, d, generator=g) + 0.05
    ch[:, 0, :, :, : max(1, d // 16)] *= 20.0  # key outlier channels
    x = torch.randn(shape, generator=g) * ch
    if t > 1:
        x[:, :, 0] *= 8.0  # attention-sink-like first token
    return x.to(dtype)


def half_ulp_bound(y: torch.Tensor, dtype) -> torch.Tensor:
    """Upper bound on the error of casting fp32 y to dtype (round to nearest)."""
    if dtype == torch.bfloat16:
        return y.abs() * 2.0**-8 + 2.0**-133
    return y.abs() * 2.0**-11 + 2.0**-25


def _levels():
    return [*QUANT_LEVELS, *EXTRA]


def _name(lv):
    return lv if isinstance(lv, str) else lv.name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("level", _levels(), ids=_name)
def test_error_bound(level, shape, dtype):
    x = kv_like(shape, dtype)
    sym, side = Q.quantize(x, level)
    nl, _, t, h, d = shape
    assert sym.dtype == torch.uint8 and tuple(sym.shape) == (nl, 2, h, d, t)
    assert side.dtype == torch.uint8 and side.numel() == nl * sum(Q.side_sizes(level, shape))
    y = Q.dequantize(sym, side, level, shape, dtype)
    assert y.dtype == dtype and tuple(y.shape) == shape
    bound = Q.error_bound(side, level, shape)
    lv = L.get_level(level)
    err = (y.float() - x.float()).abs()
    slack = half_ulp_bound(y.float(), dtype)
    if L.Transform.HADAMARD in (lv.k.transform, lv.v.transform):
        # fp32 rounding of the forward transform: <= log2(D) roundings of sums of |x| <= D*max|x|
        slack = slack + x.float().abs().amax(dim=-1, keepdim=True) * d * 2.0**-22
    assert bool((err <= bound + slack).all()), float((err - bound - slack).max())


@pytest.mark.parametrize("level", _levels(), ids=_name)
def test_bound_is_tight_enough(level):
    """S < (9/8) * absmax / qmax: the scale code rounds up by at most one E5M3 step."""
    shape = (4, 2, 64, 3, 64)
    x = kv_like(shape)
    _, side = Q.quantize(x, level)
    lv = L.get_level(level)
    ks, vs = Q.side_sizes(lv, shape)
    codes = side.reshape(4, ks + vs)
    s = Q.scale_value(codes)
    assert bool((s > 0).all())
    # compare against the largest possible absmax (max |x| of the layer/plane)
    for p, pq, part in ((0, lv.k, s[:, :ks]), (1, lv.v, s[:, ks:])):
        y = Q.fwht(x[:, p].float()) if pq.transform == L.Transform.HADAMARD else x[:, p].float()
        amax = y.abs().flatten(1).amax(1)
        qmax = torch.tensor(pq.qmax_table(4), dtype=torch.float32)
        assert bool((part.amax(1) <= amax / qmax * 1.125 * (1 + 2**-20)).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(2, 2, 0, 3, 64)])
def test_lossless_exact_all_bit_patterns(shape, dtype):
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-32768, 32768, shape, generator=g, dtype=torch.int32).to(torch.int16)
    flat = bits.reshape(-1)
    special = torch.tensor([0, -32768, 0x7F80, -128, 0x7FC0, 0x7C00, 0x0001, -1, 0x7FFF], dtype=torch.int16)
    flat[: min(flat.numel(), special.numel())] = special[: flat.numel()]
    x = bits.view(dtype)
    sym, side = Q.quantize(x, "lossless")
    y = Q.dequantize(sym, side, "lossless", shape, dtype)
    assert torch.equal(y.view(torch.int16), bits)


def test_lossless_byte_planes_definition():
    # bf16 1.0 = 0x3F80: rotl1 -> 0x7F00: hi = 0x7F (exponent 127), lo = 0x00; -2.0 = 0xC000 -> 0x8001
    x = torch.tensor([1.0, -2.0, 0.0], dtype=torch.bfloat16).reshape(1, 1, 3, 1, 1).expand(1, 2, 3, 1, 1)
    sym, side = Q.quantize(x.contiguous(), "lossless")
    assert sym.reshape(2, 3)[0].tolist() == [0x7F, 0x80, 0x00]
    assert side.reshape(2, 3)[0].tolist() == [0x00, 0x01, 0x00]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("level", _levels(), ids=_name)
def test_all_zero_groups(level, dtype):
    shape = (3, 2, 9, 3, 64)
    x = kv_like(shape, dtype).clone()
    x[0, 0, 4] = 0  # a token of K
    x[1, 1, :, 2] = 0  # a head of V over all tokens
    x[2] = 0  # a whole layer
    sym, side = Q.quantize(x, level)
    y = Q.dequantize(sym, side, level, shape, dtype)
    assert torch.isfinite(y.float()).all()
    assert bool((y[2] == 0).all())
    zs = Q.zero_symbols(level, 3)
    assert bool((sym[2, 0] == zs[2, 0]).all()) and bool((sym[2, 1] == zs[2, 1]).all())
    lv = L.get_level(level)
    if lv.k.granularity in (G.TOKEN, G.TOKEN_HEAD):  # a zero row stays zero (fwht(0) = 0)
        assert bool((y[0, 0, 4] == 0).all())
    z = torch.zeros(shape, dtype=dtype)
    sym, side = Q.quantize(z, level)
    assert bool((side == 0).all()) and bool((sym == zs[:, :, None, None, None]).all())
    assert bool((Q.dequantize(sym, side, level, shape, dtype) == 0).all())


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_deterministic_and_layout_independent(level):
    shape = (5, 2, 37, 3, 64)
    x = kv_like(shape, seed=3)
    a = Q.quantize(x, level)
    b = Q.quantize(x.clone(), level)
    # a non-contiguous view of the same values
    xt = x.transpose(3, 4).contiguous().transpose(3, 4)
    c = Q.quantize(xt, level)
    for u, v in ((a, b), (a, c)):
        assert torch.equal(u[0], v[0]) and torch.equal(u[1], v[1])
    y1 = Q.dequantize(*a, level, shape, torch.bfloat16)
    y2 = Q.dequantize(*b, level, shape, torch.bfloat16)
    assert torch.equal(y1.view(torch.int16), y2.view(torch.int16))


@pytest.mark.parametrize("level", QUANT_LEVELS)
def test_requantize_is_idempotent_on_symbols(level):
    """Decoding then encoding again gives the same scale codes for TOKEN/CHANNEL granularities and
    never grows the error: a cheap check that dequantize is the inverse the kernels must match."""
    shape = (3, 2, 64, 3, 64)
    x = kv_like(shape, seed=5)
    sym, side = Q.quantize(x, level)
    y = Q.dequantize(sym, side, level, shape, torch.bfloat16)
    sym2, side2 = Q.quantize(y, level)
    y2 = Q.dequantize(sym2, side2, level, shape, torch.bfloat16)
    assert float((y2.float() - y.float()).abs().max()) <= float(Q.error_bound(side2, level, shape).max()) * 1.01


def test_scale_code_exhaustive_against_table():
    table = Q.scale_value(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    assert table[0] == 0 and table[1] == Q.SCALE_MIN and table[255] == Q.SCALE_MAX
    assert bool((table[1:] > table[:-1]).all())
    g = torch.Generator().manual_seed(7)
    e = torch.randint(-30, 16, (200_000,), generator=g).float()
    s = (torch.rand(200_000, generator=g) + 1.0) * torch.pow(2.0, e)
    s = torch.cat([s, table[1:], torch.nextafter(table[1:], torch.tensor(0.0)), torch.tensor([1e-45, 0.0])])
    s = s[s <= Q.SCALE_MAX]
    code = Q.scale_code_ceil(s.float()).to(torch.int64)
    want = torch.searchsorted(table, s.float(), right=False)  # first table entry >= s
    want = torch.where(s == 0, torch.zeros_like(want), want.clamp_min(1))
    assert torch.equal(code, want)


def test_scale_range_and_non_finite_errors():
    with pytest.raises(Q.CodecInputError):
        Q.scale_code_ceil(torch.tensor([Q.SCALE_MAX * 1.0001]))
    x = kv_like((2, 2, 8, 1, 64))
    x[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(Q.CodecInputError):
        Q.quantize(x, "default")
    x[0, 0, 0, 0, 0] = float("inf")
    with pytest.raises(Q.CodecInputError):
        Q.quantize(x, "high")
    big = torch.full((1, 2, 4, 1, 64), 3.0e5, dtype=torch.bfloat16)
    with pytest.raises(Q.CodecInputError):
        Q.quantize(big, "low")
    Q.quantize(big, "lossless")  # lossless stores anything


def test_corrupt_or_mismatched_input_raises():
    shape = (3, 2, 16, 3, 64)
    x = kv_like(shape)
    sym, side = Q.quantize(x, "default")
    with pytest.raises(Q.CodecInputError):
        Q.dequantize(sym.reshape(-1)[:-1], side, "default", shape)
    with pytest.raises(Q.CodecInputError):
        Q.dequantize(sym, side[:-1], "default", shape)
    with pytest.raises(Q.CodecInputError):
        Q.dequantize(sym.to(torch.int16), side, "default", shape)
    bad = sym.clone()
    bad.reshape(-1)[5] = 255  # far above 2 * qmax
    with pytest.raises(Q.CodecInputError):
        Q.dequantize(bad, side, "default", shape)
    with pytest.raises(TypeError):
        Q.quantize(x.float(), "default")
    with pytest.raises(ValueError):
        Q.quantize(x[:, :1], "default")
    with pytest.raises(ValueError):
        L.get_level("medium")


def test_fwht_matches_sylvester_and_is_exact_on_integers():
    d = 64
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    x = torch.randint(-1000, 1000, (50, d)).float()
    assert torch.equal(Q.fwht(x), x @ h.T)
    assert torch.equal(Q.fwht(Q.fwht(x)), x * d)
    with pytest.raises(ValueError):
        Q.fwht(torch.zeros(3, 48))


def test_level_tables():
    assert L.CACHEGEN_REF.k.qmax_table(30) == (15,) * 10 + (7,) * 20
    assert L.CACHEGEN_REF.v.qmax_table(30) == (15,) * 2 + (7,) * 28
    assert L.CACHEGEN_REF.k.qmax_table(32) == (15,) * 11 + (7,) * 21
    for lv in L.LEVELS.values():
        if lv.adaptive:  # error bounds per layer instead of a qmax table (chosen per chunk)
            for n in (1, 2, 3, 30, 32, 80):
                assert len(lv.k.bound_table(n)) == n and len(lv.v.bound_table(n)) == n
            with pytest.raises(ValueError, match="error-bounded"):
                lv.k.qmax_table(30)
        elif not lv.lossless:
            for n in (1, 2, 3, 30, 32, 80):
                assert len(lv.k.qmax_table(n)) == n and len(lv.v.qmax_table(n)) == n
    ids = [lv.level_id for lv in L.LEVELS_BY_ID.values()]
    assert len(ids) == len(set(ids))
    assert L.get_level("default") is L.get_level(L.get_level("default").level_id)


def _lcg_bf16(shape, seed):
    """Deterministic input independent of torch's RNG: LCG -> Gaussian-ish bf16 with outliers."""
    n = int(np.prod(shape))
    st = seed
    out = np.empty(n, dtype=np.float32)
    for i in range(n):
        st = (st * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        u = (st >> 40) / float(1 << 24)
        out[i] = (u - 0.5) * (8.0 if i % 64 == 0 else 1.0)
    return torch.from_numpy(out).reshape(shape).to(torch.bfloat16)


def test_golden_vectors():
    """Pins the format: the C++/CUDA encoders must produce these exact bytes (sha256 prefixes)."""
    shape = (3, 2, 5, 2, 64)
    x = _lcg_bf16(shape, 12345)
    got = {}
    for level in ALL_LEVELS:
        sym, side = Q.quantize(x, level)
        got[level] = hashlib.sha256(sym.numpy().tobytes() + side.numpy().tobytes()).hexdigest()[:16]
    if not GOLDEN:
        pytest.skip(f"golden vectors not recorded yet: {got}")
    assert got == GOLDEN, got


GOLDEN: dict[str, str] = {
    "lossless": "1a2fc9e192e16fd2",
    "high": "69da0688d56ebf79",
    "default": "3a629368a0c5fd11",  # levels by depth (format version 2)
    "low": "c914e0be1344b3b4",
    "cachegen_ref": "572fcdf6d0e600f4",
}


@pytest.mark.gpu
@pytest.mark.parametrize("level", ALL_LEVELS + EXTRA, ids=_name)
def test_cuda_matches_cpu(level):
    shape = (4, 2, 37, 3, 64)
    x = kv_like(shape, seed=9)
    a = Q.quantize(x, level)
    b = Q.quantize(x.cuda(), level)
    assert torch.equal(a[0], b[0].cpu()) and torch.equal(a[1], b[1].cpu())
    ya = Q.dequantize(*a, level, shape, torch.bfloat16)
    yb = Q.dequantize(b[0], b[1], level, shape, torch.bfloat16)
    assert torch.equal(ya.view(torch.int16), yb.cpu().view(torch.int16))


def test_benchmark_smoke():
    """benchmarks/codec_quality.py --smoke: rate model + every level on tiny synthetic KV, no model."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "codec_quality.py"), "--smoke", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "smoke ok" in r.stdout
