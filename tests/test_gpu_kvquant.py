"""Native KV quantize / dequantize on CUDA (csrc/kvquant_cuda.cu) against the native CPU implementation
and the torch reference (lmtier.codec.quant): byte-identical symbols and side data, bit-identical
decoded values, encode on one / decode on the other both ways (also through the rANS coder), hostile
input rejected per chunk, odd alignments, explicit streams, large batches. Inputs are built on the CPU
and copied, so every comparison is exact."""

from __future__ import annotations

import pytest
import torch

from lmtier.codec import native as N
from lmtier.codec import quant as Q
from lmtier.codec import rans
from lmtier.codec.levels import get_level

pytestmark = pytest.mark.gpu

DEV = "cuda"
LEVELS = ["high", "default", "low"]
ALL_LEVELS = ["lossless", *LEVELS]
DTYPES = [torch.bfloat16, torch.float16]
# [L, 2, T, H, D]: odd T (byte path), T % 4 == 0 (word path), T = 1, partial tiles, D = 32..256
SHAPES = [
    (3, 2, 37, 3, 64),
    (5, 2, 1, 2, 64),
    (2, 2, 256, 8, 128),
    (2, 2, 5, 1, 128),
    (2, 2, 130, 2, 128),
    (2, 2, 33, 2, 32),
    (1, 2, 68, 2, 256),
    (4, 2, 64, 4, 64),
]
KINDS = ["gauss", "kv_like", "zeros"]


def make(shape, dtype, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    nl, _, t, h, d = shape
    if kind == "gauss":
        return (torch.randn(shape, generator=g) * 2.0).to(dtype)
    if kind == "zeros":
        x = torch.randn(shape, generator=g)
        x[:, :, ::3] = 0.0
        x[0] = 0.0
        return x.to(dtype)
    ch = torch.rand(nl, 2, 1, h, d, generator=g) + 0.05
    ch[:, 0, :, :, : max(1, d // 16)] *= 20.0  # key outlier channels
    x = torch.randn(shape, generator=g) * ch
    if t > 1:
        x[:, :, 0] *= 8.0  # attention-sink-like first token
    x[:, :, -1, 0] = 0.0
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).cpu()


def cpu(ts):
    return [t.cpu() for t in ts]


def gpu(ts):
    return [t.to(DEV) for t in ts]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_gpu_cpu_reference_identical(level, shape, dtype, kind):
    chunks = [make(shape, dtype, kind, s) for s in range(3)]
    s_cpu, d_cpu = N.quantize(chunks, level, num_threads=2)
    s_gpu, d_gpu = N.quantize(gpu(chunks), level)
    for i, x in enumerate(chunks):
        s_ref, d_ref = Q.quantize(x, level)
        assert torch.equal(s_gpu[i].cpu().reshape(s_ref.shape), s_ref), f"chunk {i}: GPU symbols != reference"
        assert torch.equal(d_gpu[i].cpu(), d_ref), f"chunk {i}: GPU side != reference"
        assert torch.equal(s_cpu[i], s_gpu[i].cpu()) and torch.equal(d_cpu[i], d_gpu[i].cpu())
    y_gpu = N.dequantize(s_gpu, d_gpu, level, shape, dtype)
    y_cpu = N.dequantize(s_cpu, d_cpu, level, shape, dtype)
    for i in range(len(chunks)):
        y_ref = Q.dequantize(s_cpu[i], d_cpu[i], level, shape, dtype)
        assert torch.equal(bits(y_gpu[i]), bits(y_ref)), f"chunk {i}: GPU dequantize != reference"
        assert torch.equal(bits(y_cpu[i]), bits(y_ref))
    if level == "lossless":
        for i, x in enumerate(chunks):
            assert torch.equal(bits(y_gpu[i]), bits(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_encode_on_one_decode_on_the_other(level, dtype):
    shape = (4, 2, 77, 3, 128)
    chunks = [make(shape, dtype, "kv_like", s) for s in range(4)]
    s_cpu, d_cpu = N.quantize(chunks, level)
    s_gpu, d_gpu = N.quantize(gpu(chunks), level)
    y_cg = N.dequantize(gpu(s_cpu), gpu(d_cpu), level, shape, dtype)  # CPU encode -> GPU decode
    y_gc = N.dequantize(cpu(s_gpu), cpu(d_gpu), level, shape, dtype)  # GPU encode -> CPU decode
    for i in range(len(chunks)):
        assert torch.equal(bits(y_cg[i]), bits(y_gc[i]))


def _rans_encode(symbols, level, shape):
    """One rANS stream per (chunk, layer, plane) (H*D*T symbols), adaptive tables; side raw."""
    nl = shape[0]
    streams = [s.reshape(nl * 2, -1)[r] for s in symbols for r in range(nl * 2)]
    return rans.encode(streams, rans.ADAPTIVE_TABLE)


def _rans_decode(batch, n_chunks, shape, device):
    nl = shape[0]
    data = torch.as_tensor(batch.data).to(device)
    srcs = [data[int(batch.offsets[i]) : int(batch.offsets[i + 1])] for i in range(len(batch))]
    per = N.symbol_bytes(shape) // (nl * 2)
    outs = rans.decode(srcs, None, lengths=[per] * len(srcs))
    return [
        torch.cat(
            [
                o.reshape(-1) if isinstance(o, torch.Tensor) else torch.from_numpy(o)
                for o in outs[c * nl * 2 : (c + 1) * nl * 2]
            ]
        ).to(device)
        for c in range(n_chunks)
    ]


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_through_rans_both_ways(level):
    shape = (4, 2, 256, 8, 128)
    dtype = torch.bfloat16
    chunks = [make(shape, dtype, "kv_like", s) for s in range(3)]
    # CPU quantize + CPU rANS encode -> bytes -> GPU rANS decode + GPU dequantize
    s_cpu, d_cpu = N.quantize(chunks, level)
    enc_cpu = _rans_encode(s_cpu, level, shape)
    syms_g = _rans_decode(enc_cpu, len(chunks), shape, DEV)
    y_g = N.dequantize(syms_g, gpu(d_cpu), level, shape, dtype)
    # GPU quantize + GPU rANS encode -> bytes -> CPU rANS decode + CPU dequantize
    s_gpu, d_gpu = N.quantize(gpu(chunks), level)
    enc_gpu = _rans_encode(s_gpu, level, shape)
    assert torch.equal(torch.as_tensor(enc_gpu.data).cpu(), torch.as_tensor(enc_cpu.data).cpu()), (
        "rANS bytes differ CPU vs GPU"
    )
    syms_c = _rans_decode(enc_gpu, len(chunks), shape, "cpu")
    y_c = N.dequantize(syms_c, cpu(d_gpu), level, shape, dtype)
    for i, x in enumerate(chunks):
        y_ref = Q.dequantize(*Q.quantize(x, level), level, shape, dtype)
        assert torch.equal(bits(y_g[i]), bits(y_ref)) and torch.equal(bits(y_c[i]), bits(y_ref))


@pytest.mark.parametrize("level", LEVELS)
def test_gpu_hostile_symbols_and_bad_kv(level):
    shape = (3, 2, 40, 2, 64)
    chunks = [make(shape, torch.bfloat16, "gauss", s) for s in range(3)]
    syms, sides = N.quantize(gpu(chunks), level)
    qmax = get_level(level).v.qmax_table(shape[0])[1]
    bad = syms[2].clone()
    bad[1, 1, 0, 3, 39] = 2 * qmax + 1
    with pytest.raises(Q.CodecInputError, match="chunk 2: symbol"):
        N.dequantize([syms[0], syms[1], bad], sides, level, shape)
    x = chunks[1].clone()
    x[2, 1, 7, 1, 5] = float("nan")
    with pytest.raises(Q.CodecInputError, match="chunk 1: KV contains NaN"):
        N.quantize(gpu([chunks[0], x]), level)
    x = chunks[0].clone()
    x[0, 0, 0, 0, :] = 3.0e38
    with pytest.raises(Q.CodecInputError, match="chunk 0: KV magnitude"):
        N.quantize(gpu([x]), level)
    # a failing chunk does not disturb the others: the same call's good chunks match the reference
    status = torch.zeros(3, dtype=torch.int32, device=DEV)
    outs = [torch.empty(shape, dtype=torch.bfloat16, device=DEV) for _ in range(3)]
    b = N.make_batch(outs, [syms[0], bad, syms[2]], sides)
    N.dequantize_batch(b, level, status=status)
    st = status.cpu().tolist()
    assert st[0] == 0 and st[2] == 0 and st[1] != 0
    ref = Q.dequantize(syms[0].cpu(), sides[0].cpu(), level, shape, torch.bfloat16)
    assert torch.equal(bits(outs[0]), bits(ref))


@pytest.mark.parametrize("level", ["lossless", "default"])
def test_odd_buffer_alignment_and_explicit_stream(level):
    shape = (2, 2, 64, 2, 128)  # T % 4 == 0 but symbol / side buffers at odd addresses: byte path
    chunks = [make(shape, torch.float16, "kv_like", s) for s in range(2)]
    sb, sdb = N.symbol_bytes(shape), N.side_bytes(level, shape)
    big_s = torch.zeros(2 * sb + 8, dtype=torch.uint8, device=DEV)
    big_d = torch.zeros(2 * sdb + 8, dtype=torch.uint8, device=DEV)
    syms = [big_s[1 : 1 + sb], big_s[3 + sb : 3 + 2 * sb]]
    sides = [big_d[1 : 1 + sdb], big_d[5 + sdb : 5 + 2 * sdb]]
    xg = gpu(chunks)
    stream = torch.cuda.Stream()
    status = torch.zeros(2, dtype=torch.int32, device=DEV)
    N.quantize_batch(N.make_batch(xg, syms, sides), level, status=status, stream=stream)
    stream.synchronize()
    N.check_status(status)
    for i, x in enumerate(chunks):
        s_ref, d_ref = Q.quantize(x, level)
        assert torch.equal(syms[i].cpu(), s_ref.reshape(-1)) and torch.equal(sides[i].cpu(), d_ref)
    outs = [torch.empty(shape, dtype=torch.float16, device=DEV) for _ in range(2)]
    N.dequantize_batch(N.make_batch(outs, syms, sides), level, status=status, stream=stream.cuda_stream)
    stream.synchronize()
    N.check_status(status)
    for i, x in enumerate(chunks):
        ref = Q.dequantize(*Q.quantize(x, level), level, shape, torch.float16)
        assert torch.equal(bits(outs[i]), bits(ref))


def test_misaligned_cuda_chunk_rejected():
    shape = (1, 2, 4, 1, 64)
    buf = torch.zeros(2 * 64 * 8 + 8, dtype=torch.bfloat16, device=DEV)
    x = buf[1 : 1 + 2 * 4 * 64].view(shape)  # 2-byte offset
    s = torch.empty(N.symbol_bytes(shape), dtype=torch.uint8, device=DEV)
    d = torch.empty(N.side_bytes("default", shape), dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="16-byte aligned"):
        N.make_batch([x], [s], [d])
    # the convenience API copies such chunks
    syms, sides = N.quantize([x], "default")
    assert torch.equal(syms[0].cpu(), Q.quantize(x.cpu(), "default")[0])


def test_large_batch_many_chunks():
    # > 65535 chunks: the grid walks chunks in blockIdx.y strides
    shape = (1, 2, 1, 1, 32)
    n = 70_000
    x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    syms, sides = N.quantize(x.to(DEV), "high")
    s_all = torch.stack(syms).cpu()
    d_all = torch.stack(sides).cpu()
    for i in (0, 1, 65534, 65535, 65536, n - 1):
        s_ref, d_ref = Q.quantize(x[i], "high")
        assert torch.equal(s_all[i], s_ref) and torch.equal(d_all[i], d_ref), i
    outs = N.dequantize(syms, sides, "high", shape)
    for i in (0, 65535, n - 1):
        assert torch.equal(bits(outs[i]), bits(Q.dequantize(s_all[i], d_all[i], "high", shape)))


def test_llama_geometry_batch_matches_cpu():
    shape = (32, 2, 256, 8, 128)
    chunks = [make(shape, torch.bfloat16, "kv_like", s) for s in range(2)]
    s_gpu, d_gpu = N.quantize(gpu(chunks), "default")
    s_cpu, d_cpu = N.quantize(chunks, "default")
    for a, b, c, d in zip(s_gpu, s_cpu, d_gpu, d_cpu):
        assert torch.equal(a.cpu(), b) and torch.equal(c.cpu(), d)
    y_g = N.dequantize(s_gpu, d_gpu, "default", shape)
    y_c = N.dequantize(s_cpu, d_cpu, "default", shape)
    for a, b in zip(y_g, y_c):
        assert torch.equal(bits(a), bits(b))


def test_bench_codec_smoke(tmp_path, monkeypatch):
    from lmtier.bench import codec_kernels as mod

    monkeypatch.setattr(mod, "SMOKE", True)  # what LMTIER_BENCH_SMOKE=1 sets at import
    assert mod.main(["--json", str(tmp_path / "b.json")]) == 0
