"""Streams given as byte ranges of a few contiguous buffers: the rANS encoder's input without one
tensor object per stream.

A chunk's streams (one per layer and K/V plane, plus its scale codes) are regular slices of the
quantizer's two output buffers. Cutting them with torch costs two or three tensor calls per stream,
and every torch call from a background thread hands the GIL over: behind an engine thread that
keeps the GIL busy each hand-off waits up to ``sys.getswitchinterval()`` (5 ms).
:class:`Spans` describes the same streams with one address lookup per buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .native_args import is_torch as _is_torch

__all__ = ["Spans"]


def _buffer_addr(x: Any, i: int) -> tuple[int, int, Any]:
    """(address, bytes, device or None for host memory) of a contiguous byte buffer (a torch tensor
    or a NumPy array: :class:`Spans` converts anything else once and keeps the array it reads)."""
    if _is_torch(x):
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"Spans: buffer {i} is on {x.device}, not in host memory or on a CUDA device")
        if not x.is_contiguous():
            raise ValueError(f"Spans: buffer {i} is not contiguous")
        if x.element_size() != 1:
            raise ValueError(f"Spans: buffer {i} must hold bytes (uint8), got {x.dtype}")
        return x.data_ptr(), x.numel(), (x.device if x.device.type == "cuda" else None)
    a = x
    if not a.flags.c_contiguous:
        raise ValueError(f"Spans: buffer {i} is not C-contiguous")
    if a.dtype.itemsize != 1:
        raise ValueError(f"Spans: buffer {i} must hold bytes (uint8), got {a.dtype}")
    return a.ctypes.data, a.nbytes, None


@dataclass(frozen=True, eq=False)
class Spans:
    """N streams of uint8 symbols, stream ``i`` = bytes ``[offset[i], offset[i] + nbytes[i])`` of
    ``buffers[index[i]]`` (what :func:`lmtier.codec.rans.encode` / ``encode_into`` take in place
    of a sequence of N arrays or tensors; the bytes it codes are the same).

    Args:
        buffers: contiguous byte buffers (``uint8`` NumPy arrays or torch tensors; anything else
            is converted with ``np.asarray`` and the converted array kept), all in host memory or all
            on one CUDA device; referenced for as long as the spans live.
        index: ``[N]`` ints, the buffer of each stream.
        offset: ``[N]`` ints, each stream's byte offset in its buffer.
        nbytes: ``[N]`` ints, each stream's length in bytes (= symbols).

    Raises:
        ValueError: lengths of ``index`` / ``offset`` / ``nbytes`` differ; a buffer index out of
            range; a negative offset or length; a range past its buffer's end; a buffer that is not
            contiguous or not of bytes; buffers on different devices or a tensor on a device other
            than the CPU or CUDA.

    Spans compare by identity (``==`` is ``is``).
    """

    buffers: tuple[Any, ...]
    index: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    _addr: np.ndarray = field(init=False, repr=False, compare=False)
    device: Any = field(init=False, compare=False)
    """The buffers' CUDA device, or None for host memory."""

    def __post_init__(self) -> None:
        # the arrays whose addresses are taken are the ones kept (np.asarray of a list is a copy)
        bufs = tuple(b if _is_torch(b) or isinstance(b, np.ndarray) else np.asarray(b) for b in self.buffers)
        index = np.asarray(self.index, np.int64).reshape(-1)
        offset = np.asarray(self.offset, np.int64).reshape(-1)
        nbytes = np.asarray(self.nbytes, np.int64).reshape(-1)
        if not (index.size == offset.size == nbytes.size):
            raise ValueError(f"Spans: index/offset/nbytes have {index.size}/{offset.size}/{nbytes.size} entries")
        if not bufs:
            if index.size:
                raise ValueError("Spans: streams given without buffers")
            addr, devices = np.zeros(0, np.int64), [None]
        else:
            info = [_buffer_addr(b, i) for i, b in enumerate(bufs)]
            devices = [d for _, _, d in info]
            if any(str(d) != str(devices[0]) for d in devices):
                raise ValueError(f"Spans: buffers on different devices ({sorted({str(d) for d in devices})})")
            addr = np.array([a for a, _, _ in info], np.int64)
            size = np.array([n for _, n, _ in info], np.int64)
            if index.size:
                if index.min() < 0 or index.max() >= len(bufs):
                    raise ValueError(f"Spans: buffer index out of [0, {len(bufs)})")
                if offset.min() < 0 or nbytes.min() < 0:
                    raise ValueError("Spans: negative offset or length")
                past = np.flatnonzero(offset + nbytes > size[index])
                if past.size:
                    i = int(past[0])
                    raise ValueError(
                        f"Spans: stream {i} ([{offset[i]}, {offset[i] + nbytes[i]})) runs past the end of buffer "
                        f"{index[i]} ({size[index[i]]} bytes)"
                    )
        object.__setattr__(self, "buffers", bufs)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "nbytes", nbytes)
        object.__setattr__(self, "_addr", addr)
        object.__setattr__(self, "device", devices[0])

    def __len__(self) -> int:
        return int(self.index.size)

    @property
    def on_cuda(self) -> bool:
        """Whether the buffers are on a CUDA device."""
        return self.device is not None

    def addresses(self) -> np.ndarray:
        """Each stream's start address (int64 ``[N]``)."""
        return self._addr[self.index] + self.offset if len(self) else np.zeros(0, np.int64)

    @classmethod
    def of_planes(cls, sym: Any, side: Any, num_layers: int, side_per_layer: int) -> Spans:
        """A codec chunk's streams in record order: per layer, its K and V symbol planes (``sym``
        ``[L, 2, ...]`` cut in ``2 L`` equal parts), then its ``side_per_layer`` equal parts of the
        side buffer (``side`` cut in ``L * side_per_layer`` parts).

        Raises:
            ValueError: a buffer's size is not a multiple of its part count (and the above).
        """
        nl, k = int(num_layers), int(side_per_layer)
        sym_n, side_n = _nbytes(sym), _nbytes(side)
        if nl < 1 or k < 1 or sym_n % (2 * nl) or side_n % (nl * k):
            raise ValueError(
                f"Spans.of_planes: {sym_n} symbol bytes / {side_n} side bytes do not split into "
                f"{2 * nl} planes / {nl * k} side parts"
            )
        p, q = sym_n // (2 * nl), side_n // (nl * k)
        layer = np.arange(nl, dtype=np.int64)[:, None]
        index = np.broadcast_to(np.array([0, 0] + [1] * k, np.int64), (nl, 2 + k))
        offset = np.concatenate([(2 * layer + np.arange(2)) * p, (k * layer + np.arange(k)) * q], axis=1)
        nbytes = np.broadcast_to(np.array([p, p] + [q] * k, np.int64), (nl, 2 + k))
        return cls((_flat(sym), _flat(side)), index.reshape(-1), offset.reshape(-1), nbytes.reshape(-1))


def _nbytes(x: Any) -> int:
    return x.numel() * x.element_size() if _is_torch(x) else np.asarray(x).nbytes


def _flat(x: Any) -> Any:
    """``x`` as the flat byte buffer :class:`Spans` checks (a view when it is contiguous)."""
    if _is_torch(x):
        return x if x.dim() == 1 else x.reshape(-1)
    return np.asarray(x).reshape(-1)
