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
from lmtier.codec import pca
from lmtier.codec.pca import kernels
from tests.test_codec_pca_imatmul import corner_chunk, int8_path_cases
from tests.test_codec_pca_product import INV_FREQ, SYNTHETIC_LEVELS, G, _calibration, _hand_model, _kv, fitted

pytestmark = pytest.mark.gpu
LEVELS = ("pca_high", "pca_default")


@pytest.fixture(params=["kernels", "torch"], autouse=True)
def path(request, monkeypatch):
    """Which CUDA path codes: the fused kernels (asserted built) or the torch fallback."""
    if request.param == "kernels":
        assert kernels.available(), "the extension was built without the PCA CUDA kernels"
    else:
        monkeypatch.setattr(kernels, "available", lambda: False)
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
def test_cuda_records_and_decodes_are_the_hosts(kind, level):
    esc = [_same(_models()[kind], level, kv, s) for kv, s in int8_path_cases()]
    if level == "pca_high" and kind == "quiet":
        assert esc[-1] > 0


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


def test_cuda_gemms_replay_a_captured_graph_shared_by_threads(path):
    """The kernels' GEMMs run as one captured CUDA graph per (matrix, rows): repeated encodes and
    decodes replay it and give the host's bytes, also from two threads at once on their own streams
    (they share the graph's static operands, one user at a time)."""
    if path != "kernels":
        pytest.skip("the torch fallback runs no graph")
    import threading

    m = fitted("plain")
    cases = [(_kv(64, s, 50 + s), s) for s in (0, 64, 128)]
    refs = [pca.encode(kv, start=s, model=m, level="pca_default") for kv, s in cases]
    before = kernels.graph_stats()
    for _ in range(2):
        for (kv, s), ref in zip(cases, refs):
            assert pca.encode(kv.cuda(), start=s, model=m, level="pca_default") == ref
    after = kernels.graph_stats()
    assert after["capture_failures"] == before["capture_failures"]
    assert after["replays"] - before["replays"] == 6 and after["eager"] == before["eager"]

    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                for _ in range(3):
                    for (kv, s), ref in zip(cases, refs):
                        assert pca.encode(kv.cuda(), start=s, model=m, level="pca_default") == ref
                        got = pca.decode(ref, model=m, device="cuda")
                        assert torch.equal(got.cpu().view(torch.int16), pca.decode(ref, model=m).view(torch.int16))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_cuda_gemm_set_first_user_waits_for_its_creation(path):
    """A GEMM set is created (operands zeroed, cuBLAS warmed up, graph captured) on the creating
    thread's stream; another thread's stream may use it first, so it must wait for that work. Here the
    creating stream is held back by a sleep: the set's event is still pending, a user on another stream
    queues behind it (its stream not done while the creator sleeps), and a decode there gives the host's
    bits (the ttft bench's first PCA load from four I/O threads decoded wrong KV before the set carried
    this event)."""
    if path != "kernels":
        pytest.skip("the torch fallback runs no graph")
    from lmtier.codec.pca import imatmul

    m = fitted("plain")
    kv, s = _kv(48, 16, 77), 16
    ref = pca.encode(kv, start=s, model=m, level="pca_default")
    want = pca.decode(ref, model=m).view(torch.int16)
    pca.decode(ref, model=m, device="cuda")  # the model's caches on the device
    dev = torch.device("cuda", torch.cuda.current_device())
    dec = imatmul.prepared(m, "cuda")[1]
    assert dec is imatmul.prepared(m, dev)[1]  # one cache entry, however the device is named
    with kernels._sets_lock:  # a cold set, as the first load of a served prefix finds it
        cold = [k for k in kernels._sets if k[0] == id(dec)]
        for k in cold:
            kernels._sets.pop(k).evicted = True
    assert cold, "the decode above left no set to drop"
    creator, user = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(creator):
        nb = dec.cat_t.shape[0]  # the set's operands come from the creator's cached blocks, no cudaMalloc
        warm = [torch.empty(nb, 48, dec.n8, dtype=torch.int8), torch.empty(nb, 48, 2 * dec.p8, dtype=torch.int32)]
        del warm
        torch.cuda._sleep(500_000_000)  # ~0.3 s at H100 clocks
        gs = kernels._gemm_set(dec, 48, dev)
    assert gs.done is not None and not gs.done.query(), "the set's creation is not ordered before its first use"
    with kernels._using(dec, 48, dev, user) as got_set:
        assert got_set is gs
    assert not user.query(), "the first user's stream does not wait for the set's creation"
    with torch.cuda.stream(user):
        got = pca.decode(ref, model=m, device="cuda")
    torch.cuda.synchronize()
    assert torch.equal(got.cpu().view(torch.int16), want)
