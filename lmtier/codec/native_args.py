"""Arguments of the codec's native calls: buffer addresses, CUDA stream handles, ordering and lifetime.

Shared by :mod:`lmtier.codec.rans` and :mod:`lmtier.codec.native`: the C++ entry points take raw
addresses, byte counts and a ``cudaStream_t``; these helpers get them from NumPy arrays and torch
tensors, upload small host arrays (descriptors, tables) to the device, order a side stream after the
current one and keep uploads alive until the kernels on it finished. torch is imported on first use,
so NumPy-only (CPU) callers never import it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "torch_module",
    "is_torch",
    "is_cuda",
    "addr_len",
    "device_bytes",
    "stream_handle",
    "sync_stream",
    "order_after_current",
    "keep_alive",
]


def torch_module():
    """The ``torch`` module, imported on first use."""
    import torch

    return torch


def is_torch(x: Any) -> bool:
    """Whether ``x`` is a torch object (checked without importing torch)."""
    return type(x).__module__.startswith("torch")


def is_cuda(x: Any) -> bool:
    """Whether ``x`` is a torch tensor on a CUDA device."""
    return is_torch(x) and x.device.type == "cuda"


def addr_len(x: Any) -> tuple[int, int]:
    """(address, bytes) of a contiguous 1-D byte-like NumPy array or torch tensor."""
    if is_torch(x):
        if not x.is_contiguous():
            raise ValueError("tensors must be contiguous")
        return x.data_ptr(), x.numel() * x.element_size()
    a = np.asarray(x)
    if not a.flags.c_contiguous:
        raise ValueError("arrays must be C-contiguous")
    return a.ctypes.data, a.nbytes


def device_bytes(arr: np.ndarray, device: Any):
    """A ``torch.uint8`` tensor on ``device`` holding the bytes of the host array ``arr``, allocated
    and copied on the current stream without waiting for it: the bytes go into page-locked memory
    first (torch's caching host allocator keeps it until the copy ran), so ``arr`` is free again
    when this returns. A pageable ``.to(device)`` would wait for everything queued on the stream."""
    torch = torch_module()
    src = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    host = torch.empty(src.size, dtype=torch.uint8, pin_memory=True)
    host.numpy()[:] = src
    return host.to(device, non_blocking=True)


def stream_handle(stream: Any, device: Any) -> int:
    """The ``cudaStream_t`` of ``stream``: a torch stream, a raw handle (int), or None (the current
    stream of ``device``)."""
    torch = torch_module()
    if stream is None:
        return torch.cuda.current_stream(device).cuda_stream
    if isinstance(stream, int):
        return stream
    return stream.cuda_stream


def sync_stream(stream: Any, device: Any) -> None:
    """Wait for ``stream`` (as :func:`stream_handle` takes it) to finish its work."""
    torch = torch_module()
    if stream is None:
        torch.cuda.current_stream(device).synchronize()
    elif isinstance(stream, int):
        torch.cuda.ExternalStream(stream, device=device).synchronize()
    else:
        stream.synchronize()


def order_after_current(stream: Any, device: Any) -> None:
    """Make ``stream`` wait for the current stream (where the caller produced the inputs and where
    the descriptors are uploaded) — a no-op when they are the same stream."""
    if stream is None:
        return
    torch = torch_module()
    s = torch.cuda.ExternalStream(stream, device=device) if isinstance(stream, int) else stream
    cur = torch.cuda.current_stream(device)
    if s.cuda_stream != cur.cuda_stream:
        s.wait_stream(cur)


def keep_alive(tensors: list[Any], stream: Any, device: Any) -> None:
    """The uploaded descriptor/table tensors were allocated on the current stream; when the kernels
    run on another stream, tell the caching allocator so the memory is not reused before they finish."""
    if stream is None:
        return
    torch = torch_module()
    s = torch.cuda.ExternalStream(stream, device=device) if isinstance(stream, int) else stream
    for t in tensors:
        if t is not None and is_cuda(t):
            t.record_stream(s)
