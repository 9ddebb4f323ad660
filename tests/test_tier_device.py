"""lmtier.tiers.device.PinnedBounce, the host tiers' device adapter, on this CPU-only machine: CPU
tensors stand in for CUDA tensors (the adapter's CUDA test is patched to accept them, its pool is
unpinned), so the bounce paths of the disk and Redis tiers run here; tests/test_disk_tier.py's
``gpu`` tests run the real thing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmtier.tiers import device
from lmtier.tiers.buffers import BouncePool
from lmtier.tiers.disk import DiskTier
from lmtier.tiers.disk import tier as disk_tier


def key(i: int) -> bytes:
    return bytes([i]) * 32


@pytest.fixture
def fake_cuda(monkeypatch):
    """Every torch tensor counts as a CUDA tensor; bounce buffers are plain (unpinned) memory.
    Returns the list of bounce-buffer sizes handed out."""
    acquired: list[int] = []
    is_fake = lambda obj: isinstance(obj, torch.Tensor)  # noqa: E731
    monkeypatch.setattr(device, "is_cuda_tensor", is_fake)
    monkeypatch.setattr(disk_tier, "is_cuda_tensor", is_fake)
    pools: dict[int, BouncePool] = {}

    class SpyPool(BouncePool):
        def acquire(self, nbytes):
            acquired.append(nbytes)
            return super().acquire(nbytes)

    def pool(self):
        return pools.setdefault(id(self), SpyPool(max_cached=2))

    monkeypatch.setattr(device.PinnedBounce, "pool", pool)
    return acquired


def test_adapter_host_buffers_pass_through():
    b = device.PinnedBounce()
    data = bytearray(b"abcdef")
    with b.host_payload(data) as mv:
        assert bytes(mv) == b"abcdef"
        data[0] = ord("z")
        assert bytes(mv[:1]) == b"z"  # a view, not a copy
    out = bytearray(6)

    def read(mv):
        assert mv.nbytes == 6 and not mv.readonly
        mv[:3] = b"xyz"
        return 3

    assert b.get_into(out, read) == 3 and out[:3] == b"xyz"
    b.close()


def test_adapter_bounces_device_tensors(fake_cuda):
    b = device.PinnedBounce()
    src = torch.arange(10, dtype=torch.int32)
    with b.host_payload(src) as mv:
        assert bytes(mv) == src.numpy().tobytes() and mv.nbytes == 40
    out = torch.zeros(12, dtype=torch.int32)

    def read(mv):
        assert mv.nbytes == 48  # a bounce buffer of out's size
        mv[:40] = src.numpy().tobytes()
        return 40

    assert b.get_into(out, read) == 40 and torch.equal(out[:10], src) and int(out[10:].abs().sum()) == 0
    assert b.get_into(out, lambda mv: None) is None
    with pytest.raises(TypeError, match="contiguous"):
        b.get_into(torch.zeros(4, 4)[:, 0], read)
    assert fake_cuda == [40, 48, 48]


def test_disk_tier_device_paths(tmp_path, fake_cuda):
    t = DiskTier([str(tmp_path)], 64 << 20, use_kvikio="never")
    n = (3 << 20) + 5
    src = torch.from_numpy(np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8))
    assert t.put(key(1), src)
    out = torch.zeros(n + 7, dtype=torch.uint8)
    assert t.get_into(key(1), out) == n and torch.equal(out[:n], src)
    assert fake_cuda[:2] == [n, n + 7]
    t.close()


def test_redis_tier_device_paths(redis_server, fake_cuda):
    from lmtier.tiers.redis import RedisTier

    t = RedisTier(redis_server.url, piece_bytes=4096, timeout_s=2.0)
    src = torch.arange(5000, dtype=torch.int16)
    assert t.put(key(2), src)
    out = torch.zeros(6000, dtype=torch.int16)
    assert t.get_into(key(2), out) == 10000 and torch.equal(out[:5000], src)
    assert fake_cuda == [10000, 12000] and t.counters["hits"] == 1
    t.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory)")
@pytest.mark.parametrize("nbytes", [1, 4096, 11912, 65536 + 7, 3 << 20])
def test_pinned_aligned_buffer_is_page_aligned(nbytes):
    """torch's caching host allocator hands out small pinned blocks at sub-page offsets
    (0x...8200 seen on the H200 for 12 KiB); AlignedBuffer must still start on a page."""
    from lmtier.tiers.buffers import PAGE_BYTES, AlignedBuffer

    bufs = [AlignedBuffer(nbytes, pinned=True) for _ in range(4)]  # several: later blocks are the offset ones
    for b in bufs:
        assert b.address % PAGE_BYTES == 0 and b.nbytes >= nbytes and len(b.mv) == b.nbytes
        assert b.tensor(b.nbytes).is_pinned() and b.tensor(b.nbytes).data_ptr() == b.address
