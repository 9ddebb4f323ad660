"""``Tier.put``'s contract: a tier is done reading the payload when ``put`` returns, so the caller may
reuse the memory at once. The codec tiers rely on it: they hand their inner tier each record in the
buffer they assemble the next one in (``scratch=True``, :func:`lmtier.codec.format.pack_runs`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmtier.codec import chunk as cchunk
from lmtier.codec import format as fmt
from lmtier.tiers.cpu import CPUPool
from lmtier.tiers.disk import DiskTier
from lmtier.tiers.seal import KeyRing, SealKey
from lmtier.tiers.seal.tier import SealedTier, SealMode
from tests.codec_cases import SHAPE, kv_like
from tests.test_manager import MemTier

N = (6 << 20) + 100
"""Payload bytes: several of the disk tier's write pieces and of the Redis tier's SETRANGE pieces
(1 MiB), not a whole number of pages."""


def K(i: int) -> bytes:
    return bytes([i]) * 32


def _disk(tmp_path, request):
    return DiskTier([str(tmp_path / "d")], 64 << 20, io_threads=4)


def _cpu(tmp_path, request):
    return CPUPool(4 * (7 << 20), 7 << 20, arena=torch.empty(4 * (7 << 20), dtype=torch.uint8))


def _sealed(tmp_path, request):
    ring = KeyRing.of(SealKey.from_bytes(b"\x07" * 32, source="test"))
    return SealedTier(_disk(tmp_path, request), ring, mode=SealMode.ENCRYPT)


def _redis(tmp_path, request):
    from lmtier.tiers.redis import RedisTier

    return RedisTier(request.getfixturevalue("redis_server").url, timeout_s=5.0)


def _mooncake(tmp_path, request):
    from tests.test_mooncake_tier import make_tier

    return make_tier(request.getfixturevalue("mooncake_store"))


TIERS = {"cpu": _cpu, "disk": _disk, "sealed_disk": _sealed, "redis": _redis, "mooncake": _mooncake}


@pytest.mark.parametrize("name", sorted(TIERS))
def test_put_is_done_with_the_payload_when_it_returns(name, tmp_path, request):
    """The payload's memory (page-aligned, as the codec tiers' packing buffer: the disk tier writes
    whole pages straight from it) is overwritten right after each put, as the codec tiers' next
    record does: every key still reads back the bytes it was put with."""
    tier = TIERS[name](tmp_path, request)
    buf = fmt._page_aligned(N)
    assert buf.ctypes.data % 4096 == 0
    want = {}
    try:
        for i in range(3):
            data = np.random.default_rng(i).integers(0, 256, N, dtype=np.uint8).tobytes()
            buf[:] = np.frombuffer(data, np.uint8)
            assert tier.put(K(i), memoryview(buf).toreadonly())
            buf[:] = 0xA5  # the caller reuses the memory at once
            want[K(i)] = data
        for k, data in want.items():
            out = bytearray(N)
            assert tier.get_into(k, out) == N and bytes(out) == data
    finally:
        tier.close()


def test_scratch_record_is_the_bytes_record_in_the_threads_buffer():
    """``scratch=True`` gives the same bytes as the default, as a read-only view of this thread's
    packing buffer (no copy), which the next record on the thread reuses."""
    xs = [kv_like(seed=s) for s in (1, 2)]
    enc = [cchunk.encode_chunk(x, shape=SHAPE, dtype=torch.bfloat16, level="default") for x in xs]
    view = cchunk.encode_chunk(xs[0], shape=SHAPE, dtype=torch.bfloat16, level="default", scratch=True)
    assert isinstance(enc[0], bytes) and isinstance(view, memoryview) and view.readonly
    assert bytes(view) == enc[0]
    at = np.frombuffer(view, np.uint8).ctypes.data
    assert at == fmt._scratch(1).ctypes.data and at % 4096 == 0  # this thread's buffer, page-aligned
    again = cchunk.encode_chunk(xs[1], shape=SHAPE, dtype=torch.bfloat16, level="default", scratch=True)
    assert np.frombuffer(again, np.uint8).ctypes.data == at and bytes(again) == enc[1]


def test_codec_tier_hands_its_inner_tier_the_scratch_record(tmp_path):
    """The codec tier's inner put gets the record as a view of the packing buffer (no copy into a new
    ``bytes``); stored records are the encoder's bytes, each decoding back."""
    from lmtier.tiers.codec import CodecTier

    inner = MemTier("inner")
    seen = []
    put = inner.put

    def spy(key, payload, **kw):
        seen.append(type(payload))
        return put(key, bytes(payload), **kw)

    inner.put = spy
    t = CodecTier(inner, shape=SHAPE, dtype=torch.bfloat16, level="default")
    xs = [kv_like(seed=s) for s in (3, 4)]
    for i, x in enumerate(xs):
        assert t.put(K(i), x.view(-1).view(torch.uint8).numpy().tobytes())
    assert seen == [memoryview, memoryview]
    for i, x in enumerate(xs):
        rec = inner.store[t.inner_key(K(i))]
        assert rec == cchunk.encode_chunk(x, shape=SHAPE, dtype=torch.bfloat16, level="default")
        out = torch.empty_like(x)
        assert t.get_into(K(i), out.view(-1).view(torch.uint8)) == x.numel() * 2
    t.close()
