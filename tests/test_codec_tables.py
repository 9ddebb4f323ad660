"""Calibrated table-switching tables (lmtier.codec.calibrate) through the chunk codec: exact round
trips, smaller records than per-stream tables, fallbacks (T not a multiple of 32, unseen scale
codes, foreign geometry), table-set mismatches, the shipped file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmtier.codec import calibrate as CAL
from lmtier.codec import chunk as CH
from lmtier.codec import format as fmt
from lmtier.codec import rans

SHAPE = (3, 2, 256, 2, 64)


def kv_like(seed: int, shape=SHAPE) -> torch.Tensor:
    """KV-like chunk: Gaussian with per-(layer, plane, head, channel) magnitudes, outlier key channels
    and a large first token; bf16."""
    g = torch.Generator().manual_seed(seed)
    nl, _, t, h, d = shape
    mag = torch.rand(nl, 2, 1, h, d, generator=g) * 2 + 0.05
    mag[:, 0, :, :, :3] *= 12
    x = torch.randn(shape, generator=g) * mag
    x[:, :, 0] *= 6
    return x.to(torch.bfloat16)


@pytest.fixture(scope="module")
def tables():
    return {lv: CAL.calibrate([kv_like(s) for s in range(3)], lv) for lv in ("high", "default", "low")}


def roundtrip(chunk, level, tab):
    rec = CH.encode_chunk(chunk, shape=tuple(chunk.shape), dtype=torch.bfloat16, level=level, tables=tab)
    out = torch.empty_like(chunk)
    CH.decode_chunk(rec, out, expected_shape=tuple(chunk.shape), dtype=torch.bfloat16, level=level, tables=tab)
    return rec, out


@pytest.mark.parametrize("level", ["high", "default", "low"])
def test_tables_roundtrip_equals_per_stream_path_and_is_smaller(tables, level):
    tab, arrays = tables[level]
    x = kv_like(99)
    rec_t, out_t = roundtrip(x, level, tab)
    rec_a, out_a = roundtrip(x, level, None)
    # the decoded KV does not depend on the entropy coder's tables
    assert torch.equal(out_t.view(torch.int16), out_a.view(torch.int16))
    assert fmt.unpack(rec_t).info.table_id == tab.table_id != fmt.NO_TABLE
    assert fmt.unpack(rec_a).info.table_id == fmt.NO_TABLE
    # synthetic rows look alike after the rotation, so per-channel tables gain little here (on real
    # KV they do: benchmarks/codec_quality.py); they must not lose
    assert len(rec_t) <= len(rec_a)
    # every symbol section is one stream switching tables per (head, channel) run of T
    r = fmt.unpack(rec_t)
    info = rans.stream_info(np.frombuffer(r.section(1, 0), np.uint8))
    assert (info.run_len, info.table_id, info.adaptive) == (256, (1 * 2) * 2 * 64, False)
    info = rans.stream_info(np.frombuffer(r.section(2, 2), np.uint8))  # scales: K then V, H*T each
    assert info.run_len == 2 * 256 and info.table_id == 3 * 2 * 2 * 64 + 2 * 2
    assert arrays["sym"].shape == (3 * 2 * 2 * 64, 2 * max(CH.get_level(level).k.qmax_table(3)) + 1)


def test_tables_need_t_multiple_of_32_else_per_stream(tables):
    tab, _ = tables["default"]
    for t in (1, 17, 100, 31):
        x = kv_like(5, (3, 2, t, 2, 64))
        rec, out = roundtrip(x, "default", tab)
        assert fmt.unpack(rec).info.table_id == fmt.NO_TABLE
        _, out_a = roundtrip(x, "default", None)
        assert torch.equal(out.view(torch.int16), out_a.view(torch.int16))
    x = kv_like(5, (3, 2, 64, 2, 64))  # T = 64: switching applies
    rec, _ = roundtrip(x, "default", tab)
    assert fmt.unpack(rec).info.table_id == tab.table_id


def test_unseen_scale_codes_fall_back_per_stream(tables):
    tab, _ = tables["default"]
    x = kv_like(7)
    x[1] *= 2.0**6  # layer 1's scale codes far outside the calibrated range
    rec, out = roundtrip(x, "default", tab)
    r = fmt.unpack(rec)
    assert rans.stream_info(np.frombuffer(r.section(1, 2), np.uint8)).adaptive
    assert not rans.stream_info(np.frombuffer(r.section(0, 2), np.uint8)).adaptive
    _, out_a = roundtrip(x, "default", None)
    assert torch.equal(out.view(torch.int16), out_a.view(torch.int16))


def test_table_set_mismatch_is_a_clear_error(tables):
    tab, _ = tables["default"]
    other, _ = CAL.calibrate([kv_like(50)], "default")
    assert other.table_id != tab.table_id
    x = kv_like(8)
    rec = CH.encode_chunk(x, shape=SHAPE, dtype=torch.bfloat16, level="default", tables=tab)
    out = torch.empty_like(x)
    with pytest.raises(CH.CodecRecordError, match="static table set"):
        CH.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16, tables=other)
    with pytest.raises(CH.CodecRecordError, match="static table set"):
        CH.decode_chunk(rec, out, expected_shape=SHAPE, dtype=torch.bfloat16, tables=None)
    with pytest.raises(ValueError, match="sections"):
        CH.encode_chunk(
            kv_like(1, (2, 2, 256, 2, 64)), shape=(2, 2, 256, 2, 64), dtype=torch.bfloat16, level="default", tables=tab
        )


def test_save_load_roundtrip(tmp_path, tables):
    path = tmp_path / "t.npz"
    CAL.save(path, {lv: tables[lv][1] for lv in tables})
    for lv in tables:
        got = CAL.load(path, lv)
        assert got.table_id == tables[lv][0].table_id
        np.testing.assert_array_equal(got.tables, tables[lv][0].tables)
        np.testing.assert_array_equal(got.section_runs, tables[lv][0].section_runs)
    assert CAL.load(path, "lossless") is None
    z = dict(np.load(path, allow_pickle=False))
    z["default.sym"] = z["default.sym"][:, :3]  # rows no longer sum to 4096
    np.savez(tmp_path / "bad.npz", **z)
    with pytest.raises(ValueError, match="4096"):
        CAL.load(tmp_path / "bad.npz", "default")
    with pytest.raises(ValueError, match="quantized"):
        CAL.calibrate([kv_like(1)], "lossless")


def test_shipped_tables():
    if not CAL.SHIPPED_FILE.exists():
        pytest.skip("no shipped table file")
    shape = (30, 2, 256, 3, 64)  # SmolLM2-135M
    for lv in ("high", "default", "low"):
        tab = CAL.shipped_tables(lv, shape)
        assert tab is not None and tab.tables.shape == (30 * 2 * 3 * 64 + 60, 256)
        assert (tab.tables.astype(np.int64).sum(1) == 4096).all()
    assert CAL.shipped_tables("lossless", shape) is None
    assert CAL.shipped_tables("default", (32, 2, 256, 8, 128)) is None  # another model
    assert CAL.shipped_tables("default", (30, 2, 100, 3, 64)) is None  # T % 32 != 0
    x = kv_like(3, shape)
    tab = CAL.shipped_tables("default", shape)
    rec, out = roundtrip(x, "default", tab)
    _, out_a = roundtrip(x, "default", None)
    assert torch.equal(out.view(torch.int16), out_a.view(torch.int16))


def test_large_geometry_pools_channel_pairs():
    """Llama-3.1-8B has 32*2*8*128 = 65,536 channel runs: more than a stream can address, so the
    calibrated set shares one table between two neighbouring channels (runs of 2T)."""
    assert CAL.channels_per_table((30, 3, 64)) == 1
    assert CAL.channels_per_table((32, 8, 128)) == 2
    shape = (4, 2, 64, 2, 64)
    tab, arrays = CAL.calibrate([kv_like(1, shape)], "default")
    assert arrays["sym"].shape[0] == 4 * 2 * 2 * 64 and (tab.section_runs[:2] == 1).all()
    x = kv_like(2, shape)
    rec, out = roundtrip(x, "default", tab)
    _, out_a = roundtrip(x, "default", None)
    assert torch.equal(out.view(torch.int16), out_a.view(torch.int16))
    old = CAL.MAX_TABLES
    try:  # force pairing on a small geometry: same decoded KV, runs of 2T
        CAL.MAX_TABLES = 4 * 2 * 2 * 64 // 2 + 9
        tab2, arrays2 = CAL.calibrate([kv_like(1, shape)], "default")
        assert arrays2["sym"].shape[0] == 4 * 2 * 2 * 64 // 2 and (tab2.section_runs[:2] == 2).all()
        rec2, out2 = roundtrip(x, "default", tab2)
        assert torch.equal(out2.view(torch.int16), out_a.view(torch.int16))
        assert rans.stream_info(np.frombuffer(fmt.unpack(rec2).section(0, 0), np.uint8)).run_len == 128
    finally:
        CAL.MAX_TABLES = old
