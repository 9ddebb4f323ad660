"""The codec as a tier serde: lmtier.tiers.codec.CodecTier over a real DiskTier and a real Redis
(round trips, damaged records are misses and deleted, record bounds, geometry errors, threads) and its
GPU decode path (skipped without a CUDA device). Tiny geometries (tests/codec_cases.py): the whole file
runs in seconds."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmtier.codec import chunk as C
from lmtier.codec import decoder as DEC
from lmtier.codec import format as fmt
from lmtier.config import ConfigError
from lmtier.tiers.codec import CodecTier, check_codec_geometry
from lmtier.tiers.disk import DiskTier
from tests.codec_cases import (
    DAMAGE,
    DTYPES,
    LEVELS,
    SHAPE,
    as_bytes,
    check_within_bound,
    damaged,
    key,
    kv_like,
    out_of_range_record,
    record,
    record_with_meta,
    reference,
    tables42,
)

# ------------------------------------------------------------------------------------------------
# CodecTier over a real disk tier


@pytest.fixture
def disk(tmp_path):
    t = DiskTier([str(tmp_path / "d")], 64 << 20, io_threads=1)
    yield t
    t.close()


def _tier(inner, level, dtype=torch.bfloat16, shape=SHAPE):
    return CodecTier(inner, shape=shape, dtype=dtype, level=level, config_key="local_disk_serde")


def test_decoder_argument_errors(disk):
    dec = DEC.ChunkDecoder(shape=SHAPE, dtype=torch.bfloat16, level="default")
    dec2 = DEC.ChunkDecoder(shape=SHAPE, dtype=torch.bfloat16, level="default")
    rec = record()
    out = torch.empty(16384, dtype=torch.uint8)
    with pytest.raises(ValueError, match="stream= is for CUDA"):
        dec.decode(rec, out, stream=object())
    with dec2.slot() as s, pytest.raises(ValueError, match="another decoder"):
        dec.decode(rec, out, slot=s)
    with pytest.raises(ValueError, match="bytes"):
        dec.decode(rec, torch.empty(100, dtype=torch.uint8))
    with pytest.raises(C.CodecRecordError, match="level 'high', expected 'default'"):
        dec.decode(record(level="high"), out)
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
    seen = []
    t.add_eviction_listener(lambda ev: seen.append((ev.tier, ev.keys)))
    rec, _ = damaged(kind)
    assert disk.put(t.inner_key(key(5)), rec)
    out = bytearray(b"\xee" * 16384)
    assert t.contains(key(5)) and t.get_into(key(5), out) is None
    assert not t.contains(key(5)) and not disk.contains(t.inner_key(key(5)))
    assert t.counters["corrupt_deleted"] == 1
    assert seen == [(t.name, (key(5),))]  # reported gone, under the chunk's key: a scheduler stops claiming it
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
    rec, _ = damaged(kind)
    assert redis_tier.put(t.inner_key(key(13)), rec)
    assert t.contains(key(13)) and t.get_into(key(13), bytearray(16384)) is None
    assert not t.contains(key(13)) and not redis_tier.contains(t.inner_key(key(13)))


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
    rec, msg = damaged("rans")
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
    rec = out_of_range_record() if kind == "symbols" else damaged(kind)[0]
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
    st = tables42()
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
    assert disk.put(t.inner_key(key(95)), damaged("rans")[0])
    out.fill_(0xCD)
    assert t.get_into(key(95), out, stream=s) is None
    s.synchronize()
    assert bool((out == 0xCD).all())
    t.close()


@pytest.mark.gpu
def test_gpu_decode_odd_out_offset_and_long_record():
    x = kv_like(seed=96)
    big = torch.full((16384 + 2 + 64,), 0xCD, dtype=torch.uint8, device="cuda")
    rec = record_with_meta(x, C.max_record_bytes(SHAPE, "default"))  # beyond the slot's record buffer
    C.decode_chunk(rec, big[2 : 2 + 16384], expected_shape=SHAPE, dtype=torch.bfloat16)
    y = big[2 : 2 + 16384].cpu()
    assert torch.equal(y.view(torch.bfloat16).view(SHAPE), reference(x, "default"))
    assert bool((big[:2] == 0xCD).all()) and bool((big[2 + 16384 :] == 0xCD).all())
    rec2 = record("default", x)
    C.decode_chunk(np.frombuffer(rec2, np.uint8), big[2 : 2 + 16384], expected_shape=SHAPE, dtype=torch.bfloat16)
    assert torch.equal(big[2 : 2 + 16384].cpu(), y)
