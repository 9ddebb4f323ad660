"""pytest-benchmark suites for the CPU paths, so regressions show on any machine (no GPU needed):
record headers and checksums, disk-tier records, the codec on the CPU (native quantize /
dequantize, rANS encode / decode, whole records through :mod:`lmtier.codec.chunk`), and paged
gather / scatter on the CPU (:mod:`lmtier.ops`). Keys, CPU pool and manager: ``bench_store_cpu.py``
(collected here too, see ``conftest.py``).

    .venv/bin/python -m pytest benchmarks/ --benchmark-json out/bench_cpu.json      # full sizes
    LMTIER_BENCH_SMOKE=1 .venv/bin/python -m pytest benchmarks/ --benchmark-disable  # tiny, once each

Full size = one 256-token chunk of Llama-3.1-8B KV (32 layers x K/V x 8 heads x 128, bf16 = 32 MiB;
``LMTIER_BENCH_PRESET`` picks another :data:`lmtier.bench.presets.PRESETS` geometry); smoke = 2 layers
x 16 tokens. Every benchmark checks its result (round trips bit-exact, or within the codec's error
bound) and puts ``bytes`` and ``gb_per_s`` (of bf16 KV, from the median) in ``extra_info``; the
same-run ceiling is ``test_memcpy_ceiling`` (a libc memcpy of the same bytes).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from lmtier import envs
from lmtier.bench.presets import preset

SMOKE = envs.LMTIER_BENCH_SMOKE
GEO = preset(envs.LMTIER_BENCH_PRESET)
L = 2 if SMOKE else GEO.num_layers
H, D = (GEO.num_kv_heads, GEO.head_size) if GEO.kind == "kv" else (8, 128)  # the codec takes K/V planes
T = 16 if SMOKE else 256
SHAPE = (L, 2, T, H, D)
KV_BYTES = L * 2 * T * H * D * 2


def _gbps(benchmark, nbytes: int) -> float | None:
    stats = getattr(benchmark, "stats", None)
    return nbytes / stats.stats.median / 1e9 if stats is not None else None


def _info(benchmark, nbytes: int, **kw) -> None:
    benchmark.extra_info.update(bytes=nbytes, gb_per_s=_gbps(benchmark, nbytes), shape=list(SHAPE), **kw)


@pytest.fixture(scope="module")
def kv() -> torch.Tensor:
    """One canonical chunk ``[L, 2, T, H, D]`` bf16 of KV-like data (per-channel magnitudes,
    outlier key channels, a sink token), seeded."""
    g = torch.Generator().manual_seed(0)
    ch = torch.rand(L, 2, 1, H, D, generator=g) + 0.05
    ch[:, 0, :, :, :8] *= 20.0
    x = torch.randn(L, 2, T, H, D, generator=g) * ch
    x[:, :, 0] *= 8.0
    return x.to(torch.bfloat16).contiguous()


def test_memcpy_ceiling(benchmark, kv):
    """Same-run ceiling: one libc ``memcpy`` of the chunk's bytes (torch's CPU ``copy_`` is slower)."""
    import ctypes

    memcpy = ctypes.CDLL("libc.so.6").memcpy
    memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    dst = torch.zeros_like(kv)  # touched: no first-touch page faults in the timing
    benchmark(memcpy, dst.data_ptr(), kv.data_ptr(), KV_BYTES)
    assert torch.equal(dst, kv)
    _info(benchmark, KV_BYTES, note="same-run ceiling: libc memcpy of one chunk")


# ---------------------------------------------------------------- records and the disk tier


def test_record_checksum(benchmark, kv):
    from lmtier import record

    buf = kv.view(torch.uint8).numpy()
    h = benchmark(record.payload_checksum, buf)
    assert h == record.payload_checksum(buf.copy())
    _info(benchmark, KV_BYTES)


def test_record_header_roundtrip(benchmark):
    from lmtier import record

    key = bytes(range(32))

    def op():
        hdr = record.encode_header(key, KV_BYTES, 12345)
        return record.decode_header(hdr, expected_key=key)

    h = benchmark(op)
    assert h.payload_bytes == KV_BYTES and h.payload_xxh3 == 12345


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    from lmtier.tiers.disk import DiskTier

    root = tmp_path_factory.mktemp("disk")
    t = DiskTier([str(root)], capacity_bytes=16 * (KV_BYTES + 8192), io_threads=4)
    yield t
    t.close()


def test_disk_put(benchmark, disk, kv):
    """Store of one chunk record (header, checksum, O_DIRECT pieces, fsync, atomic rename)."""
    payload = kv.view(torch.uint8).numpy()
    keys = (i.to_bytes(4, "little") * 8 for i in itertools.count())

    def op():
        k = next(keys)
        assert disk.put(k, payload)
        return k

    k = benchmark(op)
    assert disk.contains(k)
    _info(benchmark, KV_BYTES, odirect=any(disk._direct.values()))


def test_disk_get_into(benchmark, disk, kv):
    """Load of one chunk record into an aligned host buffer (checksum verified). O_DIRECT where the
    file system has it; on tmpfs / without O_DIRECT this is the page cache."""
    from lmtier.tiers.buffers import AlignedBuffer

    payload = kv.view(torch.uint8).numpy()
    key = b"r" * 32
    assert disk.put(key, payload)
    out = AlignedBuffer(KV_BYTES)
    n = benchmark(disk.get_into, key, out.mv[:KV_BYTES])
    assert n == KV_BYTES and bytes(out.mv[:KV_BYTES]) == payload.tobytes()
    _info(benchmark, KV_BYTES, odirect=any(disk._direct.values()))
    out.close()


# ---------------------------------------------------------------- codec on the CPU


LEVELS = ["lossless", "default"] if SMOKE else ["lossless", "high", "default", "low"]


@pytest.mark.parametrize("level", LEVELS)
def test_codec_quantize_native(benchmark, kv, level):
    from lmtier.codec import native, quant

    syms, sides = benchmark(native.quantize, [kv], level)
    ref_sym, ref_side = quant.quantize(kv, level)
    assert torch.equal(syms[0], ref_sym) and torch.equal(sides[0], ref_side)
    _info(benchmark, KV_BYTES, level=level, note="GB/s of bf16 input")


@pytest.mark.parametrize("level", LEVELS)
def test_codec_dequantize_native(benchmark, kv, level):
    from lmtier.codec import native, quant

    syms, sides = native.quantize([kv], level)
    (out,) = benchmark(native.dequantize, syms, sides, level, SHAPE, torch.bfloat16)
    ref = quant.dequantize(syms[0], sides[0], level, SHAPE, torch.bfloat16)
    assert torch.equal(out, ref)
    if level == "lossless":
        assert torch.equal(out, kv)
    else:  # the level's per-element error bound holds
        bound = quant.error_bound(sides[0], level, SHAPE)
        assert bool(((out.float() - kv.float()).abs() <= bound + 1e-6).all())
    _info(benchmark, KV_BYTES, level=level, note="GB/s of bf16 output")


@pytest.fixture(scope="module")
def symbol_streams(kv):
    """The ``default`` level's symbols as one uint8 stream per (layer, plane): what rANS codes."""
    from lmtier.codec import native

    syms, _ = native.quantize([kv], "default")
    return [s.numpy().reshape(-1).copy() for s in syms[0].reshape(L * 2, -1)]


def test_rans_encode_cpu(benchmark, symbol_streams):
    from lmtier.codec import rans

    enc = benchmark(rans.encode, symbol_streams)
    nsym = sum(s.size for s in symbol_streams)
    _info(
        benchmark,
        KV_BYTES,
        symbols=nsym,
        encoded_bytes=int(enc.nbytes),
        bits_per_symbol=8 * enc.nbytes / nsym,
        note="GB/s of the bf16 KV these symbols code",
    )


def test_rans_decode_cpu(benchmark, symbol_streams):
    from lmtier.codec import rans

    enc = rans.encode(symbol_streams)
    out = benchmark(rans.decode, enc)
    assert all(np.array_equal(a, b) for a, b in zip(out, symbol_streams))
    _info(benchmark, KV_BYTES, note="GB/s of the bf16 KV these symbols code")


@pytest.mark.parametrize("level", ["lossless", "default"])
def test_codec_record_encode(benchmark, kv, level):
    """A whole record: quantize + rANS of every section + framing (:func:`encode_chunk`)."""
    from lmtier.codec import chunk

    rec = benchmark(chunk.encode_chunk, kv, shape=SHAPE, dtype=torch.bfloat16, level=level)
    _info(benchmark, KV_BYTES, level=level, record_bytes=len(rec), ratio=KV_BYTES / len(rec))


@pytest.mark.parametrize("level", ["lossless", "default"])
def test_codec_record_decode(benchmark, kv, level):
    from lmtier.codec import chunk, quant

    rec = chunk.encode_chunk(kv, shape=SHAPE, dtype=torch.bfloat16, level=level)
    out = torch.empty_like(kv)
    benchmark(chunk.decode_chunk, rec, out, expected_shape=SHAPE, dtype=torch.bfloat16, level=level)
    if level == "lossless":
        assert torch.equal(out, kv)
    else:
        s, sd = quant.quantize(kv, level)
        assert torch.equal(out, quant.dequantize(s, sd, level, SHAPE, torch.bfloat16))
    _info(benchmark, KV_BYTES, level=level, ratio=KV_BYTES / len(rec))


# ---------------------------------------------------------------- paged gather / scatter on the CPU


@pytest.fixture(scope="module", params=["LBNHC", "BLHNC"])
def paged(request):
    from lmtier.layout import KVLayout, make_paged_kv_cache, slot_mapping_from_block_ids

    order, bs = request.param, 16
    blocks = 4 * (T // bs) * 4  # 4 chunks' worth of blocks x 4: scattered
    buf, views = make_paged_kv_cache(
        order, num_layers=L, num_blocks=blocks, block_size=bs, num_heads=H, head_size=D, dtype=torch.bfloat16
    )
    buf.view(torch.int16).random_(-30000, 30000, generator=torch.Generator().manual_seed(1))
    layout = KVLayout.from_layer_views(views)
    ids = torch.randperm(blocks, generator=torch.Generator().manual_seed(2))[: T // bs].view(1, -1)
    slots = slot_mapping_from_block_ids(ids, block_size=bs, tokens_per_chunk=T)
    return order, layout, slots, buf


def test_gather_cpu(benchmark, paged):
    from lmtier import ops

    order, layout, slots, _ = paged
    cb = layout.chunk_bytes(T)
    out = torch.empty(1, cb, dtype=torch.uint8)
    benchmark(ops.gather, layout, slots, out)
    back = torch.zeros(1, cb, dtype=torch.uint8)
    ops.gather(layout, slots, back)
    assert torch.equal(out, back)
    _info(benchmark, cb, order=order)


def test_scatter_cpu(benchmark, paged):
    from lmtier import ops

    order, layout, slots, buf = paged
    cb = layout.chunk_bytes(T)
    chunk = torch.empty(1, cb, dtype=torch.uint8)
    ops.gather(layout, slots, chunk)
    benchmark(ops.scatter, layout, slots, chunk)
    again = torch.empty_like(chunk)
    ops.gather(layout, slots, again)
    assert torch.equal(again, chunk)  # scatter of what gather produced is the identity
    _info(benchmark, cb, order=order)
