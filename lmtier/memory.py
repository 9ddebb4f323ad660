"""Host memory for the CPU tier and staging: page-aligned, pinned where CUDA is present.

``HostBuffer`` owns one allocation of exactly ``nbytes`` bytes (no power-of-two rounding as in
torch's caching host allocator). With a CUDA device it is page-locked and mapped
(``cudaHostAlloc(cudaHostAllocPortable | cudaHostAllocMapped)``), so copy engines reach full PCIe
speed and GPU kernels can address it directly (zero-copy). Without one it is plain 4 KiB-aligned
memory (``posix_memalign``), which is what O_DIRECT disk I/O needs.
"""

from __future__ import annotations

import torch

from lmtier import _C

PAGE_BYTES = 4096


class HostBuffer:
    """An owned, page-aligned host allocation.

    Args:
        nbytes: size in bytes (> 0).
        pinned: ``True`` requires page-locked memory (raises ``RuntimeError`` when no CUDA device is
            usable), ``False`` never pins, ``None`` (default) pins when a CUDA device is usable.

    Attributes:
        tensor: ``torch.uint8`` 1-D CPU tensor of ``nbytes`` viewing the memory (shares lifetime:
            keep the ``HostBuffer`` alive while the tensor is used).
        ptr: integer address; ``nbytes``; ``pinned``.
    """

    def __init__(self, nbytes: int, *, pinned: bool | None = None) -> None:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"HostBuffer: nbytes must be a positive int, got {nbytes!r}")
        if pinned is None:
            pinned = _C.cuda_device_count() > 0
        self._buf = _C.HostBuffer(nbytes, bool(pinned))
        self.nbytes = nbytes
        self.pinned = bool(pinned)
        self.ptr = self._buf.ptr
        self.tensor = torch.frombuffer(self._buf, dtype=torch.uint8)

    def view(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 tensor view of ``[offset, offset + nbytes)``; bounds-checked."""
        if nbytes is None:
            nbytes = self.nbytes - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise IndexError(f"HostBuffer.view: [{offset}, {offset + nbytes}) outside [0, {self.nbytes})")
        return self.tensor[offset : offset + nbytes]

    def __repr__(self) -> str:
        return f"HostBuffer(nbytes={self.nbytes}, pinned={self.pinned}, ptr=0x{self.ptr:x})"
