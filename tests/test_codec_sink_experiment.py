"""The attention-sink experiment of the codec quality harness (`benchmarks/codec_quality.py --matrix
--exact-first-tokens S`, `benchmarks/codec_matrix.py`): the positions put back (the first S tokens;
the random control never touches the first 4 and is reproducible), and that the KV handed to the
model equals the level's decode everywhere except at exactly those tokens, where it is the exact KV
— checked on a real `default` decode of KV-like data, through the same `exact_cells` path the
benchmark runs (the model run replaced by a recorder)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import codec_matrix as CM  # noqa: E402
import codec_quality as CQ  # noqa: E402


def _kv(ctx: int = 512) -> torch.Tensor:
    """KV-like bf16 [L=6, 2, ctx, H=2, D=64]: per-channel magnitudes, token 0 a 20x outlier (sink)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2, ctx, 2, 64, generator=g) * (torch.rand(6, 2, 1, 2, 64, generator=g) + 0.1)
    x[:, :, 0] *= 20.0
    return x.to(torch.bfloat16)


def test_exact_positions():
    assert CM.exact_positions("first", 1, 1024, 0).tolist() == [0]
    assert CM.exact_positions("first", 4, 1024, 0).tolist() == [0, 1, 2, 3]
    r = CM.exact_positions("random", 4, 1024, 7)
    assert r.tolist() == CM.exact_positions("random", 4, 1024, 7).tolist()  # reproducible
    assert len(set(r.tolist())) == 4 and r.tolist() == sorted(r.tolist())
    assert r.min() >= CM.RANDOM_EXCLUDE_FIRST and r.max() < 1024
    seen = torch.cat([CM.exact_positions("random", 16, 40, s) for s in range(50)])
    assert seen.min() == 4 and seen.max() == 39  # the whole non-initial range, nothing else
    with pytest.raises(ValueError, match="unknown"):
        CM.exact_positions("last", 1, 1024, 0)
    with pytest.raises(ValueError, match="outside"):
        CM.exact_positions("first", 0, 1024, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_put_back_tokens_replaces_exactly_those_tokens(dtype):
    kv = _kv()
    dec = CQ.decode_level("default", kv).to(dtype)
    pos = torch.tensor([0, 1, 300])
    assert not torch.equal(dec[:, :, pos].float(), kv[:, :, pos].float())  # the decode is lossy there
    out = CM.put_back_tokens(dec, kv, pos)
    assert out.dtype == dtype and out.shape == kv.shape
    assert torch.equal(out[:, :, pos].to(torch.bfloat16).view(torch.int16), kv[:, :, pos].view(torch.int16))
    rest = torch.ones(kv.shape[2], dtype=torch.bool)
    rest[pos] = False
    assert torch.equal(out[:, :, rest].view(torch.int8), dec[:, :, rest].view(torch.int8))  # bit for bit
    assert not torch.equal(dec[:, :, pos].float(), kv[:, :, pos].float())  # input untouched
    with pytest.raises(ValueError, match="decoded KV"):
        CM.put_back_tokens(dec[:, :, :8], kv, pos)
    with pytest.raises(ValueError, match="unknown planes"):
        CM.put_back_tokens(dec, kv, pos, "q")


@pytest.mark.parametrize("planes, kept", [("k", 1), ("v", 0)])
def test_put_back_one_plane(planes, kept):
    """K only / V only: the other plane stays the decode's at every token."""
    kv = _kv()
    dec = CQ.decode_level("default", kv)
    pos = torch.tensor([0, 5])
    out = CM.put_back_tokens(dec, kv, pos, planes)
    put = 1 - kept
    assert torch.equal(out[:, put, pos].view(torch.int16), kv[:, put, pos].view(torch.int16))
    assert torch.equal(out[:, kept].view(torch.int16), dec[:, kept].view(torch.int16))
    rest = torch.ones(kv.shape[2], dtype=torch.bool)
    rest[pos] = False
    assert torch.equal(out[:, put, rest].view(torch.int16), dec[:, put, rest].view(torch.int16))


def test_exact_cells_feed_the_model_exactly_the_put_back_kv(monkeypatch):
    """What the model sees in each variant cell: the decode, with the exact KV at the variant's
    positions only; byte cost and ratio as documented."""
    ctx = 512
    kv = _kv(ctx)
    dec = CQ.decode_level("default", kv)
    seen = []
    vocab, n = 11, 5
    ref_lp = torch.log_softmax(torch.randn(n, vocab, generator=torch.Generator().manual_seed(1)), dim=-1)

    def fake_logprobs(data, kv_in):
        seen.append(kv_in.clone())
        return ref_lp

    monkeypatch.setattr(CQ, "continuation_logprobs", fake_logprobs)
    data = dict(kv_fp32=kv.float(), ids=torch.randint(0, vocab, (ctx + n + 1,)), ctx=ctx)
    rec = [40_000, 39_000]
    base = dict(
        model="m", text="code_c", split="held-out", scheme="default", ratio_is_records=True,
        record_bytes=rec, raw_bytes=kv.numel() * 2,
    )  # fmt: skip
    variants = (("first", 1), ("first", 4), ("random", 4), ("first", 1, "k"))
    cells = CM.exact_cells(base, dec, data, ref_lp, variants)
    assert [c["scheme"] for c in cells] == ["default+first1", "default+first4", "default+rand4", "default+first1k"]
    assert len(seen) == 4
    for c, got in zip(cells, seen):
        pos = torch.tensor(c["exact_positions"])
        mask = torch.zeros(ctx, dtype=torch.bool)
        mask[pos] = True
        planes = (0, 1) if c["exact_planes"] == "kv" else (0,)
        for p in (0, 1):
            want = kv if p in planes else dec
            assert torch.equal(got[:, p, mask], want[:, p, mask].float())
            assert torch.equal(got[:, p, ~mask], dec[:, p, ~mask].float())
        s = c["exact_tokens"]
        assert c["exact_bytes"] == s * 6 * len(planes) * 2 * 64 * 2
        assert math.isclose(c["exact_pct_of_chunk0"], 100.0 * c["exact_bytes"] / rec[0])
        assert math.isclose(c["ratio"], kv.numel() * 2 / (sum(rec) + c["exact_bytes"]))
        assert c["kl"] == 0.0 and c["top1"] == 100.0  # the recorder returned the reference
    assert cells[0]["exact_positions"] == [0] and cells[1]["exact_positions"] == [0, 1, 2, 3]
    assert min(cells[2]["exact_positions"]) >= 4 and cells[3]["exact_bytes"] == cells[0]["exact_bytes"] // 2


def test_token_errors_sees_the_outlier_sink():
    kv = _kv()
    e = CM.token_errors(kv, CQ.decode_level("default", kv))
    assert e["tok0_k_norm_over_median"] > 10 and e["tok0_v_norm_over_median"] > 10
    assert 0 < e["tok_k_rel_err_median"] < 1 and 0 < e["tok0_k_rel_err"] < 1
