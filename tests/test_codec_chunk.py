"""The codec's chunk API: lmtier.codec.chunk (encode_chunk / decode_chunk, static tables,
dequantize_layers), rANS decode descriptors, and lmtier.codec.decoder.ChunkDecoder (the reusable decode
state behind decode_chunk and CodecTier.get_into), through the native kernels and the torch reference.
Tiny geometries (tests/codec_cases.py): the whole file runs in seconds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmtier.codec import chunk as C
from lmtier.codec import decoder as DEC
from lmtier.codec import format as fmt
from lmtier.codec import levels as L
from lmtier.codec import quant as Q
from lmtier.codec import rans
from tests.codec_cases import (
    DAMAGE,
    DNAME,
    DTYPES,
    LEVELS,
    SHAPE,
    check_within_bound,
    damaged,
    kv_like,
    out_of_range_record,
    record,
    record_with_meta,
    reference,
    tables42,
)

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


@pytest.mark.parametrize("kind", DAMAGE)
def test_decode_errors_are_clear_and_leave_out_untouched(kind, native):
    rec, msg = damaged(kind)
    out = torch.full((SHAPE[0] * 2 * 16 * 2 * 64 * 2,), 0xCD, dtype=torch.uint8)
    with pytest.raises(C.CodecRecordError, match=msg):
        C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16, level="default")
    assert bool((out == 0xCD).all())


def test_symbols_out_of_range_are_rejected(native):
    rec = out_of_range_record()  # a well-formed record whose K symbols exceed 2*qmax of the level
    with pytest.raises(C.CodecRecordError, match="symbol outside"):
        C.decode_chunk(rec, torch.empty(16384, dtype=torch.uint8), expected_shape=SHAPE, dtype=torch.bfloat16)


def test_decode_argument_errors():
    rec = record()
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


# ------------------------------------------------------------------------------------------------
# ChunkDecoder: the reusable decode state behind decode_chunk and CodecTier.get_into


def test_decoder_reuses_one_slot_and_its_buffers(native):
    st = tables42()
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
    st = tables42()
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
        (damaged("rans")[0], "rANS stream of layer 0, section 0 failed"),
        (out_of_range_record(), "symbol outside"),
        (damaged("checksum")[0], "checksum"),
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

    st = tables42()
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
    st = tables42()
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
    rec = record_with_meta(x, C.max_record_bytes(SHAPE, "default"))
    assert len(rec) > C.max_record_bytes(SHAPE, "default")
    out = torch.empty(16384, dtype=torch.uint8)
    C.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16)
    assert torch.equal(out.view(torch.bfloat16).view(SHAPE), reference(x, "default"))


def test_record_layout_refuses_negative_lengths_and_packs_sections_back_to_back():
    """``fmt.record_size`` / ``pack`` lay sections out at 4-byte aligned offsets (one cumsum) and
    refuse a negative length; records assembled one after the other in the thread's kept buffer are
    independent ``bytes`` (a later, smaller record leaves an earlier one as it was)."""
    info = fmt.RecordInfo(1, 2, 1, 4, 1, 8, dtype=fmt.DType.BFLOAT16, sections_per_layer=2, table_id=7)
    with pytest.raises(ValueError, match="negative section length -1"):
        fmt.record_size(info, [4, -1, 0, 0])
    secs = [b"abcde", b"", b"xy", b"0123"]
    big = fmt.pack(info, secs, b"meta")
    rec = fmt.unpack(big)
    assert rec.index["offset"].tolist() == [0, 8, 8, 12] and rec.index["length"].tolist() == [5, 0, 2, 4]
    assert [bytes(rec.section(i // 2, i % 2)) for i in range(4)] == secs
    small = fmt.pack(info, [b"z", b"", b"", b""])
    assert fmt.unpack(big).index["length"].tolist() == [5, 0, 2, 4] and big != small
    assert bytes(fmt.unpack(small).section(0, 0)) == b"z"
