"""The PCA levels' transform on CUDA with lmtier's fused kernels (``csrc/pca_cuda.cu``) around the
int8 GEMMs of :mod:`.imatmul`: the bits of :mod:`.transform`'s torch arithmetic, per batch of layer
groups two fused kernels around one batched cuBLAS GEMM call, instead of dozens of float64 passes. Layouts and rules:
``csrc/include/lmtier/pca.h``. Used by :mod:`.codec` for CUDA chunks when the extension was built
with CUDA (:func:`available`); otherwise the torch path of :mod:`.transform` runs there.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import NamedTuple

import torch

from lmtier import cuda_streams
from lmtier.codec.chunk import CodecRecordError
from lmtier.codec.quant import CodecInputError

from . import imatmul, rope, streams
from . import transform as tf
from .model import PCAModel

__all__ = [
    "available",
    "encode",
    "encode_queued",
    "QueuedSymbols",
    "decode",
    "queue_decode",
    "EscapeCountError",
    "GEMM_BYTES",
    "gemm_stats",
]

log = logging.getLogger(__name__)

GEMM_BYTES = 64 << 20
"""Device memory the int8 GEMMs' int32 outputs of one call take at most: a chunk's ``2R`` GEMMs run in
batches of layer groups (:func:`_slices`; an 8B model's 256-token chunk at G = 1: 4 batches of 16 GEMMs
to encode, 2 of 32 to decode), each batch one cuBLAS call, so several chunks in flight on the I/O
threads never hold the whole chunk's outputs (268 MB to encode)."""
GEMM_WORKSPACE = 32 << 20
"""cuBLAS workspace bytes of one batched GEMM call (cuBLAS advises 32 MiB on Hopper): from torch's
caching allocator on the caller's stream (counted by torch, private to the call), never cuBLAS's own
pool."""
_ROPE_CACHE = 64
"""RoPE tables kept per process (``2 T D`` float64 each: 0.5 MB at T = 256, D = 128): a served prefix's
chunks start at the same few positions (0, 256, ...), and computing a table costs the host ~0.5 ms."""


class EscapeCountError(CodecRecordError):
    """A chunk's escape symbols and its escaped coefficients do not match in number (a corrupted
    record): ``found`` symbols, ``given`` coefficients."""

    def __init__(self, found: int, given: int) -> None:
        super().__init__(f"{found} escape symbols, {given} escaped coefficients given")
        self.found, self.given = found, given


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


@lru_cache(maxsize=_ROPE_CACHE)
def _rope_cached(m: PCAModel, start: int, t: int, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    return rope.cos_sin(m.inv_freq, start, t, dev)


def _rope(m: PCAModel, start: int, t: int, dev: torch.device) -> tuple[torch.Tensor | None, ...]:
    """The cached RoPE tables (read only), their memory kept until the current stream's readers ran
    (a table dropped from the cache while a kernel on another stream still reads it)."""
    if m.inv_freq is None:
        return None, None
    cos, sin = _rope_cached(m, int(start), t, str(dev))
    imatmul.in_use(cos, sin)
    return cos, sin


def _ptr(x: torch.Tensor | None) -> int:
    return 0 if x is None else x.data_ptr()


def _gemm(a: torch.Tensor, b: imatmul.SplitMatrix, out: torch.Tensor, i: int) -> None:
    """``out[i] = a[i] @ [hi | lo]`` of matrix ``i`` (int8 -> int32), one ``torch._int_mm``."""
    if a.shape[1] > 16:
        torch._int_mm(a[i], b.operand(i), out=out[i])
    else:  # the CUDA GEMM needs more than 16 rows
        out[i].copy_(imatmul._int_mm(a[i], b.operand(i)))


_stats = {"batched": 0, "eager": 0, "refused": 0}
_decode_paths = {"symbols": 0, "int16": 0, "fused": 0}
_cublas: list[bool | None] = [None]
"""Whether ``lmtier._C.pca.bgemm_s8`` found cuBLAS (checked at the first GEMM: torch has loaded it by
then); without it every GEMM runs one by one."""


def cublas_found() -> bool:
    """Whether ``lmtier._C.pca.bgemm_s8`` finds cuBLAS (probed once, at the first GEMM: torch has loaded
    it by then; logged when not found)."""
    if _cublas[0] is None:
        c = _native()
        _cublas[0] = not c.cublas_library().startswith("none")
        if not _cublas[0]:
            log.warning("lmtier: PCA GEMMs run one by one (%s)", c.cublas_library())
    return bool(_cublas[0])


def gemm_stats() -> dict[str, int]:
    """Counts of the GEMM batches run as one cuBLAS call (``batched``), one by one (``eager``: no cuBLAS
    found, or a call cuBLAS refused, counted in ``refused`` too)."""
    return dict(_stats)


def decode_stats() -> dict[str, int]:
    """Counts of the CUDA decodes that read the uint8 symbols in place (``symbols``:
    ``decode_pre_symbols``, a chunk without escapes; ``fused``: those of them queued by one native call,
    :mod:`.native_decode`) or an int16 copy with the escapes filled in (``int16``)."""
    return dict(_decode_paths)


def _gemms(a: torch.Tensor, b: imatmul.SplitMatrix, lo: int, out: torch.Tensor) -> None:
    """``out[i] = a[i] @ [hi | lo]`` of matrix ``lo + i`` of ``b`` for every ``i`` (int8 ``a`` ``[B', M, N8]``
    -> int32 ``out`` ``[B', M, 2 P8]``, both contiguous on ``b``'s device) on the current stream: one
    batched cuBLAS call (``lmtier._C.pca.bgemm_s8``: all the GEMMs spread over the SMs at once), or,
    where cuBLAS is not found or refuses the call, ``torch._int_mm`` per matrix (the same integers: each
    product is exact)."""
    nb, c = a.shape[0], _native()
    if cublas_found():
        ws = torch.empty(GEMM_WORKSPACE, dtype=torch.uint8, device=a.device)  # this call's, stream-ordered
        try:
            with torch.cuda.device(a.device):  # bgemm_s8 picks its cuBLAS handle by the current device
                c.bgemm_s8(nb, a.shape[1], b.n8, 2 * b.p8, a.data_ptr(), b.cat_t[lo].data_ptr(), out.data_ptr(),
                           ws.data_ptr(), GEMM_WORKSPACE, torch.cuda.current_stream(a.device).cuda_stream)  # fmt: skip
            _stats["batched"] += 1
            return
        except RuntimeError as e:
            if not _stats["refused"]:
                log.warning("lmtier: a batch of PCA GEMMs runs one by one (cuBLAS refused it: %s)", e)
            _stats["refused"] += 1
    _stats["eager"] += 1
    sub = imatmul.SplitMatrix(b.n, b.p, b.cat_t[lo : lo + nb], b.col[lo : lo + nb])
    for i in range(nb):
        _gemm(a, sub, out, i)


def _slices(r: int, rows: int, p8: int):
    """``(r0, r1)`` ranges of layer groups whose GEMM outputs (``2 (r1 - r0)`` int32 ``[rows, 2 P8]``)
    take at most :data:`GEMM_BYTES` (one group at least): the transient device memory of a chunk's
    transform stays bounded whatever the model."""
    step = max(1, GEMM_BYTES // (2 * rows * 2 * p8 * 4))
    return [(r0, min(r, r0 + step)) for r0 in range(0, r, step)]


def _level(x: torch.Tensor, shape: tuple[int, ...], what: str, dev: torch.device) -> torch.Tensor:
    """A level array as contiguous float64 on ``dev``, its shape checked (the kernels read it raw)."""
    if tuple(x.shape) != shape:
        raise ValueError(f"{what} of shape {tuple(x.shape)}, the PCA model needs {shape}")
    return x.to(device=dev, dtype=torch.float64).contiguous()


class QueuedSymbols(NamedTuple):
    """A CUDA chunk's symbols queued on the current stream by :func:`encode_queued` (nothing read back
    yet): what :func:`encode` returns once the host knows two counts (:attr:`head`)."""

    sym: torch.Tensor
    """uint8 ``[R, 2, N, T32]`` symbols (``T32``: ``T`` rounded up to 32)."""
    exact: torch.Tensor
    """bool ``[T]``: the tokens stored exact."""
    q: torch.Tensor
    """int16 ``[R, 2, T, N]`` coefficients (the escaped ones are read from it)."""
    escaped: torch.Tensor
    """bool ``[R, 2, N, T]``: the escape symbols."""
    head: torch.Tensor
    """int64 ``[2]`` on the device: non-zero if the chunk holds NaN or inf; the escape symbols'
    count."""

    def escapes(self, count: int) -> torch.Tensor:
        """int16 ``[count]``: the escaped coefficients in stream order (``count``: :attr:`head`'s
        second value, read back). No synchronization."""
        if count == 0:
            return torch.empty(0, dtype=torch.int16, device=self.q.device)
        _, _, t, n = self.q.shape
        i = torch.nonzero_static(self.escaped.reshape(-1), size=count).reshape(-1)  # [R, 2, N, T] order
        rp, j, tok = i // (n * t), i // t % n, i % t
        return self.q.reshape(-1).index_select(0, (rp * t + tok) * n + j)  # q is [R, 2, T, N]


def encode_queued(
    m: PCAModel, kv: torch.Tensor, start: int, k: torch.Tensor, energy_threshold: torch.Tensor
) -> QueuedSymbols:
    """:func:`encode` without waiting for the device: the chunk's symbols, exact tokens and
    coefficients queued on the current stream, with the two counts the host needs next
    (:attr:`QueuedSymbols.head`) still on the device.

    Args:
        As :func:`encode` (``kv`` with at least one token).

    Raises:
        ValueError: ``k`` or ``energy_threshold`` of another shape, a chunk of no tokens.
    """
    dev = kv.device
    r, t, n = m.rows, kv.shape[2], m.vector_size
    if t == 0:
        raise ValueError("encode_queued: a chunk of no tokens")
    kk = _level(k, (r, 2, n), "k", dev)
    thr = _level(energy_threshold, (r, 2), "energy_threshold", dev)
    with torch.cuda.device(dev):
        return _encode(m, kv.contiguous(), start, kk, thr)


def encode(
    m: PCAModel, kv: torch.Tensor, start: int, k: torch.Tensor, energy_threshold: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symbols, exact tokens and escaped values of a CUDA chunk, as :mod:`.codec` stores them.

    Args:
        kv: canonical ``[L, 2, T, H, D]`` bf16/fp16 on a CUDA device.
        start: its first position. k: ``[R, 2, N]``, energy_threshold: ``[R, 2]``
            (:class:`~.model.PCALevelData`; moved to the chunk's device as float64).

    Raises:
        ValueError: ``k`` or ``energy_threshold`` of another shape.
        CodecInputError: NaN or inf in ``kv``.

    Returns:
        (uint8 ``[R, 2, N, T32]`` symbols (``T32``: ``T`` rounded up to 32), bool ``[T]`` exact
        tokens, int16 escaped coefficients in stream order), all on the device: what
        :func:`.transform.forward` and :func:`.transform.symbols` give, bit for bit. One
        synchronization (the two counts of :func:`encode_queued`).
    """
    dev = kv.device
    r, t, n = m.rows, kv.shape[2], m.vector_size
    if t == 0:
        _level(k, (r, 2, n), "k", dev)  # the shapes checked as for any chunk
        _level(energy_threshold, (r, 2), "energy_threshold", dev)
        e = torch.empty(0, dtype=torch.int16, device=dev)
        return torch.empty(r, 2, n, 0, dtype=torch.uint8, device=dev), torch.empty(0, dtype=torch.bool, device=dev), e
    qs = encode_queued(m, kv, start, k, energy_threshold)
    bad, count = (int(v) for v in streams.host_arrays(qs.head)[0])
    if bad:
        raise CodecInputError(tf.NONFINITE)
    with torch.cuda.device(dev):
        return qs.sym, qs.exact, qs.escapes(count)


def _encode(m: PCAModel, kv: torch.Tensor, start: int, kk: torch.Tensor, energy_threshold: torch.Tensor):
    c = _native()
    dev = kv.device
    enc = imatmul.prepared(m, dev)[0]
    r, t, n = m.rows, kv.shape[2], m.vector_size
    t32 = streams.run_length(t)
    geom = _geom(m, t)
    inv_sx, e_mu, _ = tf.vectors(m, str(dev))
    cos, sin = _rope(m, start, t, dev)
    s = cuda_streams.raw(dev)
    rowsum = torch.empty(r, 2, t, dtype=torch.int64, device=dev)
    flags = torch.zeros(2, t, dtype=torch.int32, device=dev)  # [clamped | non-finite, big]
    q = torch.empty(r, 2, t, n, dtype=torch.int16, device=dev)
    energy = torch.empty(r, 2, t, dtype=torch.int64, device=dev)
    g, batches = m.layer_group, _slices(r, 2 * t, enc.p8)
    most = 2 * max(r1 - r0 for r0, r1 in batches)  # one pair of GEMM buffers, reused by every batch
    xs_all = torch.empty(most, 2 * t, enc.n8, dtype=torch.int8, device=dev)
    y_all = torch.empty(most, 2 * t, 2 * enc.p8, dtype=torch.int32, device=dev)
    for r0, r1 in batches:  # one batch of layer groups: its kernels read views
        sub = ((r1 - r0) * g, *geom[1:])
        xs, y = xs_all[: 2 * (r1 - r0)], y_all[: 2 * (r1 - r0)]
        c.encode_pre(_dtype_code(c, kv.dtype), *sub, kv[r0 * g : r1 * g].data_ptr(), _ptr(cos), _ptr(sin),
                     inv_sx[r0:r1].data_ptr(), xs.data_ptr(), rowsum[r0:r1].data_ptr(), flags[0].data_ptr(),
                     s)  # fmt: skip
        _gemms(xs, enc, 2 * r0, y)
        c.encode_post(*sub, y.data_ptr(), enc.col[2 * r0 :].data_ptr(), rowsum[r0:r1].data_ptr(),
                      e_mu[r0:r1].data_ptr(), kk[r0:r1].data_ptr(), q[r0:r1].data_ptr(), energy[r0:r1].data_ptr(),
                      flags[1].data_ptr(), s)  # fmt: skip
    exact = flags.bool().any(0) | (torch.arange(start, start + t, device=dev) < m.exact_first)
    exact |= tf.loud(energy.double(), energy_threshold)
    sym = torch.empty(r, 2, n, t32, dtype=torch.uint8, device=dev)
    exact8 = exact.to(torch.uint8)  # a name, so its memory outlives the launch: a temporary's block
    # would go back to the allocator before the call, and another thread's allocation on this stream
    # could queue a write to it ahead of the kernel (records of other, valid bytes: RESULTS §4.1t)
    c.encode_symbols(*geom, t32, q.data_ptr(), exact8.data_ptr(), sym.data_ptr(), s)
    escaped = sym[..., :t] == tf.ESCAPE
    head = torch.stack([(flags[0] & c.FLAG_NONFINITE).any().long(), escaped.sum()])
    return QueuedSymbols(sym, exact, q, escaped, head)


def _escape_index(esc: torch.Tensor, count: int, r: int, n: int, t: int) -> tuple[torch.Tensor, ...] | None:
    """``(rp, tok, j)`` of the escape symbols ``esc`` (bool ``[R, 2, N, T]``) in ``(row, j)`` order,
    row ``= rp T + tok``; None when ``count`` (the escaped coefficients given) is 0. One synchronization
    (the count of ``nonzero``).

    Raises:
        EscapeCountError: ``count`` is not the number of escape symbols (checked when it is not 0)."""
    if count == 0:
        return None
    idx = torch.nonzero(esc.reshape(r * 2, n, t).transpose(1, 2), as_tuple=True)
    if idx[0].numel() != count:
        raise EscapeCountError(idx[0].numel(), count)
    return idx


def _escape_rows(
    idx: tuple[torch.Tensor, ...] | None, qt: torch.Tensor, r: int, n: int, t: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CSR over rows ``(r, p, t)`` of the escaped coefficients' high bytes ``hi8(q) = (q - lo8(q)) /
    256`` and their component ``j``, in ``(row, j)`` order (``idx``: :func:`_escape_index`; ``qt``: int16
    ``[R, 2, N, T]`` coefficients, escapes in place). An escape whose high byte is 0 is kept: its term
    in ``decode_post`` is 0. No synchronization; none of it for a chunk without escapes (most, at
    ``pca_default``)."""
    dev = qt.device
    esc_row = torch.zeros(r * 2 * t + 1, dtype=torch.int32, device=dev)
    if idx is None:
        none = torch.empty(0, dtype=torch.int32, device=dev)
        return esc_row, none, none
    rp, tok, j = idx
    hi = imatmul.split8(qt.reshape(r * 2, n, t)[rp, j, tok])[1]
    rows = rp * t + tok
    ones = torch.ones_like(rows, dtype=torch.int32)
    esc_row[1:] = torch.zeros(r * 2 * t, dtype=torch.int32, device=dev).index_add_(0, rows, ones).cumsum(0)
    return esc_row, j.to(torch.int32), hi.to(torch.int32)


def decode(
    m: PCAModel, sym: torch.Tensor, escapes: torch.Tensor, f: torch.Tensor, start: int, dtype: torch.dtype
) -> torch.Tensor:
    """Decoded chunk of symbols on a CUDA device (exact tokens come out as the mean; the caller
    overwrites them), bit for bit :func:`.transform.inverse` of the same coefficients:
    :func:`queue_decode` and its escape check (this waits for the whole decode).

    Raises:
        As :func:`queue_decode`; EscapeCountError: escape symbols in a chunk given no escaped
        coefficients.
    """
    out, found = queue_decode(m, sym, escapes, f, start, dtype)
    if found is not None and (count := int(found.item())):
        raise EscapeCountError(count, 0)
    return out


def queue_decode(
    m: PCAModel, sym: torch.Tensor, escapes: torch.Tensor, f: torch.Tensor, start: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decode of :func:`decode` queued on the current stream of the symbols' device.

    Args:
        sym: uint8 ``[R, 2, N, T]`` (a view of the padded streams is read in place); escapes: the escaped
            coefficients (any integer dtype, stream order); f: ``[R, 2, N]``; start: the chunk's
            first position; dtype: bf16 or fp16.

    Returns:
        (``dtype`` ``[L, 2, T, H, D]`` on the device, being decoded; ``found``): for a chunk given no
        escaped coefficients, int32 ``[1]`` on the device, the escape symbols ``decode_pre_symbols``
        counted: the chunk is valid only where it is 0 (check it once the stream ran); None where
        escapes were given (their count is checked before this returns: one synchronization).

    Raises:
        ValueError: ``sym`` or ``f`` of another shape, ``sym`` not uint8.
        EscapeCountError: escaped coefficients given that are not one per escape symbol.
    """
    dev = sym.device
    r, t, n = m.rows, sym.shape[3], m.vector_size
    if tuple(sym.shape) != (r, 2, n, t):
        raise ValueError(f"symbols of shape {tuple(sym.shape)}, the PCA model needs [{r}, 2, {n}, T]")
    if sym.dtype != torch.uint8:
        raise ValueError(f"symbols must be uint8, got {sym.dtype}")
    ff = _level(f, (r, 2, n), "f", dev)
    if t == 0:
        if escapes.numel():
            raise EscapeCountError(0, escapes.numel())
        return torch.empty(m.num_layers, 2, 0, m.num_heads, m.head_size, dtype=dtype, device=dev), None
    with torch.cuda.device(dev):
        return _decode(m, sym, escapes.to(dev), ff, start, dtype)


def _decode(
    m: PCAModel, sym: torch.Tensor, escapes: torch.Tensor, ff: torch.Tensor, start: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    c = _native()
    dev = sym.device
    dec = imatmul.prepared(m, dev)[1]
    r, t, n = m.rows, sym.shape[3], m.vector_size
    geom = _geom(m, t)
    _, _, mu = tf.vectors(m, str(dev))
    s = cuda_streams.raw(dev)
    if escapes.numel():  # coefficients with the escapes filled in, read by decode_pre
        esc = sym == tf.ESCAPE
        src = (sym.to(torch.int16) - tf.OFFSET).contiguous()  # [R, 2, N, T]
        idx = _escape_index(esc, escapes.numel(), r, n, t)  # the count checked before the scatter
        src.masked_scatter_(esc, escapes.to(torch.int16))  # stream order is [R, 2, N, T]'s
        esc_count = None
        _decode_paths["int16"] += 1
    else:  # none: decode_pre_symbols reads the symbols (rows of the padded streams) and counts escapes
        st = sym.stride()
        rows_ok = st[3] == 1 and st[2] >= t and st[1] == n * st[2] and st[0] == 2 * st[1]
        # a copy's row stride is T: contiguous() may return sym itself with any stride on a size-1 dim
        src, stride = (sym, st[2]) if rows_ok else (sym.contiguous(), t)
        idx, esc_count = None, torch.zeros(1, dtype=torch.int32, device=dev)
        _decode_paths["symbols"] += 1
    esc_row, esc_col, esc_hi = _escape_rows(idx, src, r, n, t)
    rowsum = torch.empty(r, 2, t, dtype=torch.int64, device=dev)
    lo = torch.empty(2 * r, t, dec.n8, dtype=torch.int8, device=dev)  # lo8(q) of every group (1 byte a value)
    if esc_count is None:
        c.decode_pre(*geom, src.data_ptr(), lo.data_ptr(), rowsum.data_ptr(), s)
    else:  # the escape count, checked by the caller once the stream ran (the values stay in bounds)
        c.decode_pre_symbols(*geom, src.data_ptr(), stride, lo.data_ptr(), rowsum.data_ptr(),
                             esc_count.data_ptr(), s)  # fmt: skip
    cos, sin = _rope(m, start, t, dev)
    out = torch.empty(m.num_layers, 2, t, m.num_heads, m.head_size, dtype=dtype, device=dev)
    g, batches = m.layer_group, _slices(r, t, dec.p8)
    y_all = torch.empty(2 * max(r1 - r0 for r0, r1 in batches), t, 2 * dec.p8, dtype=torch.int32, device=dev)
    for r0, r1 in batches:  # one batch of layer groups: its kernels read views
        sub, y = ((r1 - r0) * g, *geom[1:]), y_all[: 2 * (r1 - r0)]
        _gemms(lo[2 * r0 : 2 * r1], dec, 2 * r0, y)
        c.decode_post(_dtype_code(c, dtype), *sub, y.data_ptr(), rowsum[r0:r1].data_ptr(),
                      esc_row[2 * r0 * t :].data_ptr(), esc_col.data_ptr(), esc_hi.data_ptr(),
                      dec.cat_t[2 * r0 :].data_ptr(), ff[r0:r1].data_ptr(), mu[r0:r1].data_ptr(), _ptr(cos), _ptr(sin),
                      out[r0 * g : r1 * g].data_ptr(), s)  # fmt: skip
    return out, esc_count
