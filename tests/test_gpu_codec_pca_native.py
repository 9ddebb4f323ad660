"""One PCA record's CUDA decode queued by one native call (:mod:`lmtier.codec.pca.native_decode`,
``lmtier._C.pca.decode_record``): at Llama-3.1-8B's geometry (64 streams: coder calls of 63 and 1,
side by side; two batches of GEMMs; a sink chunk with exact tokens; ``pca_high``'s escapes) its
decodes equal the kernels queued one by one from Python and the host's, bit for bit, from threads
on their own streams too; a
native step that raises turns it off for the process and the record decodes the Python-driven way.
Marked ``gpu``: skipped without a CUDA device. The refusals (cut streams, escape symbols announced
as none) through this path: ``test_gpu_codec_pca_queued``."""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch

from lmtier.bench import codec_pca as bench
from lmtier.codec import pca
from lmtier.codec.pca import codec as pca_codec
from lmtier.codec.pca import kernels, native_decode, streams
from tests.test_codec_pca_product import _kv, fitted
from tests.threads import run_in_threads

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    """The native decode on (the product's default), whatever an earlier test left."""
    monkeypatch.setitem(native_decode._state, "enabled", True)


GEOM = (32, 8, 128, 1)  # Llama-3.1-8B: L, H, D, G (N = 1,024)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().contiguous().view(torch.int16)


@functools.cache
def _llama() -> tuple[pca.PCAModel, list[bytes]]:
    m = bench.model_for(GEOM, bench.MIN_CALIB_TOKENS)
    recs = [pca.encode(bench.synthetic_kv(GEOM, t, s, 7 + s).cuda(), start=s, model=m, level="pca_default")
            for t, s in ((256, 0), (256, 256), (200, 512))]  # fmt: skip
    return m, recs


def test_llama_geometry_native_decodes_are_the_python_driven_and_the_hosts():
    assert native_decode.available(), "no lmtier._C.pca.decode_record, or no cuBLAS"
    m, recs = _llama()
    assert len(streams.batches(2 * m.rows, m.vector_size)) == 2
    assert len(kernels._slices(m.rows, 256, kernels.imatmul.prepared(m, "cuda")[1].p8)) == 2
    assert pca.record_meta(recs[0]).exact_tokens > 0
    assert all(pca.record_meta(r).escapes == 0 for r in recs)
    before = kernels.decode_stats()
    native = [pca.decode(r, model=m, device="cuda") for r in recs]
    assert kernels.decode_stats()["fused"] - before["fused"] == len(recs)
    with native_decode.enabled(False):
        driven = [pca.decode(r, model=m, device="cuda") for r in recs]
    assert kernels.decode_stats()["fused"] - before["fused"] == len(recs)
    for a, b in zip(native, driven, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(native[0]), _bits(pca.decode(recs[0], model=m)))  # the host: ~1 s a chunk


def test_llama_geometry_records_with_escapes():
    """``pca_high`` at Llama-3.1-8B's geometry: many escaped coefficients, placed on the device
    (``csrc/pca_escapes.cu``); native = Python-driven = host; its scratch is the native size."""
    from lmtier import _C

    m, _ = _llama()
    recs = [pca.encode(bench.synthetic_kv(GEOM, 256, s, 9 + s).cuda(), start=s, model=m, level="pca_high")
            for s in (0, 256)]  # fmt: skip
    assert all(pca.record_meta(r).escapes > 0 for r in recs)
    native = [pca.decode(r, model=m, device="cuda") for r in recs]
    with native_decode.enabled(False):
        driven = [pca.decode(r, model=m, device="cuda") for r in recs]
    for a, b in zip(native, driven, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert torch.equal(_bits(native[1]), _bits(pca.decode(recs[1], model=m)))
    for t in (256, 200, 1):
        assert native_decode.escape_scratch_bytes(m.rows, m.vector_size, t) == _C.pca.escape_scratch_bytes(
            m.num_layers, t, m.num_heads, m.head_size, m.layer_group
        )


def test_llama_geometry_native_decodes_from_threads_on_their_own_streams():
    m, recs = _llama()
    want = [_bits(pca.decode(r, model=m, device="cuda")) for r in recs]

    def worker() -> None:
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(3):
                pending = [pca_codec.decode_queued(r, model=m, device="cuda") for r in recs]
                for p, w in zip(pending, want, strict=True):
                    assert torch.equal(_bits(p.result()), w)

    run_in_threads(worker, [()] * 3)


def test_a_native_step_that_raises_turns_it_off_and_the_record_still_decodes(monkeypatch, caplog):
    m = fitted("plain")
    recs = (pca.encode(_kv(40, 8, seed), start=8, model=m, level="pca_default") for seed in range(31, 61))
    rec = next(r for r in recs if pca.record_meta(r).escapes == 0)  # the native path's records
    want = _bits(pca.decode(rec, model=m))
    monkeypatch.setattr(native_decode, "_state", {**native_decode._state, "enabled": True, "disabled": ""})

    def refuse(**kw):
        raise RuntimeError("lmtier: bgemm_s8: cublasGemmStridedBatchedEx failed (status 15)")

    monkeypatch.setattr(kernels._native(), "decode_record", refuse)
    assert native_decode.available()
    before = kernels.decode_stats()
    with caplog.at_level("WARNING", logger="lmtier.codec.pca.native_decode"):
        assert torch.equal(_bits(pca.decode(rec, model=m, device="cuda")), want)
        assert torch.equal(_bits(pca.decode(rec, model=m, device="cuda")), want)
    after = kernels.decode_stats()
    assert after["fused"] == before["fused"] and after["symbols"] - before["symbols"] == 2
    assert not native_decode.available() and "status 15" in native_decode._state["disabled"]
    assert sum("Python-driven" in r.message for r in caplog.records) == 1  # logged once


def test_zero_token_record_and_a_corrupt_header_on_the_native_path():
    """T = 0 decodes to an empty chunk (nothing queued); a stream header naming another table is
    refused as corrupt before anything is queued, as on the Python-driven path."""
    from lmtier.codec.chunk import CodecRecordError
    from tests.test_codec_pca_product import _parts, _repack

    m = fitted("plain")
    empty = pca.encode(_kv(0, 0, 1), start=0, model=m, level="pca_default")
    got = pca.decode(empty, model=m, device="cuda")
    assert got.is_cuda and got.shape[2] == 0
    recs = (pca.encode(_kv(40, 8, seed), start=8, model=m, level="pca_default") for seed in range(33, 63))
    rec = next(r for r in recs if pca.record_meta(r).escapes == 0)
    _, secs, _ = _parts(rec)
    head = bytearray(secs[1])
    head[8:10] = (int.from_bytes(head[8:10], "little") + 1).to_bytes(2, "little")  # table_id
    bad = _repack(rec, secs=[secs[0], bytes(head), *secs[2:]])
    for off in (False, True):
        with native_decode.enabled(False) if off else contextlib.nullcontext():
            with pytest.raises(CodecRecordError, match="corrupted PCA codec record: stream 1 names table"):
                pca.decode(bad, model=m, device="cuda")


def test_threads_deliver_records_with_escapes_as_a_tier_does():
    """Four threads, each with its decode stream, decode records with escapes (and without) and
    deliver each chunk on a second stream as ``PCACodecTier._deliver`` does (wait for ``ready``,
    copy, ``record_stream``), 12 rounds: every delivered chunk equals the single-threaded decode."""
    m, _ = _llama()
    recs = [pca.encode(bench.synthetic_kv(GEOM, t, s, 40 + s).cuda(), start=s, model=m, level=lv)
            for lv in ("pca_high", "pca_default") for t, s in ((256, 0), (256, 256), (76, 512))]  # fmt: skip
    assert sum(pca.record_meta(r).escapes > 0 for r in recs) >= 3
    want = [_bits(pca.decode(r, model=m, device="cuda")) for r in recs]

    def worker(seed: int) -> None:
        decode_stream, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()
        for k in range(12):
            order = [(i + seed + k) % len(recs) for i in range(len(recs))]
            dsts = {}
            for i in order:
                with torch.cuda.stream(decode_stream):
                    p = pca_codec.decode_queued(recs[i], model=m, device="cuda")
                    chunk = p.result()
                copy_stream.wait_event(p.ready)
                with torch.cuda.stream(copy_stream):
                    dsts[i] = chunk.clone()
                chunk.record_stream(copy_stream)
                del chunk, p
            copy_stream.synchronize()
            for i, d in dsts.items():
                assert torch.equal(_bits(d), want[i]), (seed, k, i)

    run_in_threads(worker, [(s,) for s in range(4)])


def test_staging_blocks_are_reused_and_never_while_a_decode_still_reads_them():
    """The native call stages each record in a page-locked block of a pool (``csrc/pca_stage.cpp``).
    A record whose stream is held back (``torch.cuda._sleep``) has its pending decode dropped: its
    block is released while its upload has not run yet. A record staged meanwhile on another stream
    must get another block (else its payload would overwrite the held-back one's), and both decode
    to the Python-driven decode's bits, through the native call (it is not turned off: a block found
    busy is not an error). Records decoded one after another then reuse the pool's blocks."""
    from lmtier import _C

    m, recs = _llama()
    with native_decode.enabled(False):
        want = [_bits(pca.decode(r, model=m, device="cuda")) for r in recs]
    torch.cuda.synchronize()
    before = kernels.decode_stats()["fused"]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(1 << 31)  # ~1 s: the upload queued after it waits
        p = pca_codec.decode_queued(recs[0], model=m, device="cuda")
        held_back = p._chunk
        del p  # its DecodeStage gone, its copies still queued
    with torch.cuda.stream(s2):
        q = pca_codec.decode_queued(recs[1], model=m, device="cuda")
        assert torch.equal(_bits(q.result()), want[1])
    s1.synchronize()
    assert torch.equal(_bits(held_back), want[0])
    assert native_decode.available() and kernels.decode_stats()["fused"] - before == 2
    blocks, _ = _C.pca.stage_pool_stats()
    for _ in range(3):
        for r, w in zip(recs, want, strict=True):
            assert torch.equal(_bits(pca.decode(r, model=m, device="cuda")), w)
    assert _C.pca.stage_pool_stats()[0] == blocks  # one at a time: a released block each time
    assert native_decode.available()


def test_the_native_call_gives_its_checks_in_its_staging_block():
    """``queue`` returns the checks as the native call's page-locked ``DecodeStage``, and
    ``PendingChunk`` refuses device checks and host checks at once."""
    from lmtier import _C

    m, recs = _llama()
    p = pca_codec.decode_queued(recs[0], model=m, device="cuda")
    assert isinstance(p._checks, _C.pca.DecodeStage)
    p.result()
    with pytest.raises(ValueError, match="not both"):
        pca_codec.PendingChunk(p._chunk, torch.zeros(4, device="cuda"), lambda g: None, host_checks=b"x")


def test_a_record_cut_after_staging_is_refused_and_the_next_decodes():
    """At Llama-3.1-8B's geometry, a stream cut to half its bytes (enough for its header's segments:
    the host's checks pass, so the record is staged and decoded) is refused by the device's checks,
    read back through the staging block, as the host decoder refuses it; the record queued after it
    decodes to its bits."""
    from lmtier.codec.chunk import CodecRecordError
    from tests.test_codec_pca_product import _parts, _repack

    m, recs = _llama()
    want = _bits(pca.decode(recs[1], model=m, device="cuda"))
    _, secs, _ = _parts(recs[0])
    bad = _repack(recs[0], secs=[*secs[:5], secs[5][: len(secs[5]) // 2], *secs[6:]])
    before = kernels.decode_stats()["fused"]
    pending = [pca_codec.decode_queued(r, model=m, device="cuda") for r in (bad, recs[1])]
    with pytest.raises(CodecRecordError, match="corrupted PCA codec record: rans decode failed .*stream 5: "):
        pending[0].result()
    assert torch.equal(_bits(pending[1].result()), want)
    assert native_decode.available() and kernels.decode_stats()["fused"] - before == 2


def _without_bitmap(mp: pytest.MonkeyPatch) -> None:
    """Native decodes that check their tables at each rANS call (no ``tables_ok``)."""
    orig = native_decode.queue
    mp.setattr(native_decode, "queue", lambda *a, **k: orig(*a, **{**k, "tables_ok": None}))


def test_native_decodes_with_the_tables_bitmap_are_those_without(monkeypatch):
    """The level's validity bitmap (built once with its arrays) spares each rANS call reading its
    tables; the decodes are the same bits as with the check at each call."""
    m, recs = _llama()
    arrays = pca_codec._level_arrays(m, "pca_default", "cuda")
    assert arrays.tables_ok.is_cuda and arrays.tables_ok.numel() == -(-arrays.tables.shape[0] // 32)
    before = kernels.decode_stats()["fused"]
    with_bits = [_bits(pca.decode(r, model=m, device="cuda")) for r in recs]
    _without_bitmap(monkeypatch)
    for r, w in zip(recs, with_bits, strict=True):
        assert torch.equal(_bits(pca.decode(r, model=m, device="cuda")), w)
    assert native_decode.available() and kernels.decode_stats()["fused"] - before == 2 * len(recs)


def test_a_bitmap_not_made_for_the_tables_is_refused_as_the_callers():
    """``queue`` refuses a ``tables_ok`` of another size, dtype or device (``NativeRefused``: the
    caller's argument, not the record)."""
    m, recs = _llama()
    arrays = pca_codec._level_arrays(m, "pca_default", "cuda")
    p = pca_codec._parse(recs[0], m)
    spans = p.rec.index[: 2 * m.rows + 3]
    offs, lens = spans["offset"].astype(np.int64), spans["length"].astype(np.int64)
    payload = np.frombuffer(p.rec.payload, np.uint8)
    ok = arrays.tables_ok
    for bad in (ok[:-1], ok.to(torch.int64), ok.cpu()):
        with pytest.raises(native_decode.NativeRefused, match="tables_ok"):
            native_decode.queue(m, payload, offs, lens, p.exact, p.n_esc, arrays.tables, arrays.f, p.start, p.dtype,
                                torch.device("cuda"), tables_ok=bad)  # fmt: skip


@pytest.mark.parametrize("bitmap", [True, False], ids=["bitmap", "checked-per-call"])
@pytest.mark.parametrize("stream", [0, 63])  # in the first coder call and in the second (streams 63 + 1)
def test_a_table_that_does_not_sum_to_4096_refuses_its_stream(monkeypatch, bitmap, stream):
    """A level whose table in ``stream``'s range does not sum to 4096 (its bitmap built from those
    tables, or none): the record is refused naming that stream, never decoded from the table; the
    same level's good tables then decode it to its bits."""
    from lmtier.codec import rans
    from lmtier.codec.chunk import CodecRecordError

    m, recs = _llama()
    want = _bits(pca.decode(recs[0], model=m, device="cuda"))
    good = pca_codec._level_arrays(m, "pca_default", "cuda")
    t = good.tables.cpu().numpy().copy()
    t[stream * m.vector_size + 5, 0] += 1  # sums to 4,097; the stream's runs use all its N tables
    tables = torch.from_numpy(t).cuda()
    bad = good._replace(tables=tables, tables_ok=rans.build_tables_ok(tables))
    with monkeypatch.context() as mp:
        mp.setattr(pca_codec, "_level_arrays", lambda *_: bad)
        if not bitmap:
            _without_bitmap(mp)
        with pytest.raises(
            CodecRecordError, match=rf"rans decode failed for 1 stream\(s\): stream {stream}: bad or unknown table"
        ):
            pca.decode(recs[0], model=m, device="cuda")
    assert torch.equal(_bits(pca.decode(recs[0], model=m, device="cuda")), want)
    assert native_decode.available()


def test_records_take_the_native_scan_and_without_it_the_same_bits(monkeypatch):
    """The encoder's records pass the native scan of their host checks (``pca.scan``): the native call
    then skips the spans' Python check; a record the scan leaves to the Python checks (the scan
    refusing every record here) decodes to the same bits through them, at Llama-3.1-8B's geometry
    with exact tokens (``pca_default``) and escapes (``pca_high``)."""
    from lmtier.codec.pca import scan

    m, recs = _llama()
    recs = [recs[0], pca.encode(bench.synthetic_kv(GEOM, 256, 256, 11).cuda(), start=256, model=m, level="pca_high")]
    seen = []
    queue = native_decode.queue
    monkeypatch.setattr(native_decode, "queue", lambda *a, **k: seen.append(k["spans_checked"]) or queue(*a, **k))
    scanned = [pca.decode(r, model=m, device="cuda") for r in recs]
    assert seen == [True, True] and all(scan.scan(r, m) is not None for r in recs)
    monkeypatch.setattr(scan, "scan", lambda *a: None)
    checked = [pca.decode(r, model=m, device="cuda") for r in recs]
    assert seen == [True, True, False, False]
    for a, b in zip(scanned, checked, strict=True):
        assert torch.equal(_bits(a), _bits(b))
