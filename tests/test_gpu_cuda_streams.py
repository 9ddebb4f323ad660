"""``lmtier.cuda_streams``: the cached current-stream lookups give torch's answers (the same handle,
an equal stream) under every way the current stream changes, and ``use`` restores the stream that
was current. Marked ``gpu``: skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from lmtier import cuda_streams
from tests.threads import run_in_threads

pytestmark = pytest.mark.gpu


def _same(dev: torch.device) -> None:
    want = torch.cuda.current_stream(dev)
    got = cuda_streams.current(dev)
    assert got == want and got.cuda_stream == want.cuda_stream == cuda_streams.raw(dev)


def test_current_follows_stream_changes():
    dev = torch.device("cuda", torch.cuda.current_device())
    _same(dev)
    a, b = torch.cuda.Stream(device=dev), torch.cuda.Stream(device=dev)
    with torch.cuda.stream(a):
        _same(dev)
        assert cuda_streams.current(dev) == a
        with torch.cuda.stream(b):
            assert cuda_streams.current(dev) == b and cuda_streams.raw(None) == b.cuda_stream
        assert cuda_streams.current(dev) == a
    ext = torch.cuda.ExternalStream(a.cuda_stream, device=dev)
    with torch.cuda.stream(ext):
        _same(dev)
    assert cuda_streams.current(dev) == torch.cuda.default_stream(dev)


def test_use_sets_and_restores():
    dev = torch.device("cuda", torch.cuda.current_device())
    a, b = torch.cuda.Stream(device=dev), torch.cuda.Stream(device=dev)
    with torch.cuda.stream(a):
        with cuda_streams.use(b):
            assert torch.cuda.current_stream(dev) == b
            x = torch.ones(1 << 20, device=dev)  # queued on b
        assert torch.cuda.current_stream(dev) == a
        b.synchronize()
        assert int(x.sum().item()) == 1 << 20
    with pytest.raises(RuntimeError, match="boom"):
        with cuda_streams.use(b):
            raise RuntimeError("boom")
    assert torch.cuda.current_stream(dev) == torch.cuda.default_stream(dev)


def test_threads_see_their_own_streams():
    dev = torch.device("cuda", torch.cuda.current_device())
    streams = [torch.cuda.Stream(device=dev) for _ in range(4)]

    default = torch.cuda.default_stream(dev).cuda_stream

    def one(i: int) -> None:
        seen = []
        for _ in range(50):
            with torch.cuda.stream(streams[i]):
                seen.append(cuda_streams.current(dev).cuda_stream)
            seen.append(cuda_streams.current(dev).cuda_stream)
        assert seen == [streams[i].cuda_stream, default] * 50, i

    run_in_threads(one, [(i,) for i in range(4)])


def test_names_and_odd_streams_as_torch_takes_them():
    dev = torch.device("cuda", torch.cuda.current_device())
    a = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(a):
        for name in (str(dev), dev.index, None, torch.device("cuda")):
            assert cuda_streams.current(name) == torch.cuda.current_stream(name) == a
            assert cuda_streams.raw(name) == a.cuda_stream
    with pytest.raises(ValueError):
        torch.cuda.current_stream(torch.device("cpu"))
    with pytest.raises(ValueError):
        cuda_streams.current(torch.device("cpu"))
    ext = torch.cuda.ExternalStream(a.cuda_stream, device=dev)
    with cuda_streams.use(ext):
        assert torch.cuda.current_stream(dev) == ext and cuda_streams.current(dev) == ext
    assert torch.cuda.current_stream(dev) == torch.cuda.default_stream(dev)
    with torch.cuda.stream(a), cuda_streams.use(None):
        assert torch.cuda.current_stream(dev) == a


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_another_devices_stream():
    here, there = torch.cuda.current_device(), (torch.cuda.current_device() + 1) % torch.cuda.device_count()
    s = torch.cuda.Stream(device=there)
    with torch.cuda.stream(s):
        torch_sees = torch.cuda.current_device()
    with cuda_streams.use(s):
        assert torch.cuda.current_device() == torch_sees  # as torch's context leaves it
        assert cuda_streams.current(there) == torch.cuda.current_stream(there) == s
        assert cuda_streams.current(here) == torch.cuda.default_stream(here)
    assert torch.cuda.current_device() == here
    assert torch.cuda.current_stream(there) == torch.cuda.default_stream(there)
