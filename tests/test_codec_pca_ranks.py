"""PCA model files for tensor parallelism (lmtier.codec.pca.ranks): the heads each rank holds, the
file's round trip and refusals, the calibration command's ``--tensor-parallel-size``, and the tiers
each rank builds from one file."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import struct
from pathlib import Path

import pytest
import torch

from lmtier.codec import pca
from lmtier.codec.pca import calibrate as C
from lmtier.codec.pca import ranks
from lmtier.config import ConfigError, LMTierConfig
from lmtier.keys import Namespace
from lmtier.manager import TierManager
from lmtier.testing.vllm import MODEL_DIR
from lmtier.tiers import factory
from lmtier.tiers.codec_pca import PCACodecTier
from tests.test_codec_pca_calibrate import _write_texts
from tests.test_codec_pca_product import INV_FREQ, SYNTHETIC_LEVELS, G, H, _calibration, _kv
from tests.test_codec_pca_tier import T, _values

TP = 2  # the synthetic KV's H = 2 heads: one a rank


@functools.cache
def rank_fit(h0: int, h1: int) -> pca.PCAModel:
    """The synthetic calibration fitted on KV heads ``h0 .. h1 - 1``."""
    kvs, starts = _calibration()
    sliced = [kv[:, :, :, h0:h1].contiguous() for kv in kvs]
    return pca.fit(sliced, starts, inv_freq=INV_FREQ, layer_group=G, outlier_share=0.01, levels=SYNTHETIC_LEVELS)


@pytest.fixture(scope="module")
def tp_models() -> ranks.RankModels:
    return ranks.RankModels(TP, H, tuple(rank_fit(h, h + 1) for h in range(H)))


@pytest.fixture(scope="module")
def tp_file(tmp_path_factory, tp_models) -> Path:
    p = tmp_path_factory.mktemp("pca_tp") / "tp2.lmtpca"
    assert pca.save_ranks(tp_models, p) == [m.model_id for m in tp_models.models]
    return p


# ------------------------------------------------------------------------------------ rank_heads
@pytest.mark.parametrize(
    ("heads", "tp", "want"),
    [
        (4, 1, [(0, 4)]),
        (4, 2, [(0, 2), (2, 4)]),
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # vLLM replicates: num_kv_head_replicas = tp / H
        (1, 2, [(0, 1), (0, 1)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_rank_heads_as_vllm_splits_them(heads, tp, want):
    assert [pca.rank_heads(heads, tp, r) for r in range(tp)] == want


@pytest.mark.parametrize(("heads", "tp", "rank"), [(3, 2, 0), (2, 3, 0), (4, 2, 2), (4, 2, -1), (0, 1, 0)])
def test_rank_heads_refuses_a_split_vllm_cannot_make(heads, tp, rank):
    with pytest.raises(ValueError, match="KV heads|rank"):
        pca.rank_heads(heads, tp, rank)


# ------------------------------------------------------------------------------------ the file
def test_the_file_round_trips_and_each_rank_gets_its_heads_model(tp_file, tp_models):
    got = pca.load_file(tp_file)
    assert isinstance(got, pca.RankModels) and (got.tp_size, got.num_kv_heads) == (TP, H)
    assert [m.digest for m in got.models] == [m.digest for m in tp_models.models]
    assert got.models[0].digest != got.models[1].digest  # each slice its own basis and id
    assert [got.for_rank(r).digest for r in range(TP)] == [m.digest for m in tp_models.models]
    assert all(m.num_heads == 1 for m in got.models)
    with pytest.raises(ValueError, match="rank 2"):
        got.for_rank(2)
    one = Path(tp_file).with_name("one.lmtpca")
    pca.save(rank_fit(0, H), one)
    assert isinstance(pca.load_file(one), pca.PCAModel)  # a file of one model reads as before


def test_replicated_heads_share_one_model():
    m = rank_fit(0, 1)
    rm = ranks.RankModels(4, 1, (m,))  # 1 KV head, tp 4: every rank holds it
    assert all(rm.for_rank(r) is m for r in range(4))
    back = ranks.ranks_from_bytes(ranks.ranks_to_bytes(rm))
    assert len(back.models) == 1 and back.for_rank(3).digest == m.digest


def test_a_model_of_the_wrong_heads_or_count_is_refused():
    m1, m2 = rank_fit(0, 1), rank_fit(0, H)
    with pytest.raises(pca.PCAModelError, match="1 models for tensor_parallel_size 2 and 2 KV heads; 2 expected"):
        ranks.RankModels(2, 2, (m1,))
    with pytest.raises(pca.PCAModelError, match="model 1 holds 2 KV heads; each rank holds 1"):
        ranks.RankModels(2, 2, (m1, m2))
    with pytest.raises(ValueError, match="3 KV heads do not split over tensor_parallel_size 2"):
        ranks.RankModels(2, 3, (m1, m1))
    other = dataclasses.replace(m1, inv_freq=m1.inv_freq * 2)
    with pytest.raises(pca.PCAModelError, match="model 1's rotary frequencies differ from model 0's"):
        ranks.RankModels(2, 2, (m1, other))
    fewer = dataclasses.replace(m1, levels={"pca_high": m1.levels["pca_high"]})
    with pytest.raises(pca.PCAModelError, match=r"model 1 has L=4, D=16, levels \['pca_high'\]"):
        ranks.RankModels(2, 2, (m1, fewer))


def _resealed(data: bytearray) -> bytes:
    return bytes(data[:-32]) + hashlib.sha256(data[:-32]).digest()


def test_a_damaged_file_is_refused_naming_it(tp_file, tmp_path):
    data = bytearray(Path(tp_file).read_bytes())
    cases = {}
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    cases["checksum mismatch"] = bytes(flipped)
    cases["truncated"] = bytes(data[:20])
    cases[r"truncated|checksum"] = bytes(data[:-100])
    v = bytearray(data)
    struct.pack_into("<I", v, 8, 9)
    cases["tensor-parallel file version 9"] = _resealed(v)
    count = bytearray(data)
    struct.pack_into("<I", count, 20, 1 << 20)
    cases["1048576 models for tensor_parallel_size 2 and 2 KV heads; 2 expected"] = _resealed(count)
    (o0, n0), (o1, n1) = struct.unpack_from("<QQ", data, 24), struct.unpack_from("<QQ", data, 40)
    for name, entries in {
        "overlap": [(o0, n0), (o0, n0)],  # one model indexed twice
        "swapped": [(o1, n1), (o0, n0)],
        "unaligned": [(o0, n0), (o1 + 1, n1 - 1)],
        "into the index": [(24, n0), (o1, n1)],
    }.items():
        b = bytearray(data)
        for i, (o, n) in enumerate(entries):
            struct.pack_into("<QQ", b, 24 + 16 * i, o, n)
        cases[f"model [01] lies outside the file or over another|{name}"] = _resealed(b)
    out = bytearray(data)
    struct.pack_into("<Q", out, 24, len(data) // 64 * 64)  # model 0's offset past the end
    cases["model 0 lies outside the file"] = _resealed(out)
    inner = bytearray(data)
    (o, _) = struct.unpack_from("<QQ", inner, 24)
    inner[o + 200] ^= 1  # inside model 0: its own checksum fails
    cases[r"model 0 of 2\).*checksum mismatch"] = _resealed(inner)
    tp = bytearray(data)
    struct.pack_into("<I", tp, 12, 3)  # tp_size 3 for 2 heads
    cases["tensor_parallel_size 3"] = _resealed(tp)
    for i, (why, blob) in enumerate(cases.items()):
        p = tmp_path / f"bad{i}.lmtpca"
        p.write_bytes(blob)
        with pytest.raises(pca.PCAModelError, match=rf"PCA model {p}.*({why})"):
            pca.load_file(p)


def test_an_index_that_repeats_one_model_is_refused_before_parsing(tmp_path, monkeypatch):
    """A small file indexing one model many times (a review's amplification: each index entry is
    parsed and copied) is refused before any model is read."""
    m = rank_fit(0, 1)
    blob = pca.model.to_bytes(m)
    count = 64
    head = struct.pack("<8sIIII", ranks.RANKS_MAGIC, 1, count, count, count)
    at = -(-(len(head) + 16 * count) // 64) * 64
    index = b"".join(struct.pack("<QQ", at, len(blob)) for _ in range(count))
    body = head + index + bytes(at - len(head) - len(index)) + blob
    data = body + hashlib.sha256(body).digest()
    parsed = []
    monkeypatch.setattr(ranks, "from_bytes", lambda *a: parsed.append(a) or m)
    with pytest.raises(pca.PCAModelError, match="model 1 lies outside the file or over another"):
        ranks.ranks_from_bytes(data, "x")
    assert parsed == []


def test_a_model_fitted_on_other_heads_than_its_slot_is_refused():
    a, b = rank_fit(0, 1), rank_fit(1, 2)
    tagged = [dataclasses.replace(x, info=dict(x.info, kv_heads=[i, i + 1])) for i, x in enumerate((a, b))]
    assert ranks.RankModels(2, 2, tuple(tagged)).models[1] is tagged[1]
    with pytest.raises(pca.PCAModelError, match=r"model 0 was fitted on KV heads \[1, 2\], its slot holds \[0, 1\]"):
        ranks.RankModels(2, 2, (tagged[1], tagged[0]))
    odd = dataclasses.replace(a, info=dict(a.info, kv_heads=7))  # not a pair: refused, not a TypeError
    with pytest.raises(pca.PCAModelError, match="model 0 was fitted on KV heads 7"):
        ranks.RankModels(2, 2, (odd, tagged[1]))


def test_the_one_model_reader_names_the_tensor_parallel_reader(tp_file):
    with pytest.raises(pca.PCAModelError, match="a tensor-parallel model file.*load_file"):
        pca.load(tp_file)


# ------------------------------------------------------------------------------------ the tiers
def _ns(heads: int, rank: int = 0, tp: int = 1) -> Namespace:
    from tests.test_codec_pca_product import D, L

    return Namespace(
        model="m", num_layers=L, num_kv_heads=heads, head_size=D, kv_dtype="bfloat16", chunk_size=T,
        tp_rank=rank, tp_size=tp,
    )  # fmt: skip


def test_each_rank_builds_its_tiers_with_its_heads_model(tmp_path, tp_file, tp_models):
    cfg = LMTierConfig.from_dict(_values(tmp_path, str(tp_file)))
    for rank in range(TP):
        with TierManager.from_config(cfg, _ns(1, rank, TP)) as m:
            assert isinstance(m.disk, PCACodecTier) and m.disk.model.digest == tp_models.models[rank].digest
            x = _kv(T, 64, 50 + rank)[:, :, :, rank : rank + 1].contiguous()  # this rank's head of a chunk
            assert m.disk.put(bytes([rank]) * 32, x.view(-1).view(torch.uint8), position=64)
            out = torch.empty(x.numel() * 2, dtype=torch.uint8)
            assert m.disk.get_into(bytes([rank]) * 32, out) == out.numel()
            model = tp_models.models[rank]
            want = pca.decode(pca.encode(x, start=64, model=model, level="pca_default"), model=model)
            assert torch.equal(out.view(torch.int16), want.reshape(-1).view(torch.int16))
        assert factory.load_pca_model(cfg, tp_rank=rank, tp_size=TP).digest == tp_models.models[rank].digest


def test_a_file_for_another_tensor_parallel_size_is_refused(tmp_path, tp_file):
    cfg = LMTierConfig.from_dict(_values(tmp_path, str(tp_file)))
    with pytest.raises(
        ConfigError,
        match=r"codec_pca_model=.*tp2\.lmtpca.*calibrated for tensor_parallel_size 2 .*this engine runs 1.*"
        r"--tensor-parallel-size 1",
    ):
        TierManager.from_config(cfg, _ns(H))
    with pytest.raises(ConfigError, match="calibrated for tensor_parallel_size 2 .*runs 4"):
        factory.load_pca_model(cfg, tp_size=4)
    with pytest.raises(ConfigError, match="calibrated for a model of 2 KV heads, the served model has 4"):
        factory.load_pca_model(cfg, tp_size=TP, total_kv_heads=4)
    with pytest.raises(ConfigError, match="tensor-parallel rank 2 of 2"):
        factory.load_pca_model(cfg, tp_rank=2, tp_size=TP)
    # a file of one model at TP=2: refused (it would give every rank one slice's basis), naming the option
    one = tmp_path / "one.lmtpca"
    pca.save(rank_fit(0, H), one)
    cfg = LMTierConfig.from_dict(_values(tmp_path, str(one)))
    with pytest.raises(
        ConfigError, match=r"one model \(of 2 KV heads\) for tensor_parallel_size 2.*--tensor-parallel-size 2"
    ):
        TierManager.from_config(cfg, _ns(1, 1, TP))
    head0 = tmp_path / "head0.lmtpca"  # one head's model: all ranks hold one head (MQA) or not
    pca.save(rank_fit(0, 1), head0)
    cfg = LMTierConfig.from_dict(_values(tmp_path, str(head0)))
    with pytest.raises(ConfigError, match=r"one model \(of 1 KV heads\) for tensor_parallel_size 2"):
        factory.load_pca_model(cfg, tp_size=TP, total_kv_heads=2)
    assert factory.load_pca_model(cfg, tp_size=TP, total_kv_heads=1).num_heads == 1  # replicated: every rank
    # a tensor-parallel file of a one-KV-head model holds one model, which serves any TP
    mqa = tmp_path / "mqa_tp4.lmtpca"
    pca.save_ranks(ranks.RankModels(4, 1, (rank_fit(0, 1),)), mqa)
    cfg = LMTierConfig.from_dict(_values(tmp_path, str(mqa)))
    want = rank_fit(0, 1).digest
    assert [factory.load_pca_model(cfg, tp_rank=r, tp_size=tp).digest for tp, r in ((1, 0), (2, 1), (8, 7))] == [
        want
    ] * 3
    with pytest.raises(ConfigError, match="calibrated for a model of 1 KV heads, the served model has 2"):
        factory.load_pca_model(cfg, tp_size=2, total_kv_heads=2)


# ------------------------------------------------------------------------------------ the command
def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = C.main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """tests/test_connector_tp.py's tiny Llama (4 layers, 4 KV heads of 32, random weights)."""
    from tests.test_connector_tp import _make_model

    if not (MODEL_DIR / "tokenizer.json").exists():
        pytest.skip("SmolLM2's tokenizer (the tiny model's) is not in models/")

    d = tmp_path_factory.mktemp("tiny") / "tiny-llama-kv4"
    _make_model(d)
    return d


def test_the_command_fits_one_model_per_rank_on_its_heads(tiny, tmp_path, monkeypatch):
    from lmtier.codec.pca import hf

    seen = []
    collect = hf.collect

    def spy(*a, **kw):
        seen.append(collect(*a, **kw))
        return seen[-1]

    monkeypatch.setattr(hf, "collect", spy)
    out_file = tmp_path / "tiny_tp2.lmtpca"
    argv = ["--model", str(tiny), *_write_texts(tmp_path), "--layer-group", "1", "--tensor-parallel-size", "2"]
    rc, out, err = _run([*argv, "--out", str(out_file)])
    assert rc == 0, err
    got = pca.load_file(out_file)
    assert isinstance(got, pca.RankModels) and (got.tp_size, got.num_kv_heads, len(got.models)) == (2, 4, 2)
    cal = seen[0]
    for i, (h0, h1) in enumerate([(0, 2), (2, 4)]):
        m = got.models[i]
        assert (m.num_layers, m.num_heads, m.head_size, m.layer_group) == (4, 2, 32, 1)
        assert m.info["kv_heads"] == [h0, h1] and m.info["tensor_parallel_size"] == 2
        # the same model as a fit on that slice of the same KV and metric (fit is deterministic)
        want = pca.fit(
            [kv[:, :, :, h0:h1].contiguous() for kv in cal.kv],
            [0] * len(cal.kv),
            inv_freq=cal.inv_freq,
            layer_group=1,
            metric=cal.metric[:, :, h0 * 32 : h1 * 32, h0 * 32 : h1 * 32],
            outlier_share=0.002,
        )
        assert torch.equal(torch.from_numpy(want.d_int), torch.from_numpy(m.d_int))
        assert torch.equal(torch.from_numpy(want.e_int), torch.from_numpy(m.e_int))
        chunk = cal.kv[0][:, :, :64, h0:h1].contiguous()
        dec = pca.decode(pca.encode(chunk, start=0, model=m, level="pca_high"), model=m)
        rel = float((dec[:, :, 1:].float() - chunk[:, :, 1:].float()).norm() / chunk[:, :, 1:].float().norm())
        assert rel < 0.1, rel
        assert f"KV heads {h0}-{h1 - 1}: model id {m.model_id:#010x} (G=1, N=64)" in out
    assert "tensor_parallel_size 2: 2 models" in out


@pytest.mark.parametrize(("tp", "why"), [("3", "4 KV heads do not split over tensor_parallel_size 3"), ("0", ">= 1")])
def test_the_command_refuses_a_split_before_loading_the_model(tiny, tmp_path, tp, why):
    rc, _, err = _run(
        ["--model", str(tiny), *_write_texts(tmp_path), "--tensor-parallel-size", tp, "--out", str(tmp_path / "x")]
    )
    assert rc == 2 and why in err and not (tmp_path / "x").exists()
