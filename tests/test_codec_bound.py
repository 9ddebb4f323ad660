"""Error-bounded (adaptive) codec levels (lmtier.codec.bound): the chosen qmax meets the stated
error bound (computed exactly, and checked on the decoded chunk), is the smallest menu value that
does, records round-trip with their qmax table (native and reference paths byte/bit-identical),
malformed tables are refused, and the bound holds on the real model's KV."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lmtier.codec import bound as B
from lmtier.codec import chunk as CH
from lmtier.codec import levels as L
from lmtier.codec import quant as Q

H, TH = L.Transform.HADAMARD, L.Granularity.TOKEN_HEAD


def kv_like(seed: int, shape=(6, 2, 256, 2, 64)) -> torch.Tensor:
    """Gaussian KV with per-channel magnitudes, outlier key channels, a large first token and a
    shared key offset (what CENTERED discounts); bf16."""
    g = torch.Generator().manual_seed(seed)
    nl, _, t, h, d = shape
    mag = torch.rand(nl, 2, 1, h, d, generator=g) * 2 + 0.05
    mag[:, 0, :, :, :3] *= 12
    x = torch.randn(shape, generator=g) * mag
    x[:, 0] += torch.randn(nl, 1, h, d, generator=g) * 3
    x[:, :, 0] *= 6
    return x.to(torch.bfloat16)


def level(metric=L.BoundMetric.RELATIVE, kb=(0.2, 0.15, 0.05, 0.07, 0.1, 0.2), vb=(0.3, 0.25, 0.15, 0.4, 0.3, 0.3)):
    return L.Level(
        "test_eb",
        250,
        k=L.PlaneQuant(TH, (), H, L._eb_sixths(*kb), metric),
        v=L.PlaneQuant(TH, (), H, L._eb_sixths(*vb)),
        qmax_menu=L.QMAX_MENU,
    )


@pytest.fixture
def registered(monkeypatch):
    def reg(lv):
        monkeypatch.setitem(L.LEVELS_BY_ID, lv.level_id, lv)
        return lv

    return reg


def exact_errors(x: torch.Tensor, lv: L.Level, metric_k: L.BoundMetric) -> torch.Tensor:
    """[L, 2] error metric of the resolved level, computed independently: quantize with the
    reference's plane quantizer, dequantize in the rotated domain, fp64 norms."""
    out = torch.zeros(x.shape[0], 2, dtype=torch.float64)
    for p, pq, metric in ((0, lv.k, metric_k), (1, lv.v, L.BoundMetric.RELATIVE)):
        xp = x[:, p].float()
        q, codes = Q._quantize_plane(xp, pq)
        s = Q._broadcast_scale(Q.scale_value(codes), pq.granularity)
        y = Q.fwht(xp).double()
        yhat = q.double() * s.double()
        ref = y - y.mean(dim=1, keepdim=True) if metric == L.BoundMetric.CENTERED else y
        out[:, p] = (yhat - y).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    return out


@pytest.mark.parametrize("metric", [L.BoundMetric.RELATIVE, L.BoundMetric.CENTERED])
@pytest.mark.parametrize("seed", [0, 1])
def test_chosen_qmax_meets_bound_and_is_minimal(metric, seed):
    lv = level(metric)
    x = kv_like(seed)
    nl = x.shape[0]
    qk, qv, met = B.choose_qmax(x, lv)
    assert met
    rl = L.resolve(lv, qk, qv)
    err = exact_errors(x, rl, metric)
    bounds = torch.tensor([lv.k.bound_table(nl), lv.v.bound_table(nl)], dtype=torch.float64).T
    assert bool((err <= bounds).all()), (err, bounds)
    # minimal: one menu step lower breaks the bound (where there is a lower step)
    menu = list(L.QMAX_MENU)
    for p, chosen in ((0, qk), (1, qv)):
        for layer, q in enumerate(chosen):
            i = menu.index(q)
            if i == 0:
                continue
            lower = [list(qk), list(qv)]
            lower[p][layer] = menu[i - 1]
            e = exact_errors(x, L.resolve(lv, tuple(lower[0]), tuple(lower[1])), metric)
            assert e[layer, p] > bounds[layer, p]
    # the bounds differ by depth, so do the choices: K of the third sixth (bound 0.05) is finer
    assert qk[2] > qk[0]


def test_decoded_chunk_error_within_bound_plus_cast(registered):
    lv = registered(level())
    x = kv_like(3)
    shape = tuple(x.shape)
    rec = CH.encode_chunk(x, shape=shape, dtype=torch.bfloat16, level=lv)
    out = torch.empty_like(x)
    CH.decode_chunk(rec, out, expected_shape=shape, dtype=torch.bfloat16, level=lv)
    xf, of = x.double(), out.double()
    rel = (of - xf).flatten(2).norm(dim=2) / xf.flatten(2).norm(dim=2)  # [L, 2]
    bounds = torch.tensor([lv.k.bound_table(6), lv.v.bound_table(6)], dtype=torch.float64).T
    # forward-transform rounding (fp32, a few ulp) + output cast (bf16: 2^-9 relative)
    assert bool((rel <= bounds + 2.0**-9 * (1 + bounds) + 1e-5).all()), (rel, bounds)


def test_records_roundtrip_native_equals_reference(registered, monkeypatch):
    lv = registered(level())
    x = kv_like(4)
    shape = tuple(x.shape)
    rec = CH.encode_chunk(x, shape=shape, dtype=torch.bfloat16, level=lv)
    monkeypatch.setattr(CH, "USE_NATIVE", False)
    rec_ref = CH.encode_chunk(x, shape=shape, dtype=torch.bfloat16, level=lv)
    assert rec == rec_ref
    out_ref = torch.empty_like(x)
    CH.decode_chunk(rec, out_ref, expected_shape=shape, dtype=torch.bfloat16, level=lv)
    monkeypatch.setattr(CH, "USE_NATIVE", True)
    out = torch.empty_like(x)
    CH.decode_chunk(rec, out, expected_shape=shape, dtype=torch.bfloat16, level=lv)
    assert torch.equal(out.view(torch.int16), out_ref.view(torch.int16))
    qk, qv, _ = B.choose_qmax(x, lv)
    rl = L.resolve(lv, qk, qv)
    s, sd = Q.quantize(x, rl)
    assert torch.equal(out.view(torch.int16), Q.dequantize(s, sd, rl, shape, torch.bfloat16).view(torch.int16))
    info = CH.fmt.unpack(rec)
    assert bytes(info.meta) == B.META_MAGIC + bytes(v for pair in zip(qk, qv) for v in pair)
    assert len(rec) <= CH.max_record_bytes(shape, lv)


def test_malformed_qmax_table_is_refused(registered):
    lv = registered(level())
    x = kv_like(5)
    shape = tuple(x.shape)
    rec = CH.encode_chunk(x, shape=shape, dtype=torch.bfloat16, level=lv)
    r = CH.fmt.unpack(rec)
    sections = [r.section(layer, s) for layer in range(r.info.num_layers) for s in range(3)]
    out = torch.empty_like(x)
    bad_tables = [b"", B.META_MAGIC + bytes([8] * 12), B.META_MAGIC + bytes([7] * 10), b"QB0" + bytes([7] * 12)]
    for meta in bad_tables:  # 8 is not in the menu; too short; wrong magic
        forged = CH.fmt.pack(r.info, sections, meta)
        with pytest.raises(CH.CodecRecordError):
            CH.decode_chunk(forged, out, expected_shape=shape, dtype=torch.bfloat16, level=lv)


def test_unresolved_adaptive_level_is_not_quantized_by_accident():
    lv = level()
    with pytest.raises(ValueError, match="error-bounded"):
        Q.quantize(kv_like(0), lv)
    with pytest.raises(ValueError, match="menu"):
        L.resolve(lv, (8,) * 6, (7,) * 6)


def test_unreachable_bound_uses_menu_max_and_says_so():
    lv = level(kb=(0.001,) * 6)  # below what qmax 127 reaches on Gaussian rows
    qk, _qv, met = B.choose_qmax(kv_like(0), lv)
    assert not met and qk == (127,) * 6


MODEL = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct"


@pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="SmolLM2-135M not present")
def test_bound_holds_on_real_model_kv(registered):
    """SmolLM2's KV of two short texts (license prose, Python source), through the shipped adaptive
    levels: every chunk's decoded error within its bound (+ the bf16 cast)."""
    import inspect
    import textwrap

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    texts = [Path("/usr/share/common-licenses/GPL-3").read_text()[:6000], inspect.getsource(textwrap)]
    levels = [L.get_level("eb_default"), registered(level(L.BoundMetric.CENTERED))]
    for text in texts:
        ids = torch.tensor(tok(text).input_ids[:512])[None]
        with torch.no_grad():
            cache = m(ids, use_cache=True).past_key_values
        kv = torch.stack(
            [torch.stack([ly.keys[0].transpose(0, 1), ly.values[0].transpose(0, 1)]) for ly in cache.layers]
        )
        for c in (kv[:, :, :256], kv[:, :, 256:]):
            c = c.to(torch.bfloat16).contiguous()
            shape = tuple(c.shape)
            for lv in levels:
                nl = shape[0]
                rec = CH.encode_chunk(c, shape=shape, dtype=torch.bfloat16, level=lv)
                out = torch.empty_like(c)
                CH.decode_chunk(rec, out, expected_shape=shape, dtype=torch.bfloat16, level=lv)
                xf, of = c.double(), out.double()
                for p, pq in ((0, lv.k), (1, lv.v)):
                    e = of[:, p] - xf[:, p]
                    ref = xf[:, p]
                    if pq.metric == L.BoundMetric.CENTERED:
                        ref = ref - ref.mean(dim=1, keepdim=True)
                    rel = e.flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
                    b = torch.tensor(pq.bound_table(nl), dtype=torch.float64)
                    # cast allowance relative to the plane, scaled into the metric's denominator
                    cast = 2.0**-9 * xf[:, p].flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
                    assert bool((rel <= b + cast * (1 + b) + 1e-5).all()), (lv.name, p, rel, b)
    assert math.isfinite(float(kv.float().abs().max()))


def test_shipped_adaptive_tables_and_tier_round_trip(tmp_path):
    """The shipped SmolLM2 tables of the eb_* levels: fitted per plane for one qmax (planes choosing
    another qmax code with their own table), smaller records than per-stream tables, the same KV;
    CodecTier over a disk tier stores and loads eb_default chunks bit-identically to decode_chunk."""
    import numpy as np

    from lmtier.codec import calibrate as CAL
    from lmtier.tiers.codec import CodecTier
    from lmtier.tiers.disk import DiskTier

    if not CAL.SHIPPED_FILE.exists():
        pytest.skip("no shipped table file")
    shape = (30, 2, 256, 3, 64)
    x = kv_like(7, shape)
    for name in ("eb_high", "eb_default", "eb_low"):
        tab = CAL.shipped_tables(name, shape)
        assert tab is not None and tab.plane_qmax.shape == (30, 2)
        assert set(tab.plane_qmax.reshape(-1).tolist()) <= set(L.QMAX_MENU)
    for name in ("eb_default",):  # the record path is the same for the three
        tab = CAL.shipped_tables(name, shape)
        rec = CH.encode_chunk(x, shape=shape, dtype=torch.bfloat16, level=name, tables=tab)
        rec_own = CH.encode_chunk(x, shape=shape, dtype=torch.bfloat16, level=name)
        out, out_own = torch.empty_like(x), torch.empty_like(x)
        CH.decode_chunk(rec, out, expected_shape=shape, dtype=torch.bfloat16, level=name, tables=tab)
        CH.decode_chunk(rec_own, out_own, expected_shape=shape, dtype=torch.bfloat16, level=name)
        assert torch.equal(out.view(torch.int16), out_own.view(torch.int16))
        assert CH.fmt.unpack(rec).info.table_id == tab.table_id  # (smaller on real KV: the matrix)
        with pytest.raises(CH.CodecRecordError, match="static table set"):
            CH.decode_chunk(rec, out, expected_shape=shape, dtype=torch.bfloat16, level=name)
    # a fixed level's record is not an eb_default record (new level ids: old records are misses)
    rec_fixed = CH.encode_chunk(x, shape=shape, dtype=torch.bfloat16, level="default")
    with pytest.raises(CH.CodecRecordError, match="expected 'eb_default'"):
        CH.decode_chunk(rec_fixed, out, expected_shape=shape, dtype=torch.bfloat16, level="eb_default")
    disk = DiskTier([str(tmp_path / "d")], 64 << 20, io_threads=1)
    tier = CodecTier(disk, shape=shape, dtype=torch.bfloat16, level="eb_default", config_key="local_disk_serde")
    try:
        raw = x.contiguous().view(torch.uint8).reshape(-1)
        assert tier.put(b"k" * 32, raw.numpy().tobytes())
        got = torch.empty_like(x)
        assert tier.get_into(b"k" * 32, got) is not None
        want = torch.empty_like(x)
        rec = CH.encode_chunk(x, shape=shape, dtype=torch.bfloat16, level="eb_default", tables=tier.tables)
        CH.decode_chunk(rec, want, expected_shape=shape, dtype=torch.bfloat16, level="eb_default", tables=tier.tables)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert np.asarray(tier.tables.plane_qmax).shape == (30, 2)
    finally:
        tier.close()
