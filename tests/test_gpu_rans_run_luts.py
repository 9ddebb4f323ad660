"""The rANS coder's decode lookups of table-switching streams on CUDA (``rans.build_run_luts``,
``rans.h``'s ``kRunLutBytes`` layout): the lookups equal a NumPy reference built from the tables'
definition, and decodes that read them give the symbols and statuses of the CPU decoder and of the
CUDA decode without them, on valid, cut and corrupted streams and on a table that does not sum to
4096. Marked ``gpu``."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from lmtier.codec import rans  # noqa: E402
from tests.test_gpu_rans import DEV, _run_batch, _statuses_both, hostile_copies  # noqa: E402

pytestmark = pytest.mark.gpu


def reference_luts(tables: np.ndarray) -> np.ndarray:
    """uint8 ``[T, RUN_LUT_BYTES]``: per table, uint32 bucket[b] (b < 128) = ``s | (f_s - 1) << 8 |
    cdf[s] << 20`` for the symbol s whose range [cdf[s], cdf[s] + f_s) holds slot 32 b, then uint16
    cdf[0..255]."""
    out = np.zeros((len(tables), rans.RUN_LUT_BYTES), np.uint8)
    for i, f in enumerate(tables.astype(np.int64)):
        cdf = np.concatenate([[0], np.cumsum(f)])
        slots = 32 * np.arange(128)
        s = np.searchsorted(cdf, slots, side="right") - 1  # cdf[s] <= slot < cdf[s + 1]
        bucket = s | (f[s] - 1) << 8 | cdf[s] << 20
        out[i, :512] = bucket.astype(np.uint32).view(np.uint8)
        out[i, 512:] = cdf[:256].astype(np.uint16).view(np.uint8)
    return out


def _tables(rng) -> np.ndarray:
    """Valid tables of every shape the lookups must handle: peaked, flat, sparse, one symbol of
    frequency 4096, symbols at both alphabet ends, small alphabets."""
    rows = [
        rans.build_table(np.ones(256)),
        rans.build_table(np.r_[np.zeros(255), 1.0]),
        rans.build_table(np.r_[1.0, np.zeros(255)]),
        rans.build_table(np.r_[1000.0, np.zeros(254), 1.0]),
        rans.build_table(np.bincount(rng.geometric(0.05, 20_000) % 256, minlength=256)),
    ]
    for spread in rng.uniform(0.2, 40.0, 59):
        x = np.clip(np.round(rng.normal(128, spread, 5000)), 0, 255).astype(np.int64)
        rows.append(rans.build_table(np.bincount(x, minlength=256)))
    t = np.stack(rows).astype(np.uint16)
    assert (t.astype(np.int64).sum(1) == rans.PROB_SCALE).all()
    return t


def test_run_luts_are_the_reference_lookups():
    tables = _tables(np.random.default_rng(3))
    luts = rans.build_run_luts(torch.from_numpy(tables).to(DEV))
    assert luts.shape == (len(tables), rans.RUN_LUT_BYTES) and luts.dtype == torch.uint8
    np.testing.assert_array_equal(luts.cpu().numpy(), reference_luts(tables))
    # tables at a 2-byte aligned address (the 16-byte loads' fallback): the same lookups
    big = torch.from_numpy(np.r_[np.zeros(1, np.uint16), tables.reshape(-1)]).to(DEV)
    odd = big[1:].view(len(tables), 256)
    assert odd.data_ptr() % 16 == 2
    np.testing.assert_array_equal(rans.build_run_luts(odd).cpu().numpy(), reference_luts(tables))
    # none: an empty result, no launch
    assert rans.build_run_luts(torch.from_numpy(tables[:0]).to(DEV)).shape == (0, rans.RUN_LUT_BYTES)


def _decode(bufs: list[bytes], tables: np.ndarray, capacity: int, luts: torch.Tensor | None):
    """CUDA decode of ``bufs`` through ``rans.decode_descriptors`` with or without lookups:
    (statuses, counts, outputs) on the host."""
    n = len(bufs)
    srcs = [torch.from_numpy(np.frombuffer(b, np.uint8).copy()).to(DEV) if b else None for b in bufs]
    outs = torch.zeros(n, capacity, dtype=torch.uint8, device=DEV)
    desc = np.zeros(n, rans.DECODE_DESC)
    desc["src"] = [0 if s is None else s.data_ptr() for s in srcs]
    desc["src_bytes"] = [len(b) for b in bufs]
    desc["dst"] = outs.data_ptr() + capacity * np.arange(n)
    desc["dst_capacity"] = capacity
    tdev = torch.from_numpy(tables).to(DEV)
    lens = torch.zeros(n, dtype=torch.int64, device=DEV)
    st = torch.zeros(n, dtype=torch.int32, device=DEV)
    scratch = torch.empty(rans.decode_scratch_bytes(n), dtype=torch.uint8, device=DEV)
    ddesc = torch.from_numpy(desc.view(np.uint8)).to(DEV)
    rans.decode_descriptors(
        ddesc, n, tdev.data_ptr(), len(tables), out_lengths=lens, status=st, scratch=scratch, run_luts=luts
    )
    torch.cuda.synchronize()
    return st.cpu().numpy(), lens.cpu().numpy(), outs.cpu().numpy()


@pytest.mark.parametrize("seg_log2", [10, rans.DEFAULT_SEG_LOG2])
def test_decodes_with_run_luts_are_the_cpus(seg_log2):
    """Valid table-switching streams (runs of 32 .. 1024 symbols, odd lengths, a stream on its own
    table, single-table streams beside them) and their cut and corrupted copies: with the lookups,
    the statuses, counts and symbols of the decode without them and of the CPU decoder."""
    rng = np.random.default_rng(seg_log2 + 7)
    streams, ids, runs, tables = _run_batch(rng)
    enc = rans.encode(streams, ids, tables, seg_log2=seg_log2, run_lens=runs)
    good = [bytes(enc.stream(i)) for i in range(len(streams))]
    picked = [good[i] for i in (0, 3, 9)]
    bufs = hostile_copies(rng, picked, 97, 300) + picked + good
    cap = max(len(x) for x in streams)
    luts = rans.build_run_luts(torch.from_numpy(tables).to(DEV))
    st_l, n_l, o_l = _decode(bufs, tables, cap, luts)
    st_n, n_n, o_n = _decode(bufs, tables, cap, None)
    st_c, st_g, (oc, lc), _ = _statuses_both(bufs, tables, capacity=cap)
    # refused alike (the error code of a stream with several bad segments is whichever segment's
    # warp reported first, on the device: compared as refused / decoded, as test_gpu_rans does)
    np.testing.assert_array_equal(st_l == 0, st_n == 0)
    np.testing.assert_array_equal(st_l == 0, st_c == 0)
    np.testing.assert_array_equal(st_l == 0, st_g == 0)
    np.testing.assert_array_equal(n_l, n_n)
    for i in np.flatnonzero(st_l == 0):
        assert n_l[i] == lc[i]
        np.testing.assert_array_equal(o_l[i, : n_l[i]], oc[i][: lc[i]])
        np.testing.assert_array_equal(o_l[i, : n_l[i]], o_n[i, : n_n[i]])
    for x, i in zip(streams, range(len(bufs) - len(good), len(bufs))):  # the valid streams themselves
        assert st_l[i] == 0 and n_l[i] == len(x)
        np.testing.assert_array_equal(o_l[i, : len(x)], x)
    assert (st_l[: len(bufs) - len(good)] != 0).mean() > 0.5


def test_decodes_read_the_lookups():
    """Lookups of other valid tables (each table id given its neighbour's) make every long
    table-switching stream decode to other symbols or be refused: the decode reads the lookups, not
    the tables' frequencies."""
    rng = np.random.default_rng(9)
    streams, ids, runs, tables = _run_batch(rng)
    enc = rans.encode(streams, ids, tables, seg_log2=10, run_lens=runs)
    good = [bytes(enc.stream(i)) for i in range(len(streams))]
    cap = max(len(x) for x in streams)
    switching = [
        i for i, r in enumerate(runs) if r and len(streams[i]) >= 1000 and not rans.stream_info(good[i]).adaptive
    ]
    assert len(switching) >= 4
    st, n, outs = _decode(good, tables, cap, rans.build_run_luts(torch.from_numpy(tables).to(DEV)))
    assert all(st[i] == 0 and np.array_equal(outs[i, : n[i]], streams[i]) for i in switching)
    other = rans.build_run_luts(torch.from_numpy(np.roll(tables, 1, axis=0)).to(DEV))
    st, n, outs = _decode(good, tables, cap, other)
    for i in switching:
        assert st[i] != 0 or not np.array_equal(outs[i, : n[i]], streams[i]), i


def test_decodes_with_run_luts_refuse_a_bad_table_as_the_cpu():
    """A table that does not sum to 4096 inside a stream's run range: its lookups are whatever the
    build made of it, and the decode refuses exactly the streams the CPU refuses (the others decode)."""
    rng = np.random.default_rng(5)
    streams, ids, runs, tables = _run_batch(rng)
    enc = rans.encode(streams, ids, tables, seg_log2=10, run_lens=runs)
    good = [bytes(enc.stream(i)) for i in range(len(streams))]
    cap = max(len(x) for x in streams)
    for bad in (0, 31, 205, 591):
        t = tables.copy()
        s = int(np.flatnonzero(t[bad])[0])
        t[bad, s] -= 1  # sums to 4095
        luts = rans.build_run_luts(torch.from_numpy(t).to(DEV))
        st_l, _, _ = _decode(good, t, cap, luts)
        st_c, _, _, _ = _statuses_both(good, t, capacity=cap)
        np.testing.assert_array_equal(st_l, st_c)
        assert (st_l == 3).any() and (st_l == 0).any(), (bad, st_l)


def test_run_luts_arguments_are_checked():
    tables = torch.from_numpy(_tables(np.random.default_rng(1))).to(DEV)
    with pytest.raises(ValueError, match="CUDA uint16"):
        rans.build_run_luts(tables.view(torch.int16))
    with pytest.raises(ValueError, match="contiguous"):
        rans.build_run_luts(tables[:, :128])
    n = 1
    desc = torch.zeros(rans.DECODE_DESC.itemsize, dtype=torch.uint8, device=DEV)
    kw = dict(
        out_lengths=torch.zeros(n, dtype=torch.int64, device=DEV),
        status=torch.zeros(n, dtype=torch.int32, device=DEV),
        scratch=torch.empty(rans.decode_scratch_bytes(n), dtype=torch.uint8, device=DEV),
    )
    short = torch.zeros(rans.RUN_LUT_BYTES * (len(tables) - 1), dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="fewer than"):
        rans.decode_descriptors(desc, n, tables.data_ptr(), len(tables), run_luts=short, **kw)
    with pytest.raises(ValueError, match="contiguous on"):
        rans.decode_descriptors(desc, n, tables.data_ptr(), len(tables), run_luts=short.cpu(), **kw)
    misaligned = torch.zeros(rans.RUN_LUT_BYTES * len(tables) + 16, dtype=torch.uint8, device=DEV)[8:]
    with pytest.raises(ValueError, match="16-byte aligned"):
        rans.decode_descriptors(desc, n, tables.data_ptr(), len(tables), run_luts=misaligned, **kw)


def test_tables_ok_bits_are_each_tables_sum():
    """``build_tables_ok``: bit t of the bitmap is set exactly when table t sums to 4096, over more
    tables than one decode call checks (65,536) and a count that is not a multiple of 32; bad
    arguments are refused."""
    rng = np.random.default_rng(5)
    n = 70_001
    t = np.tile(_tables(rng), (-(-n // 64), 1))[:n].copy()
    bad = rng.choice(n, 300, replace=False)
    bad = np.r_[bad, 0, 31, 32, 65_535, 65_536, n - 1]
    t[bad, rng.integers(0, 256, len(bad))] += 1  # 4,097: not a table (wraps only from 65,535)
    want = t.astype(np.int64).sum(1) == rans.PROB_SCALE
    assert not want[bad].any() and want.sum() == n - len(np.unique(bad))
    bits = rans.build_tables_ok(torch.from_numpy(t).to(DEV)).cpu().numpy()
    assert bits.shape == (-(-n // 32),)
    got = np.unpackbits(bits.view(np.uint8), bitorder="little")[:n].astype(bool)
    np.testing.assert_array_equal(got, want)
    assert not np.unpackbits(bits.view(np.uint8), bitorder="little")[n:].any()
    tables = torch.from_numpy(t[:64]).to(DEV)
    with pytest.raises(ValueError, match="CUDA uint16"):
        rans.build_tables_ok(tables.cpu())
    with pytest.raises(ValueError, match="contiguous"):
        rans.build_tables_ok(tables[:, :128])
