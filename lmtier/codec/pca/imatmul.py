"""Exact integer matrix products of the PCA transform on int8 tensor cores (CUDA).

A 16-bit integer ``v`` in ``[-32768, 32767]`` is written in two signed bytes,
``v = 256 * hi + lo + 128`` with ``hi = floor(v / 256)`` and ``lo = (v mod 256) - 128``, both in
``[-128, 127]``. Then, for ``x`` ``[M, N]`` and ``a`` ``[N, P]`` of 16-bit integers::

    x @ a = 65536 * xh @ ah + 256 * (xh @ al + xl @ ah) + xl @ al
            + 128 * (colsum(a) - 128 * N) + 128 * rowsum(x)

with every int8 product accumulated in int32 (``|sum| <= 128**2 * N < 2**31`` for
``N <=`` :data:`~.model.MAX_VECTOR_SIZE`) and the terms combined in int64: the same integers as the
CPU reference's float64 GEMM (exact there because every partial sum is an integer below 2**53). The
decoder's left operand is mostly small: ``q = lo8(q) + 256 * hi8(q)`` with ``lo8(q)`` in int8 and
``hi8(q)`` non-zero only on the rare escaped coefficients, added row by row.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from lmtier import cuda_streams

__all__ = ["SplitMatrix", "split16", "split8", "pad8", "split_matrix", "matmul", "matmul_small", "prepared"]

_MIN_ROWS = 32
"""``torch._int_mm`` on CUDA needs more than 16 rows; smaller operands are padded to this many."""
_ESC_BATCH = 1 << 12
"""Escaped coefficients added per step of :func:`matmul_small` (bounds its int64 scratch)."""


def split16(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``hi``, ``lo``) int8 of integers ``v`` (any integer dtype, values in ``[-32768, 32767]``):
    ``v = 256 * hi + lo + 128``."""
    v = v.to(torch.int32)
    return torch.bitwise_right_shift(v, 8).to(torch.int8), (torch.bitwise_and(v, 255) - 128).to(torch.int8)


def split8(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``lo8`` int8, ``hi8`` int32) of integers ``q`` (any integer dtype, ``|q| <= 32767``):
    ``q = lo8 + 256 * hi8`` with ``lo8`` in ``[-128, 127]``; ``hi8`` is 0 for ``q`` in that range."""
    qi = q.to(torch.int32)
    lo = (torch.bitwise_and(qi + 128, 255) - 128).to(torch.int8)
    return lo, torch.bitwise_right_shift(qi - lo, 8)


@dataclass(frozen=True)
class SplitMatrix:
    """A 16-bit integer matrix ``a`` ``[B, N, P]`` prepared for :func:`matmul` on one device, zero
    padded to ``N8``, ``P8`` (multiples of 8, the int8 GEMM's rule; zeros change no product).

    Attributes:
        n, p: ``N``, ``P`` of ``a``.
        cat_t: int8 ``[B, 2 * P8, N8]``: ``[hi | lo]`` of :func:`split16` along the columns,
            stored transposed (row ``c`` is column ``c`` of ``[hi | lo]``), so that the GEMM's right
            operand :meth:`operand` is column-major: the layout cuBLASLt's int8 kernels take on
            every architecture (row-major by column-major, "TN").
        col: int64 ``[B, P8]``: ``128 * (colsum(a) - 128 * N8)``.
    """

    n: int
    p: int
    cat_t: torch.Tensor
    col: torch.Tensor

    @property
    def p8(self) -> int:
        return self.cat_t.shape[1] // 2

    @property
    def n8(self) -> int:
        return self.cat_t.shape[2]

    def operand(self, i: int) -> torch.Tensor:
        """int8 ``[N8, 2 * P8]`` column-major view: ``[hi | lo]`` of matrix ``i``."""
        return self.cat_t[i].t()

    def rows(self, b: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """int64 ``[K, P]``: rows ``j`` of matrices ``b`` (``[K]`` indices each) of ``a``, rebuilt from
        their bytes (``256 * hi + lo + 128``)."""
        c = self.cat_t[b, :, j].to(torch.int64)  # [K, 2 P8]
        return c[:, : self.p] * 256 + c[:, self.p8 : self.p8 + self.p] + 128


def pad8(v: int) -> int:
    """``v`` rounded up to a multiple of 8 (the int8 GEMM's size rule)."""
    return -(-v // 8) * 8


def split_matrix(a: np.ndarray | torch.Tensor, device: torch.device | str) -> SplitMatrix:
    """:class:`SplitMatrix` of int16 ``a`` ``[..., N, P]`` (leading dims flattened into ``B``) on
    ``device``. Raises ValueError for fewer than 2 dims."""
    t = torch.as_tensor(a)
    if t.dim() < 2:
        raise ValueError(f"split_matrix needs a matrix, got shape {tuple(t.shape)}")
    n, p = t.shape[-2:]
    t = t.reshape(-1, n, p).to(device=device, dtype=torch.int32)
    n8, p8 = pad8(n), pad8(p)
    tp = torch.nn.functional.pad(t, (0, p8 - p, 0, n8 - n))
    hi, lo = split16(tp)
    col = 128 * (tp.sum(1, dtype=torch.int64) - 128 * n8)
    return SplitMatrix(n, p, torch.cat([hi, lo], 2).transpose(1, 2).contiguous(), col)


def _int_mm(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """int32 ``x @ a`` of int8 ``x`` ``[M, N8]`` and ``a`` ``[N8, Q]`` (:meth:`SplitMatrix.operand`;
    rows padded for the CUDA GEMM)."""
    m = x.shape[0]
    if m < _MIN_ROWS:
        x = torch.cat([x, x.new_zeros(_MIN_ROWS - m, x.shape[1])])
    return torch._int_mm(x.contiguous(), a)[:m]


def matmul(x: torch.Tensor, a: SplitMatrix) -> torch.Tensor:
    """Exact int64 ``x @ a`` of integers ``x`` ``[B, M, N]`` in ``[-32768, 32767]`` (any integer or
    integer-valued float dtype, on ``a``'s device) and a :class:`SplitMatrix` ``[B, N, P]``.
    Four int8 products per batch entry, as one GEMM of ``[xh; xl]`` by ``[ah | al]``."""
    b, m, n = x.shape
    _check(x, a)
    xi = torch.nn.functional.pad(x.to(torch.int32), (0, a.n8 - n))
    xh, xl = split16(xi)
    rows = 128 * xi.sum(-1, dtype=torch.int64)
    p, p8 = a.p, a.p8
    out = torch.empty(b, m, p, dtype=torch.int64, device=x.device)
    for i in range(b):
        y = _int_mm(torch.cat([xh[i], xl[i]]), a.operand(i)).to(torch.int64)  # [2M, 2 P8]
        hh, hl, lh, ll = y[:m, :p], y[:m, p8 : p8 + p], y[m:, :p], y[m:, p8 : p8 + p]
        out[i] = (hh * 65536).add_((hl + lh) * 256).add_(ll).add_(a.col[i, :p]).add_(rows[i][:, None])
    return out


def _check(x: torch.Tensor, a: SplitMatrix) -> None:
    if x.dim() != 3 or (x.shape[0], x.shape[2]) != (a.cat_t.shape[0], a.n):
        raise ValueError(f"matmul of {tuple(x.shape)} by {a.cat_t.shape[0]} split matrices of {a.n} x {a.p}")


def matmul_small(q: torch.Tensor, a: SplitMatrix) -> torch.Tensor:
    """:func:`matmul` for a left operand that is mostly in ``[-128, 127]`` (the decoder's
    coefficients): one int8 GEMM by ``[ah | al]`` for ``lo8(q)``, then ``256 * hi8(q)`` row by row
    for the rest (:meth:`SplitMatrix.rows`)."""
    b, m, n = q.shape
    _check(q, a)
    lo, hi = split8(q)
    rows = 128 * lo.sum(-1, dtype=torch.int64)
    lo = torch.nn.functional.pad(lo, (0, a.n8 - n))
    p, p8 = a.p, a.p8
    out = torch.empty(b, m, p, dtype=torch.int64, device=q.device)
    for i in range(b):
        y = _int_mm(lo[i], a.operand(i)).to(torch.int64)  # [M, 2 P8]
        out[i] = (y[:, :p] * 256).add_(y[:, p8 : p8 + p]).add_(rows[i][:, None])
    bi, ri, ci = torch.nonzero(hi, as_tuple=True)
    for s in range(0, bi.numel(), _ESC_BATCH):
        sb, sr, sc = bi[s : s + _ESC_BATCH], ri[s : s + _ESC_BATCH], ci[s : s + _ESC_BATCH]
        add = a.rows(sb, sc) * (256 * hi[sb, sr, sc].to(torch.int64))[:, None]
        out.view(b * m, p).index_add_(0, sb * m + sr, add)
    return out


def settled(device: torch.device | str) -> None:
    """Block until the current stream of a CUDA ``device`` ran the work queued on it (the host: no-op).
    Called by the caches of device tensors (the model's matrices and vectors) before they hand a tensor
    out: other threads read it on their own streams, which do not wait for the creating one."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def in_use(*tensors: torch.Tensor) -> None:
    """Mark cached CUDA tensors as read by the current stream of their device (host tensors: no-op):
    when a cache drops one and its last reference goes, the caching allocator reuses the memory only
    after the work queued so far on that stream ran, not merely the creating stream's.

    A tensor is marked once per stream and memory (the allocator keeps a block's streams until the
    block is freed, so marking again adds nothing): each tensor remembers the stream handles it was
    marked for with the address they were marked at (a copy by ``deepcopy`` or ``pickle``, or memory
    swapped by ``set_``, has another address and is marked again), and the current stream is looked
    up once per device of the call. This runs at every decode and holds the GIL, which a tier's I/O
    threads share."""
    dev = handle = None
    for t in tensors:
        if not t.is_cuda:
            continue
        if handle is None or dev != t.device:
            dev, handle = t.device, cuda_streams.raw(t.device)
        at, marked = getattr(t, "_lmtier_streams", (None, None))
        if at != t.data_ptr():
            at, marked = t.data_ptr(), set()
            t._lmtier_streams = (at, marked)
        if handle not in marked:
            t.record_stream(cuda_streams.current(dev))
            marked.add(handle)


def device_key(device: torch.device | str) -> str:
    """The cache key of a device: ``"cpu"``, or ``"cuda:<index>"`` with the current device's index
    for a bare ``"cuda"`` (one entry per GPU, whichever way it was named)."""
    key = _KEYS.get(device)
    if key is not None:
        return key
    dev = torch.device(device)
    if dev.type != "cuda" or dev.index is not None:  # names one device whatever the current one
        key = str(dev)
        if len(_KEYS) < 64:
            _KEYS[device] = key
        return key
    return str(torch.device("cuda", torch.cuda.current_device()))


_KEYS: dict[torch.device | str, str] = {}
""":func:`device_key` of the devices and names that fix one device (not a bare ``"cuda"``)."""


@lru_cache(maxsize=4)
def _prepared(m: object, device: str) -> tuple[SplitMatrix, SplitMatrix]:
    got = split_matrix(m.e_int, device), split_matrix(m.d_int, device)
    settled(device)
    return got


def prepared(m: object, device: torch.device) -> tuple[SplitMatrix, SplitMatrix]:
    """(encode, decode) :class:`SplitMatrix` of a :class:`~.model.PCAModel`'s ``e_int``, ``d_int``
    on ``device`` (cached per model object and device; marked :func:`in_use` by the current stream)."""
    got = _prepared(m, device_key(device))
    for a in got:
        in_use(a.cat_t, a.col)
    return got
