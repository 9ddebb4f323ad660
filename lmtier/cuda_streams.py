"""The current CUDA stream, looked up without building a ``torch.cuda.Stream`` at each call.

``torch.cuda.current_stream`` makes a new Python object every call, entering a device context to do
so; the codec's decode path asks for the stream several times a record while holding the GIL, which
a tier's I/O threads share. :func:`raw` reads the handle alone; :func:`current` hands out one
``Stream`` object per (thread, device, handle), made once.
"""

from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["current", "raw", "use"]

_MAX_CACHED = 64
"""Stream objects one thread keeps (beyond it the thread's cache starts over): a thread meets its own
streams and torch's pool's, a few dozen."""

_local = threading.local()


def _index(device: torch.device | int | None) -> int:
    if isinstance(device, int):
        return device
    if device is None or device.index is None:
        return torch.cuda.current_device()
    return device.index


def raw(device: torch.device | int | None = None) -> int:
    """The ``cudaStream_t`` (an int) of the current stream on CUDA ``device`` (None or an index-less
    device: the current device), as ``torch.cuda.current_stream(device).cuda_stream`` gives it."""
    return torch._C._cuda_getCurrentRawStream(_index(device))


def current(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)``: the same stream (equal, same handle), the object made
    once per thread, device and handle.

    Raises:
        RuntimeError, AssertionError: as ``torch.cuda.current_stream`` (no CUDA, a bad index)."""
    idx = _index(device)
    handle = torch._C._cuda_getCurrentRawStream(idx)
    cache = _local.__dict__.setdefault("streams", {})
    s = cache.get((idx, handle))
    if s is None:
        if len(cache) >= _MAX_CACHED:
            cache.clear()
        s = cache[(idx, handle)] = torch.cuda.current_stream(idx)
    return s


@contextlib.contextmanager
def use(stream: torch.cuda.Stream):
    """``torch.cuda.stream(stream)``: ``stream`` current in the block, the previous current stream
    again after it (for a stream of the current device, the common case, looked up by
    :func:`current`; else through ``torch.cuda.stream``)."""
    if stream.device.index != torch.cuda.current_device():
        with torch.cuda.stream(stream):
            yield stream
        return
    prev = current(stream.device)
    torch.cuda.set_stream(stream)
    try:
        yield stream
    finally:
        torch.cuda.set_stream(prev)
