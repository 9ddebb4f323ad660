"""The PCA levels' queued CUDA decode (:func:`lmtier.codec.pca.codec.decode_queued`, one wait per
record or per batch instead of one per stage): decodes equal the host's bit for bit whichever stream
takes the result and however soon the host record buffer is reused; a record the device refuses
(a rANS stream that does not decode, escape symbols in a record announcing none) is refused by
:meth:`~lmtier.codec.pca.codec.PendingChunk.result`, records queued beside it still decode right; the
PCA tier's batched reads (:meth:`lmtier.tiers.codec_pca.PCACodecTier.get_many_into` over a tier that
batches gets) queue their records and deliver each, deleting only the corrupt ones."""

from __future__ import annotations

import math

import pytest
import torch

from lmtier.codec import pca
from lmtier.codec.chunk import CodecRecordError
from lmtier.codec.pca import codec as pca_codec
from lmtier.codec.pca import kernels, native_decode
from lmtier.tiers.codec_pca import PCACodecTier
from tests.test_codec_pca_imatmul import corner_chunk, int8_path_cases
from tests.test_codec_pca_product import D, H, L, _hand_model, _kv, _parts, _repack, fitted
from tests.test_codec_pca_refusals import escape_liars
from tests.test_fetch_batch import BatchingTier
from tests.threads import run_in_threads

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["native", "python"], autouse=True)
def decode_path(request, monkeypatch):
    """Each record's decode queued by one native call (the default), or by the Python-driven kernels."""
    monkeypatch.setitem(native_decode._state, "enabled", request.param == "native")
    return request.param


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().contiguous().view(torch.int16)


def _cases() -> list[tuple[bytes, pca.PCAModel]]:
    """Records of both levels over the int8 path's chunks (T = 0, short, sink, loud) and the hand-built
    model's corner chunk (escapes), each with its model."""
    m, hand = fitted("plain"), _hand_model()
    out = [
        (pca.encode(kv, start=s, model=m, level=lv), m)
        for lv in ("pca_default", "pca_high")
        for kv, s in int8_path_cases()
    ]
    out.append((pca.encode(corner_chunk(), start=0, model=hand, level="pca_default"), hand))
    assert pca.record_meta(out[-1][0]).escapes >= 2
    return out


def test_queued_decodes_are_the_hosts_from_a_reused_buffer_on_another_stream():
    """Every record queued on a side stream from one host buffer, overwritten right after each call
    (the record is uploaded before ``decode_queued`` returns), then the results taken on the default
    stream: each equals the host decode bit for bit, and the symbols path ran for the chunks without
    escapes."""
    assert kernels.available()
    cases = _cases()
    want = [pca.decode(r, model=m) for r, m in cases]
    buf = bytearray(max(len(r) for r, _ in cases))
    side = torch.cuda.Stream()
    before = kernels.decode_stats()
    with torch.cuda.stream(side):
        pending = []
        for r, m in cases:
            buf[: len(r)] = r
            pending.append(pca_codec.decode_queued(memoryview(buf)[: len(r)], model=m, device="cuda"))
            buf[:] = b"\xa5" * len(buf)
    for p, w in zip(pending, want, strict=True):
        got = p.result()
        assert got.is_cuda and got.dtype == w.dtype and torch.equal(_bits(got), _bits(w))
        assert p.result() is got  # checked once
    after = kernels.decode_stats()
    coded = [pca.record_meta(r).escapes for r, _ in cases if fmt_tokens(r) > 0]
    native = native_decode.available()  # every coded record one native call, else those without escapes
    assert after["symbols"] - before["symbols"] == (len(coded) if native else coded.count(0))
    assert after["fused"] - before["fused"] == (len(coded) if native else 0)


def fmt_tokens(record: bytes) -> int:
    return _parts(record)[0].num_tokens


def test_device_refusals_come_from_result_and_spare_the_records_beside_them():
    """A rANS stream cut short in a record without escapes (its coder status, read on the device) and
    escape symbols in a record announcing none (counted by ``decode_pre_symbols``) are refused by
    ``result()`` with the host's messages; in a record with escapes both a cut stream and one escape
    fewer than symbols are refused (by ``result()`` on the native path, at once on the Python-driven
    one, whose escape index waits for the symbols), the cut stream named as such; the good records
    queued between them decode right."""
    m = fitted("plain")
    good = [pca.encode(_kv(40, s, 60 + s), start=s, model=m, level="pca_default") for s in (0, 40, 80)]
    loud = pca.encode(_kv(50, 0, 19, loud=(5,)), start=0, model=m, level="pca_high")
    assert pca.record_meta(loud).escapes > 0 and pca.record_meta(good[1]).escapes == 0

    def cut(record: bytes) -> bytes:
        _, secs, _ = _parts(record)
        return _repack(record, secs=[secs[0][:20], *secs[1:]])

    rans_says = "corrupted PCA codec record: rans decode failed .*stream 0: "
    (none, none_says), (fewer, fewer_says) = escape_liars(m)
    with pytest.raises(CodecRecordError, match=f"corrupted PCA codec record: {fewer_says}"):
        pca_codec.decode_queued(fewer, model=m, device="cuda").result()  # native: from result()
    with pytest.raises(CodecRecordError, match=rans_says):
        pca_codec.decode_queued(cut(loud), model=m, device="cuda").result()
    order = [good[0], cut(good[1]), good[1], none, good[2]]
    pending = [pca_codec.decode_queued(r, model=m, device="cuda") for r in order]
    with pytest.raises(CodecRecordError, match=rans_says):
        pending[1].result()
    with pytest.raises(CodecRecordError, match=f"corrupted PCA codec record: {none_says}"):
        pending[3].result()
    for i in (0, 2, 4):
        assert torch.equal(_bits(pending[i].result()), _bits(pca.decode(order[i], model=m)))


@pytest.mark.parametrize("on_stream", [False, True])
def test_tier_batched_reads_queue_their_records(monkeypatch, on_stream):
    """``get_many_into`` over a tier that batches gets, CUDA destinations: every record goes through
    ``decode_queued``; good chunks land bit for bit as the host decodes them, a miss is None, a record
    with a flipped byte (refused on the host) and one whose stream is cut (refused by the device) are
    misses and deleted; records are queued ahead of the results taken (not one at a time)."""
    t_tok = 32
    shape = (L, 2, t_tok, H, D)
    m = fitted("plain")
    inner = BatchingTier()
    tier = PCACodecTier(inner, shape=shape, dtype=torch.bfloat16, level="pca_default", model=m)
    keys = [bytes([i + 1]) * 32 for i in range(7)]
    chunks = [_kv(t_tok, 32 * i, 70 + i) for i in range(7)]
    for i, (k, x) in enumerate(zip(keys, chunks)):
        if i != 3:  # key 3: a miss
            assert tier.put(k, x.contiguous().view(-1).view(torch.uint8), position=32 * i)
    flipped = bytearray(inner.data[tier.inner_key(keys[1])])
    flipped[len(flipped) // 2] ^= 1
    inner.data[tier.inner_key(keys[1])] = bytes(flipped)
    rec5 = inner.data[tier.inner_key(keys[5])]
    _, secs, _ = _parts(rec5)
    inner.data[tier.inner_key(keys[5])] = _repack(rec5, secs=[secs[0][:20], *secs[1:]])
    calls: list[str] = []  # "q": a record queued, "r": a result taken
    real, real_result = pca_codec.decode_queued, pca_codec.PendingChunk.result
    monkeypatch.setattr(pca_codec, "decode_queued", lambda *a, **kw: calls.append("q") or real(*a, **kw))
    monkeypatch.setattr(pca_codec.PendingChunk, "result", lambda self: calls.append("r") or real_result(self))
    nbytes = math.prod(shape) * 2
    outs = [torch.full((nbytes,), 7, dtype=torch.uint8, device="cuda") for _ in keys]
    stream = torch.cuda.Stream() if on_stream else None
    got = tier.get_many_into(keys, outs, stream=stream)
    if stream is not None:
        stream.synchronize()
    assert got == [nbytes, None, nbytes, None, nbytes, None, nbytes]
    # every record read is queued (the miss not), three before the first result (the fourth item is the
    # miss), then one more after each result: q q q r q q r q r r r (the flipped record has no result)
    assert calls == list("qqqrqqrqrrr")
    for i in (0, 2, 4, 6):
        want = pca.decode(pca.encode(chunks[i], start=32 * i, model=m, level="pca_default"), model=m)
        assert torch.equal(outs[i].cpu().view(torch.bfloat16).view(shape).view(torch.int16), _bits(want))
    for i in (1, 3, 5):
        assert torch.equal(outs[i].cpu(), torch.full((nbytes,), 7, dtype=torch.uint8))  # never written
    assert tier.counters["corrupt_deleted"] == 2
    assert tier.inner_key(keys[1]) not in inner.data and tier.inner_key(keys[5]) not in inner.data


@pytest.mark.parametrize("per_call", [1, 5])
def test_coder_calls_side_by_side_are_the_hosts(monkeypatch, per_call):
    """A record's streams in several coder calls (here 12 streams, 1 or 5 per call: 12 or 3 calls; an
    8B model's 64 streams are 2 calls) decode on the current stream and this thread's side streams at
    once, to the host's bits, from a thread of its own too, and the next record's decode is right
    (no call's scratch or output reused while another runs)."""
    from lmtier.bench import codec_pca as bench
    from lmtier.codec.pca import streams

    monkeypatch.setattr(streams, "streams_per_call", lambda n: per_call)
    m = bench.tiled(fitted("plain"), 3)
    assert len(streams.batches(2 * m.rows, m.vector_size)) == -(-2 * m.rows // per_call) > 1
    recs = [pca.encode(_kv(40, s, 80 + s).repeat(3, 1, 1, 1, 1), start=s, model=m, level=lv)
            for lv in ("pca_default", "pca_high") for s in (0, 40)]  # fmt: skip
    want = [pca.decode(r, model=m) for r in recs]
    for r, w in zip(recs, want, strict=True):
        assert torch.equal(_bits(pca.decode(r, model=m, device="cuda")), _bits(w))
    pending = [pca_codec.decode_queued(r, model=m, device="cuda") for r in recs]
    assert all(torch.equal(_bits(p.result()), _bits(w)) for p, w in zip(pending, want, strict=True))

    def worker() -> None:
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(3):
                for r, w in zip(recs, want, strict=True):
                    assert torch.equal(_bits(pca.decode(r, model=m, device="cuda")), _bits(w))

    run_in_threads(worker, [()] * 2)
