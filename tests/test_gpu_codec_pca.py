"""The PCA codec levels on CUDA (`lmtier.codec.pca` with a chunk on the GPU, or ``decode(device=)``):
the records are the host encoder's byte for byte and the decodes its bits, for every level of the
synthetic models of ``test_codec_pca_product`` (plain, metric-weighted, no outliers), the hand-built
corner cases (N = 4; ties, +-127/128 symbols, 32767 coefficients) and a model of Llama-3.1-8B's head
geometry (H = 8, D = 128, G = 4: N = 4,096, the int8 GEMMs' real size). Both CUDA paths: the fused
kernels (``csrc/pca_cuda.cu``, the product's when built) and the torch arithmetic of
``lmtier.codec.pca.transform`` on int8 GEMMs (the fallback). Marked ``gpu``: skipped without a CUDA
device. The same comparison of the int8 path on the host: ``test_codec_pca_imatmul``."""

from __future__ import annotations

import functools

import pytest
import torch

from lmtier.bench import codec_pca as bench
from lmtier.codec import pca, rans
from lmtier.codec.pca import imatmul, kernels, native_decode, streams
from tests.test_codec_pca_imatmul import corner_chunk, int8_path_cases
from tests.test_codec_pca_product import INV_FREQ, SYNTHETIC_LEVELS, G, _calibration, _hand_model, _kv, fitted
from tests.threads import run_in_threads

pytestmark = pytest.mark.gpu
LEVELS = ("pca_high", "pca_default")


@pytest.fixture(params=["kernels", "kernels-python", "torch"], autouse=True)
def path(request, monkeypatch):
    """Which CUDA path codes: the fused kernels (asserted built), each record decoded by one native
    call (``kernels``, the product's default, asserted available) or by the kernels queued one by one
    from Python (``kernels-python``: :func:`lmtier.codec.pca.native_decode.enable` ``(False)``), or the
    torch fallback."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "available", lambda: False)
        return "torch"
    assert kernels.available(), "the extension was built without the PCA CUDA kernels"
    if request.param == "kernels":
        monkeypatch.setitem(native_decode._state, "enabled", True)
        assert native_decode.available(), "no lmtier._C.pca.decode_record, or no cuBLAS"
    else:
        monkeypatch.setitem(native_decode._state, "enabled", False)
    return request.param


@functools.cache
def _models() -> dict[str, pca.PCAModel]:
    kvs, starts = _calibration()
    quiet = pca.fit(
        kvs, starts, inv_freq=INV_FREQ, layer_group=G, outlier_share=0.0, exact_first=2, levels=SYNTHETIC_LEVELS
    )
    return {"plain": fitted("plain"), "metric": fitted("metric"), "quiet": quiet}


def _same(m: pca.PCAModel, level: str, kv: torch.Tensor, start: int) -> int:
    """Assert the CUDA record and decodes equal the host's; return the record's escapes."""
    ref = pca.encode(kv, start=start, model=m, level=level)
    assert pca.encode(kv.cuda(), start=start, model=m, level=level) == ref
    dec = pca.decode(ref, model=m)
    got = pca.decode(ref, model=m, device="cuda")
    assert got.is_cuda and got.dtype == dec.dtype
    assert torch.equal(got.cpu().view(torch.int16), dec.view(torch.int16))
    return pca.record_meta(ref).escapes


@pytest.mark.parametrize("kind", ["plain", "metric", "quiet"])
@pytest.mark.parametrize("level", LEVELS)
def test_cuda_records_and_decodes_are_the_hosts(kind, level, path):
    before = kernels.decode_stats()
    cases = int8_path_cases()
    esc = [_same(_models()[kind], level, kv, s) for kv, s in cases]
    if level == "pca_high" and kind == "quiet":
        assert esc[-1] > 0
    if path != "torch":  # each decode of T > 0 tokens read the symbols in place, or an int16 copy where escapes were
        after = kernels.decode_stats()
        coded = [e for (kv, _), e in zip(cases, esc) if kv.shape[2] > 0]  # T = 0 returns before either path
        assert len(coded) == len(esc) - 1
        got = {k: after[k] - before[k] for k in after}
        if path == "kernels":  # one native call each, escapes placed on the device
            assert got == {"symbols": len(coded), "int16": 0, "fused": len(coded)}, (got, esc)
        else:
            assert got == {"symbols": sum(e == 0 for e in coded), "int16": sum(e > 0 for e in coded), "fused": 0}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_dtypes(dtype):
    _same(fitted("plain"), "pca_default", _kv(64, 7, 40, dtype=dtype), 7)


def test_cuda_hand_built_corner_cases():
    m = _hand_model()
    kv = corner_chunk()
    assert _same(m, "pca_default", kv, 0) >= 2
    _same(m, "pca_high", kv, 0)


@functools.cache
def _llama_like() -> pca.PCAModel:
    return bench.model_for((8, 8, 128, 4), 3 * 4096)


@pytest.mark.parametrize("level", LEVELS)
def test_cuda_at_llama_head_geometry(level):
    """N = 4,096 (two layer groups of Llama-3.1-8B's heads): a sink chunk and a later one."""
    m = _llama_like()
    for start, seed in ((0, 3), (256, 4)):
        _same(m, level, bench.synthetic_kv((8, 8, 128, 4), 256, start, seed), start)


@pytest.mark.parametrize("level", LEVELS)
def test_cuda_decodes_without_run_luts_are_the_same(level, monkeypatch):
    """The rANS tables' decode lookups turned off (``pca.codec.use_run_luts(False)``: the coder builds
    each table run's lookups itself, the product's path before them): every decode still gives the
    host's bits, on each CUDA path; turned on again, the cached lookups serve the next decode. Each
    path's coder call is handed the lookups exactly when they are on."""
    m = _models()["quiet"]
    handed = []

    def spy(real, device_arg=None):  # records the CUDA calls' lookups (the host decodes of _same pass none)
        def call(*a, **k):
            if device_arg is None or torch.device(a[device_arg]).type == "cuda":
                handed.append(k.get("run_luts"))
            return real(*a, **k)

        return call

    monkeypatch.setattr(native_decode, "queue", spy(native_decode.queue))
    monkeypatch.setattr(streams, "queue_spans", spy(streams.queue_spans, device_arg=5))
    monkeypatch.setitem(pca.codec._RUN_LUTS, "enabled", False)
    for kv, s in int8_path_cases():
        _same(m, level, kv, s)
    assert handed and all(x is None for x in handed)
    assert pca.codec._run_luts(m, level, "cuda") is None
    pca.codec.use_run_luts(True)
    luts = pca.codec._run_luts(m, level, "cuda")
    assert luts is not None and luts.shape == (m.levels[level].tables.shape[0], rans.RUN_LUT_BYTES)
    handed.clear()
    _same(m, level, *int8_path_cases()[-1])
    assert handed and all(x is luts for x in handed)
    pca.codec.use_run_luts(False)  # frees the lookups built so far
    assert pca.codec._cached_run_luts.cache_info().currsize == 0
    pca.codec.use_run_luts(True)


def test_in_use_marks_each_cached_tensor_once_per_stream(monkeypatch):
    """``imatmul.in_use`` (at every decode, for each cached tensor it reads) calls ``record_stream``
    once per tensor and stream: again on another stream, never for host tensors."""
    calls, real = [], torch.Tensor.record_stream

    def spy(self, s):
        calls.append(s.cuda_stream)
        return real(self, s)

    monkeypatch.setattr(torch.Tensor, "record_stream", spy)
    t, u = torch.empty(16, device="cuda"), torch.empty(8, device="cuda")
    imatmul.in_use(t, t, u)
    imatmul.in_use(t)
    main = torch.cuda.current_stream().cuda_stream
    assert calls == [main, main]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        imatmul.in_use(t, torch.empty(4))
    assert calls == [main, main, side.cuda_stream]


def test_cuda_empty_chunk_and_level_arrays_on_the_host():
    """T = 0 codes as on the host; the level's arrays may come from the host (moved to the device)."""
    m = fitted("plain")
    _same(m, "pca_default", _kv(0, 0, 1), 0)
    lv = m.levels["pca_high"]
    kv = _kv(40, 8, 37)
    k, thr = torch.from_numpy(lv.k), torch.from_numpy(lv.energy_threshold).double()
    ref = pca.codec.chunk_symbols(m, kv, 8, k, thr)
    got = pca.codec.chunk_symbols(m, kv.cuda(), 8, k, thr)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, ref))


def test_cuda_encode_synchronizes_twice(path, monkeypatch):
    """The fused kernels' encode of a CUDA chunk (escapes and exact tokens in it) waits for the device
    twice (the counts and the coder's status, then the record's sections) and nowhere else: no op
    that synchronizes implicitly (``torch.cuda.set_sync_debug_mode("error")`` raises on one: a
    pageable upload of the coder's descriptors did), two stream synchronizations; the record is the
    host's."""
    if path == "torch":
        pytest.skip("the torch fallback reads its counts back as it goes")
    m = fitted("plain")
    kv = _kv(40, 8, 37)
    ref = pca.encode(kv, start=8, model=m, level="pca_high")
    assert pca.record_meta(ref).escapes > 0
    x = kv.cuda()
    assert pca.encode(x, start=8, model=m, level="pca_high") == ref  # the model's arrays and tables uploaded
    syncs: list[int] = []
    real = torch.cuda.Stream.synchronize

    def counted(self):  # an explicit wait: counted, not refused
        syncs.append(1)
        torch.cuda.set_sync_debug_mode("default")
        try:
            return real(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(torch.cuda.Stream, "synchronize", counted)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = pca.encode(x, start=8, model=m, level="pca_high")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got == ref and len(syncs) == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_cuda_nonfinite_chunk_refused_and_next_chunk_unharmed(bad):
    """NaN or inf anywhere (a key of the last layer here, RoPE-paired) is refused, as on the host; the
    next finite chunk still codes the host's bytes (the fused kernels find it while transforming)."""
    from lmtier.codec.quant import CodecInputError

    m = fitted("plain")
    kv = _kv(40, 8, 37)
    poisoned = kv.clone()
    poisoned[-1, 0, 17, 1, 3] = bad
    for x in (poisoned, poisoned.cuda()):
        with pytest.raises(CodecInputError, match="NaN or inf"):
            pca.encode(x, start=8, model=m, level="pca_default")
    _same(m, "pca_default", kv, 8)


def test_cuda_escape_counts_that_lie_are_refused():
    """Records whose escaped coefficients disagree in number with their escape symbols (none announced:
    ``decode_pre_symbols`` counts them; one fewer: the escape index counts them) are refused on CUDA
    as on the host, and the next decode is right."""
    from lmtier.codec.chunk import CodecRecordError
    from tests.test_codec_pca_refusals import escape_liars

    m = fitted("plain")
    for bad, match in escape_liars(m):
        with pytest.raises(CodecRecordError, match=f"corrupted PCA codec record: {match}"):
            pca.decode(bad, model=m, device="cuda")
    if kernels.available():  # the kernels' own refusals: escapes of an empty chunk, symbols not uint8
        f = torch.ones(m.rows, 2, m.vector_size, dtype=torch.float64)
        empty = torch.empty(m.rows, 2, m.vector_size, 0, dtype=torch.uint8, device="cuda")
        with pytest.raises(kernels.EscapeCountError, match="0 escape symbols, 2 escaped coefficients given"):
            kernels.decode(m, empty, torch.ones(2, dtype=torch.int16), f, 0, torch.bfloat16)
        with pytest.raises(ValueError, match="symbols must be uint8, got torch.int16"):
            kernels.decode(m, empty.to(torch.int16), torch.empty(0), f, 0, torch.bfloat16)
    _same(m, "pca_default", _kv(40, 3, 5), 3)


def test_cuda_gemms_run_batched_and_threads_share_nothing(path):
    """The kernels' GEMMs run as batched cuBLAS calls (``lmtier._C.pca.bgemm_s8``, never one by one):
    repeated encodes give the host's bytes, also from two threads at once on their own streams
    (each call's operands are its own: the threads share only the model's read-only matrices)."""
    if path == "torch":
        pytest.skip("the torch fallback runs torch._int_mm")
    from lmtier import _C

    assert _C.pca.cublas_library().startswith("libcublas"), _C.pca.cublas_library()
    m = fitted("plain")
    cases = [(_kv(64, s, 50 + s), s) for s in (0, 64, 128)]
    refs = [pca.encode(kv, start=s, model=m, level="pca_default") for kv, s in cases]
    before = kernels.gemm_stats()
    for _ in range(2):
        for (kv, s), ref in zip(cases, refs):
            assert pca.encode(kv.cuda(), start=s, model=m, level="pca_default") == ref
    after = kernels.gemm_stats()
    assert after["batched"] - before["batched"] >= 6 and after["eager"] == before["eager"]

    def worker() -> None:
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(3):
                for (kv, s), ref in zip(cases, refs):
                    assert pca.encode(kv.cuda(), start=s, model=m, level="pca_default") == ref
                    got = pca.decode(ref, model=m, device="cuda")
                    assert torch.equal(got.cpu().view(torch.int16), pca.decode(ref, model=m).view(torch.int16))

    run_in_threads(worker, [()] * 2)


@pytest.mark.parametrize("groups", [1, 2])
def test_cuda_transform_in_batches_of_layer_groups_is_the_hosts(path, monkeypatch, groups):
    """A chunk's transform runs in batches of layer groups bounded by ``kernels.GEMM_BYTES`` (each
    batch's kernels on views of the chunk's arrays at its groups' offsets): one group and two groups
    per batch (of the encoder's GEMM outputs at T = 40; the decoder's take half, so twice the groups)
    give the host's records and decodes, escapes included (``pca_high``'s many), short chunks too."""
    if path == "torch":
        pytest.skip("the torch fallback runs no batches")
    m = bench.tiled(fitted("plain"), 3)
    p8 = imatmul.prepared(m, "cuda")[0].p8
    monkeypatch.setattr(kernels, "GEMM_BYTES", groups * 2 * (2 * 40) * 2 * p8 * 4)
    assert len(kernels._slices(m.rows, 2 * 40, p8)) == -(-m.rows // groups) > 1
    before = kernels.gemm_stats()
    for level in LEVELS:
        for kv, s in [(_kv(40, 8, 91).repeat(3, 1, 1, 1, 1), 8), (_kv(3, 3, 92).repeat(3, 1, 1, 1, 1), 3)]:
            _same(m, level, kv, s)
    assert kernels.gemm_stats()["eager"] == before["eager"]


@pytest.mark.parametrize("why", ["no cublas", "refused"])
def test_cuda_gemms_one_by_one_without_cublas_are_the_hosts(path, monkeypatch, why):
    """Where cuBLAS is not found, or refuses a batch, the GEMMs run one by one (``torch._int_mm``, its
    16-row padding for short chunks included) and give the host's records and decodes."""
    if path == "torch":
        pytest.skip("the torch fallback runs no batches")
    if why == "no cublas":
        monkeypatch.setattr(kernels, "_cublas", [False])
    else:  # the Python bgemm_s8 refuses; the native decode's GEMMs are C++'s (test_gpu_codec_pca_native)
        monkeypatch.setitem(native_decode._state, "enabled", False)

        def refuse(*args):
            raise RuntimeError("lmtier: bgemm_s8: cublasGemmStridedBatchedEx failed (status 15)")

        monkeypatch.setattr(kernels._native(), "bgemm_s8", refuse)
    m = fitted("plain")
    before = kernels.gemm_stats()
    for kv, s in [(_kv(40, 8, 93), 8), (_kv(3, 3, 94), 3)]:
        _same(m, "pca_high", kv, s)
    after = kernels.gemm_stats()
    assert after["batched"] == before["batched"] and after["eager"] > before["eager"]
    assert (after["refused"] > before["refused"]) == (why == "refused")


@pytest.mark.parametrize(
    ("batch", "m", "k", "p"), [(1, 1, 4, 4), (3, 17, 24, 40), (5, 48, 128, 256), (2, 256, 1024, 2048)]
)
def test_bgemm_s8_is_exact(path, batch, m, k, p):
    """``lmtier._C.pca.bgemm_s8``: ``out[b] = a[b] @ bt[b]^T`` in int32, equal to an int64 product on the
    host for random int8 operands at the extremes (-128 .. 127), odd row counts included; sizes not
    multiples of 4 are a ValueError naming them."""
    if path != "kernels":
        pytest.skip("one run is enough: no codec path involved")
    from lmtier import _C

    g = torch.Generator().manual_seed(batch * 1000 + m)
    a = torch.randint(-128, 128, (batch, m, k), dtype=torch.int8, generator=g)
    bt = torch.randint(-128, 128, (batch, p, k), dtype=torch.int8, generator=g)
    a[0, 0] = -128
    bt[0, 0] = -128
    want = (a.to(torch.int64) @ bt.to(torch.int64).transpose(1, 2)).to(torch.int32)
    ad, bd = a.cuda(), bt.cuda()
    stream = torch.cuda.current_stream().cuda_stream
    ws = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    for w, nw in ((ws.data_ptr(), ws.numel()), (ws.data_ptr(), 16 << 10)):  # the product's, and cuBLAS's least
        out = torch.full((batch, m, p), -7, dtype=torch.int32, device="cuda")
        _C.pca.bgemm_s8(batch, m, k, p, ad.data_ptr(), bd.data_ptr(), out.data_ptr(), w, nw, stream)
        assert torch.equal(out.cpu(), want)
    with pytest.raises(ValueError, match=r"k \(6\) and p \(8\) must be multiples of 4"):
        _C.pca.bgemm_s8(1, 1, 6, 8, ad.data_ptr(), bd.data_ptr(), out.data_ptr(), 0, 0, stream)
    with pytest.raises(ValueError, match="a workspace of 16 bytes at address 0"):
        _C.pca.bgemm_s8(1, 1, 8, 8, ad.data_ptr(), bd.data_ptr(), out.data_ptr(), 0, 16, stream)


def test_the_exact_mask_outlives_encode_symbols_launch(path, monkeypatch):
    """An allocation between the exact-token mask's creation and ``encode_symbols``' launch (another
    thread's, on the same stream: what the store threads of a ``TierManager`` do) cannot take the
    mask's memory and write to it ahead of the kernel: the record is the host's. Before the fix the
    mask was a temporary freed before the launch, and the blocks of its size filled with ones here
    (one of them its block) made every token read as exact (a valid record of other bytes)."""
    if path == "torch":
        pytest.skip("the torch fallback has no native encode_symbols")
    c = kernels._native()
    real = c.encode_symbols

    def squat(*args):
        t = args[1]  # the chunk's tokens: blocks of the mask's size, enough to take any free one
        hogs = [torch.ones(t, dtype=torch.uint8, device="cuda") for _ in range(256)]
        real(*args)
        del hogs

    monkeypatch.setattr(c, "encode_symbols", squat)
    m = fitted("plain")
    for kv, s in ((_kv(40, 8, 37), 8), (_kv(40, 0, 38), 0)):
        assert pca.encode(kv.cuda(), start=s, model=m, level="pca_default") == pca.encode(
            kv, start=s, model=m, level="pca_default"
        )
