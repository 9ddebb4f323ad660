"""The current CUDA stream (and device), looked up without building a ``torch.cuda.Stream`` at each call.

``torch.cuda.current_stream`` makes a new Python object every call, entering a device context to do
so; the codec's decode path asks for the stream several times a record while holding the GIL, which
a tier's I/O threads share. :func:`raw` reads the handle alone; :func:`current` hands out one
``Stream`` object per thread and stream, made once.
"""

from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["current", "device", "raw", "use"]

_MAX_CACHED = 64
"""Stream objects one thread keeps (beyond it the thread's cache starts over): a thread meets its own
streams and torch's pool's, a few dozen."""

_local = threading.local()


def _index(device: torch.device | str | int | None) -> int:
    """The CUDA device index ``torch.cuda.current_stream`` takes for ``device`` (its errors too)."""
    torch.cuda.init()  # as torch.cuda.current_stream: CUDA initialized first (a no-op once it is)
    if type(device) is torch.device and device.type == "cuda" and device.index is not None:
        return device.index  # the common case, without torch's checks
    return torch.cuda._utils._get_device_index(device, optional=True)


def raw(device: torch.device | str | int | None = None) -> int:
    """The ``cudaStream_t`` (an int) of the current stream on CUDA ``device`` (None or an index-less
    device: the current device), as ``torch.cuda.current_stream(device).cuda_stream`` gives it."""
    return torch._C._cuda_getCurrentRawStream(_index(device))


def current(device: torch.device | str | int | None = None) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)``: an equal stream (same id, so the same handle), the object
    made once per thread and stream id (an ``ExternalStream`` of a pool stream's handle has an id of
    its own, as in torch).

    Raises:
        RuntimeError, AssertionError, ValueError: as ``torch.cuda.current_stream`` (no CUDA, a bad
            index, a device that is not CUDA)."""
    key = torch._C._cuda_getCurrentStream(_index(device))  # (stream id, device index, device type)
    cache = _local.__dict__.setdefault("streams", {})
    s = cache.get(key)
    if s is None:
        if len(cache) >= _MAX_CACHED:
            cache.clear()
        s = cache[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return s


def device(dev: torch.device):
    """``torch.cuda.device(dev)``, or nothing when ``dev`` (an indexed CUDA device) is current already:
    torch's context switches the device in and out even then."""
    return contextlib.nullcontext() if torch.cuda.current_device() == dev.index else torch.cuda.device(dev)


@contextlib.contextmanager
def use(stream: torch.cuda.Stream | None):
    """``torch.cuda.stream(stream)``: ``stream`` current in the block, the previous current stream
    again after it (for a stream of the current device, the common case, looked up by
    :func:`current`; else through ``torch.cuda.stream``); None: nothing changes."""
    if stream is None or stream.device.index != torch.cuda.current_device():
        with torch.cuda.stream(stream):
            yield stream
        return
    prev = current(stream.device)
    torch.cuda.set_stream(stream)
    try:
        yield stream
    finally:
        torch.cuda.set_stream(prev)
