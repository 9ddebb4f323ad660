"""The codec as a tier serde: lmtier.codec.chunk (encode_chunk / decode_chunk), lmtier.tiers.codec
(CodecTier over a real DiskTier and a real Redis), the config keys (remote_serde, local_disk_serde,
codec_level) and TierManager.from_config wiring. Tiny geometries: the whole file runs in seconds."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
import xxhash

from lmtier import config as cfgmod
from lmtier.codec import chunk as C
from lmtier.codec import decoder as DEC
from lmtier.codec import format as fmt
from lmtier.codec import levels as L
from lmtier.codec import quant as Q
from lmtier.codec import rans
from lmtier.config import ConfigError, LMTierConfig, load_config
from lmtier.keys import Namespace
from lmtier.manager import TierManager
from lmtier.tiers.codec import CodecTier, check_codec_geometry
from lmtier.tiers.disk import DiskTier

SHAPE = (2, 2, 16, 2, 64)  # [L, 2, T, H, D]: 16 KiB of bf16
LOSSY = ("high", "default", "low")
LEVELS = ("lossless", *LOSSY)
DTYPES = (torch.bfloat16, torch.float16)
DNAME = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def key(i: int) -> bytes:
    return bytes([i % 256]) * 31 + b"\x07"


def kv_like(shape=SHAPE, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """KV-like data: per-channel magnitudes, key outlier channels, a sink token, a zero head row."""
    g = torch.Generator().manual_seed(seed)
    nl, _, t, h, d = shape
    ch = torch.rand(nl, 2, 1, h, d, generator=g) + 0.05
    ch[:, 0, :, :, : max(1, d // 16)] *= 20.0
    x = torch.randn(shape, generator=g) * ch
    x[:, :, 0] *= 8.0
    x[0, 1, 3, 1] = 0.0
    return x.to(dtype)


def as_bytes(x: torch.Tensor) -> bytes:
    return x.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def check_within_bound(x: torch.Tensor, y: torch.Tensor, level: str) -> None:
    """|x - y| <= quant.error_bound (S/2) + the forward transform's fp32 rounding + the output cast."""
    _, side = Q.quantize(x, level)
    bound = Q.error_bound(side, level, tuple(x.shape))
    err = (y.float() - x.float()).abs()
    ulp = 2.0**-8 if x.dtype == torch.bfloat16 else 2.0**-11
    slack = y.float().abs() * ulp + 2.0**-24 + x.float().abs().amax(dim=-1, keepdim=True) * x.shape[-1] * 2.0**-22
    assert bool((err <= bound + slack).all()), float((err - bound - slack).max())
    assert float(err.max()) > 0  # lossy really is lossy here


def reference(x: torch.Tensor, level: str) -> torch.Tensor:
    if level == "lossless":
        return x
    sym, side = Q.quantize(x, level)
    return Q.dequantize(sym, side, level, tuple(x.shape), x.dtype)


def rechecksum(rec: bytearray) -> bytearray:
    """Recompute a record's xxh3 checksum (so damage reaches the checks behind it)."""
    end = fmt.unpack(bytes(rec), verify_checksum=False).nbytes
    h = xxhash.xxh3_64()
    h.update(bytes(rec[:56]))
    h.update(bytes(rec[64:end]))
    rec[56:64] = struct.pack("<Q", h.intdigest())
    return rec


# ------------------------------------------------------------------------------------------------
# chunk API


@pytest.fixture(params=[True, False], ids=["native", "torch"])
def native(request, monkeypatch):
    """Both quantize/dequantize paths of lmtier.codec.chunk: the compiled kernels and the reference."""
    monkeypatch.setattr(C, "USE_NATIVE", request.param)
    if request.param and C._native() is None:
        pytest.skip("lmtier._C has no kvquant kernels")
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("level", LEVELS)
def test_chunk_round_trip_matches_reference(level, dtype, native):
    x = kv_like(dtype=dtype)
    rec = C.encode_chunk(x.view(-1).view(torch.uint8), shape=SHAPE, dtype=dtype, level=level)
    C.USE_NATIVE = not native  # the other path encodes the same bytes
    assert rec == C.encode_chunk(x, shape=SHAPE, dtype=dtype, level=level)
    C.USE_NATIVE = native
    assert rec[:4] == b"LMKC" and len(rec) <= C.max_record_bytes(SHAPE, level)
    assert rec == C.encode_chunk(x, shape=SHAPE, dtype=DNAME[dtype], level=level)  # typed input, deterministic
    info = fmt.unpack(rec).info
    assert info.level_id == L.get_level(level).level_id and info.table_id == fmt.NO_TABLE
    out = torch.full((x.numel() * 2 + 8,), 0xAB, dtype=torch.uint8)  # larger than the chunk: the rest untouched
    C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=dtype, level=level)
    y = out[: x.numel() * 2].view(dtype).view(SHAPE)
    assert torch.equal(y.view(torch.int16), reference(x, level).view(torch.int16))
    assert bool((out[x.numel() * 2 :] == 0xAB).all())
    if level != "lossless":
        check_within_bound(x, y, level)
        assert len(rec) < x.numel() * 2 / 2  # well below bf16 even on this tiny chunk


def test_lossless_every_bit_pattern_and_size_bound():
    # random 16-bit patterns (NaN, inf, -0, subnormals included) are incompressible: the record
    # exceeds the raw size but never max_record_bytes, and round-trips bit for bit
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-(2**15), 2**15, SHAPE, generator=g, dtype=torch.int32).to(torch.int16).view(torch.float16)
    rec = C.encode_chunk(x, shape=SHAPE, dtype=torch.float16, level="lossless")
    bound = C.max_record_bytes(SHAPE, "lossless")
    assert x.numel() * 2 < len(rec) <= bound < x.numel() * 2 + 8 * 1024
    out = torch.empty(x.numel() * 2, dtype=torch.uint8)
    C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.float16)
    assert torch.equal(out, x.view(-1).view(torch.uint8))


def test_lossy_rejects_non_finite():
    x = kv_like()
    x[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(Q.CodecInputError, match="NaN"):
        C.encode_chunk(x, shape=SHAPE, dtype=torch.bfloat16, level="default")
    C.encode_chunk(x, shape=SHAPE, dtype=torch.bfloat16, level="lossless")  # lossless stores anything


def test_encode_argument_errors():
    x = kv_like()
    with pytest.raises(TypeError, match="bf16/fp16"):
        C.encode_chunk(x.float(), shape=SHAPE, dtype=torch.float32, level="lossless")
    with pytest.raises(TypeError, match="dtype"):
        C.encode_chunk(x, shape=SHAPE, dtype=torch.float16, level="lossless")
    with pytest.raises(ValueError, match="bytes"):
        C.encode_chunk(x.view(-1).view(torch.uint8)[:-2], shape=SHAPE, dtype=torch.bfloat16, level="lossless")
    with pytest.raises(ValueError, match="shape"):
        C.encode_chunk(x, shape=(2, 2, 8, 4, 64), dtype=torch.bfloat16, level="lossless")
    with pytest.raises(ValueError, match="unknown codec level"):
        C.encode_chunk(x, shape=SHAPE, dtype=torch.bfloat16, level="medium")


def _record(level="default", x=None, shape=SHAPE, dtype=torch.bfloat16) -> bytes:
    x = kv_like(shape, dtype) if x is None else x
    return C.encode_chunk(x, shape=shape, dtype=dtype, level=level)


def _damaged(kind: str) -> tuple[bytes, str]:
    rec = bytearray(_record())
    r = fmt.unpack(bytes(rec))
    if kind == "checksum":
        rec[r.payload_offset + 40] ^= 0x10
        return bytes(rec), "checksum"
    if kind == "truncated":
        return bytes(rec[: len(rec) - 100]), "truncated"
    if kind == "magic":
        return b"XXXX" + bytes(rec[4:]), "not a codec record"
    if kind == "level":
        rec[8] = 99
        return bytes(rechecksum(rec)), "unknown level"
    if kind == "rans":  # damage inside a coded segment, checksum fixed: the coder's status
        off, n = int(r.section_offsets()[0]), int(r.section_lengths()[0])
        rec[off + n - 8] ^= 0x5A
        return bytes(rechecksum(rec)), "rANS stream of layer 0, section 0 failed"
    if kind == "geometry":
        return _record(shape=(2, 2, 8, 2, 64)), "geometry"
    if kind == "dtype":
        return _record(dtype=torch.float16), "holds FLOAT16"
    if kind == "other_level":
        return _record(level="high"), "level 'high', expected 'default'"
    raise AssertionError(kind)


DAMAGE = ("checksum", "truncated", "magic", "level", "rans", "geometry", "dtype", "other_level")


@pytest.mark.parametrize("kind", DAMAGE)
def test_decode_errors_are_clear_and_leave_out_untouched(kind, native):
    rec, msg = _damaged(kind)
    out = torch.full((SHAPE[0] * 2 * 16 * 2 * 64 * 2,), 0xCD, dtype=torch.uint8)
    with pytest.raises(C.CodecRecordError, match=msg):
        C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16, level="default")
    assert bool((out == 0xCD).all())


def test_symbols_out_of_range_are_rejected(native):
    # a well-formed record whose K symbols exceed 2*qmax of the level (hand-built, valid streams)
    x = kv_like()
    sym, side = Q.quantize(x, "default")
    sym = sym.clone()
    sym[1, 0, 0, 0, 5] = 200
    nl = SHAPE[0]
    extra = side.view(nl, -1)
    streams = []
    for l in range(nl):
        streams += [sym[l, 0].reshape(-1), sym[l, 1].reshape(-1), extra[l]]
    b = rans.encode(streams)
    info = fmt.RecordInfo(2, nl, 2, 16, 2, 64, fmt.DType.BFLOAT16, 3)
    rec = fmt.pack(info, [b.stream(i) for i in range(len(streams))])
    with pytest.raises(C.CodecRecordError, match="symbol outside"):
        C.decode_chunk(rec, torch.empty(16384, dtype=torch.uint8), expected_shape=SHAPE, dtype=torch.bfloat16)


def test_decode_argument_errors():
    rec = _record()
    with pytest.raises(ValueError, match="bytes"):
        C.decode_chunk(rec, torch.empty(100, dtype=torch.uint8), expected_shape=SHAPE, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="torch.Tensor"):
        C.decode_chunk(rec, bytearray(16384), expected_shape=SHAPE, dtype=torch.bfloat16)


def test_static_tables():
    x = kv_like()
    lv = L.get_level("default")
    sym, side = Q.quantize(x, lv)
    # one table per section kind (K, V, codes) fitted on this chunk; the codes use a per-stream table
    tabs = np.stack(
        [rans.table_from_symbols(sym[:, 0], alphabet_size=13), rans.table_from_symbols(sym[:, 1], alphabet_size=7)]
    )
    st = C.StaticTables(table_id=42, tables=tabs, section_tables=[0, 1, rans.ADAPTIVE_TABLE] * SHAPE[0])
    rec = C.encode_chunk(x, shape=SHAPE, dtype=torch.bfloat16, level=lv, tables=st)
    assert fmt.unpack(rec).info.table_id == 42
    out = torch.empty(16384, dtype=torch.uint8)
    C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16, tables=st)
    assert torch.equal(out.view(torch.bfloat16).view(SHAPE), reference(x, "default"))
    with pytest.raises(C.CodecRecordError, match="static table set 42, the decoder has none"):
        C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16)
    other = C.StaticTables(table_id=7, tables=tabs, section_tables=st.section_tables)
    with pytest.raises(C.CodecRecordError, match="has 7"):
        C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16, tables=other)
    with pytest.raises(ValueError, match="sections"):
        C.encode_chunk(
            x,
            shape=SHAPE,
            dtype=torch.bfloat16,
            level=lv,
            tables=C.StaticTables(table_id=1, tables=tabs, section_tables=[0]),
        )


@pytest.mark.parametrize("level", LEVELS)
def test_dequantize_layers_matches_reference(level):
    # the building block of the pipelined benchmark decoder: layer ranges into a strided view
    x = kv_like(shape=(3, 2, 16, 2, 64))
    shape = tuple(x.shape)
    sym, side = Q.quantize(x, level)
    kv = torch.zeros(3, 2, 40, 2, 64, dtype=torch.bfloat16)
    C.dequantize_layers(sym.reshape(-1), side.reshape(-1), level, shape, kv[0:1, :, 8:24], 0, 1)
    C.dequantize_layers(sym.reshape(-1), side.reshape(-1), level, shape, kv[1:3, :, 8:24], 1, 3)
    assert torch.equal(kv[:, :, 8:24], reference(x, level)) and not kv[:, :, :8].any()


# ------------------------------------------------------------------------------------------------
# CodecTier over a real disk tier


@pytest.fixture
def disk(tmp_path):
    t = DiskTier([str(tmp_path / "d")], 64 << 20, io_threads=1)
    yield t
    t.close()


def _tier(inner, level, dtype=torch.bfloat16, shape=SHAPE):
    return CodecTier(inner, shape=shape, dtype=dtype, level=level, config_key="local_disk_serde")


# ------------------------------------------------------------------------------------------------
# ChunkDecoder: the reusable decode state behind decode_chunk and CodecTier.get_into


def _tables42(x=None) -> C.StaticTables:
    """A static table set fitted on ``x`` (K, V symbol tables; per-stream tables for the codes)."""
    sym, _ = Q.quantize(kv_like() if x is None else x, "default")
    tabs = np.stack(
        [rans.table_from_symbols(sym[:, 0], alphabet_size=13), rans.table_from_symbols(sym[:, 1], alphabet_size=7)]
    )
    return C.StaticTables(table_id=42, tables=tabs, section_tables=[0, 1, rans.ADAPTIVE_TABLE] * SHAPE[0])


def _out_of_range_record() -> bytes:
    """A well-formed ``default`` record whose K symbols exceed 2*qmax (hand-built, valid streams)."""
    x = kv_like()
    sym, side = Q.quantize(x, "default")
    sym = sym.clone()
    sym[1, 0, 0, 0, 5] = 200
    nl = SHAPE[0]
    extra = side.view(nl, -1)
    streams = []
    for l in range(nl):
        streams += [sym[l, 0].reshape(-1), sym[l, 1].reshape(-1), extra[l]]
    b = rans.encode(streams)
    info = fmt.RecordInfo(2, nl, 2, 16, 2, 64, fmt.DType.BFLOAT16, 3)
    return fmt.pack(info, [b.stream(i) for i in range(len(streams))])


def _record_with_meta(x: torch.Tensor, meta_bytes: int) -> bytes:
    """A valid ``default`` record of ``x`` carrying ``meta_bytes`` of metadata (encode_chunk writes
    none): longer than max_record_bytes when ``meta_bytes`` is large."""
    sym, side = Q.quantize(x, "default")
    nl = SHAPE[0]
    extra = side.view(nl, -1)
    streams = []
    for l in range(nl):
        streams += [sym[l, 0].reshape(-1), sym[l, 1].reshape(-1), extra[l]]
    b = rans.encode(streams)
    info = fmt.RecordInfo(2, nl, 2, 16, 2, 64, fmt.DType.BFLOAT16, 3)
    return fmt.pack(info, [b.stream(i) for i in range(len(streams))], b"m" * meta_bytes)


def test_decoder_reuses_one_slot_and_its_buffers(native):
    st = _tables42()
    dec = DEC.ChunkDecoder(shape=SHAPE, dtype=torch.bfloat16, level="default", tables=st)
    seen = set()
    for seed in range(4):
        x = kv_like(seed=seed)
        rec = C.encode_chunk(x, shape=SHAPE, dtype=torch.bfloat16, level="default", tables=st)
        out = torch.empty(16384, dtype=torch.uint8)
        with dec.slot() as s:
            s.record[: len(rec)] = rec  # what CodecTier does: the inner tier reads into the slot
            dec.decode(s.record[: len(rec)], out, slot=s)
            seen.add((s.record_address, s.sym.data_ptr(), s.work.data_ptr(), s.ctl.data_ptr()))
        assert torch.equal(out.view(torch.bfloat16).view(SHAPE), reference(x, "default"))
        dec.decode(rec, out)  # a record elsewhere in host memory, no slot given: the same slot again
        assert torch.equal(out.view(torch.bfloat16).view(SHAPE), reference(x, "default"))
    assert dec.slots_created == 1 and len(seen) == 1


def test_decoder_slot_survives_failures(native):
    # one slot, good and bad records interleaved: a failure leaves no state that a later decode sees,
    # a bad record never touches out
    st = _tables42()
    dec = DEC.ChunkDecoder(shape=SHAPE, dtype=torch.bfloat16, level="default", tables=st)
    good = [
        (
            C.encode_chunk(
                kv_like(seed=i), shape=SHAPE, dtype=torch.bfloat16, level="default", tables=st if i % 2 else None
            ),
            kv_like(seed=i),
        )
        for i in range(3)
    ]
    other = C.StaticTables(table_id=7, tables=st.tables, section_tables=st.section_tables)
    bad = [
        (_damaged("rans")[0], "rANS stream of layer 0, section 0 failed"),
        (_out_of_range_record(), "symbol outside"),
        (_damaged("checksum")[0], "checksum"),
        (
            C.encode_chunk(kv_like(), shape=SHAPE, dtype=torch.bfloat16, level="default", tables=other),
            "static table set 7, the decoder has 42",
        ),
    ]
    with dec.slot() as s:
        for (rec, x), (brec, msg) in zip(good * 2, bad * 2):
            out = torch.full((16384,), 0xCD, dtype=torch.uint8)
            with pytest.raises(C.CodecRecordError, match=msg):
                dec.decode(brec, out, slot=s)
            assert bool((out == 0xCD).all())
            dec.decode(rec, out, slot=s)
            assert torch.equal(out.view(torch.bfloat16).view(SHAPE), reference(x, "default"))
    assert dec.slots_created == 1


def test_decoder_threads_bit_identical(native):
    import concurrent.futures as cf

    st = _tables42()
    dec = DEC.ChunkDecoder(shape=SHAPE, dtype=torch.bfloat16, level="default", tables=st, max_idle_slots=4)
    xs = [kv_like(seed=100 + i) for i in range(12)]
    recs = [C.encode_chunk(x, shape=SHAPE, dtype=torch.bfloat16, level="default", tables=st) for x in xs]
    want = [reference(x, "default") for x in xs]

    def work(i: int) -> bool:
        out = torch.empty(SHAPE, dtype=torch.bfloat16)
        ok = True
        for _ in range(3):
            out.fill_(float("nan"))
            dec.decode(recs[i], out)
            ok &= torch.equal(out.view(torch.int16), want[i].view(torch.int16))
        return ok

    with cf.ThreadPoolExecutor(4) as ex:
        assert all(ex.map(work, range(len(xs))))
    assert 1 <= dec.slots_created <= 4


def test_decode_chunk_shares_decoders():
    st = _tables42()
    x = kv_like(seed=5)
    rec = C.encode_chunk(x, shape=SHAPE, dtype=torch.bfloat16, level="default", tables=st)
    out = torch.empty(16384, dtype=torch.uint8)
    for _ in range(3):
        C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16, tables=st)
    dec = DEC.shared_decoder(shape=SHAPE, dtype=torch.bfloat16, level="default", tables=st, device="cpu")
    assert dec.slots_created == 1 and dec.tables is st
    assert (
        DEC.shared_decoder(
            shape=SHAPE, dtype="bfloat16", level=L.get_level("default"), tables=st, device=torch.device("cpu")
        )
        is dec
    )
    assert DEC.shared_decoder(shape=SHAPE, dtype=torch.bfloat16, level="default", tables=None, device="cpu") is not dec


def test_record_longer_than_the_bound_still_decodes(native):
    x = kv_like(seed=6)
    rec = _record_with_meta(x, C.max_record_bytes(SHAPE, "default"))
    assert len(rec) > C.max_record_bytes(SHAPE, "default")
    out = torch.empty(16384, dtype=torch.uint8)
    C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16)
    assert torch.equal(out.view(torch.bfloat16).view(SHAPE), reference(x, "default"))


def test_decoder_argument_errors(disk):
    dec = DEC.ChunkDecoder(shape=SHAPE, dtype=torch.bfloat16, level="default")
    dec2 = DEC.ChunkDecoder(shape=SHAPE, dtype=torch.bfloat16, level="default")
    rec = _record()
    out = torch.empty(16384, dtype=torch.uint8)
    with pytest.raises(ValueError, match="stream= is for CUDA"):
        dec.decode(rec, out, stream=object())
    with dec2.slot() as s, pytest.raises(ValueError, match="another decoder"):
        dec.decode(rec, out, slot=s)
    with pytest.raises(ValueError, match="bytes"):
        dec.decode(rec, torch.empty(100, dtype=torch.uint8))
    with pytest.raises(C.CodecRecordError, match="level 'high', expected 'default'"):
        dec.decode(_record(level="high"), out)
    t = _tier(disk, "default")
    assert t.put(key(9), as_bytes(kv_like()))
    with pytest.raises(ValueError, match="stream= needs a CUDA out"):
        t.get_into(key(9), bytearray(16384), stream=object())
    dec.decode(rec, out)
    assert dec.slots_created == 1  # the failures above took no slot
    dec.close()
    dec.decode(rec, out)  # a closed decoder still decodes (its slots are not kept)
    assert dec.slots_created == 2


def test_codec_tier_threads_bit_identical(disk):
    import concurrent.futures as cf

    t = _tier(disk, "default")
    xs = {i: kv_like(seed=200 + i) for i in range(8)}
    for i, x in xs.items():
        assert t.put(key(60 + i), as_bytes(x))
    want = {i: reference(x, "default") for i, x in xs.items()}
    # keep every slot the 4 threads may hold idle (the CPU default keeps 2 and frees the others, so a
    # later get may create one more): then a slot is created only while all earlier ones are in use
    t.decoder("cpu").max_idle_slots = 4

    def work(i: int) -> bool:
        out = bytearray(16384)
        y = torch.frombuffer(out, dtype=torch.bfloat16).view(SHAPE)
        return all(t.get_into(key(60 + i), out) == 16384 and torch.equal(y, want[i]) for _ in range(3))

    with cf.ThreadPoolExecutor(4) as ex:
        assert all(ex.map(work, range(8)))
    assert t.counters["hits"] == 24 and 1 <= t.decoder("cpu").slots_created <= 4
    t.close()


def test_rans_decode_descriptors_matches_decode_into():
    rng = np.random.default_rng(0)
    streams = [rng.integers(0, 9, n, dtype=np.uint8) for n in (1, 100, 70_000, 0, 4096)]
    b = rans.encode(streams)
    data = np.asarray(b.data)
    outs = [np.zeros(len(s) + 3, np.uint8) for s in streams]
    desc = np.zeros(len(streams), rans.DECODE_DESC)
    for i, o in enumerate(outs):
        src = data[int(b.offsets[i]) : int(b.offsets[i + 1])]
        desc[i] = (src.ctypes.data, src.nbytes, o.ctypes.data, o.nbytes)
    got = np.zeros(len(streams), np.int64)
    status = np.full(len(streams), 99, np.int32)
    rans.decode_descriptors(desc, len(streams), 0, 0, out_lengths=got, status=status)
    assert not status.any() and got.tolist() == [len(s) for s in streams]
    assert all(np.array_equal(o[: len(s)], s) for o, s in zip(outs, streams))
    with pytest.raises(ValueError, match="DECODE_DESC"):
        rans.decode_descriptors(desc[:2], 3, 0, 0, out_lengths=got, status=status)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("level", LEVELS)
def test_disk_round_trip(disk, level, dtype):
    t = _tier(disk, level, dtype)
    assert t.name == "disk"
    x = kv_like(dtype=dtype, seed=1)
    assert not t.contains(key(1)) and t.get_into(key(1), bytearray(16384)) is None
    assert t.put(key(1), as_bytes(x))  # read-only bytes
    assert t.contains(key(1)) and not disk.contains(key(1))  # stored under the derived key
    assert disk.contains(t.inner_key(key(1)))
    out = bytearray(16384)  # host buffer (what the manager's CPU slots are)
    assert t.get_into(key(1), out) == 16384
    y = torch.frombuffer(out, dtype=dtype).view(SHAPE)
    if level == "lossless":
        assert bytes(out) == as_bytes(x)
    else:
        assert torch.equal(y, reference(x, level))
        check_within_bound(x, y, level)
    tt = torch.zeros(SHAPE, dtype=dtype)  # typed tensor destination
    assert t.get_into(key(1), tt) == 16384 and torch.equal(tt, y)
    assert t.counters["puts"] == 1 and t.counters["hits"] == 2
    assert t.counters["record_bytes_out"] < t.counters["raw_bytes_in"] or level == "lossless"
    assert t.delete(key(1)) and not t.contains(key(1))


def test_disk_restart_finds_records(tmp_path):
    d = DiskTier([str(tmp_path)], 1 << 24, io_threads=1)
    x = kv_like(seed=2)
    assert _tier(d, "default").put(key(2), as_bytes(x))
    d.close()
    d2 = DiskTier([str(tmp_path)], 1 << 24, io_threads=1)
    t = _tier(d2, "default")
    out = torch.empty(16384, dtype=torch.uint8)
    assert t.get_into(key(2), out) == 16384
    assert torch.equal(out.view(torch.bfloat16).view(SHAPE), reference(x, "default"))
    # another level reads nothing (disjoint key spaces); neither does a naive reader of the same key
    assert _tier(d2, "high").get_into(key(2), out) is None and _tier(d2, "lossless").contains(key(2)) is False
    assert d2.get_into(key(2), bytearray(1 << 16)) is None
    t.close()


def test_naive_and_codec_chunks_coexist(disk):
    x = kv_like(seed=4)
    raw = bytes(range(256)) * 64
    assert disk.put(key(3), raw)  # a naive writer
    t = _tier(disk, "lossless")
    assert not t.contains(key(3)) and t.get_into(key(3), bytearray(16384)) is None
    assert t.put(key(3), as_bytes(x))
    out = bytearray(16384)
    assert disk.get_into(key(3), out) == 16384 and bytes(out) == raw  # untouched
    assert t.get_into(key(3), out) == 16384 and bytes(out) == as_bytes(x)


@pytest.mark.parametrize("kind", DAMAGE)
def test_disk_corrupted_record_is_miss_and_deleted(disk, kind):
    # damaged records that pass the disk tier's own checksum: the codec's checks catch them
    t = _tier(disk, "default")
    rec, _ = _damaged(kind)
    assert disk.put(t.inner_key(key(5)), rec)
    out = bytearray(b"\xee" * 16384)
    assert t.contains(key(5)) and t.get_into(key(5), out) is None
    assert not t.contains(key(5)) and not disk.contains(t.inner_key(key(5)))
    assert t.counters["corrupt_deleted"] == 1
    assert t.put(key(5), as_bytes(kv_like())) and t.get_into(key(5), out) == 16384  # the next store works


def test_disk_file_damage_is_miss_and_deleted(tmp_path):
    d = DiskTier([str(tmp_path)], 1 << 24, io_threads=1)
    t = _tier(d, "lossless")
    assert t.put(key(6), as_bytes(kv_like()))
    (path,) = [p for p in tmp_path.rglob("*.lmt")]
    data = bytearray(path.read_bytes())
    data[4096 + 200] ^= 0xFF
    path.write_bytes(bytes(data))
    assert t.get_into(key(6), bytearray(16384)) is None and not t.contains(key(6)) and not path.exists()
    t.close()


def test_put_rejects_wrong_sizes_and_unencodable(disk):
    t = _tier(disk, "default")
    assert not t.put(key(7), b"\x00" * 100)
    x = kv_like()
    x[1, 1, 1, 1, 1] = float("inf")
    assert not t.put(key(7), as_bytes(x)) and not t.contains(key(7))
    assert t.counters["put_failures"] == 2
    assert t.put(key(7), as_bytes(kv_like()))
    assert t.get_into(key(7), bytearray(100)) is None and t.contains(key(7))  # too small out: kept


def test_record_never_exceeds_bound_and_scratch(disk):
    t = _tier(disk, "lossless", torch.float16)
    assert t.max_record_bytes == C.max_record_bytes(SHAPE, "lossless")
    g = torch.Generator().manual_seed(9)
    x = torch.randint(0, 256, (16384,), generator=g, dtype=torch.uint8)  # incompressible
    assert t.put(key(8), x)
    out = torch.empty(16384, dtype=torch.uint8)
    assert t.get_into(key(8), out) == 16384 and torch.equal(out, x)
    assert 16384 < t.counters["record_bytes_out"] <= t.max_record_bytes


@pytest.mark.parametrize(
    "dtype,level,msg",
    [
        ("float32", "default", "lossy codec level 'default' needs a bfloat16/float16 KV cache, kv_dtype is float32"),
        ("float32", "lossless", "'lossless' needs a 16-bit float KV cache"),
        ("fp8_e4m3", "low", "kv_dtype is fp8_e4m3"),
        (torch.float32, "high", "kv_dtype is float32"),
    ],
)
def test_unsupported_dtype_is_config_error(disk, dtype, level, msg):
    with pytest.raises(ConfigError, match=f"local_disk_serde='cachegen': .*{msg}"):
        _tier(disk, level, dtype)


def test_geometry_config_errors():
    with pytest.raises(ConfigError, match="remote_serde='cachegen'.*kv_planes=2"):
        check_codec_geometry((2, 1, 16, 1, 64), "bfloat16", "lossless", config_key="remote_serde")
    with pytest.raises(ConfigError, match="power-of-two head size.*48"):
        check_codec_geometry((2, 2, 16, 2, 48), "bfloat16", "default")
    check_codec_geometry((2, 2, 16, 2, 48), "bfloat16", "lossless")
    with pytest.raises(ConfigError, match="codec_level='medium'"):
        check_codec_geometry(SHAPE, "bfloat16", "medium")
    with pytest.raises(ConfigError, match="codec_level='cachegen_ref'"):
        check_codec_geometry(SHAPE, "bfloat16", "cachegen_ref")  # a benchmark level, not a user level


# ------------------------------------------------------------------------------------------------
# CodecTier over a real Redis


@pytest.fixture
def redis_tier(redis_server):
    from lmtier.tiers.redis import RedisTier

    t = RedisTier(redis_server.url, timeout_s=1.0)
    yield t
    t.close()


@pytest.mark.parametrize("level", ["lossless", "default"])
def test_redis_round_trip(redis_tier, level):
    t = CodecTier(redis_tier, shape=SHAPE, dtype="bfloat16", level=level, config_key="remote_serde")
    assert t.name == redis_tier.name and hasattr(t, "contains_many")
    x = kv_like(seed=11)
    assert t.put(key(11), as_bytes(x))
    assert t.contains_many([key(11), key(12)]) == [True, False]
    out = torch.empty(16384, dtype=torch.uint8)
    assert t.get_into(key(11), out) == 16384
    y = out.view(torch.bfloat16).view(SHAPE)
    if level == "lossless":
        assert torch.equal(out, x.view(-1).view(torch.uint8))
    else:
        assert torch.equal(y, reference(x, level))
        check_within_bound(x, y, level)


@pytest.mark.parametrize("kind", ["checksum", "rans", "geometry", "other_level"])
def test_redis_corrupted_record_is_miss_and_deleted(redis_tier, kind):
    t = CodecTier(redis_tier, shape=SHAPE, dtype=torch.bfloat16, level="default", config_key="remote_serde")
    rec, _ = _damaged(kind)
    assert redis_tier.put(t.inner_key(key(13)), rec)
    assert t.contains(key(13)) and t.get_into(key(13), bytearray(16384)) is None
    assert not t.contains(key(13)) and not redis_tier.contains(t.inner_key(key(13)))


# ------------------------------------------------------------------------------------------------
# config


def test_config_defaults_and_keys():
    cfg = LMTierConfig.from_dict({})
    assert cfg.disk.serde == "naive" and cfg.remote.serde == "naive" and cfg.codec_level == "default"
    assert cfg.serde_level("disk") is None and cfg.serde_level("remote") is None
    d = cfg.to_dict()
    assert d["local_disk_serde"] == "naive" and d["codec_level"] == "default" and d["remote_serde"] == "naive"
    assert cfgmod.CODEC_LEVELS == tuple(L.LEVELS)  # config's list stays in step with the codec's


def test_config_cachegen(tmp_path):
    cfg = LMTierConfig.from_dict({"remote_serde": "cachegen"})  # LMCache's file: lmtier's default level
    assert cfg.serde_level("remote") == "default" and cfg.serde_level("disk") is None
    cfg = LMTierConfig.from_dict(
        {
            "local_disk": f"file://{tmp_path}",
            "max_local_disk_size": 1,
            "local_disk_serde": "cachegen",
            "codec_level": "lossless",
        }
    )
    assert cfg.serde_level("disk") == "lossless" and cfg.serde_level("remote") is None


def test_config_env_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("remote_serde: cachegen\ncodec_level: high\n")
    cfg = load_config(f, env={"LMTIER_CODEC_LEVEL": "low", "LMTIER_LOCAL_DISK_SERDE": "cachegen"})
    assert cfg.codec_level == "low" and cfg.disk.serde == "cachegen" and cfg.remote.serde == "cachegen"


@pytest.mark.parametrize(
    "values,key",
    [
        ({"codec_level": "medium"}, "codec_level='medium'"),
        ({"codec_level": "cachegen_ref"}, "codec_level"),
        ({"codec_level": 2}, "codec_level=2"),
        ({"codec_level": None}, "codec_level=None"),
        ({"local_disk_serde": "pickle"}, "local_disk_serde='pickle'"),
        ({"local_disk_serde": True}, "local_disk_serde=True"),
        ({"remote_serde": "zstd"}, "remote_serde='zstd'"),
    ],
)
def test_config_bad_values_name_the_key(values, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        LMTierConfig.from_dict(values)


def test_config_bad_env_value_names_the_key():
    with pytest.raises(ConfigError, match="codec_level='best'"):
        load_config(env={"LMTIER_CODEC_LEVEL": "best"})


def test_local_disk_serde_requires_codec(monkeypatch):
    monkeypatch.setattr(cfgmod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="local_disk_serde.*lmtier.codec"):
        LMTierConfig.from_dict({"local_disk_serde": "cachegen"})


def test_unused_codec_keys_warn(caplog):
    with caplog.at_level("WARNING", logger="lmtier.config"):
        LMTierConfig.from_dict({"codec_level": "high"})
        LMTierConfig.from_dict({"local_disk_serde": "cachegen"})
    assert "codec_level='high' but no serde is 'cachegen'" in caplog.text
    assert "local_disk_serde='cachegen' without local_disk" in caplog.text


# ------------------------------------------------------------------------------------------------
# TierManager.from_config


def _ns(**kw) -> Namespace:
    args = dict(model="m", num_layers=2, num_kv_heads=2, head_size=64, kv_dtype="bfloat16", chunk_size=16)
    args.update(kw)
    return Namespace(**args)


@pytest.mark.parametrize("level", ["lossless", "low"])
def test_manager_disk_cachegen_end_to_end(tmp_path, level):
    ns = _ns()
    assert ns.chunk_bytes == 16384
    cfg = LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "local_cpu": False,
            "local_disk": f"file://{tmp_path}",
            "max_local_disk_size": 0.01,
            "local_disk_serde": "cachegen",
            "codec_level": level,
        }
    )
    x = kv_like(seed=21)
    with TierManager.from_config(cfg, ns) as m:
        assert isinstance(m.disk, CodecTier) and m.disk.level.name == level and m.remote is None
        assert m.store(key(21), x.view(-1).view(torch.uint8)).result(30)
        assert m.lookup([key(21), key(22)]) == ["disk"]
        out = torch.empty(16384, dtype=torch.uint8)
        assert m.retrieve(key(21), out)
        assert torch.equal(out.view(torch.bfloat16).view(SHAPE), reference(x, level))
        assert m.counters["hits_disk"] == 1
    # restart: the records are found again by the same configuration
    with TierManager.from_config(cfg, ns) as m2:
        assert m2.lookup([key(21)]) == ["disk"]


def test_manager_cpu_write_back_through_codec(tmp_path):
    # CPU pool of one slot: the second store evicts the first, which is written back as a record;
    # the retrieve promotes it from disk (decoded into a CPU slot)
    ns = _ns()
    cfg = LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "max_local_cpu_size": 16384 / 2**30,
            "local_disk": f"file://{tmp_path}",
            "max_local_disk_size": 0.01,
            "local_disk_serde": "cachegen",
            "codec_level": "lossless",
        }
    )
    a, b = kv_like(seed=31), kv_like(seed=32)
    with TierManager.from_config(cfg, ns, arena=torch.empty(16384, dtype=torch.uint8)) as m:
        assert m.store(key(31), a.view(-1).view(torch.uint8)).result(30)
        assert m.store(key(32), b.view(-1).view(torch.uint8), timeout_s=None).result(30)
        assert m.lookup([key(31), key(32)]) == ["disk", "cpu"]
        out = torch.empty(16384, dtype=torch.uint8)
        assert m.retrieve(key(31), out) and torch.equal(out, a.view(-1).view(torch.uint8))


def test_manager_disk_cachegen_evictions_and_forget(tmp_path):
    """Issue 14, defect 1: with ``local_disk_serde: cachegen`` the disk tier is a CodecTier; its LRU
    evictions reach the manager's index listeners as DISK_EVICTED under the chunk keys (records
    found on disk at startup included), CPU evictions as EVICTED "disk", and ``manager.disk.forget``
    works (the old CodecTier had neither listeners nor ``forget``)."""
    from lmtier.events import IndexEvent
    from lmtier.events import IndexEventKind as E

    ns = _ns()
    xs = {i: kv_like(seed=40 + i) for i in range(8)}
    rec_bytes = {
        i: len(
            C.encode_chunk(
                xs[i].view(-1).view(torch.uint8),
                shape=SHAPE,
                dtype=torch.bfloat16,
                level=L.LEVELS["lossless"],
                tables=None,
            )
        )
        for i in range(8)
    }
    file_bytes = 4096 + -(-max(rec_bytes.values()) // 4096) * 4096
    cfg = LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "local_cpu": False,
            "local_disk": f"file://{tmp_path}",
            "max_local_disk_size": 3 * file_bytes / 2**30,
            "local_disk_serde": "cachegen",
            "codec_level": "lossless",
        }
    )
    events: list[IndexEvent] = []
    with TierManager.from_config(cfg, ns) as m:
        assert isinstance(m.disk, CodecTier)
        m.add_listener(events.append)
        for i in range(3):
            assert m.store(key(i), xs[i].view(-1).view(torch.uint8), timeout_s=None).result(30)
        assert events == [IndexEvent(E.STORED, key(i), "disk") for i in range(3)]
    events.clear()
    # A restart: the three records are found on disk; evicting them reports their chunk keys.
    with TierManager.from_config(cfg, ns) as m:
        m.add_listener(events.append)
        assert m.lookup([key(0), key(1), key(2)]) == ["disk"] * 3
        for i in (3, 4):
            assert m.store(key(i), xs[i].view(-1).view(torch.uint8), timeout_s=None).result(30)
        evicted = [e.key for e in events if e.kind == E.DISK_EVICTED]
        assert evicted == [key(0), key(1)] and all(e.tier is None for e in events if e.kind == E.DISK_EVICTED)
        assert [e for e in events if e.kind == E.STORED] == [IndexEvent(E.STORED, key(i), "disk") for i in (3, 4)]
        # forget: this process stops claiming key 2; its record stays for other processes
        assert m.disk.forget(key(2)) and not m.disk.forget(key(2))
        assert m.lookup([key(2)]) == []
        m.remove_listener(events.append)
    with TierManager.from_config(cfg, ns) as m:
        assert m.lookup([key(2), key(3), key(4)]) == ["disk"] * 3
    # With a CPU pool of one slot: the evicted chunk is written back as a record first.
    cfg2 = LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "max_local_cpu_size": 16384 / 2**30,
            "local_disk": f"file://{tmp_path}/2",
            "max_local_disk_size": 0.01,
            "local_disk_serde": "cachegen",
            "codec_level": "lossless",
        }
    )
    events.clear()
    with TierManager.from_config(cfg2, ns, arena=torch.empty(16384, dtype=torch.uint8)) as m:
        m.add_listener(events.append)
        assert m.store(key(5), xs[5].view(-1).view(torch.uint8), timeout_s=None).result(30)
        assert m.store(key(6), xs[6].view(-1).view(torch.uint8), timeout_s=None).result(30)
        assert events == [
            IndexEvent(E.STORED, key(5), "cpu"),
            IndexEvent(E.EVICTED, key(5), "disk"),
            IndexEvent(E.STORED, key(6), "cpu"),
        ]
        assert m.lookup([key(5), key(6)]) == ["disk", "cpu"]


@pytest.mark.parametrize(
    "ns_kw,values,msg",
    [
        ({"kv_dtype": "float32"}, {"local_disk_serde": "cachegen"}, "local_disk_serde='cachegen'.*float32"),
        (
            {"kv_dtype": "float32"},
            {"remote_serde": "cachegen", "remote_url": "redis://127.0.0.1:1"},
            "remote_serde='cachegen'.*float32",
        ),
        (
            {"kv_planes": 1, "num_kv_heads": 1},
            {"local_disk_serde": "cachegen", "codec_level": "lossless"},
            "kv_planes=2",
        ),
        ({"head_size": 48}, {"local_disk_serde": "cachegen"}, "power-of-two head size"),
    ],
)
def test_manager_rejects_unsupported_caches(tmp_path, ns_kw, values, msg):
    cfg = LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "local_cpu": False,
            "local_disk": f"file://{tmp_path}",
            "max_local_disk_size": 0.01,
            **values,
        }
    )
    with pytest.raises(ConfigError, match=msg):
        TierManager.from_config(cfg, _ns(**ns_kw))


def test_manager_naive_serde_unwrapped_and_lossless_odd_head(tmp_path):
    cfg = LMTierConfig.from_dict(
        {"chunk_size": 16, "local_cpu": False, "local_disk": f"file://{tmp_path}", "max_local_disk_size": 0.01}
    )
    with TierManager.from_config(cfg, _ns(kv_dtype="float32")) as m:
        assert isinstance(m.disk, DiskTier)
    cfg = LMTierConfig.from_dict(
        {
            "chunk_size": 16,
            "local_cpu": False,
            "local_disk": f"file://{tmp_path}",
            "max_local_disk_size": 0.01,
            "local_disk_serde": "cachegen",
            "codec_level": "lossless",
        }
    )
    with TierManager.from_config(cfg, _ns(head_size=48)) as m:
        assert isinstance(m.disk, CodecTier)


def test_manager_remote_cachegen(redis_server):
    cfg = LMTierConfig.from_dict(
        {"chunk_size": 16, "local_cpu": False, "remote_url": redis_server.url, "remote_serde": "cachegen"}
    )
    x = kv_like(seed=41)
    with TierManager.from_config(cfg, _ns()) as m:
        assert isinstance(m.remote, CodecTier) and m.remote.level.name == "default"
        assert m.store(key(41), x.view(-1).view(torch.uint8)).result(30)
        assert m.lookup([key(41)]) == ["remote"]
        out = torch.empty(16384, dtype=torch.uint8)
        assert m.retrieve(key(41), out)
        assert torch.equal(out.view(torch.bfloat16).view(SHAPE), reference(x, "default"))


# ------------------------------------------------------------------------------------------------
# GPU (skipped without a CUDA device)


@pytest.mark.gpu
@pytest.mark.parametrize("level", LEVELS)
def test_gpu_decode_matches_cpu(disk, level):
    x = kv_like(seed=51)
    rec_cpu = C.encode_chunk(x, shape=SHAPE, dtype=torch.bfloat16, level=level)
    rec_gpu = C.encode_chunk(x.cuda(), shape=SHAPE, dtype=torch.bfloat16, level=level)
    assert rec_cpu == rec_gpu  # byte-identical encoders
    out_cpu = torch.empty(16384, dtype=torch.uint8)
    out_gpu = torch.empty(16384, dtype=torch.uint8, device="cuda")
    C.decode_chunk(rec_cpu, out_cpu, expected_shape=SHAPE, dtype=torch.bfloat16)
    C.decode_chunk(rec_cpu, out_gpu, expected_shape=SHAPE, dtype=torch.bfloat16)
    assert torch.equal(out_gpu.cpu(), out_cpu)
    t = _tier(disk, level)
    assert t.put(key(52), x.cuda())
    kv = torch.empty(SHAPE, dtype=torch.bfloat16, device="cuda")
    assert t.get_into(key(52), kv) == 16384 and torch.equal(kv.cpu().view(-1).view(torch.uint8), out_cpu)
    rec, msg = _damaged("rans")
    with pytest.raises(C.CodecRecordError, match="rANS"):
        C.decode_chunk(rec, out_gpu, expected_shape=SHAPE, dtype=torch.bfloat16)


def _gpu_case(shape=(4, 2, 256, 8, 128), n=6, seed=300):
    """Chunks of a larger geometry with calibrated table-switching tables (the shipped tables' path:
    lmtier.codec.calibrate, fitted on other data), their records and the CPU decoder's bytes."""
    from lmtier.codec import calibrate as CAL

    xs = [kv_like(shape, seed=seed + i) for i in range(n)]
    tab, _ = CAL.calibrate([kv_like(shape, seed=seed - 1)], "default")
    recs = [C.encode_chunk(x, shape=shape, dtype=torch.bfloat16, level="default", tables=tab) for x in xs]
    assert all(fmt.unpack(r).info.table_id == tab.table_id for r in recs)
    want = []
    for r in recs:
        o = torch.empty(math.prod(shape) * 2, dtype=torch.uint8)
        C.decode_chunk(r, o, expected_shape=shape, dtype=torch.bfloat16, tables=tab)
        want.append(o)
    return shape, xs, tab, recs, want


@pytest.mark.gpu
def test_gpu_tables_uploaded_once_and_slots_reused(disk):
    # defect (issue 14, product decode path): the whole static table set went to the GPU on every
    # decode, and every work buffer was allocated per call
    shape, xs, tab, recs, want = _gpu_case()
    t = CodecTier(disk, shape=shape, dtype=torch.bfloat16, level="default", tables=tab)
    n0 = DEC.table_uploads()
    for i, x in enumerate(xs):
        assert t.put(key(70 + i), x.cuda())  # GPU encode: the set goes to the device here, once
    out = torch.empty(math.prod(shape) * 2, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        for i in range(len(xs)):
            out.fill_(0xCD)
            assert t.get_into(key(70 + i), out) == out.numel()
            assert torch.equal(out.cpu(), want[i])
    assert DEC.table_uploads() == n0 + 1  # once for this (table set, device), never per encode / decode
    for i, r in enumerate(recs):  # decode_chunk's shared decoder uses the same device copy
        C.decode_chunk(r, out, expected_shape=shape, dtype=torch.bfloat16, tables=tab)
        assert torch.equal(out.cpu(), want[i])
    assert DEC.table_uploads() == n0 + 1
    dec = t.decoder(out.device)
    assert dec.slots_created == 1 and t.counters["hits"] == 3 * len(xs)
    (slot,) = dec._free
    assert slot.stream.cuda_stream != torch.cuda.default_stream().cuda_stream
    t.close()


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [4, 12])  # 12 > the 8 idle slots a tier keeps
def test_gpu_concurrent_get_into_bit_identical_to_cpu(disk, threads):
    import concurrent.futures as cf

    shape, xs, tab, _, want = _gpu_case(n=8)
    t = CodecTier(disk, shape=shape, dtype=torch.bfloat16, level="default", tables=tab)
    for i, x in enumerate(xs):
        assert t.put(key(80 + i), x)
    streams = set()

    def work(j: int) -> bool:
        i = j % len(xs)
        out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        ok = True
        for _ in range(4):
            out.fill_(float("nan"))
            ok &= t.get_into(key(80 + i), out) == out.numel() * 2
            ok &= torch.equal(out.view(-1).view(torch.uint8).cpu(), want[i])
        return ok

    with cf.ThreadPoolExecutor(threads) as ex:
        assert all(ex.map(work, range(2 * threads)))
    dec = t.decoder("cuda")
    assert 1 <= dec.slots_created and len(dec._free) <= 8
    for s in dec._free:
        streams.add(s.stream.cuda_stream)
    assert len(streams) == len(dec._free) and torch.cuda.default_stream().cuda_stream not in streams
    t.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [*DAMAGE, "symbols"])
def test_gpu_corrupted_record_is_miss_and_out_untouched(disk, kind):
    t = _tier(disk, "default")
    rec = _out_of_range_record() if kind == "symbols" else _damaged(kind)[0]
    assert disk.put(t.inner_key(key(90)), rec)
    out = torch.full((16384 + 64,), 0xCD, dtype=torch.uint8, device="cuda")
    assert t.get_into(key(90), out) is None
    assert bool((out == 0xCD).all())  # nothing of a failed record reaches out
    assert not disk.contains(t.inner_key(key(90))) and t.counters["corrupt_deleted"] == 1
    x = kv_like(seed=91)
    assert t.put(key(91), x) and t.get_into(key(91), out) == 16384  # the same slot, after the failure
    assert torch.equal(out[:16384].cpu().view(torch.bfloat16).view(SHAPE), reference(x, "default"))
    assert bool((out[16384:] == 0xCD).all())
    with pytest.raises(C.CodecRecordError):
        C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16, level="default")
    t.close()


@pytest.mark.gpu
def test_gpu_table_set_mismatch_rejected():
    st = _tables42()
    x = kv_like(seed=92)
    rec = C.encode_chunk(x, shape=SHAPE, dtype=torch.bfloat16, level="default", tables=st)
    other = C.StaticTables(table_id=7, tables=st.tables, section_tables=st.section_tables)
    out = torch.full((16384,), 0xCD, dtype=torch.uint8, device="cuda")
    with pytest.raises(C.CodecRecordError, match="has 7"):
        C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16, tables=other)
    with pytest.raises(C.CodecRecordError, match="has none"):
        C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16)
    dec = DEC.ChunkDecoder(shape=SHAPE, dtype=torch.bfloat16, level="default", tables=other, device="cuda")
    with pytest.raises(C.CodecRecordError, match="static table set 42, the decoder has 7"):
        dec.decode(rec, out)
    assert bool((out == 0xCD).all())
    C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16, tables=st)
    assert torch.equal(out.cpu().view(torch.bfloat16).view(SHAPE), reference(x, "default"))


@pytest.mark.gpu
def test_gpu_out_written_when_get_into_returns(disk):
    # the caller's stream may still read out: the copy into out waits for it, and out holds the
    # chunk when get_into returns (read here from an unrelated stream without any wait)
    t = _tier(disk, "default")
    x = kv_like(seed=93)
    assert t.put(key(93), x)
    out = torch.full((16384,), 0xCD, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    caller, reader = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(caller):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the call
        assert t.get_into(key(93), out) == 16384
    assert caller.query()  # the copy into out waited for the caller's stream
    with torch.cuda.stream(reader):
        snap = out.clone()
    reader.synchronize()
    assert torch.equal(snap.cpu().view(torch.bfloat16).view(SHAPE), reference(x, "default"))
    t.close()


@pytest.mark.gpu
def test_gpu_stream_ordered_get_into(disk):
    t = _tier(disk, "default")
    x = kv_like(seed=94)
    assert t.put(key(94), x)
    out = torch.full((16384,), 0xCD, dtype=torch.uint8, device="cuda")
    assert t.get_into(key(94), out) == 16384  # warm: the slot exists
    out.fill_(0xCD)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(1_000_000_000)  # keeps s busy well past the decode
    assert t.get_into(key(94), out, stream=s) == 16384
    assert not s.query()  # returned once verified, without waiting for s
    with torch.cuda.stream(s):
        snap = out.clone()  # ordered after the copy into out
    s.synchronize()
    assert torch.equal(snap.cpu().view(torch.bfloat16).view(SHAPE), reference(x, "default"))
    # a bad record with stream=: a miss, out untouched
    assert disk.put(t.inner_key(key(95)), _damaged("rans")[0])
    out.fill_(0xCD)
    assert t.get_into(key(95), out, stream=s) is None
    s.synchronize()
    assert bool((out == 0xCD).all())
    t.close()


@pytest.mark.gpu
def test_gpu_decode_odd_out_offset_and_long_record():
    x = kv_like(seed=96)
    big = torch.full((16384 + 2 + 64,), 0xCD, dtype=torch.uint8, device="cuda")
    rec = _record_with_meta(x, C.max_record_bytes(SHAPE, "default"))  # beyond the slot's record buffer
    C.decode_chunk(rec, big[2 : 2 + 16384], expected_shape=SHAPE, dtype=torch.bfloat16)
    y = big[2 : 2 + 16384].cpu()
    assert torch.equal(y.view(torch.bfloat16).view(SHAPE), reference(x, "default"))
    assert bool((big[:2] == 0xCD).all()) and bool((big[2 + 16384 :] == 0xCD).all())
    rec2 = _record("default", x)
    C.decode_chunk(np.frombuffer(rec2, np.uint8), big[2 : 2 + 16384], expected_shape=SHAPE, dtype=torch.bfloat16)
    assert torch.equal(big[2 : 2 + 16384].cpu(), y)
