"""rANS on CUDA: byte identity with the CPU encoder, cross decoding both ways, hostile input, odd
alignments, large batches. Inputs are built on the CPU (NumPy), run through both implementations and
compared exactly."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from lmtier.codec import format as fmt  # noqa: E402
from lmtier.codec import rans  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
SEG_LOG2S = [10, 12, rans.DEFAULT_SEG_LOG2, 16]
KINDS = ["skewed", "laplace", "uniform", "same", "constant", "missing", "adaptive", "mixed"]
SIZES = [0, 1, 31, 33, 128, 129, 511, 513, 1023, 1024, 1025, 4097, 16383, 16384, 16385, 65537, 300_001]


def skewed(rng, n, p=0.35, alphabet=256):
    return (rng.geometric(p, n) % alphabet).astype(np.uint8)


def laplace_symbols(rng, n, scale=2.0):
    return np.clip(np.round(rng.laplace(16, scale, n)), 0, 31).astype(np.uint8)


def make_batch(rng, kind):
    streams, ids = [], []
    for n in SIZES:
        if kind == "skewed":
            x, tid = skewed(rng, n, alphabet=64), 0
        elif kind == "laplace":
            x, tid = laplace_symbols(rng, n), 0
        elif kind == "uniform":
            x, tid = rng.integers(0, 256, n, dtype=np.uint8), 1
        elif kind == "same":
            x, tid = np.full(n, 9, np.uint8), 0
        elif kind == "constant":  # one-symbol adaptive table (freq 4096): states only
            x, tid = np.full(n, 7, np.uint8), rans.ADAPTIVE_TABLE
        elif kind == "missing":
            x, tid = skewed(rng, n, alphabet=64), 0
            if n:
                x[rng.integers(0, n)] = 250  # absent from table 0
        elif kind == "adaptive":
            x, tid = skewed(rng, n), rans.ADAPTIVE_TABLE
        else:
            x = np.concatenate([laplace_symbols(rng, n // 2), rng.integers(0, 256, n - n // 2, dtype=np.uint8)])
            tid = int(rng.integers(0, 2))
        streams.append(x)
        ids.append(tid)
    t0 = rans.build_table(
        np.bincount(laplace_symbols(rng, 50_000), minlength=256) + np.r_[np.ones(64), np.zeros(192)].astype(np.int64)
    )
    tables = np.stack([t0, rans.build_table(np.ones(256))])
    return streams, ids, tables


def gpu_encode(streams, ids, tables, seg_log2, stream=None):
    xs = [torch.from_numpy(x).to(DEV) for x in streams]
    return rans.encode(xs, ids, tables, seg_log2=seg_log2, stream=stream)


@pytest.mark.parametrize("seg_log2", SEG_LOG2S)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_bytes_identical_to_cpu(kind, seg_log2):
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{seg_log2}".encode()))
    streams, ids, tables = make_batch(rng, kind)
    cpu = rans.encode(streams, ids, tables, seg_log2=seg_log2)
    gpu = gpu_encode(streams, ids, tables, seg_log2)
    np.testing.assert_array_equal(gpu.offsets, cpu.offsets)
    g = gpu.data.cpu().numpy()
    if not np.array_equal(g, cpu.data):
        first = int(np.flatnonzero(g != cpu.data)[0])
        stream = int(np.searchsorted(cpu.offsets, first, side="right") - 1)
        pytest.fail(f"GPU bytes differ from CPU at byte {first} (stream {stream}, n={len(streams[stream])})")
    # cross decode: GPU decodes CPU bytes, CPU decodes GPU bytes
    dev_batch = rans.EncodedBatch(torch.from_numpy(cpu.data.copy()).to(DEV), cpu.offsets)
    out_gpu = rans.decode(dev_batch, tables, lengths=[len(x) for x in streams])
    out_cpu = rans.decode(rans.EncodedBatch(g, gpu.offsets), tables)
    for x, a, b in zip(streams, out_gpu, out_cpu):
        np.testing.assert_array_equal(a.cpu().numpy(), x)
        np.testing.assert_array_equal(b, x)


def test_gpu_many_streams_and_large_stream():
    rng = np.random.default_rng(11)
    # > 1024 streams (prep scan loops) and > 1024 segments in one stream (size scan loops)
    streams = [laplace_symbols(rng, int(n)) for n in rng.integers(0, 5000, 2500)]
    streams.append(laplace_symbols(rng, (1 << 24) + 12345))
    ids = [0] * len(streams)
    ids[5] = rans.ADAPTIVE_TABLE
    tables = np.stack([rans.table_from_symbols(streams[-1][:100000], alphabet_size=32)])
    cpu = rans.encode(streams, ids, tables)
    gpu = gpu_encode(streams, ids, tables, rans.DEFAULT_SEG_LOG2)
    np.testing.assert_array_equal(gpu.offsets, cpu.offsets)
    assert torch.equal(gpu.data.cpu(), torch.from_numpy(cpu.data))
    out = rans.decode(gpu, tables, lengths=[len(x) for x in streams])
    for x, y in zip(streams, out):
        assert torch.equal(y.cpu(), torch.from_numpy(x))


@pytest.mark.parametrize("shift", [1, 3, 4, 8, 13])
def test_gpu_unaligned_sources_and_destinations(shift):
    rng = np.random.default_rng(shift)
    lens = [0, 700, 512, 5000, 20000, 33]
    flat = np.concatenate([skewed(rng, n, alphabet=40) for n in lens])
    tables = np.stack([rans.table_from_symbols(flat, alphabet_size=40)])
    dev = torch.zeros(flat.size + 64, dtype=torch.uint8, device=DEV)
    dev[shift : shift + flat.size] = torch.from_numpy(flat).to(DEV)
    bounds = np.r_[0, np.cumsum(lens)] + shift
    views = [dev[bounds[i] : bounds[i + 1]] for i in range(len(lens))]
    cpu = rans.encode([flat[bounds[i] - shift : bounds[i + 1] - shift] for i in range(len(lens))], 0, tables)
    gpu = rans.encode(views, 0, tables)
    assert torch.equal(gpu.data.cpu(), torch.from_numpy(cpu.data))
    # decode into unaligned destinations
    out = torch.zeros(flat.size + 64, dtype=torch.uint8, device=DEV)
    outs = [out[bounds[i] : bounds[i + 1]] for i in range(len(lens))]
    st = torch.zeros(len(lens), dtype=torch.int32, device=DEV)
    ln = torch.zeros(len(lens), dtype=torch.int64, device=DEV)
    scratch = torch.empty(rans.decode_scratch_bytes(len(lens)), dtype=torch.uint8, device=DEV)
    rans.decode_into(
        [gpu.stream(i) for i in range(len(lens))], tables, outs=outs, out_lengths=ln, status=st, scratch=scratch
    )
    torch.cuda.synchronize()
    assert st.cpu().tolist() == [0] * len(lens) and ln.cpu().tolist() == lens
    assert torch.equal(out[shift : shift + flat.size].cpu(), torch.from_numpy(flat))
    assert int(out[:shift].abs().sum()) == 0 and int(out[shift + flat.size :].sum()) == 0


def _statuses_both(bufs, tables, capacity):
    """Decode hostile streams on CPU and GPU in one batch each; returns (cpu status, gpu status,
    cpu outputs, gpu outputs)."""
    n = len(bufs)
    srcs_c = [np.frombuffer(b, np.uint8).copy() if len(b) else np.zeros(0, np.uint8) for b in bufs]
    outs_c = [np.zeros(capacity, np.uint8) for _ in bufs]
    st_c, ln_c = np.zeros(n, np.int32), np.zeros(n, np.int64)
    rans.decode_into(srcs_c, tables, outs=outs_c, out_lengths=ln_c, status=st_c)
    # device: each source in its own exact-size allocation (so OOB reads would be caught by
    # compute-sanitizer runs) but 4-aligned
    srcs_g = [torch.from_numpy(s).to(DEV) if s.size else torch.zeros(0, dtype=torch.uint8, device=DEV) for s in srcs_c]
    outs_g = [torch.zeros(capacity, dtype=torch.uint8, device=DEV) for _ in bufs]
    st_g = torch.zeros(n, dtype=torch.int32, device=DEV)
    ln_g = torch.zeros(n, dtype=torch.int64, device=DEV)
    scratch = torch.empty(rans.decode_scratch_bytes(n), dtype=torch.uint8, device=DEV)
    rans.decode_into(srcs_g, tables, outs=outs_g, out_lengths=ln_g, status=st_g, scratch=scratch)
    torch.cuda.synchronize()
    return st_c, st_g.cpu().numpy(), (outs_c, ln_c), ([o.cpu().numpy() for o in outs_g], ln_g.cpu().numpy())


def hostile_copies(rng, good: list[bytes], cut_step: int, mutants: int) -> list[bytes]:
    """Each stream of ``good`` cut short every ``cut_step`` bytes, then ``mutants`` copies of it with 1
    to 3 random bytes changed."""
    bufs = []
    for g in good:
        bufs += [g[:cut] for cut in range(0, len(g), cut_step)]
        for _ in range(mutants):
            m = bytearray(g)
            for _ in range(int(rng.integers(1, 4))):
                m[int(rng.integers(0, len(m)))] = int(rng.integers(0, 256))
            bufs.append(bytes(m))
    return bufs


def test_gpu_hostile_input_matches_cpu_verdicts():
    rng = np.random.default_rng(21)
    x = laplace_symbols(rng, 9000)
    tables = np.stack([rans.table_from_symbols(x)])
    good = [bytes(rans.encode([x], tid, tables, seg_log2=10).data) for tid in (0, rans.ADAPTIVE_TABLE)]
    bufs = hostile_copies(rng, good, 7, 400)
    bufs += [bytes(rng.integers(0, 256, int(rng.integers(0, 600)), dtype=np.uint8)) for _ in range(200)]
    bufs += good
    st_c, st_g, (oc, lc), (og, lg) = _statuses_both(bufs, tables, capacity=16384)
    np.testing.assert_array_equal(st_c == 0, st_g == 0)
    assert st_g[-1] == 0 and st_g[-2] == 0
    for i in np.flatnonzero(st_c == 0):
        assert lc[i] == lg[i]
        np.testing.assert_array_equal(oc[i][: lc[i]], og[i][: lg[i]])
    assert (st_g[:-2] != 0).mean() > 0.9


def test_gpu_status_errors():
    rng = np.random.default_rng(2)
    x = torch.from_numpy(skewed(rng, 5000)).to(DEV)
    t = rans.table_from_symbols(x.cpu())
    with pytest.raises(ValueError, match="table"):
        rans.encode([x], 4, t[None])
    n = x.numel()
    out = torch.empty(rans.max_batch_encoded_bytes(1, n), dtype=torch.uint8, device=DEV)
    off = torch.empty(2, dtype=torch.int64, device=DEV)
    st = torch.empty(1, dtype=torch.int32, device=DEV)
    scratch = torch.empty(rans.encode_scratch_bytes(1, n), dtype=torch.uint8, device=DEV)
    rans.encode_into([x], 0, t[None], out=out[:64], offsets=off, status=st, scratch=scratch)
    torch.cuda.synchronize()
    assert st.item() == 10 and off[-1].item() == 0
    rans.encode_into([x], 0, t[None], out=out, offsets=off, status=st, scratch=scratch[:4096])
    torch.cuda.synchronize()
    assert st.item() == 9
    # empty batch / empty streams
    assert rans.encode([], 0, t[None]).nbytes == 0
    e = rans.encode([torch.zeros(0, dtype=torch.uint8, device=DEV)] * 3, 0, t[None])
    assert e.offsets.tolist() == [0, 16, 32, 48]
    assert [y.numel() for y in rans.decode(e, t[None], lengths=[0, 0, 0])] == [0, 0, 0]


def test_gpu_side_stream_and_record():
    rng = np.random.default_rng(4)
    streams = [laplace_symbols(rng, 40_000) for _ in range(6)]
    tables = np.stack([rans.table_from_symbols(np.concatenate(streams))])
    s = torch.cuda.Stream()
    with torch.cuda.stream(torch.cuda.Stream()):
        gpu = gpu_encode(streams, 0, tables, rans.DEFAULT_SEG_LOG2, stream=s)
    cpu = rans.encode(streams, 0, tables)
    info = fmt.RecordInfo(
        level_id=1, num_layers=3, num_planes=2, num_tokens=256, num_heads=8, head_size=128, sections_per_layer=2
    )
    rec_g = fmt.pack(info, [gpu.stream(i).cpu() for i in range(6)])
    rec_c = fmt.pack(info, [cpu.stream(i) for i in range(6)])
    assert rec_g == rec_c


# ---------------------------------------------------------------------------------------------------
# table switching (stream version 2)


def _run_batch(rng):
    """Streams coded with per-run tables: KV-like runs of different spreads, odd lengths, a missing
    symbol (whole-stream fallback), run lengths 32 .. 1024, mixed with single-table streams."""
    nt = 600
    tables = np.stack(
        [
            rans.build_table(
                np.bincount(np.clip(np.round(rng.normal(6, s, 4000)), 0, 12).astype(np.int64), minlength=13),
                alphabet_size=13,
            )
            for s in rng.uniform(0.3, 3.0, nt)
        ]
    )
    streams, ids, runs = [], [], []
    for n, run, tid in [
        (256 * 192, 256, 0),
        (256 * 192 - 37, 256, 192),
        (16384 * 3 + 5, 1024, 10),
        (5000, 32, 400),
        (0, 256, 0),
        (1, 64, 7),
        (33, 32, 1),
        (768 * 2, 768, 590),
        (20000, 0, 3),
        (4097, 96, 100),
    ]:
        spread = np.repeat(rng.uniform(0.3, 3.0, max(1, -(-n // max(run, 1)))), max(run, 1))[:n]
        x = np.clip(np.round(rng.normal(6, spread)), 0, 12).astype(np.uint8)
        streams.append(x)
        ids.append(tid)
        runs.append(run)
    m = streams[0].copy()
    m[1000] = 99  # absent from every table: the stream falls back to its own table
    streams.append(m)
    ids.append(0)
    runs.append(256)
    return streams, ids, runs, tables


@pytest.mark.parametrize("seg_log2", SEG_LOG2S)
def test_gpu_run_tables_identical_to_cpu(seg_log2):
    rng = np.random.default_rng(seg_log2 + 100)
    streams, ids, runs, tables = _run_batch(rng)
    cpu = rans.encode(streams, ids, tables, seg_log2=seg_log2, run_lens=runs)
    xs = [torch.from_numpy(x).to(DEV) for x in streams]
    gpu = rans.encode(xs, ids, tables, seg_log2=seg_log2, run_lens=runs)
    np.testing.assert_array_equal(gpu.offsets, cpu.offsets)
    g = gpu.data.cpu().numpy()
    assert np.array_equal(g, cpu.data), "GPU table-switching bytes differ from CPU"
    dev_batch = rans.EncodedBatch(torch.from_numpy(cpu.data.copy()).to(DEV), cpu.offsets)
    out_gpu = rans.decode(dev_batch, tables, lengths=[len(x) for x in streams])
    out_cpu = rans.decode(rans.EncodedBatch(g, gpu.offsets), tables)
    for x, a, b in zip(streams, out_gpu, out_cpu):
        np.testing.assert_array_equal(a.cpu().numpy(), x)
        np.testing.assert_array_equal(b, x)


def test_gpu_run_tables_hostile_matches_cpu():
    rng = np.random.default_rng(77)
    streams, ids, runs, tables = _run_batch(rng)
    good = [bytes(rans.encode([streams[i]], ids[i], tables, seg_log2=10, run_lens=runs[i]).data) for i in (0, 3, 9)]
    bufs = hostile_copies(rng, good, 97, 300) + good
    st_c, st_g, (oc, lc), (og, lg) = _statuses_both(bufs, tables, capacity=256 * 192)
    np.testing.assert_array_equal(st_c == 0, st_g == 0)
    assert (st_g[-3:] == 0).all()
    for i in np.flatnonzero(st_c == 0):
        assert lc[i] == lg[i]
        np.testing.assert_array_equal(oc[i][: lc[i]], og[i][: lg[i]])
    # too few tables on the device: the same verdicts
    st_c, st_g, _, _ = _statuses_both(good, tables[:100], capacity=256 * 192)
    np.testing.assert_array_equal(st_c, st_g)
    assert (st_c == 3).all()


def test_gpu_run_tables_one_bad_table_in_range_matches_cpu():
    """The device validity bitmap (one warp per 32 tables) rejects exactly the streams whose run
    range holds an invalid table, at any bit position, as the CPU does (encode raises, decode
    reports kErrBadTable per stream)."""
    rng = np.random.default_rng(5)
    streams, ids, runs, tables = _run_batch(rng)
    enc = rans.encode(streams, ids, tables, seg_log2=10, run_lens=runs)
    good = [bytes(enc.stream(i)) for i in range(len(streams))]
    for bad in (0, 31, 32, 205, 383, 590, 591):
        t = tables.copy()
        s = int(np.flatnonzero(t[bad])[0])
        t[bad, s] -= 1  # sums to 4095
        st_c, st_g, _, _ = _statuses_both(good, t, capacity=256 * 192)
        np.testing.assert_array_equal(st_c, st_g)
        assert (st_g == 3).any() and (st_g == 0).any(), (bad, st_g)
        # encode: the same streams rejected (per-stream statuses), the others byte-identical
        descs = []
        for dev in ("cpu", DEV):
            xs = streams if dev == "cpu" else [torch.from_numpy(x).to(DEV) for x in streams]
            n, total = len(xs), sum(len(x) for x in streams)
            mk = (
                (lambda k: np.zeros(k, np.uint8))
                if dev == "cpu"
                else (lambda k: torch.zeros(k, dtype=torch.uint8, device=DEV))
            )
            out, scratch = mk(rans.max_batch_encoded_bytes(n, total, 10)), mk(rans.encode_scratch_bytes(n, total, 10))
            off = np.zeros(n + 1, np.int64) if dev == "cpu" else torch.zeros(n + 1, dtype=torch.int64, device=DEV)
            st = np.zeros(n, np.int32) if dev == "cpu" else torch.zeros(n, dtype=torch.int32, device=DEV)
            rans.encode_into(xs, ids, t, out=out, offsets=off, status=st, scratch=scratch, seg_log2=10, run_lens=runs)
            if dev != "cpu":
                torch.cuda.synchronize()
                out, off, st = out.cpu().numpy(), off.cpu().numpy(), st.cpu().numpy()
            descs.append((out, off, st))
        (oc, fc, sc), (og, fg, sg) = descs
        np.testing.assert_array_equal(sc, sg)
        assert (sg == 3).any() and (sg == 0).any(), (bad, sg)


def test_gpu_decode_descriptors_prebuilt_on_a_side_stream():
    """rans.decode_descriptors (what lmtier.codec.decoder.ChunkDecoder calls): descriptors and
    tables already on the device, run on a non-default stream, the same destinations reused for a
    second batch; results equal the input bytes (and thus the CPU decoder), statuses included."""
    n = None
    outs = lens = st = scratch = ddesc = desc = None
    s = torch.cuda.Stream()
    for seed in (11, 12):
        streams, ids, runs, tables = _run_batch(np.random.default_rng(seed))
        enc = rans.encode(streams, ids, tables, run_lens=runs)
        if n is None:  # built once, reused for the second batch (same lengths)
            n = len(streams)
            outs = [torch.full((len(x) + 5,), 0xEE, dtype=torch.uint8, device=DEV) for x in streams]
            lens = torch.zeros(n, dtype=torch.int64, device=DEV)
            st = torch.full((n,), 77, dtype=torch.int32, device=DEV)
            scratch = torch.empty(rans.decode_scratch_bytes(n), dtype=torch.uint8, device=DEV)
            ddesc = torch.empty(n * rans.DECODE_DESC.itemsize, dtype=torch.uint8, device=DEV)
            desc = np.zeros(n, rans.DECODE_DESC)
            desc["dst"] = [o.data_ptr() for o in outs]
            desc["dst_capacity"] = [o.numel() for o in outs]
        assert [len(x) for x in streams] == [o.numel() - 5 for o in outs]
        tdev = torch.from_numpy(tables.view(np.uint8).reshape(-1)).to(DEV)
        src = torch.from_numpy(np.asarray(enc.data)).to(DEV)
        desc["src"] = src.data_ptr() + enc.offsets[:-1]
        desc["src_bytes"] = np.diff(enc.offsets)
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            ddesc.copy_(torch.from_numpy(desc.view(np.uint8)))
            rans.decode_descriptors(
                ddesc, n, tdev.data_ptr(), tables.shape[0], out_lengths=lens, status=st, scratch=scratch, stream=s
            )
        s.synchronize()
        assert not st.cpu().numpy().any()
        assert lens.cpu().tolist() == [len(x) for x in streams]
        for x, o in zip(streams, outs):
            assert np.array_equal(o[: len(x)].cpu().numpy(), x) and bool((o[len(x) :] == 0xEE).all())
    with pytest.raises(ValueError, match="scratch"):
        rans.decode_descriptors(ddesc, n, tdev.data_ptr(), tables.shape[0], out_lengths=lens, status=st)
