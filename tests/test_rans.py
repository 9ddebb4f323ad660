"""rANS entropy coder (lmtier.codec.rans, csrc/rans_cpu.cpp): CPU round trips, the byte format
against a plain NumPy reference encoder, table normalization, fallback tables, raw segments, and
corrupted / truncated / hostile input (hypothesis fuzz, bounded)."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmtier.codec import rans

SEG = rans.DEFAULT_SEG_LOG2
L = 1 << 16


# ---------------------------------------------------------------------------------------------------
# Plain references (NumPy / Python) of the spec in csrc/include/lmtier/rans.h


def ref_normalize(counts, alphabet_size=0):
    c = [int(v) for v in counts] + [0] * (256 - len(counts))
    present = [s for s in range(256) if c[s] > 0 or s < alphabet_size]
    if not present:
        return None
    total = sum(c) or 1
    f = [0] * 256
    for s in present:
        f[s] = max(1, c[s] * 4096 // total)
    tot = sum(f)
    while tot < 4096:
        used = set()
        gave = False
        while tot < 4096:
            best, best_rem = -1, 0
            for s in range(256):
                if f[s] == 0 or s in used:
                    continue
                rem = max(c[s] * 4096 - f[s] * total, 0)
                if best < 0 or rem > best_rem:
                    best, best_rem = s, rem
            if best < 0:
                break
            used.add(best)
            f[best] += 1
            tot += 1
            gave = True
        if not gave:
            break
    while tot > 4096:
        best = -1
        for s in range(256):
            if f[s] > 1 and (best < 0 or f[s] > f[best]):
                best = s
        f[best] -= 1
        tot -= 1
    return np.array(f, np.uint16)


MISSING, RAW = "missing", "raw"


def ref_encode_segment(sym: np.ndarray, freq: np.ndarray, step_tables=None):
    """``step_tables`` (table switching): a function step -> freq of that step's run."""
    n = len(sym)
    x = np.full(32, L, np.uint64)
    words: list[int] = []
    for k in range(-(-n // 32)):
        if step_tables is not None:
            freq = step_tables(k)
        cdf = np.concatenate([[0], np.cumsum(freq.astype(np.uint64))]).astype(np.uint64)
        f_all = freq.astype(np.uint64)
        chunk = sym[32 * k : 32 * k + 32]
        m = len(chunk)
        f = f_all[chunk]
        if (f == 0).any():
            return MISSING
        xs = x[:m].copy()
        emit = xs >= (f << np.uint64(20))
        words.extend((xs[emit] & np.uint64(0xFFFF)).tolist())
        xs = np.where(emit, xs >> np.uint64(16), xs)
        q = xs // f
        x[:m] = (q << np.uint64(12)) + xs - q * f + cdf[chunk]
        if 128 + 2 * len(words) >= n:
            return RAW
    return x.astype("<u4").tobytes() + np.array(words, "<u2").tobytes()


def ref_encode_stream(
    sym: np.ndarray, table_id: int, tables: np.ndarray, seg_log2: int = SEG, run_len: int = 0
) -> bytes:
    n = len(sym)
    seg = 1 << seg_log2
    segs = [sym[i : i + seg] for i in range(0, n, seg)]
    adaptive = table_id == rans.ADAPTIVE_TABLE and n > 0
    freq = None
    coded = []
    if not adaptive and n > 0:
        freq = tables[table_id]
        if run_len:
            coded = [
                ref_encode_segment(s, None, lambda k, j=j: tables[table_id + (j * seg + 32 * k) // run_len])
                for j, s in enumerate(segs)
            ]
        else:
            coded = [ref_encode_segment(s, freq) for s in segs]
        adaptive = any(c is MISSING for c in coded)
    if adaptive:
        freq = ref_normalize(np.bincount(sym, minlength=256))
        coded = [ref_encode_segment(s, freq) for s in segs]
    head = np.array(
        [(0x534E524C, 2, 1 if adaptive else 0, seg_log2, 5, table_id & 0xFFFF, 0 if adaptive else run_len // 32, n)],
        dtype=np.dtype("<u4,u1,u1,u1,u1,<u2,<u2,<u4"),
    ).tobytes()
    table = b""
    if adaptive:
        bitmap = np.packbits(freq > 0, bitorder="little").tobytes()
        fq = freq[freq > 0].astype("<u2").tobytes()
        table = bitmap + fq + b"\0" * ((-len(fq)) % 4)
    payload = b""
    ends = []
    for s, c in zip(segs, coded):
        assert c is not MISSING
        body = s.tobytes() if c is RAW else c
        payload += body
        ends.append(len(payload))
        payload += b"\0" * ((-len(body)) % 4)
    return head + table + np.array(ends, "<u4").tobytes() + payload


# ---------------------------------------------------------------------------------------------------
# data


def skewed(rng, n, p=0.35, alphabet=256):
    return (rng.geometric(p, n) % alphabet).astype(np.uint8)


def laplace_symbols(rng, n, scale=2.0, center=16):
    return np.clip(np.round(rng.laplace(center, scale, n)), 0, 31).astype(np.uint8)


SIZES = [
    0,
    1,
    2,
    31,
    32,
    33,
    127,
    128,
    129,
    511,
    512,
    513,
    1023,
    1024,
    1025,
    4095,
    4097,
    (1 << SEG) - 1,
    1 << SEG,
    (1 << SEG) + 1,
    3 * (1 << SEG) + 17,
]


@pytest.fixture(scope="module")
def rng():
    return np.random.default_rng(1234)


# ---------------------------------------------------------------------------------------------------
# tables


def test_build_table_matches_reference(rng):
    cases = [
        np.bincount(skewed(rng, 5000), minlength=256),
        rng.integers(0, 3, 256),
        np.eye(256, dtype=np.int64)[7] * 10,
        np.r_[np.ones(256, np.int64)],
        np.r_[10**9, np.ones(255, np.int64)],
        rng.integers(0, 10**6, 256),
    ]
    for c in cases:
        for alpha in (0, 16, 256):
            got = rans.build_table(c, alphabet_size=alpha)
            want = ref_normalize(list(c), alpha)
            assert got.sum() == 4096
            np.testing.assert_array_equal(got, want)
            present = (np.asarray(c) > 0) | (np.arange(256) < alpha)
            assert (got[present] >= 1).all() and (got[~present] == 0).all()
    assert rans.build_table([0, 0, 5]).tolist()[2] == 4096
    with pytest.raises(ValueError):
        rans.build_table(np.zeros(256))
    assert rans.build_table(np.zeros(256), alphabet_size=4).tolist()[:5] == [1024, 1024, 1024, 1024, 0]


def test_division_by_magic_is_exact():
    """The CUDA encoder divides with Granlund-Montgomery reciprocals (rans.h div_magic); the CPU with
    '/'. Check the formula for every frequency 1..4096 on edge and random 32-bit states."""
    r = np.random.default_rng(7)
    xs = np.unique(
        np.r_[
            np.arange(0, 70000, 997),
            [0, 1, 2**16, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1],
            r.integers(0, 2**32, 4000, dtype=np.uint64),
        ]
    ).astype(np.uint64)
    for d in range(1, 4097):
        l = (d - 1).bit_length()
        mul = ((1 << 32) * ((1 << l) - d)) // d + 1
        assert mul < 1 << 32
        sh1, sh2 = min(l, 1), max(l - 1, 0)
        x = np.r_[xs, np.array([d * k - 1 for k in (1, 2, 2**20) if 0 <= d * k - 1 < 2**32], np.uint64)]
        t = (x * np.uint64(mul)) >> np.uint64(32)
        q = (t + ((x - t) >> np.uint64(sh1))) >> np.uint64(sh2)
        np.testing.assert_array_equal(q, x // np.uint64(d), err_msg=f"d={d}")


def test_entropy_bits(rng):
    x = skewed(rng, 20000)
    t = rans.table_from_symbols(x)
    bits = rans.entropy_bits(x, t)
    p = np.bincount(x, minlength=256) / x.size
    h = -(p[p > 0] * np.log2(p[p > 0])).sum() * x.size
    assert h <= bits <= h * 1.02
    t2 = t.copy()
    t2[x[0]] = 0
    assert math.isinf(rans.entropy_bits(x, t2))


# ---------------------------------------------------------------------------------------------------
# format vs reference


@pytest.mark.parametrize("n", [0, 1, 33, 129, 1000, 1025, 5000])
@pytest.mark.parametrize("kind", ["skewed", "laplace", "uniform", "same", "missing", "adaptive"])
def test_bytes_match_reference(rng, n, kind):
    seg_log2 = 10
    table = rans.build_table(np.bincount(skewed(rng, 4000), minlength=256), alphabet_size=64)
    tables = np.stack([table, rans.build_table(np.ones(256))])
    tid = 0
    if kind == "skewed":
        x = skewed(rng, n, alphabet=64)
    elif kind == "laplace":
        x = laplace_symbols(rng, n)
    elif kind == "uniform":
        x, tid = rng.integers(0, 256, n, dtype=np.uint8), 1
    elif kind == "same":
        x = np.full(n, 3, np.uint8)
    elif kind == "missing":
        x = skewed(rng, n, alphabet=64)
        if n:
            x[n // 2] = 200  # absent from table 0
    else:
        x, tid = skewed(rng, n), rans.ADAPTIVE_TABLE
    b = rans.encode([x], tid, tables, seg_log2=seg_log2)
    want = ref_encode_stream(x, tid, tables, seg_log2)
    assert bytes(b.stream(0)) == want
    (y,) = rans.decode(b, tables)
    np.testing.assert_array_equal(y, x)
    if kind == "missing" and n >= 1000:
        assert rans.stream_info(b.stream(0)).adaptive


# ---------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("seg_log2", [10, 12, SEG])
def test_round_trip_sizes(rng, seg_log2):
    tables = np.stack([rans.build_table(np.bincount(skewed(rng, 10000), minlength=256), alphabet_size=256)])
    streams = []
    for n in SIZES:
        streams.append(skewed(rng, n))
        streams.append(rng.integers(0, 256, n, dtype=np.uint8))
        streams.append(np.full(n, 255, np.uint8))
    for tid in (0, rans.ADAPTIVE_TABLE):
        b = rans.encode(streams, tid, tables, seg_log2=seg_log2)
        out = rans.decode(b, tables)
        for x, y in zip(streams, out):
            np.testing.assert_array_equal(x, y)
        assert b.nbytes <= rans.max_batch_encoded_bytes(len(streams), sum(map(len, streams)), seg_log2)
        for i, x in enumerate(streams):
            assert b.offsets[i + 1] - b.offsets[i] <= rans.max_encoded_bytes(len(x), seg_log2)


def test_threads_identical(rng):
    streams = [skewed(rng, 200_000), laplace_symbols(rng, 70_001), rng.integers(0, 256, 50_000, dtype=np.uint8)]
    tables = np.stack([rans.table_from_symbols(streams[0])])
    outs = [rans.encode(streams, [0, rans.ADAPTIVE_TABLE, 0], tables, num_threads=t) for t in (1, 2, 5)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o.offsets, outs[0].offsets)
        assert bytes(o.data) == bytes(outs[0].data)
    for t in (1, 3):
        for x, y in zip(streams, rans.decode(outs[0], tables, num_threads=t)):
            np.testing.assert_array_equal(x, y)


def test_compression_close_to_entropy(rng):
    x = laplace_symbols(rng, 1 << 20, scale=1.5)
    t = rans.table_from_symbols(x)
    b = rans.encode([x], 0, t)
    ideal = rans.entropy_bits(x, t) / 8
    assert b.nbytes < ideal * 1.03 + 1024
    # static table with every symbol: no fallback table, no raw segments
    info = rans.stream_info(b.stream(0))
    assert not info.adaptive and info.num_symbols == x.size


@pytest.mark.parametrize("n", [1000, 1 << SEG, 100_000])
def test_single_symbol_table(rng, n):
    """A one-symbol table (freq 4096) codes a constant stream in 128 bytes of states per segment."""
    x = np.full(n, 42, np.uint8)
    b = rans.encode([x], rans.ADAPTIVE_TABLE, seg_log2=10)
    assert bytes(b.stream(0)) == ref_encode_stream(x, rans.ADAPTIVE_TABLE, None, 10)
    nseg = -(-n // 1024)
    assert b.nbytes <= 16 + 36 + 4 * nseg + 128 * nseg + 1024
    np.testing.assert_array_equal(rans.decode(b)[0], x)


def test_raw_segments_for_incompressible(rng):
    x = rng.integers(0, 256, 100_000, dtype=np.uint8)
    b = rans.encode([x], rans.ADAPTIVE_TABLE)
    nseg = -(-x.size // (1 << SEG))
    assert b.nbytes <= x.size + 16 + 544 + 4 * nseg + 3 * nseg
    np.testing.assert_array_equal(rans.decode(b)[0], x)


def test_torch_cpu_and_encode_into(rng):
    torch = pytest.importorskip("torch")
    xs = [torch.from_numpy(skewed(rng, n)) for n in (10, 40_000)]
    n_total = sum(x.numel() for x in xs)
    out = torch.empty(rans.max_batch_encoded_bytes(2, n_total), dtype=torch.uint8)
    scratch = torch.empty(rans.encode_scratch_bytes(2, n_total), dtype=torch.uint8)
    offsets = torch.empty(3, dtype=torch.int64)
    status = torch.empty(2, dtype=torch.int32)
    rans.encode_into(xs, rans.ADAPTIVE_TABLE, None, out=out, offsets=offsets, status=status, scratch=scratch)
    assert status.tolist() == [0, 0]
    ref = rans.encode([x.numpy() for x in xs])
    assert bytes(out[: int(offsets[-1])].numpy()) == bytes(ref.data)
    # too small scratch / output -> status, not a crash
    rans.encode_into(xs, rans.ADAPTIVE_TABLE, None, out=out[:100], offsets=offsets, status=status, scratch=scratch)
    assert set(status.tolist()) == {10}
    rans.encode_into(xs, rans.ADAPTIVE_TABLE, None, out=out, offsets=offsets, status=status, scratch=scratch[:5000])
    assert set(status.tolist()) == {9}


def test_bad_tables_and_ids(rng):
    x = skewed(rng, 1000)
    good = rans.table_from_symbols(x)
    with pytest.raises(ValueError, match="table"):
        rans.encode([x], 3, good[None])
    bad = good.copy()
    bad[0] += 1
    with pytest.raises(ValueError, match="table"):
        rans.encode([x], 0, bad[None])
    b = rans.encode([x], 0, good[None])
    with pytest.raises(ValueError, match="table"):
        rans.decode(b, None)
    with pytest.raises(ValueError, match="table"):
        rans.decode(b, bad[None])
    with pytest.raises(ValueError, match="capacity"):
        out = np.empty(10, np.uint8)
        st, ln = np.zeros(1, np.int32), np.zeros(1, np.int64)
        rans.decode_into([b.stream(0)], good[None], outs=[out], out_lengths=ln, status=st)
        rans._raise_status(st, "decode")
    with pytest.raises(ValueError):
        rans.encode([x], 0, good[None], seg_log2=5)


# ---------------------------------------------------------------------------------------------------
# corrupted / hostile input


def _decode_status(buf: bytes, tables, capacity=1 << 16) -> tuple[int, np.ndarray]:
    src = np.frombuffer(buf, np.uint8).copy() if len(buf) else np.zeros(0, np.uint8)
    out = np.zeros(capacity, np.uint8)
    st, ln = np.zeros(1, np.int32), np.zeros(1, np.int64)
    rans.decode_into([src], tables, outs=[out], out_lengths=ln, status=st)
    return int(st[0]), out[: int(ln[0])]


@pytest.fixture(scope="module")
def sample(rng):
    x = laplace_symbols(rng, 6000)
    tables = np.stack([rans.table_from_symbols(x)])
    b0 = bytes(rans.encode([x], 0, tables, seg_log2=10).data)
    b1 = bytes(rans.encode([x], rans.ADAPTIVE_TABLE, tables, seg_log2=10).data)
    return x, tables, b0, b1


def test_truncation_always_detected(sample):
    x, tables, b0, b1 = sample
    for buf in (b0, b1):
        assert _decode_status(buf, tables)[0] == 0
        for cut in range(len(buf)):
            status, _ = _decode_status(buf[:cut], tables)
            assert status != 0, cut
        with pytest.raises(ValueError):
            rans.decode([np.frombuffer(buf[: len(buf) // 2], np.uint8)], tables, lengths=[x.size])


def test_corruption_detected_or_harmless(sample):
    x, tables, b0, b1 = sample
    r = np.random.default_rng(3)
    detected = 0
    trials = 0
    for buf in (b0, b1):
        for _ in range(300):
            m = bytearray(buf)
            pos = int(r.integers(0, len(m)))
            m[pos] ^= 1 << int(r.integers(0, 8))
            status, y = _decode_status(bytes(m), tables)
            trials += 1
            detected += status != 0
            if status == 0:
                assert y.size <= 1 << 16
    # the rANS integrity check (final states, word count) catches nearly every flip of coded data
    assert detected / trials > 0.9


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=0, max_size=3000))
def test_fuzz_random_bytes(data):
    tables = np.stack([rans.build_table(np.ones(256))])
    # also with a valid-looking header
    head = np.array(
        [(0x534E524C, 2, 0, 10, 5, 0, 0, len(data))], dtype=np.dtype("<u4,u1,u1,u1,u1,<u2,<u2,<u4")
    ).tobytes()
    for buf in (data, head + data):
        status, y = _decode_status(buf, tables, capacity=4096)
        assert status >= 0


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8),
    st.integers(0, 10**6),
    st.booleans(),
)
def test_fuzz_mutated_streams(edits, cut, adaptive):
    rng = np.random.default_rng(5)
    x = laplace_symbols(rng, 3000)
    tables = np.stack([rans.table_from_symbols(x)])
    buf = bytearray(rans.encode([x], rans.ADAPTIVE_TABLE if adaptive else 0, tables, seg_log2=10).data)
    for pos, val in edits:
        buf[pos % len(buf)] = val
    buf = bytes(buf[: max(0, len(buf) - cut % 64)])
    status, y = _decode_status(buf, tables, capacity=4096)
    assert status >= 0
    if status == 0:
        assert y.size <= 4096


def test_hostile_lengths_are_bounded():
    tables = np.stack([rans.build_table(np.ones(256))])
    # claims 2**31 symbols but the capacity is small -> capacity error, no allocation, no hang
    head = np.array([(0x534E524C, 2, 0, 10, 5, 0, 0, 2**31)], dtype=np.dtype("<u4,u1,u1,u1,u1,<u2,<u2,<u4")).tobytes()
    assert _decode_status(head, tables)[0] == 4
    # header fine, but segment table would lie past the buffer
    head = np.array([(0x534E524C, 2, 0, 10, 5, 0, 0, 60000)], dtype=np.dtype("<u4,u1,u1,u1,u1,<u2,<u2,<u4")).tobytes()
    assert _decode_status(head + b"\0" * 20, tables, capacity=1 << 20)[0] == 1
    # segment ends that point past the payload
    ends = np.array([1 << 30], "<u4").tobytes()
    head = np.array([(0x534E524C, 2, 0, 10, 5, 0, 0, 1000)], dtype=np.dtype("<u4,u1,u1,u1,u1,<u2,<u2,<u4")).tobytes()
    assert _decode_status(head + ends + b"\0" * 64, tables)[0] == 5
    # misaligned source
    x = np.zeros(100, np.uint8)
    b = bytes(rans.encode([x], 0, tables).data)
    src = np.zeros(len(b) + 1, np.uint8)[1:]
    src[:] = np.frombuffer(b, np.uint8)
    out, st, ln = np.zeros(100, np.uint8), np.zeros(1, np.int32), np.zeros(1, np.int64)
    rans.decode_into([src], tables, outs=[out], out_lengths=ln, status=st)
    assert st[0] == 7


# ---------------------------------------------------------------------------------------------------
# codec record (lmtier.codec.format)

from lmtier.codec import format as fmt  # noqa: E402


def _record(rng, layers=3, S=2, meta=b"qmax-table"):
    info = fmt.RecordInfo(
        level_id=2,
        num_layers=layers,
        num_planes=2,
        num_tokens=256,
        num_heads=8,
        head_size=128,
        dtype=fmt.DType.BFLOAT16,
        sections_per_layer=S,
        table_id=7,
    )
    streams = [laplace_symbols(rng, int(n)) for n in rng.integers(0, 3000, layers * S)]
    tables = np.stack([rans.table_from_symbols(np.concatenate(streams))])
    batch = rans.encode(streams, 0, tables)
    return info, streams, tables, batch, fmt.pack(info, [batch.stream(i) for i in range(len(batch))], meta)


def test_record_round_trip(rng):
    info, streams, tables, batch, rec = _record(rng)
    r = fmt.unpack(rec)
    assert r.info == info and bytes(r.meta) == b"qmax-table" and r.payload_offset % 16 == 0
    assert len(rec) == fmt.record_size(info, [len(batch.stream(i)) for i in range(len(batch))], 10)
    # batch offsets are already 4-aligned: the payload is the encoded batch verbatim
    assert bytes(r.payload) == bytes(batch.data)
    for l in range(info.num_layers):
        off, n = r.layer_span(l)
        assert bytes(rec[off : off + n]) == bytes(r.section(l, 0)) + bytes(rec[off + len(r.section(l, 0)) : off + n])
        for s in range(2):
            (y,) = rans.decode([np.frombuffer(r.section(l, s), np.uint8)], tables)
            np.testing.assert_array_equal(y, streams[l * 2 + s])
    # decode all sections in one batched call straight from the record buffer
    buf = np.frombuffer(rec, np.uint8)
    srcs = [buf[o : o + n] for o, n in zip(r.section_offsets(), r.section_lengths())]
    for x, y in zip(streams, rans.decode(srcs, tables)):
        np.testing.assert_array_equal(x, y)
    # deterministic and trailing padding ignored
    assert fmt.pack(info, [batch.stream(i) for i in range(len(batch))], b"qmax-table") == rec
    fmt.unpack(rec + b"\0" * 4096)
    with pytest.raises(IndexError):
        r.section(3, 0)


def test_record_truncated_and_corrupted(rng):
    info, _, _, _, rec = _record(rng, layers=2, S=1)
    for cut in range(0, len(rec), max(1, len(rec) // 300)):
        with pytest.raises(ValueError):
            fmt.unpack(rec[:cut])
    r = np.random.default_rng(9)
    for _ in range(200):
        m = bytearray(rec)
        m[int(r.integers(0, len(m)))] ^= 1 << int(r.integers(0, 8))
        with pytest.raises(ValueError):
            fmt.unpack(bytes(m))
    with pytest.raises(ValueError, match="magic"):
        fmt.unpack(b"XXXX" + rec[4:])
    with pytest.raises(ValueError):
        fmt.RecordInfo(level_id=300, num_layers=1, num_planes=1, num_tokens=1, num_heads=1, head_size=1)
    with pytest.raises(ValueError, match="sections"):
        fmt.pack(info, [b"x"])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_record_fuzz(data):
    for buf in (data, fmt.MAGIC + struct.pack("<HH", 1, 64) + data):
        try:
            r = fmt.unpack(buf)
        except ValueError:
            continue
        for l in range(r.info.num_layers):
            r.layer_span(l)


# ---------------------------------------------------------------------------------------------------
# table switching (stream version 2): symbol i coded with table table_id + i // run_len


def _run_tables(rng, nruns, alphabet=13):
    return np.stack(
        [
            rans.build_table(
                np.r_[rng.integers(0, 50, alphabet), 0] + (np.arange(alphabet + 1) == alphabet // 2) * 800,
                alphabet_size=alphabet,
            )
            for _ in range(nruns)
        ]
    )


@pytest.mark.parametrize(
    "n,run_len,seg_log2",
    [
        (256 * 192, 256, SEG),
        (256 * 192 - 37, 256, SEG),
        (5000, 32, 10),
        (3 * 1024 + 5, 96, 10),
        (768 * 2, 768, SEG),
        (1, 64, SEG),
        (0, 32, SEG),
    ],
)
def test_run_tables_bytes_match_reference(rng, n, run_len, seg_log2):
    nruns = max(1, -(-n // run_len))
    tables = _run_tables(rng, nruns + 3)
    # each run drawn from a different spread so per-run tables matter
    spread = rng.uniform(0.5, 3.0, nruns)
    x = np.clip(np.round(rng.normal(6, np.repeat(spread, run_len)[:n])), 0, 12).astype(np.uint8)
    b = rans.encode([x], 2, tables, seg_log2=seg_log2, run_lens=run_len)
    assert bytes(b.stream(0)) == ref_encode_stream(x, 2, tables, seg_log2, run_len)
    info = rans.stream_info(b.stream(0))
    assert (info.run_len, info.adaptive, info.table_id) == ((run_len if n else 0) if n else 0, False, 2) or n == 0
    np.testing.assert_array_equal(rans.decode(b, tables)[0], x)


@pytest.mark.parametrize("run_len", [64, 256])  # a slot's symbol searched / indexed by buckets (rans_cpu.cpp)
@pytest.mark.parametrize("used", [(3, 7, 200, 255), (0, 1), (254,), tuple(range(0, 256, 5))])
def test_run_tables_with_gaps_decode_exactly(rng, used, run_len):
    """Switched tables whose symbols of nonzero frequency leave gaps (leading, between, none after
    the last or the last at 255): the decoder finds a slot's symbol past the zero-frequency ones,
    run after run; the CPU decode gives back every symbol."""
    nruns = 40
    tables = []
    for _ in range(nruns):
        counts = np.zeros(256, np.int64)
        counts[list(used)] = rng.integers(1, 60, len(used))
        tables.append(rans.build_table(counts))
    tables = np.stack(tables)
    x = rng.choice(np.array(used, np.uint8), run_len * nruns - 9)
    b = rans.encode([x], 0, tables, seg_log2=10, run_lens=run_len)
    assert rans.stream_info(b.stream(0)).run_len == run_len
    np.testing.assert_array_equal(rans.decode(b, tables)[0], x)


def test_run_tables_smaller_than_one_table(rng):
    """Per-run tables fitted to runs of different spreads beat one pooled table (the point of switching)."""
    run_len, nruns = 256, 64
    spread = np.repeat(rng.uniform(0.3, 3.0, nruns), run_len)
    x = np.clip(np.round(rng.normal(6, spread)), 0, 12).astype(np.uint8)
    runs = x.reshape(nruns, run_len)
    tables = np.stack([rans.build_table(np.bincount(r, minlength=13), alphabet_size=13) for r in runs])
    pooled = rans.build_table(np.bincount(x, minlength=13), alphabet_size=13)
    b_run = rans.encode([x], 0, tables, run_lens=run_len)
    b_one = rans.encode([x], 0, pooled[None])
    assert b_run.nbytes < 0.93 * b_one.nbytes
    np.testing.assert_array_equal(rans.decode(b_run, tables)[0], x)


def test_run_tables_fallback_and_errors(rng):
    tables = _run_tables(rng, 10)
    x = np.full(10 * 256, 6, np.uint8)
    x[700] = 200  # absent from run 2's table: the whole stream falls back to its own table
    b = rans.encode([x], 0, tables, run_lens=256)
    info = rans.stream_info(b.stream(0))
    assert info.adaptive and info.run_len == 0
    assert bytes(b.stream(0)) == ref_encode_stream(x, 0, tables, SEG, 256)
    np.testing.assert_array_equal(rans.decode(b, tables)[0], x)
    x[700] = 6
    with pytest.raises(ValueError, match="bad or unknown table"):  # runs need tables 1..10: 10 missing
        rans.encode([x], 1, tables, run_lens=256)
    with pytest.raises(ValueError, match="multiples of 32"):
        rans.encode([x], 0, tables, run_lens=100)
    b = rans.encode([x], 0, tables, run_lens=256)
    with pytest.raises(ValueError, match="bad or unknown table"):  # decoder with too few tables
        rans.decode(b, tables[:9])
    bad = tables.copy()
    bad[9, 6] += 1  # run 9's table no longer sums to 4096
    with pytest.raises(ValueError, match="bad or unknown table"):
        rans.decode(b, bad)
    # adaptive flag together with a run length is not a valid header
    raw = bytearray(bytes(rans.encode([x], rans.ADAPTIVE_TABLE).stream(0)))
    raw[10:12] = (8).to_bytes(2, "little")
    with pytest.raises(ValueError, match="bad stream header"):
        rans.decode([np.frombuffer(bytes(raw), np.uint8)], tables, lengths=[x.size])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_run_tables_hostile_bytes(data):
    """Random corruption of table-switching streams never crashes; it decodes or raises."""
    r = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    tables = _run_tables(r, 24)
    x = np.clip(np.round(r.normal(6, 2, 24 * 64)), 0, 12).astype(np.uint8)
    good = bytearray(bytes(rans.encode([x], 0, tables, run_lens=64, seg_log2=10).stream(0)))
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(good) - 1))
        good[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(good)))
    buf = np.frombuffer(bytes(good[:cut]) + b"\0" * ((-cut) % 4), np.uint8)
    out = np.empty(x.size, np.uint8)
    got = np.zeros(1, np.int64)
    stt = np.zeros(1, np.int32)
    rans.decode_into([buf], tables, outs=[out], out_lengths=got, status=stt)
    assert stt[0] in rans.STATUS_NAMES


def test_encode_scratch_bytes_is_enough_for_a_lone_stream():
    """encode_scratch_bytes sizes scratch for (symbols >> seg_log2) + streams segments; the encoder's
    capacity from those bytes must not come out one segment short (a 49,115-symbol stream at
    seg_log2 10 needs 48 segments: it used to get 47 and fail with "scratch too small")."""
    rng = np.random.default_rng(49115)
    x = rng.integers(0, 16, 49115, dtype=np.uint8)
    n = x.size
    out = np.empty(rans.max_batch_encoded_bytes(1, n), np.uint8)
    off = np.empty(2, np.int64)
    st = np.empty(1, np.int32)
    scratch = np.empty(rans.encode_scratch_bytes(1, n, seg_log2=10), np.uint8)
    rans.encode_into([x], rans.ADAPTIVE_TABLE, None, out=out, offsets=off, status=st, scratch=scratch, seg_log2=10)
    assert st[0] == 0
    enc = rans.encode([x], rans.ADAPTIVE_TABLE, None, seg_log2=10)
    np.testing.assert_array_equal(np.asarray(rans.decode(enc, None, lengths=[n])[0]), x)


def test_native_refusals_name_the_value_file_and_line():
    """A native argument check (here the CPU coder's seg_log2) raises ValueError with the numbers and
    the place formatted in (built without iostreams: common.h, RESULTS §4.1m)."""
    import lmtier._C as C

    off, st = np.zeros(2, np.uint64), np.zeros(1, np.int32)
    sc, desc = np.zeros(1 << 12, np.uint8), np.zeros(64, np.uint8)
    with pytest.raises(
        ValueError, match=r"^lmtier: rans: seg_log2 must be in \[10, 20\], got 99 \[.*rans_cpu\.cpp:\d+\]$"
    ):
        C.rans.encode(False, desc.ctypes.data, 1, 0, 0, 99, sc.ctypes.data, 1000, off.ctypes.data, st.ctypes.data,
                      sc.ctypes.data, sc.nbytes, 0, 0)  # fmt: skip


def test_run_luts_are_cuda_only():
    """The decode lookups of table-switching streams (``build_run_luts``) are a CUDA structure: the
    CPU decode refuses them by name, at the Python layer and at the native entry, and building them
    needs a CUDA tensor."""
    t = np.stack([rans.build_table(np.ones(256))])
    lens, st = np.zeros(1, np.int64), np.zeros(1, np.int32)
    desc = np.zeros(1, rans.DECODE_DESC)
    with pytest.raises(ValueError, match="CPU decode takes none"):
        rans.decode_descriptors(
            desc, 1, t.ctypes.data, 1, out_lengths=lens, status=st, run_luts=np.zeros(1024, np.uint8)
        )
    with pytest.raises(ValueError, match="CPU decode takes none"):
        rans._R.decode(False, desc.ctypes.data, 1, t.ctypes.data, 1, lens.ctypes.data, st.ctypes.data, 0, 0, 1, 0, 4096)
    with pytest.raises(ValueError, match="CUDA uint16"):
        rans.build_run_luts(t)
    assert rans.RUN_LUT_BYTES == 1024
