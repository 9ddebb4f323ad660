"""The PCA levels' exact integer products on int8 GEMMs (`lmtier.codec.pca.imatmul`, the CUDA path),
run here on the host (``torch._int_mm`` has a CPU kernel): the same int64 results as a float64 GEMM
over the whole 16-bit range and its edges, for sizes that are not multiples of 8, and the records
and decodes of the codec bit for bit the reference's when the transform runs on that path.
The CUDA run of the same comparison: ``tests/test_gpu_codec_pca.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmtier.codec import pca, rans
from lmtier.codec.pca import imatmul as im
from lmtier.codec.pca import streams
from lmtier.codec.pca import transform as tf
from tests.test_codec_pca_product import _hand_chunk, _hand_model, _kv, fitted


def _ref(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return (x.double() @ a.double()).to(torch.int64)


def _operands(b: int, m: int, n: int, p: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int32 ``x`` ``[b, m, n]`` and ``a`` ``[b, n, p]`` over ``[-32768, 32767]``, with rows and
    columns at both ends of the range (the split's edge cases)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-32768, 32768, (b, m, n), generator=g, dtype=torch.int32)
    a = torch.randint(-32768, 32768, (b, n, p), generator=g, dtype=torch.int32)
    x[0, 0], x[0, -1], a[0, :, 0], a[-1, :, -1] = 32767, -32768, -32768, 32767
    return x, a


def test_split16_covers_the_16_bit_range():
    v = torch.arange(-32768, 32768)
    hi, lo = im.split16(v)
    assert hi.dtype == lo.dtype == torch.int8
    assert torch.equal(256 * hi.long() + lo.long() + 128, v)
    assert (int(hi.min()), int(hi.max()), int(lo.min()), int(lo.max())) == (-128, 127, -128, 127)


@pytest.mark.parametrize("shape", [(2, 5, 16, 24), (3, 40, 64, 64), (2, 7, 4, 4), (1, 3, 13, 5), (1, 1, 8, 8)])
def test_matmul_is_exact_over_the_whole_range(shape):
    x, a = _operands(*shape, seed=sum(shape))
    sm = im.split_matrix(a.to(torch.int16), "cpu")
    got = im.matmul(x, sm)
    assert got.dtype == torch.int64 and torch.equal(got, _ref(x, a))


def test_matmul_of_extreme_operands():
    """Every input and matrix entry at -32768 or 32767: the largest sums the split meets."""
    n = 64
    a = torch.full((1, n, 8), -32768, dtype=torch.int32)
    a[0, :, 4:] = 32767
    x = torch.full((1, 3, n), 32767, dtype=torch.int32)
    x[0, 1] = -32768
    x[0, 2, ::2] = -32768
    assert torch.equal(im.matmul(x, im.split_matrix(a.to(torch.int16), "cpu")), _ref(x, a))


@pytest.mark.parametrize("shape", [(2, 5, 16, 24), (3, 40, 64, 64), (1, 3, 13, 5)])
def test_matmul_small_adds_the_escaped_values(shape):
    """Coefficients mostly in [-127, 127], a few at -128 and beyond (up to +-32767): exact."""
    b, m, n, p = shape
    _, a = _operands(*shape, seed=7)
    g = torch.Generator().manual_seed(8)
    q = torch.randint(-127, 128, (b, m, n), generator=g, dtype=torch.int32)
    q[0, 0, 3], q[-1, 2, 1], q[0, 1, 0], q[-1, 1, 2], q[0, -1, 4] = 32767, -32767, -128, 200, 128
    got = im.matmul_small(q, im.split_matrix(a.to(torch.int16), "cpu"))
    assert torch.equal(got, _ref(q, a))


def test_matmul_small_in_several_escape_batches(monkeypatch):
    monkeypatch.setattr(im, "_ESC_BATCH", 5)
    _, a = _operands(2, 9, 16, 8, seed=3)
    q = torch.full((2, 9, 16), 300, dtype=torch.int32)
    q[:, ::2] = -1000
    assert torch.equal(im.matmul_small(q, im.split_matrix(a.to(torch.int16), "cpu")), _ref(q, a))


def test_refusals():
    a = im.split_matrix(torch.zeros(2, 16, 8, dtype=torch.int16), "cpu")
    with pytest.raises(ValueError, match="split matrices of 16 x 8"):
        im.matmul(torch.zeros(2, 3, 15, dtype=torch.int32), a)
    with pytest.raises(ValueError, match="split matrices"):
        im.matmul(torch.zeros(3, 3, 16, dtype=torch.int32), a)
    with pytest.raises(ValueError, match="split matrices"):
        im.matmul_small(torch.zeros(2, 3, 8, dtype=torch.int32), a)


def test_split_matrix_rows_are_the_matrix_rows():
    _, a = _operands(3, 1, 13, 21, seed=11)
    sm = im.split_matrix(a.to(torch.int16), "cpu")
    b, j = torch.tensor([0, 2, 1, 2]), torch.tensor([0, 12, 5, 3])
    assert torch.equal(sm.rows(b, j), a[b, j].to(torch.int64))
    with pytest.raises(ValueError, match="needs a matrix"):
        im.split_matrix(torch.zeros(8, dtype=torch.int16), "cpu")


def int8_path_cases() -> list[tuple[torch.Tensor, int]]:
    """(chunk, start) of the int8 path's comparisons (here and tests/test_gpu_codec_pca.py): sink and
    loud tokens, starts, T = 0 (no GEMM rows: the first CUDA run's torch path failed to reshape it),
    T = 5 / 9 / 12 (GEMMs of at most 16 rows, padded), and last a token 8x louder (escaped
    coefficients at pca_high)."""
    loud = _kv(40, 100, 34)
    loud[:, :, 17] *= 8
    return [
        (_kv(0, 7, 30), 7),
        (_kv(256, 0, 31, loud=(5, 77)), 0),
        (_kv(45, 300, 32), 300),
        (_kv(9, 17, 33), 17),
        (_kv(5, 3, 35), 3),
        (_kv(12, 40, 36), 40),
        (loud, 100),
    ]


def corner_chunk() -> torch.Tensor:
    """The hand-built model's corner cases: ties, +-127/128 symbols, a 32767 coefficient escaped."""
    return _hand_chunk([{0: 1}, {1: 8}, {1: 10}, {0: -3}], [{0: 5}, {1: 128}, {1: -127}, {2: 32752}])


@pytest.mark.parametrize("kind", ["plain", "metric"])
@pytest.mark.parametrize("level", ["pca_high", "pca_default"])
def test_codec_on_the_int8_path_gives_the_references_bytes(kind, level, monkeypatch):
    """Records and decodes with the transform's products on the int8 path (the CUDA one) equal the
    float64 GEMMs' byte for byte on :func:`int8_path_cases`."""
    m = fitted(kind)
    cases = int8_path_cases()
    ref = [pca.encode(x, start=s, model=m, level=level) for x, s in cases]
    decs = [pca.decode(r, model=m) for r in ref]
    monkeypatch.setattr(tf, "_imatmul", tf._imatmul_int8)
    for r, d, (x, s) in zip(ref, decs, cases):
        assert pca.encode(x, start=s, model=m, level=level) == r
        assert torch.equal(pca.decode(r, model=m).view(torch.int16), d.view(torch.int16))
    if level == "pca_high":
        assert pca.record_meta(ref[-1]).escapes > 0


def test_hand_built_corner_cases_on_the_int8_path(monkeypatch):
    """N = 4 (padded to 8 for the GEMM): ties, +-127/128 symbols, a 32767 coefficient escaped."""
    m = _hand_model()
    kv = corner_chunk()
    ref = {lv: pca.encode(kv, start=0, model=m, level=lv) for lv in ("pca_default", "pca_high")}
    decs = {lv: pca.decode(r, model=m) for lv, r in ref.items()}
    assert pca.record_meta(ref["pca_default"]).escapes >= 2
    monkeypatch.setattr(tf, "_imatmul", tf._imatmul_int8)
    for lv, r in ref.items():
        assert pca.encode(kv, start=0, model=m, level=lv) == r
        assert torch.equal(pca.decode(r, model=m).view(torch.int16), decs[lv].view(torch.int16))


def _check_streams(sym: torch.Tensor, tables: np.ndarray, run_len: int) -> list[bytes]:
    """`streams.encode`'s bytes of ``sym`` [S, N * run_len] are rans.encode's of each stream alone with
    its call's slice of the tables and its table base; `streams.decode` gives the symbols back."""
    s_count, n = sym.shape[0], tables.shape[0] // sym.shape[0]
    secs = streams.encode(sym, torch.from_numpy(tables), run_len)
    for c in streams.batches(s_count, n):
        for i in c:
            ref = rans.encode([sym[i].numpy()], table_ids=streams.table_base(i, n),
                              tables=tables[c.start * n : c.stop * n], run_lens=run_len)  # fmt: skip
            assert bytes(secs[i]) == bytes(ref.stream(0))
            assert rans.stream_info(bytes(secs[i])).table_id == (i - c.start) * n
    host = [bytes(s) for s in secs]
    assert torch.equal(streams.decode(host, tables, n * run_len, torch.device("cpu")), sym)
    return host


def test_stream_helpers_give_the_coders_bytes_and_symbols():
    """`lmtier.codec.pca.streams` (one coder call for every stream of a record whose tables fit the
    16-bit ids) on host tensors: each stream's bytes are rans.encode's, decode returns the symbols,
    and a stream of another length, a truncated one or one naming another first table raises."""
    m = fitted("plain")
    data, n = m.levels["pca_default"], m.vector_size
    assert streams.batches(2 * m.rows, n) == [range(2 * m.rows)]
    g = torch.Generator().manual_seed(0)
    sym = torch.randint(100, 150, (2 * m.rows, n * 64), generator=g, dtype=torch.uint8)
    host = _check_streams(sym, data.tables, 64)
    with pytest.raises(ValueError, match="expected"):
        streams.decode(host, data.tables, n * 64 + 32, torch.device("cpu"))
    with pytest.raises(ValueError):
        streams.decode([host[0], host[1][:40], *host[2:]], data.tables, n * 64, torch.device("cpu"))
    region = b"".join(h + bytes(-len(h) % 4) for h in host)  # a record's streams: one region, 4-byte aligned
    starts = np.cumsum([0] + [-(-len(h) // 4) * 4 for h in host[:-1]])
    sizes = np.array([len(h) for h in host])
    assert torch.equal(
        streams.queue_spans(region, starts, sizes, data.tables, n * 64, torch.device("cpu")).result(), sym
    )
    for bad_starts, bad_sizes in ((starts + 2, sizes), (starts + len(region), sizes), (starts, -sizes)):
        with pytest.raises(ValueError, match="outside the region of .* or not 4-byte aligned"):  # misaligned, out
            streams.queue_spans(region, bad_starts, bad_sizes, data.tables, n * 64, torch.device("cpu"))
    other_run = rans.encode([sym[0].numpy()], table_ids=0, tables=data.tables, run_lens=32).stream(0)
    with pytest.raises(ValueError, match="stream 0 switches tables every 32 symbols, its layout needs 64"):
        streams.decode([bytes(other_run), *host[1:]], data.tables, n * 64, torch.device("cpu"))
    old = rans.encode([sym[1].numpy()], table_ids=0, tables=data.tables[n : 2 * n], run_lens=64).stream(0)
    with pytest.raises(ValueError, match="stream 1 names table 0, its layout needs"):  # layout 1's header
        streams.decode([host[0], bytes(old), *host[2:]], data.tables, n * 64, torch.device("cpu"))


def test_header_fast_path_accepts_only_what_the_full_checks_accept(monkeypatch):
    """check_spans' whole-array comparison of the headers (the decode's common case) passes a record's
    streams as encoded; for random changes of 1-4 header bytes of any streams, whatever it passes the
    field-by-field checks pass too (and it declines every change to a field they check); counts that
    do not fit the coder (2**32 or more, above its maximum) and a layout of 0 tables are refused with
    a ValueError, as before the fast path."""
    m = fitted("plain")
    data, n = m.levels["pca_default"], m.vector_size
    g = torch.Generator().manual_seed(3)
    sym = torch.randint(100, 150, (2 * m.rows, n * 64), generator=g, dtype=torch.uint8)
    host = _check_streams(sym, data.tables, 64)
    region = np.frombuffer(b"".join(h + bytes(-len(h) % 4) for h in host), np.uint8)
    starts = np.cumsum([0] + [-(-len(h) // 4) * 4 for h in host[:-1]]).astype(np.int64)
    sizes = np.array([len(h) for h in host], np.int64)
    fast = streams._headers_as_laid_out
    assert fast(region, starts, sizes, n * 64, n)
    assert not fast(region, starts, sizes, n * 64 + 32, n)  # another count
    assert not fast(region, starts, sizes - sizes + 19, n * 64, n)  # too few bytes for the segment table

    def full(buf, length=n * 64, tables=n):  # the field-by-field checks alone
        with monkeypatch.context() as mp:
            mp.setattr(streams, "_headers_as_laid_out", lambda *a: False)
            streams.check_spans(buf, starts, sizes, length, tables)

    rng = np.random.default_rng(11)
    passed = 0
    for _ in range(400):
        bad = region.copy()
        for _ in range(int(rng.integers(1, 5))):
            at = int(starts[rng.integers(0, len(starts))] + rng.integers(0, rans.HEADER_BYTES))
            bad[at] = int(rng.integers(0, 256))
        if fast(bad, starts, sizes, n * 64, n):
            full(bad)  # must not raise
            passed += 1
    assert passed < 20  # nearly every change is declined (a byte may be set to its own value)
    for length, tables in ((1 << 32, n), (rans.MAX_STREAM_SYMBOLS + 32, n), (n * 64, 0)):
        with pytest.raises(ValueError):
            streams.check_spans(region, starts, sizes, length, tables)


def test_stream_helpers_split_the_streams_over_calls_when_their_tables_exceed_the_ids():
    """Streams of more tables than one call's 16-bit ids name (here B = 2 streams of 22,000 tables a
    call): consecutive ranges of B streams, each header naming its base within the call's slice; the
    tables differ, so a stream decoded with another's would not give the symbols back."""
    n, s_count = 22_000, 3
    assert streams.streams_per_call(n) == 2 and streams.batches(s_count, n) == [range(0, 2), range(2, 3)]
    tables = np.full((s_count * n, 256), 15, np.uint16)
    tables[np.arange(s_count * n), np.arange(s_count * n) % 256] += 256
    g = torch.Generator().manual_seed(1)
    sym = torch.randint(0, 256, (s_count, n * 32), generator=g, dtype=torch.uint8)
    _check_streams(sym, tables, 32)
    with pytest.raises(ValueError, match="coder's table ids"):
        streams.streams_per_call(rans.ADAPTIVE_TABLE + 1)


def test_stream_runs_are_the_streams_and_cost_no_torch_call_per_stream():
    """`streams.encode_runs`: one run per coder call holding its streams back to back (what
    format.pack_runs copies at once), equal to `streams.encode`'s streams, with a number of torch
    operations that grows with the coder calls, not with the streams (it cut a tensor per stream:
    each torch call of a store thread hands the GIL over)."""
    from tests.test_codec_spans import _CountOps

    g = torch.Generator().manual_seed(2)
    counts = {}
    for n, s_count in ((64, 2), (64, 16), (22_000, 3), (22_000, 4)):  # 1, 1, 2 and 2 coder calls
        tables = np.full((s_count * n, 256), 15, np.uint16)
        tables[np.arange(s_count * n), np.arange(s_count * n) % 256] += 256
        sym = torch.randint(0, 256, (s_count, n * 32), generator=g, dtype=torch.uint8)
        with _CountOps() as mode:
            runs = streams.encode_runs(sym, torch.from_numpy(tables), 32)
        counts[s_count] = len(mode.ops)
        assert [len(off) - 1 for _, off in runs] == [len(c) for c in streams.batches(s_count, n)]
        flat = [bytes(d[a:b]) for d, off in runs for a, b in zip(off, off[1:])]
        assert flat == [bytes(x) for x in streams.encode(sym, tables, 32)]
        assert all(off[0] == 0 and off[-1] == d.size for d, off in runs)
    assert counts[16] == counts[2] and counts[4] == counts[3], counts


def test_host_gemms_without_float64_copies_give_the_same_records(monkeypatch):
    """A model too large for cached float64 copies (as an 8B model's) widens each matrix when used:
    the same records and decodes."""
    m = fitted("metric")
    kv = _kv(40, 100, 34)
    ref = pca.encode(kv, start=100, model=m, level="pca_default")
    dec = pca.decode(ref, model=m)
    monkeypatch.setattr(tf, "_HOST_CACHE_BYTES", 0)
    tf._host_mats.cache_clear()
    assert tf._host_mats(m) is None
    assert pca.encode(kv, start=100, model=m, level="pca_default") == ref
    assert torch.equal(pca.decode(ref, model=m).view(torch.int16), dec.view(torch.int16))
    tf._host_mats.cache_clear()


def test_gemm_batches_cover_every_layer_group_once_within_the_budget(monkeypatch):
    """``kernels._slices``: the CUDA transform's batches of layer groups cover ``0 .. R`` in order, each
    batch's int32 GEMM outputs (``2 x groups x rows x 2 P8 x 4`` bytes) within ``GEMM_BYTES``, and at
    least one group per batch whatever the budget."""
    from lmtier.codec.pca import kernels

    assert kernels.GEMM_BYTES == 64 << 20
    assert kernels._slices(32, 512, 1024) == [(0, 8), (8, 16), (16, 24), (24, 32)]  # 8 MiB a group
    assert kernels._slices(32, 256, 1024) == [(0, 16), (16, 32)]
    assert kernels._slices(5, 1, 8) == [(0, 5)]
    assert kernels._slices(7, 256, 1024)[-1] == (0, 7)
    monkeypatch.setattr(kernels, "GEMM_BYTES", 1)
    assert kernels._slices(3, 256, 1024) == [(0, 1), (1, 2), (2, 3)]
    monkeypatch.setattr(kernels, "GEMM_BYTES", 3 * 4 << 20)
    assert kernels._slices(7, 256, 1024) == [(0, 3), (3, 6), (6, 7)]


def test_escape_rows_csr_gives_each_escaped_coefficients_high_byte():
    """``kernels._escape_rows`` (the CUDA decode's escape terms, built with torch ops, run here on the
    host): per row ``(r, p, t)`` the components ``j`` of the escaped coefficients in ascending order
    with ``hi8(q)``; scattered back, they equal ``hi8`` of every escaped coefficient and 0 elsewhere."""
    from lmtier.codec.pca import kernels

    g = torch.Generator().manual_seed(5)
    r, n, t = 3, 20, 33
    esc = torch.rand(r, 2, n, t, generator=g) < 0.1
    qt = torch.randint(-128, 128, (r, 2, n, t), generator=g, dtype=torch.int16)
    big = torch.randint(-32768, 32768, (int(esc.sum()),), generator=g, dtype=torch.int32)
    big[::4] = torch.randint(-128, 128, big[::4].shape, generator=g, dtype=torch.int32)  # escapes with hi8 = 0 too
    qt.masked_scatter_(esc, big.to(torch.int16))
    with pytest.raises(ValueError, match=f"{int(esc.sum())} escape symbols, 3 escaped coefficients given"):
        kernels._escape_index(esc, 3, r, n, t)
    row, col, hi = kernels._escape_rows(kernels._escape_index(esc, int(esc.sum()), r, n, t), qt, r, n, t)
    assert row[0] == 0 and row[-1] == col.numel() == int(esc.sum())
    dense = torch.zeros(r * 2 * t, n, dtype=torch.int32)
    for i in range(r * 2 * t):
        cols = col[row[i] : row[i + 1]]
        assert torch.all(cols[1:] > cols[:-1])  # ascending, no repeats
        dense[i, cols.long()] = hi[row[i] : row[i + 1]]
    want = torch.where(esc, im.split8(qt)[1], 0).reshape(r * 2, n, t).transpose(1, 2).reshape(r * 2 * t, n)
    assert (
        torch.equal(dense, want)
        and (want != 0).any()
        and ((want == 0) & esc.reshape(r * 2, n, t).transpose(1, 2).reshape(r * 2 * t, n)).any()
    )
    assert kernels._escape_index(esc, 0, r, n, t) is None
    empty = kernels._escape_rows(None, qt, r, n, t)
    assert empty[0].count_nonzero() == 0 and empty[1].numel() == empty[2].numel() == 0


def test_kernel_symbol_constants_are_the_transforms():
    """``decode_pre_symbols`` maps symbols with the C++ constants (``kSymOffset``, ``kSymEscape``): they
    must be :mod:`.transform`'s ``OFFSET`` and ``ESCAPE`` (checked on any CUDA build, GPU or not)."""
    from lmtier.codec.pca import kernels
    from lmtier.codec.pca import transform as tf

    c = kernels._native() if kernels.available() else None
    if c is None:
        pytest.skip("built without the PCA CUDA kernels")
    assert (c.SYM_OFFSET, c.SYM_ESCAPE) == (tf.OFFSET, tf.ESCAPE)
