"""The PCA levels' transform on CUDA with lmtier's fused kernels (``csrc/pca_cuda.cu``) around the
int8 GEMMs of :mod:`.imatmul`: the bits of :mod:`.transform`'s torch arithmetic, in five kernel
launches and ``2R`` GEMMs per chunk instead of dozens of float64 passes. Layouts and rules:
``csrc/include/lmtier/pca.h``. Used by :mod:`.codec` for CUDA chunks when the extension was built
with CUDA (:func:`available`); otherwise the torch path of :mod:`.transform` runs there.
"""

from __future__ import annotations

import torch

from . import imatmul, rope, streams
from . import transform as tf
from .model import PCAModel

__all__ = ["available", "encode", "decode"]


def _native():
    from lmtier import _C

    return getattr(_C, "pca", None)


def available() -> bool:
    """True when the compiled extension has the PCA CUDA kernels."""
    try:
        return _native() is not None
    except ImportError:
        return False


def _dtype_code(c, dtype: torch.dtype) -> int:
    """The kernels' element type code (``DTYPE_BF16`` / ``DTYPE_FP16`` of ``lmtier._C.pca``)."""
    return {torch.bfloat16: c.DTYPE_BF16, torch.float16: c.DTYPE_FP16}[dtype]


def _geom(m: PCAModel, t: int) -> tuple[int, int, int, int, int]:
    return m.num_layers, t, m.num_heads, m.head_size, m.layer_group


def _rope(m: PCAModel, start: int, t: int, dev: torch.device) -> tuple[torch.Tensor | None, ...]:
    return (None, None) if m.inv_freq is None else rope.cos_sin(m.inv_freq, start, t, dev)


def _ptr(x: torch.Tensor | None) -> int:
    return 0 if x is None else x.data_ptr()


def _gemms(a: torch.Tensor, b: imatmul.SplitMatrix, out: torch.Tensor) -> None:
    """``out[i] = a[i] @ [hi | lo]`` of matrix ``i`` (int8 -> int32) for every batch entry."""
    for i in range(a.shape[0]):
        if a.shape[1] > 16:
            torch._int_mm(a[i], b.operand(i), out=out[i])
        else:  # the CUDA GEMM needs more than 16 rows
            out[i].copy_(imatmul._int_mm(a[i], b.operand(i)))


def _level(x: torch.Tensor, shape: tuple[int, ...], what: str, dev: torch.device) -> torch.Tensor:
    """A level array as contiguous float64 on ``dev``, its shape checked (the kernels read it raw)."""
    if tuple(x.shape) != shape:
        raise ValueError(f"{what} of shape {tuple(x.shape)}, the PCA model needs {shape}")
    return x.to(device=dev, dtype=torch.float64).contiguous()


def encode(
    m: PCAModel, kv: torch.Tensor, start: int, k: torch.Tensor, energy_threshold: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symbols, exact tokens and escaped values of a CUDA chunk, as :mod:`.codec` stores them.

    Args:
        kv: canonical ``[L, 2, T, H, D]`` bf16/fp16 on a CUDA device (finite; checked by the caller).
        start: its first position. k: ``[R, 2, N]``, energy_threshold: ``[R, 2]``
            (:class:`~.model.PCALevelData`; moved to the chunk's device as float64).

    Raises:
        ValueError: ``k`` or ``energy_threshold`` of another shape.

    Returns:
        (uint8 ``[R, 2, N, T32]`` symbols (``T32``: ``T`` rounded up to 32), bool ``[T]`` exact
        tokens, int16 escaped coefficients in stream order), all on the device: what
        :func:`.transform.forward` and :func:`.transform.symbols` give, bit for bit.
    """
    dev = kv.device
    r, t, n = m.rows, kv.shape[2], m.vector_size
    kk = _level(k, (r, 2, n), "k", dev)
    thr = _level(energy_threshold, (r, 2), "energy_threshold", dev)
    if t == 0:
        e = torch.empty(0, dtype=torch.int16, device=dev)
        return torch.empty(r, 2, n, 0, dtype=torch.uint8, device=dev), torch.empty(0, dtype=torch.bool, device=dev), e
    with torch.cuda.device(dev):
        return _encode(m, kv.contiguous(), start, kk, thr)


def _encode(m: PCAModel, kv: torch.Tensor, start: int, kk: torch.Tensor, energy_threshold: torch.Tensor):
    c = _native()
    dev = kv.device
    enc = imatmul.prepared(m, dev)[0]
    r, t, n, n8 = m.rows, kv.shape[2], m.vector_size, enc.n8
    t32 = streams.run_length(t)
    geom = _geom(m, t)
    inv_sx, e_mu, _ = tf.vectors(m, str(dev))
    cos, sin = _rope(m, start, t, dev)
    s = torch.cuda.current_stream(dev).cuda_stream
    xs = torch.empty(r * 2, 2 * t, n8, dtype=torch.int8, device=dev)
    rowsum = torch.empty(r, 2, t, dtype=torch.int64, device=dev)
    flags = torch.zeros(2, t, dtype=torch.int32, device=dev)  # [clamped, big]
    c.encode_pre(_dtype_code(c, kv.dtype), *geom, kv.data_ptr(), _ptr(cos), _ptr(sin), inv_sx.data_ptr(),
                 xs.data_ptr(), rowsum.data_ptr(), flags[0].data_ptr(), s)  # fmt: skip
    y = torch.empty(r * 2, 2 * t, 2 * n8, dtype=torch.int32, device=dev)
    _gemms(xs, enc, y)
    q = torch.empty(r, 2, t, n, dtype=torch.int16, device=dev)
    energy = torch.empty(r, 2, t, dtype=torch.int64, device=dev)
    c.encode_post(*geom, y.data_ptr(), enc.col.data_ptr(), rowsum.data_ptr(), e_mu.data_ptr(), kk.data_ptr(),
                  q.data_ptr(), energy.data_ptr(), flags[1].data_ptr(), s)  # fmt: skip
    exact = flags.bool().any(0) | (torch.arange(start, start + t, device=dev) < m.exact_first)
    exact |= tf.loud(energy.double(), energy_threshold)
    sym = torch.empty(r, 2, n, t32, dtype=torch.uint8, device=dev)
    c.encode_symbols(*geom, t32, q.data_ptr(), exact.to(torch.uint8).data_ptr(), sym.data_ptr(), s)
    escapes = q.transpose(2, 3)[sym[..., :t] == tf.ESCAPE]
    return sym, exact, escapes


def decode(
    m: PCAModel, sym: torch.Tensor, escapes: torch.Tensor, f: torch.Tensor, start: int, dtype: torch.dtype
) -> torch.Tensor:
    """Decoded chunk of symbols on a CUDA device (exact tokens come out as the mean; the caller
    overwrites them), bit for bit :func:`.transform.inverse` of the same coefficients.

    Args:
        sym: uint8 ``[R, 2, N, T]`` (a view of the padded streams is fine); escapes: the escaped
            coefficients (any integer dtype, stream order); f: ``[R, 2, N]``; start: the chunk's
            first position; dtype: bf16 or fp16.

    Returns:
        ``dtype`` ``[L, 2, T, H, D]`` on the device.

    Raises:
        ValueError: ``sym`` or ``f`` of another shape.
    """
    dev = sym.device
    r, t, n = m.rows, sym.shape[3], m.vector_size
    if tuple(sym.shape) != (r, 2, n, t):
        raise ValueError(f"symbols of shape {tuple(sym.shape)}, the PCA model needs [{r}, 2, {n}, T]")
    ff = _level(f, (r, 2, n), "f", dev)
    if t == 0:
        return torch.empty(m.num_layers, 2, 0, m.num_heads, m.head_size, dtype=dtype, device=dev)
    with torch.cuda.device(dev):
        return _decode(m, sym, escapes.to(dev), ff, start, dtype)


def _decode(
    m: PCAModel, sym: torch.Tensor, escapes: torch.Tensor, ff: torch.Tensor, start: int, dtype: torch.dtype
) -> torch.Tensor:
    c = _native()
    dev = sym.device
    dec = imatmul.prepared(m, dev)[1]
    r, t, n, n8 = m.rows, sym.shape[3], m.vector_size, dec.n8
    geom = _geom(m, t)
    _, _, mu = tf.vectors(m, str(dev))
    s = torch.cuda.current_stream(dev).cuda_stream
    esc = sym == tf.ESCAPE
    qt = (sym.to(torch.int16) - tf.OFFSET).contiguous()  # the kernel reads [R, 2, N, T] raw
    qt[esc] = escapes.to(torch.int16)
    lo = torch.empty(r * 2, t, n8, dtype=torch.int8, device=dev)
    rowsum = torch.empty(r, 2, t, dtype=torch.int64, device=dev)
    c.decode_pre(*geom, qt.data_ptr(), lo.data_ptr(), rowsum.data_ptr(), s)
    y = torch.empty(r * 2, t, 2 * n8, dtype=torch.int32, device=dev)
    _gemms(lo, dec, y)
    # escaped coefficients beyond int8: hi8(q) = (q - lo8(q)) / 256, added per row (r, p, t) in CSR
    hi = imatmul.split8(escapes)[1]
    rp, j, tok = torch.nonzero(esc.reshape(r * 2, n, t), as_tuple=True)
    keep = hi != 0
    rows, cols, his = rp[keep] * t + tok[keep], j[keep], hi[keep]
    order = torch.argsort(rows, stable=True)
    esc_col, esc_hi = cols[order].to(torch.int32).contiguous(), his[order].to(torch.int32).contiguous()
    esc_row = torch.zeros(r * 2 * t + 1, dtype=torch.int32, device=dev)
    esc_row[1:] = torch.bincount(rows, minlength=r * 2 * t).cumsum(0)
    cos, sin = _rope(m, start, t, dev)
    out = torch.empty(m.num_layers, 2, t, m.num_heads, m.head_size, dtype=dtype, device=dev)
    c.decode_post(_dtype_code(c, dtype), *geom, y.data_ptr(), rowsum.data_ptr(), esc_row.data_ptr(), esc_col.data_ptr(),
                  esc_hi.data_ptr(), dec.cat_t.data_ptr(), ff.data_ptr(), mu.data_ptr(), _ptr(cos), _ptr(sin),
                  out.data_ptr(), s)  # fmt: skip
    return out
