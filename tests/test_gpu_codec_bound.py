"""The error-bounded codec levels (eb_high, eb_default, eb_low; issue 19) on CUDA: every product path
that takes a CUDA tensor or encodes/decodes on a GPU gives the CPU's bytes and bits.

For each level, on SmolLM2-135M's real KV (two chunks ``[30, 2, 256, 3, 64]``, tests/eb_kv.py), on
seeded KV-like chunks of SmolLM2's geometry and of a Llama-3.1-8B-like one ``[32, 2, 256, 8, 128]``
(tests/test_codec_bound.py's generator), against the CPU's encode / decode of the same chunk:

* :func:`lmtier.codec.bound.choose_qmax` on the CUDA chunk picks the same qmax per (layer, plane),
  and its error metric at that qmax agrees with the CPU's to fp64 rounding (the sums run in another
  order on the device; the smallest distance of any metric from its bound is reported);
* :func:`lmtier.codec.chunk.encode_chunk` of the CUDA chunk (typed, and as raw bytes) returns the
  CPU record byte for byte — with per-stream tables and, for SmolLM2's geometry, the shipped tables;
* :func:`lmtier.codec.chunk.decode_chunk` into a CUDA ``out`` gives the CPU decode bit for bit;
* :class:`lmtier.codec.encoder.DeviceEncoder` (a host chunk encoded on cuda:0) returns the CPU record;
* :class:`lmtier.tiers.codec.CodecTier` with ``encode_device=cuda:0`` over a disk tier: host and CUDA
  payloads stored as the CPU record, ``get_into`` / ``get_many_into`` / ``get_into(stream=)`` into
  CUDA buffers give the CPU decode.

The GPU tests are marked ``gpu`` (skipped without a CUDA device, tests/conftest.py). The CPU tests
below them run the same comparison helpers with ``device="cpu"`` on both sides — a check of the
harness (it compares real values and fails on a difference), not of a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import pytest
import torch

from lmtier.codec import bound as B
from lmtier.codec import calibrate as CAL
from lmtier.codec import chunk as CH
from lmtier.codec import levels as L
from lmtier.codec.encoder import DeviceEncoder
from lmtier.tiers.codec import CodecTier
from lmtier.tiers.disk import DiskTier
from tests import eb_kv

EB_LEVELS = tuple(L.EXPERIMENTAL_LEVELS)
CASES = ("smollm2_real0", "smollm2_real1", "smollm2_like", "llama8b_like")
CUDA0 = torch.device("cuda", 0)
BF16 = torch.bfloat16


def chunk_of(case: str) -> torch.Tensor:
    """The CPU bf16 chunk of a case (skips the real-KV cases where neither the model nor the file is)."""
    if case.startswith("smollm2_real"):
        real = eb_kv.smollm2_real()
        if real is None:
            pytest.skip(f"SmolLM2 real KV: {eb_kv.source()}")
        return real[int(case[-1])]
    if case == "smollm2_like":
        return eb_kv.kv_like(11, eb_kv.SMOL)
    if case == "llama8b_like":
        return eb_kv.kv_like(12, eb_kv.LLAMA8B)
    raise ValueError(case)


@dataclass(frozen=True)
class Coded:
    """One chunk through one device's product path: the record, the decoded chunk (as int16 bits),
    the chosen qmax and the error metric per (layer, plane) at that qmax and the next smaller one."""

    record: bytes
    decoded: torch.Tensor  # int16 [L, 2, T, H, D] on the CPU
    qmax_k: tuple[int, ...]
    qmax_v: tuple[int, ...]
    errors: torch.Tensor  # fp64 [L, 2, 2] on the CPU: at the chosen qmax, at the next smaller one


def plane_metric(x: torch.Tensor, level: L.Level, qk, qv) -> torch.Tensor:
    """The chooser's error metric (:func:`lmtier.codec.bound.plane_errors`) per (layer, plane) at the
    chosen qmax and at the next smaller menu value (inf where there is none): fp64 ``[L, 2, 2]``."""
    xf = x.to(torch.float32)
    menu = list(level.qmax_menu)
    out = []
    for p, pq, q in ((0, level.k, qk), (1, level.v, qv)):
        y = B._rotated(xf[:, p], pq)
        below = [menu[max(0, menu.index(v) - 1)] for v in q]
        e = B.plane_errors(y, torch.tensor(q, device=x.device), pq.metric).cpu()
        e_below = B.plane_errors(y, torch.tensor(below, device=x.device), pq.metric).cpu()
        e_below[torch.tensor([v == menu[0] for v in q])] = math.inf
        out.append(torch.stack([e, e_below], dim=1))
    return torch.stack(out, dim=1)


def code(x: torch.Tensor, level: str, device, tables=None) -> Coded:
    """Choose, encode and decode ``x`` with every step on ``device`` (the record is decoded into a
    buffer on ``device``)."""
    lv = L.get_level(level)
    xd = x.to(device)
    qk, qv, _met = B.choose_qmax(xd, lv)
    rec = CH.encode_chunk(xd, shape=tuple(x.shape), dtype=BF16, level=lv, tables=tables)
    out = torch.empty(x.shape, dtype=BF16, device=device)
    CH.decode_chunk(rec, out, expected_shape=tuple(x.shape), dtype=BF16, level=lv, tables=tables)
    return Coded(rec, out.cpu().view(torch.int16), qk, qv, plane_metric(xd, lv, qk, qv))


@functools.lru_cache(maxsize=32)
def cpu_coded(case: str, level: str, shipped: bool) -> Coded:
    """The CPU reference of a case (cached: the CPU eb encode of a Llama-8B chunk takes seconds)."""
    x = chunk_of(case)
    tabs = CAL.shipped_tables(level, tuple(x.shape)) if shipped else None
    return code(x, level, "cpu", tabs)


def assert_same(got: Coded, want: Coded, level: str) -> float:
    """``got`` equals ``want`` (qmax, record bytes, decoded bits; metrics to fp64 rounding); returns
    the smallest relative distance from its bound of a metric at the chosen qmax (below it) or at the
    next smaller qmax (above it): how far the choice was from a tie that another summation order of
    the fp64 metric could break the other way."""
    assert (got.qmax_k, got.qmax_v) == (want.qmax_k, want.qmax_v)
    meta = CH.fmt.unpack(got.record, verify_checksum=False).meta
    assert bytes(meta) == B.META_MAGIC + bytes(v for pair in zip(want.qmax_k, want.qmax_v) for v in pair)
    assert len(got.record) == len(want.record)
    assert got.record == want.record
    assert torch.equal(got.decoded, want.decoded)
    torch.testing.assert_close(got.errors, want.errors, rtol=1e-12, atol=0.0)
    lv = L.get_level(level)
    nl = want.errors.shape[0]
    bounds = torch.tensor([lv.k.bound_table(nl), lv.v.bound_table(nl)], dtype=torch.float64).T
    at, below = want.errors[..., 0], want.errors[..., 1]
    assert bool((at <= bounds).all()) and bool((below > bounds).all())  # the smallest menu value that passes
    return float(torch.minimum((bounds - at) / bounds, (below - bounds) / bounds).min())


# ------------------------------------------------------------------------------------------------
# GPU (skipped without a CUDA device)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("level", EB_LEVELS)
def test_choose_encode_decode_on_cuda_equal_cpu(level, case):
    x = chunk_of(case)
    want = cpu_coded(case, level, False)
    got = code(x, level, CUDA0)
    margin = assert_same(got, want, level)
    print(f"{level} {case}: qmax K {got.qmax_k} V {got.qmax_v}; {len(got.record)} B; min bound margin {margin:.2e}")
    # the CUDA encoder's record decodes to the same bits on the CPU, and a CUDA chunk given as raw bytes
    out = torch.empty_like(x)
    CH.decode_chunk(got.record, out, expected_shape=tuple(x.shape), dtype=BF16, level=level)
    assert torch.equal(out.view(torch.int16), want.decoded)
    raw = x.to(CUDA0).view(-1).view(torch.uint8)
    assert CH.encode_chunk(raw, shape=tuple(x.shape), dtype=BF16, level=level) == want.record


@pytest.mark.gpu
@pytest.mark.parametrize("case", ("smollm2_real0", "smollm2_like"))
@pytest.mark.parametrize("level", EB_LEVELS)
def test_shipped_tables_on_cuda_equal_cpu(level, case):
    x = chunk_of(case)
    tabs = CAL.shipped_tables(level, tuple(x.shape))
    assert tabs is not None and tabs.plane_qmax is not None
    want = cpu_coded(case, level, True)
    assert CH.fmt.unpack(want.record).info.table_id == tabs.table_id
    assert_same(code(x, level, CUDA0, tabs), want, level)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ("smollm2_real0", "llama8b_like"))
@pytest.mark.parametrize("level", EB_LEVELS)
def test_device_encoder_equals_cpu(level, case):
    x = chunk_of(case)
    want = cpu_coded(case, level, False)
    enc = DeviceEncoder(shape=tuple(x.shape), dtype=BF16, level=L.get_level(level), device=CUDA0)
    try:
        src = x.view(-1).view(torch.uint8)
        assert enc.encode(src, tables=None) == want.record
        assert enc.encode(src.pin_memory(), tables=None) == want.record
    finally:
        enc.close()


@pytest.mark.gpu
@pytest.mark.parametrize("case", ("smollm2_real0", "llama8b_like"))  # shipped tables / per-stream tables
@pytest.mark.parametrize("level", EB_LEVELS)
def test_codec_tier_cuda_paths_equal_cpu(tmp_path, level, case):
    x = chunk_of(case)
    shape = tuple(x.shape)
    disk = DiskTier([str(tmp_path / "d")], 256 << 20, io_threads=1)
    tier = CodecTier(disk, shape=shape, dtype=BF16, level=level, encode_device=CUDA0)  # tables: shipped if any
    try:
        want = cpu_coded(case, level, tier.tables is not None)
        k_host, k_dev = b"h" * 32, b"d" * 32
        assert tier.put(k_host, x.view(-1).view(torch.uint8))  # host payload: encoded on encode_device
        assert tier.put(k_dev, x.to(CUDA0).view(-1).view(torch.uint8))  # CUDA payload: on its device
        assert tier.counters["gpu_encodes"] == 1 and tier.counters["gpu_encode_fallbacks"] == 0
        for k in (k_host, k_dev):
            buf = bytearray(tier.max_record_bytes + 4096)
            n = disk.get_into(tier.inner_key(k), buf)
            assert n is not None and bytes(buf[:n]) == want.record
        raw = math.prod(shape) * 2
        outs = [torch.empty(shape, dtype=BF16, device=CUDA0) for _ in range(2)]
        assert tier.get_many_into([k_host, k_dev], outs) == [raw, raw]
        s = torch.cuda.Stream()
        dst = torch.empty(shape, dtype=BF16, device=CUDA0)
        assert tier.get_into(k_host, dst, stream=s) == raw
        s.synchronize()
        for o in (*outs, dst):
            assert torch.equal(o.cpu().view(torch.int16), want.decoded)
        host = torch.empty(shape, dtype=BF16)
        assert tier.get_into(k_dev, host) == raw and torch.equal(host.view(torch.int16), want.decoded)
        assert tier.counters["corrupt_deleted"] == 0 and tier.counters["decode_failures"] == 0
    finally:
        tier.close()


# ------------------------------------------------------------------------------------------------
# CPU: the harness above with device="cpu" on both sides (CI; no GPU involved)


@pytest.mark.parametrize("level", EB_LEVELS)
def test_harness_cpu_vs_cpu(level):
    """The comparison the GPU tests make, CPU against CPU: identical, and a real comparison — the
    qmax differ between levels and so do the records, and a changed byte is caught."""
    case = "smollm2_like"
    want = cpu_coded(case, level, False)
    got = code(chunk_of(case), level, "cpu")
    margin = assert_same(got, want, level)
    assert 0.0 <= margin < 1.0
    other = cpu_coded(case, "eb_low" if level != "eb_low" else "eb_high", False)
    assert (other.qmax_k, other.qmax_v) != (want.qmax_k, want.qmax_v) and other.record != want.record
    with pytest.raises(AssertionError):
        assert_same(other, want, level)
    flipped = bytearray(want.record)
    flipped[-1] ^= 1
    with pytest.raises(AssertionError):
        assert_same(dataclasses.replace(want, record=bytes(flipped)), want, level)


def test_harness_real_kv_cpu_vs_cpu():
    """The real-KV case the GPU tests use (skipped where tests/eb_kv.py finds neither the model nor
    its file), CPU against CPU, with the shipped tables."""
    want = cpu_coded("smollm2_real0", "eb_default", True)
    got = code(chunk_of("smollm2_real0"), "eb_default", "cpu", CAL.shipped_tables("eb_default", eb_kv.SMOL))
    assert_same(got, want, "eb_default")
    assert CH.fmt.unpack(want.record).info.table_id != CH.fmt.NO_TABLE


# ------------------------------------------------------------------------------------------------
# lmtier.bench.codec_product: a tiny run (CPU here, CUDA on a GPU machine)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_bench_codec_product_smoke(tmp_path, device):
    import json

    from lmtier.bench import codec_product as mod

    out = tmp_path / "b.json"
    argv = ["--device", device, "--preset", "tiny", "--chunks", "2", "--iters", "1", "--json", str(out)]
    assert mod.main([*argv, "--levels", "default", "eb_default"]) == 0
    res = json.loads(out.read_text())
    rows = {r["level"]: r for r in res["rows"]}
    assert set(rows) == {"default", "eb_default"} and res["system"]["device"].startswith(device)
    assert res["ceilings"]["memcpy_GBps_2"] > 0
    for name, r in rows.items():
        assert r["chunks"] == 2 and r["ratio_bf16"] > 2 and r["encode_GBps"] > 0 and r["decode_GBps"] > 0
        assert ("choose_GBps" in r) == (name == "eb_default")
        assert ("dev_encode_GBps" in r) == (device == "cuda")
