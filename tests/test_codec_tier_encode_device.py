"""CodecTier's GPU encode of host chunks (``encode_device``, :class:`lmtier.codec.encoder.DeviceEncoder`):
the CPU path without a device, the fallback to the CPU encode (one warning, GPU encoding turned off,
records byte-identical to the CPU encoder's), the plumbing from TierManager.from_config / the vLLM
worker's shared manager into every codec tier, and (gpu-marked, skipped without a CUDA device)
GPU-encoded records equal to CPU-encoded ones, counted, and decoding on CPU and CUDA to the reference.

The fallback tests use the real ``lmtier._C`` and the real torch: on a machine without CUDA the first
put fails creating the encoder's CUDA stream (torch raises), or at the build check when ``lmtier._C``
reports no CUDA (the CPU-build case, forced by patching ``built_with_cuda`` alone)."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math

import pytest
import torch

from lmtier import _C
from lmtier.codec import chunk as C
from lmtier.codec.encoder import DeviceEncoder
from lmtier.codec.levels import LEVELS
from lmtier.config import LMTierConfig
from lmtier.keys import Namespace
from lmtier.manager import TierManager
from lmtier.tiers.codec import CodecTier
from lmtier.tiers.disk import DiskTier
from tests.codec_cases import LEVELS as LEVEL_NAMES
from tests.codec_cases import SHAPE, as_bytes, key, kv_like, reference

CUDA0 = torch.device("cuda", 0)
NBYTES = math.prod(SHAPE) * 2
no_torch_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a process where CUDA cannot be used")


@pytest.fixture
def disk(tmp_path):
    t = DiskTier([str(tmp_path / "d")], 64 << 20, io_threads=1)
    yield t
    t.close()


def stored_record(t: CodecTier, k: bytes) -> bytes:
    """The record bytes the inner tier holds for chunk ``k``."""
    buf = bytearray(t.max_record_bytes + 4096)
    n = t.inner.get_into(t.inner_key(k), buf)
    assert n is not None
    return bytes(buf[:n])


def cpu_record(x: torch.Tensor, level: str, tables=None, shape=SHAPE) -> bytes:
    return C.encode_chunk(x, shape=shape, dtype=torch.bfloat16, level=level, tables=tables)


def gpu_warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "lmtier.tiers.codec" and "encoded on the CPU" in r.message
    ]


# ------------------------------------------------------------------------------------------------
# CPU (CI)


def test_no_encode_device_keeps_the_cpu_path(disk, caplog):
    t = CodecTier(disk, shape=SHAPE, dtype=torch.bfloat16, level="default")
    assert t.encode_device is None and t._gpu is None
    xs = [kv_like(seed=500 + i) for i in range(3)]
    with caplog.at_level(logging.WARNING, "lmtier.tiers.codec"):
        for i, x in enumerate(xs):
            assert t.put(key(i), as_bytes(x))
    assert [stored_record(t, key(i)) for i in range(3)] == [cpu_record(x, "default") for x in xs]
    assert t.counters["puts"] == 3 and t.counters["gpu_encodes"] == 0
    assert "gpu_encode_fallbacks" not in t.event_counts() and not gpu_warnings(caplog)
    t.close()


def test_encoder_arguments_and_laziness(disk):
    lv = LEVELS["default"]
    for bad in ("cpu", "cuda", torch.device("cpu")):
        with pytest.raises(ValueError, match="cuda:N"):
            DeviceEncoder(shape=SHAPE, dtype=torch.bfloat16, level=lv, device=bad)
    with pytest.raises(ValueError, match="max_idle_slots"):
        DeviceEncoder(shape=SHAPE, dtype=torch.bfloat16, level=lv, device="cuda:0", max_idle_slots=-1)
    enc = DeviceEncoder(shape=SHAPE, dtype=torch.bfloat16, level=lv, device="cuda:1")  # touches no CUDA
    assert enc.device == torch.device("cuda", 1) and enc.raw_bytes == NBYTES and enc.idle_slots() == 0
    for src in (torch.zeros(NBYTES - 1, dtype=torch.uint8), torch.zeros(NBYTES // 2, dtype=torch.int16)):
        with pytest.raises(ValueError, match=f"contiguous host uint8 tensor of {NBYTES} bytes"):
            enc.encode(src, tables=None)
    enc.close()
    with pytest.raises(RuntimeError, match="closed"):
        enc.encode(torch.zeros(NBYTES, dtype=torch.uint8), tables=None)
    with pytest.raises(ValueError, match="cuda:N"):
        CodecTier(disk, shape=SHAPE, dtype=torch.bfloat16, level="default", encode_device="cpu")


def _check_fallback(t: CodecTier, caplog, why: str) -> None:
    """Three host puts on a tier whose GPU encode cannot work: one warning naming ``why``, every
    record stored and byte-identical to the CPU encoder's, GPU encoding off after the first put."""
    assert t.encode_device == CUDA0  # lazy: nothing failed before the first put
    xs = [kv_like(seed=510 + i) for i in range(3)]
    payloads = [as_bytes(xs[0]), bytearray(as_bytes(xs[1])), xs[2].view(-1).view(torch.uint8)]
    with caplog.at_level(logging.WARNING, "lmtier.tiers.codec"):
        for i, p in enumerate(payloads):
            assert t.put(key(i), p)
    (msg,) = gpu_warnings(caplog)
    assert why in msg and "cuda:0" in msg and "gpu_encode_fallbacks" in msg
    assert t.encode_device is None
    assert t.counters["gpu_encode_fallbacks"] == 1 and t.counters["gpu_encodes"] == 0 and t.counters["puts"] == 3
    assert t.event_counts()["gpu_encode_fallbacks"] == 1
    assert [stored_record(t, key(i)) for i in range(3)] == [cpu_record(x, "default") for x in xs]
    out = torch.empty(NBYTES, dtype=torch.uint8)
    for i, x in enumerate(xs):
        assert t.get_into(key(i), out) == NBYTES
        assert torch.equal(out.view(torch.bfloat16).view(SHAPE), reference(x, "default"))


def test_cpu_build_falls_back_once_with_cpu_identical_records(disk, caplog, monkeypatch):
    # an lmtier._C built without CUDA: the encoder refuses before touching the device (encode_chunk
    # alone would quietly encode the device copy on the CPU and the put would count as a GPU encode)
    monkeypatch.setattr(_C, "built_with_cuda", lambda: False)
    monkeypatch.setattr(torch.cuda, "Stream", None)  # any use of the device would now raise TypeError
    t = CodecTier(disk, shape=SHAPE, dtype=torch.bfloat16, level="default", encode_device="cuda:0")
    _check_fallback(t, caplog, "lmtier._C was built without CUDA")
    t.close()


@no_torch_cuda
def test_no_cuda_in_the_process_falls_back_once(disk, caplog):
    # the real failure where no GPU is usable: torch raises creating the encoder's CUDA stream (this
    # machine's _C may well be a CUDA build: then the build check passes and torch is what fails)
    t = CodecTier(disk, shape=SHAPE, dtype=torch.bfloat16, level="default", encode_device=CUDA0)
    why = "CUDA" if _C.built_with_cuda() else "lmtier._C was built without CUDA"
    _check_fallback(t, caplog, why)
    t.close()


def test_concurrent_failures_warn_once(disk, caplog, monkeypatch):
    monkeypatch.setattr(_C, "built_with_cuda", lambda: False)
    t = CodecTier(disk, shape=SHAPE, dtype=torch.bfloat16, level="lossless", encode_device="cuda:0")
    xs = [kv_like(seed=520 + i) for i in range(8)]
    with caplog.at_level(logging.WARNING, "lmtier.tiers.codec"), cf.ThreadPoolExecutor(4) as ex:
        assert all(ex.map(lambda i: t.put(key(i), as_bytes(xs[i])), range(8)))
    assert len(gpu_warnings(caplog)) == 1 and 1 <= t.counters["gpu_encode_fallbacks"] <= 4
    assert [stored_record(t, key(i)) for i in range(8)] == [cpu_record(x, "lossless") for x in xs]
    t.close()


def test_unencodable_kv_is_not_a_device_failure(disk, monkeypatch):
    # CodecInputError (NaN/inf with a lossy level) is the data's: the store is refused as on the CPU
    # and GPU encoding stays on. The device is replaced by the CPU encoder (this machine has no GPU).
    seen: list[torch.Tensor] = []

    def on_cpu(self, src, *, tables, scratch=False):
        seen.append(src)
        return C.encode_chunk(src, shape=self.shape, dtype=self.dtype, level=self.level, tables=tables, scratch=scratch)

    monkeypatch.setattr(DeviceEncoder, "encode", on_cpu)
    t = CodecTier(disk, shape=SHAPE, dtype=torch.bfloat16, level="default", encode_device="cuda:0")
    x = kv_like(seed=530)
    bad = x.clone()
    bad[1, 1, 1, 1, 1] = float("inf")
    assert not t.put(key(1), as_bytes(bad))
    assert t.counters["put_failures"] == 1 and t.counters["gpu_encode_fallbacks"] == 0 and t.encode_device == CUDA0
    payload = bytearray(as_bytes(x))
    assert t.put(key(2), payload)
    assert t.counters["gpu_encodes"] == 1 and stored_record(t, key(2)) == cpu_record(x, "default")
    src = seen[-1]  # the host chunk itself (zero copy over the writable payload), not a copy
    assert not src.is_cuda and src.numel() == NBYTES
    assert src.data_ptr() == torch.frombuffer(payload, dtype=torch.uint8).data_ptr()
    t.close()


def test_an_input_error_of_the_encoder_is_not_a_device_failure(disk, monkeypatch, caplog):
    # ValueError / TypeError (e.g. tables that do not fit the record) are the input's, raised as on
    # the CPU: GPU encoding stays on, no fallback is counted or logged.
    def bad_tables(self, src, *, tables, scratch=False):
        raise ValueError("tables.section_tables has 7 entries, the record has 120 sections")

    monkeypatch.setattr(DeviceEncoder, "encode", bad_tables)
    t = CodecTier(disk, shape=SHAPE, dtype=torch.bfloat16, level="default", encode_device="cuda:0")
    with pytest.raises(ValueError, match="section_tables"):
        t.put(key(1), as_bytes(kv_like(seed=531)))
    assert t.counters["gpu_encode_fallbacks"] == 0 and t.encode_device == CUDA0
    assert not gpu_warnings(caplog) and not t.contains(key(1))
    t.close()


def _codec_config(tmp_path, *, remote: bool = True, **extra) -> LMTierConfig:
    """A cachegen disk tier (and a cachegen remote tier with ``remote``), per-stream tables."""
    values = {
        "chunk_size": 16,
        "local_cpu": False,
        "local_disk": f"file://{tmp_path}/disk",
        "max_local_disk_size": 0.01,
        "local_disk_serde": "cachegen",
        "codec_tables": "none",
    }
    if remote:
        values |= {"remote_url": "redis://unused:6379", "remote_serde": "cachegen"}
    return LMTierConfig.from_dict(values | extra)


def _ns() -> Namespace:
    return Namespace(model="m", num_layers=2, num_kv_heads=2, head_size=64, kv_dtype="bfloat16", chunk_size=16)


def test_manager_passes_the_worker_device_to_every_codec_tier(tmp_path, caplog):
    ns = _ns()
    cfg = _codec_config(tmp_path)

    def remote(_remote, _ns):  # a local stand-in for the remote store
        return DiskTier([str(tmp_path / "remote")], 16 << 20, io_threads=1)

    with TierManager.from_config(cfg, ns, remote_factory=remote) as m:
        assert isinstance(m.disk, CodecTier) and isinstance(m.remote, CodecTier)
        assert m.disk.encode_device is None and m.remote.encode_device is None
    with TierManager.from_config(cfg, ns, remote_factory=remote, encode_device=CUDA0) as m:
        assert m.disk.encode_device == CUDA0 and m.remote.encode_device == CUDA0
        if torch.cuda.is_available():
            return
        # no GPU here: the manager's store still reaches both tiers, each tier warning once
        from lmtier.integration.vllm.stats import StatsSink, TierEventReporter

        sink = StatsSink()
        reporter = TierEventReporter(m, sink)  # what the worker exports as vllm:lmtier_tier_events_total
        x = kv_like(seed=540)
        with caplog.at_level(logging.WARNING, "lmtier.tiers.codec"):
            assert m.store(key(40), x.view(-1).view(torch.uint8)).result(30)
            assert m.flush(30)
        for tier in (m.disk, m.remote):  # each tier tried its device once, warned once, stored the CPU record
            assert tier.counters["gpu_encode_fallbacks"] == 1 and tier.encode_device is None
            assert stored_record(tier, key(40)) == cpu_record(x, "default")
        assert len(gpu_warnings(caplog)) == 2
        reporter.report()
        assert sink.take().data["tier_events"] == {
            "disk": {"gpu_encode_fallbacks": 1},
            "remote": {"gpu_encode_fallbacks": 1},
        }


def test_worker_shared_manager_encodes_on_its_gpu_and_the_scheduler_never(tmp_path):
    from lmtier.integration.vllm import common

    ns = _ns()
    cfg = _codec_config(tmp_path, remote=False)
    m = common.shared_manager("encdev-test:0", cfg, ns, gpu_id=1, encode_device=torch.device("cuda", 1))
    try:
        assert isinstance(m.disk, CodecTier) and m.disk.encode_device == torch.device("cuda", 1)
        sched, shared = common.scheduler_tiers("encdev-test-other", cfg, ns)  # another process's view
        assert not shared and isinstance(sched.disk, CodecTier) and sched.disk.encode_device is None
        sched.close()
    finally:
        common.drop_shared_manager("encdev-test:0")
        m.close()


# ------------------------------------------------------------------------------------------------
# GPU (skipped without a CUDA device)


@pytest.mark.gpu
@pytest.mark.parametrize("level", LEVEL_NAMES)
def test_gpu_encode_records_equal_cpu_records(disk, level):
    t = CodecTier(disk, shape=SHAPE, dtype=torch.bfloat16, level=level, tables=None, encode_device="cuda:0")
    xs = [kv_like(seed=600 + i) for i in range(4)]
    pinned = xs[3].view(-1).view(torch.uint8).pin_memory()
    payloads = [as_bytes(xs[0]), bytearray(as_bytes(xs[1])), xs[2].view(-1).view(torch.uint8), pinned]
    for i, p in enumerate(payloads):
        assert t.put(key(i), p)
    assert t.counters["gpu_encodes"] == 4 and t.counters["gpu_encode_fallbacks"] == 0 and t.encode_device == CUDA0
    assert [stored_record(t, key(i)) for i in range(4)] == [cpu_record(x, level) for x in xs]
    (slot,) = t._gpu._idle  # one caller: one slot, on a stream of its own
    assert slot.stream.cuda_stream != torch.cuda.default_stream(CUDA0).cuda_stream
    host = torch.empty(NBYTES, dtype=torch.uint8)
    dev = torch.empty(SHAPE, dtype=torch.bfloat16, device="cuda")
    for i, x in enumerate(xs):
        want = reference(x, level)
        assert t.get_into(key(i), host) == NBYTES and torch.equal(host.view(torch.bfloat16).view(SHAPE), want)
        assert t.get_into(key(i), dev) == NBYTES and torch.equal(dev.cpu(), want)
    t.close()
    assert t.encode_device is None


@pytest.mark.gpu
def test_gpu_encode_with_static_tables_and_threads(disk):
    from lmtier.codec import calibrate as CAL

    shape = (4, 2, 256, 8, 128)
    n = math.prod(shape) * 2
    tab, _ = CAL.calibrate([kv_like(shape, seed=699)], "default")
    xs = [kv_like(shape, seed=700 + i) for i in range(8)]
    t = CodecTier(disk, shape=shape, dtype=torch.bfloat16, level="default", tables=tab, encode_device=CUDA0)
    with cf.ThreadPoolExecutor(4) as ex:
        assert all(ex.map(lambda i: t.put(key(i), xs[i].view(-1).view(torch.uint8)), range(8)))
    assert t.counters["gpu_encodes"] == 8 and t.counters["gpu_encode_fallbacks"] == 0
    assert [stored_record(t, key(i)) for i in range(8)] == [cpu_record(x, "default", tab, shape) for x in xs]
    idle = t._gpu._idle
    assert 1 <= len(idle) <= 4 and len({s.stream.cuda_stream for s in idle}) == len(idle)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    for i, x in enumerate(xs):
        want = torch.empty(n, dtype=torch.uint8)
        C.decode_chunk(
            cpu_record(x, "default", tab, shape), want, expected_shape=shape, dtype=torch.bfloat16, tables=tab
        )
        assert t.get_into(key(i), dev) == n and torch.equal(dev.cpu(), want)
    t.close()


@pytest.mark.gpu
def test_gpu_encode_auto_tables_calibrate_on_the_host_chunks(tmp_path, monkeypatch):
    from lmtier.codec import autotables as AT
    from lmtier.codec import calibrate as CAL
    from lmtier.codec import format as fmt
    from tests.test_codec_autotables import SHAPE as ASHAPE
    from tests.test_codec_autotables import kv_like as akv

    monkeypatch.setattr(AT, "QUEUE_CHUNKS", 64)  # calibration takes exactly the first 4 chunks
    disk = DiskTier([str(tmp_path / "d")], 256 << 20, io_threads=1)
    t = CodecTier(
        disk,
        shape=ASHAPE,
        dtype=torch.bfloat16,
        level="default",
        tables="auto",
        tables_dir=tmp_path / "tables",
        namespace_id="0123456789abcdef",
        calibration_chunks=4,
        encode_device=CUDA0,
    )
    xs = [akv(800 + i) for i in range(6)]
    for i, x in enumerate(xs[:4]):
        assert t.put(key(i), x.view(-1).view(torch.uint8))
    assert t.auto_tables.wait(120)
    tab = t.tables
    assert tab is not None and tab.table_id == CAL.calibrate(xs[:4], "default")[0].table_id
    for i, x in enumerate(xs[4:], 4):
        assert t.put(key(i), x.view(-1).view(torch.uint8))
    assert t.counters["gpu_encodes"] == 6 and t.counters["gpu_encode_fallbacks"] == 0
    recs = [stored_record(t, key(i)) for i in range(6)]
    assert [fmt.unpack(r).info.table_id for r in recs] == [fmt.NO_TABLE] * 4 + [tab.table_id] * 2
    assert recs[4:] == [cpu_record(x, "default", tab, ASHAPE) for x in xs[4:]]
    t.close()


@pytest.mark.gpu
def test_gpu_manager_write_back_encodes_pinned_pool_slots_on_the_gpu(tmp_path):
    # the product path: a pinned CPU pool of one slot; the second store evicts the first, whose
    # write-back puts the slot's host bytes into the codec tier, which encodes them on cuda:0
    cfg = _codec_config(tmp_path, remote=False, local_cpu=True, max_local_cpu_size=NBYTES / 2**30)
    a, b = kv_like(seed=900), kv_like(seed=901)
    with TierManager.from_config(cfg, _ns(), encode_device=CUDA0) as m:  # the pool's own page-locked arena
        assert m.cpu.pinned
        assert m.store(key(90), a.view(-1).view(torch.uint8)).result(30)
        assert m.store(key(91), b.view(-1).view(torch.uint8), timeout_s=None).result(30)
        assert m.lookup([key(90), key(91)]) == ["disk", "cpu"]
        assert m.disk.counters["gpu_encodes"] == 1 and m.disk.counters["gpu_encode_fallbacks"] == 0
        assert stored_record(m.disk, key(90)) == cpu_record(a, "default")
        out = torch.empty(NBYTES, dtype=torch.uint8)
        assert m.retrieve(key(90), out) and torch.equal(out.view(torch.bfloat16).view(SHAPE), reference(a, "default"))
