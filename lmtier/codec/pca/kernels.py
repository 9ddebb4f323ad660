"""The PCA levels' transform on CUDA with lmtier's fused kernels (``csrc/pca_cuda.cu``) around the
int8 GEMMs of :mod:`.imatmul`: the bits of :mod:`.transform`'s torch arithmetic, in five kernel
launches and ``2R`` GEMMs per chunk instead of dozens of float64 passes. Layouts and rules:
``csrc/include/lmtier/pca.h``. Used by :mod:`.codec` for CUDA chunks when the extension was built
with CUDA (:func:`available`); otherwise the torch path of :mod:`.transform` runs there.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from functools import cache, lru_cache

import torch

from lmtier.codec.quant import CodecInputError

from . import imatmul, rope, streams
from . import transform as tf
from .model import PCAModel

__all__ = ["available", "encode", "decode", "GEMM_STREAMS", "graph_stats"]

log = logging.getLogger(__name__)

GEMM_STREAMS = 4
"""Streams the ``2R`` GEMMs of a chunk spread over inside their CUDA graph: one GEMM of a chunk fills
a fraction of the SMs (``2T x 2N8`` outputs in 128 x 128 tiles)."""
_GEMM_SETS_PER_DEVICE = 4
"""Captured GEMM sets kept per device, shared by every thread (each holds its static operands: the
encoder's of an 8B model's chunk at G = 1 take ~300 MB, the decoder's ~150 MB; one model's two are
one encode and one decode set)."""
_ROPE_CACHE = 64
"""RoPE tables kept per process (``2 T D`` float64 each: 0.5 MB at T = 256, D = 128): a served prefix's
chunks start at the same few positions (0, 256, ...), and computing a table costs the host ~0.5 ms."""


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
    """``out[i] = a[i] @ [hi | lo]`` of matrix ``i`` (int8 -> int32)."""
    if a.shape[1] > 16:
        torch._int_mm(a[i], b.operand(i), out=out[i])
    else:  # the CUDA GEMM needs more than 16 rows
        out[i].copy_(imatmul._int_mm(a[i], b.operand(i)))


def _gemms(a: torch.Tensor, b: imatmul.SplitMatrix, out: torch.Tensor) -> None:
    """:func:`_gemm` for every batch entry, in order on the current stream."""
    for i in range(a.shape[0]):
        _gemm(a, b, out, i)


_stats = {"captured": 0, "replays": 0, "eager": 0, "capture_failures": 0}


def graph_stats() -> dict[str, int]:
    """Counts of the GEMM sets captured, replayed and run eagerly (a failed capture runs them eagerly)."""
    return dict(_stats)


@cache
def _own_streams(index: int) -> tuple[torch.cuda.ExternalStream, ...]:
    """The capture stream and :data:`GEMM_STREAMS` side streams of device ``index``: non-blocking streams
    created for this module alone, once (``lmtier._C.cuda_stream_nonblocking``). Never torch's
    ``Stream()``: those come from a shared pool, so a pooled stream may be another thread's, and work
    it enqueued there during a capture would be swallowed into the graph (and run on every replay)."""
    from lmtier import _C

    dev = torch.device("cuda", index)
    return tuple(
        torch.cuda.ExternalStream(_C.cuda_stream_nonblocking(index), device=dev) for _ in range(1 + GEMM_STREAMS)
    )


class _GemmSet:
    """The ``B`` GEMMs ``out[i] = a[i] @ [hi | lo]`` of one split matrix at one row count, on static
    operands ``a`` int8 ``[B, M, N8]`` and ``out`` int32 ``[B, M, 2 P8]``, captured once in a CUDA graph
    over :data:`GEMM_STREAMS` streams: one launch per chunk instead of ``B`` cuBLAS calls (~13 µs of
    host time each), and concurrent GEMMs. A failed capture leaves ``graph`` None: :meth:`run` then
    calls the GEMMs one by one (same integers: each product is exact).

    Shared by every thread through :func:`_using` (the set's lock held while a caller enqueues its
    writer of ``a``, :meth:`run` and its reader of ``out``, its stream ordered after the previous
    user's by an event): users on different streams never overlap on the device. Captures run under
    the module's lock, on streams of its own (:func:`_own_streams`)."""

    def __init__(self, b: imatmul.SplitMatrix, rows: int, dev: torch.device) -> None:
        nb = b.cat_t.shape[0]
        self.b = b  # keeps the operand alive while the graph points at it
        self.a = torch.zeros(nb, rows, b.n8, dtype=torch.int8, device=dev)
        self.out = torch.empty(nb, rows, 2 * b.p8, dtype=torch.int32, device=dev)
        self.lock = threading.Lock()
        self.evicted = False  # set under ``lock`` when dropped from the cache: not to be used again
        self.graph = self._capture(dev)
        # the operands' zeroing and the warm-ups ran on the creating thread's stream: the first user
        # (another thread's stream, maybe) waits for them as every later user waits for the previous one
        self.done = torch.cuda.Event()
        self.done.record(torch.cuda.current_stream(dev))

    def _capture(self, dev: torch.device) -> torch.cuda.CUDAGraph | None:
        a, b, out, nb = self.a, self.b, self.out, self.a.shape[0]
        main = torch.cuda.current_stream(dev)
        cap, *side = _own_streams(dev.index)
        side = side[: min(GEMM_STREAMS, nb)]
        try:
            for s in side:  # warm-up on every stream: cuBLAS handles and workspaces exist before the capture
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    _gemm(a, b, out, 0)
                main.wait_stream(s)
            cap.wait_stream(main)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(cap):  # restored however the capture ends
                g.capture_begin(capture_error_mode="thread_local")
                try:
                    for s in side:
                        s.wait_stream(cap)
                    for i in range(nb):
                        with torch.cuda.stream(side[i % len(side)]):
                            _gemm(a, b, out, i)
                finally:
                    for s in side:  # every fork joined, also after a failure
                        cap.wait_stream(s)
                    g.capture_end()
            main.wait_stream(cap)
        except RuntimeError as e:  # capture refused (driver, allocator): the GEMMs run one by one
            _stats["capture_failures"] += 1
            log.warning("lmtier: PCA GEMMs run uncaptured (CUDA graph capture failed: %s)", e)
            torch.cuda.synchronize(dev)
            return None
        _stats["captured"] += 1
        return g

    def run(self, stream: torch.cuda.Stream) -> None:
        """The GEMMs on ``stream`` (one graph launch, or the calls one by one)."""
        with torch.cuda.stream(stream):
            if self.graph is None:
                _stats["eager"] += 1
                _gemms(self.a, self.b, self.out)
            else:
                _stats["replays"] += 1
                self.graph.replay()


_sets: OrderedDict[tuple[int, int, int], _GemmSet] = OrderedDict()
_sets_lock = threading.Lock()


def _gemm_set(b: imatmul.SplitMatrix, rows: int, dev: torch.device) -> _GemmSet:
    """The :class:`_GemmSet` of ``b`` at ``rows`` rows on ``dev`` (captured on first use; the least
    recently used of more than :data:`_GEMM_SETS_PER_DEVICE` per device is dropped once its last user's
    work ran, and marked evicted)."""
    key = (id(b), rows, dev.index)
    with _sets_lock:
        got = _sets.get(key)
        if got is not None and got.b is b:
            _sets.move_to_end(key)
            return got
        on_dev = [k for k in _sets if k[2] == dev.index]
        while len(on_dev) >= _GEMM_SETS_PER_DEVICE:
            old = _sets.pop(on_dev.pop(0))
            with old.lock:  # its last user has enqueued everything; its buffers go back once that ran
                old.done.synchronize()
                old.evicted = True
        got = _sets[key] = _GemmSet(b, rows, dev)
        return got


@contextlib.contextmanager
def _using(b: imatmul.SplitMatrix, rows: int, dev: torch.device, stream: torch.cuda.Stream):
    """The :class:`_GemmSet` of ``b`` at ``rows`` rows, held (its lock) while the caller enqueues on
    ``stream`` the writer of ``a``, :meth:`_GemmSet.run` and the reader of ``out``; ``stream`` waits
    for the previous user's work first, and the next user waits for this one's (an event recorded on
    exit). A set evicted between the lookup and the lock is looked up again."""
    while True:
        gs = _gemm_set(b, rows, dev)
        gs.lock.acquire()
        if not gs.evicted:
            break
        gs.lock.release()
    try:
        stream.wait_event(gs.done)
        yield gs
    finally:
        gs.done = torch.cuda.Event()
        gs.done.record(stream)
        gs.lock.release()


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
    r, t, n = m.rows, kv.shape[2], m.vector_size
    t32 = streams.run_length(t)
    geom = _geom(m, t)
    inv_sx, e_mu, _ = tf.vectors(m, str(dev))
    cos, sin = _rope(m, start, t, dev)
    stream = torch.cuda.current_stream(dev)
    s = stream.cuda_stream
    rowsum = torch.empty(r, 2, t, dtype=torch.int64, device=dev)
    flags = torch.zeros(2, t, dtype=torch.int32, device=dev)  # [clamped | non-finite, big]
    q = torch.empty(r, 2, t, n, dtype=torch.int16, device=dev)
    energy = torch.empty(r, 2, t, dtype=torch.int64, device=dev)
    with _using(enc, 2 * t, dev, stream) as gs:
        c.encode_pre(_dtype_code(c, kv.dtype), *geom, kv.data_ptr(), _ptr(cos), _ptr(sin), inv_sx.data_ptr(),
                     gs.a.data_ptr(), rowsum.data_ptr(), flags[0].data_ptr(), s)  # fmt: skip
        gs.run(stream)
        c.encode_post(*geom, gs.out.data_ptr(), enc.col.data_ptr(), rowsum.data_ptr(), e_mu.data_ptr(),
                      kk.data_ptr(), q.data_ptr(), energy.data_ptr(), flags[1].data_ptr(), s)  # fmt: skip
    bad = (flags[0] & c.FLAG_NONFINITE).any()
    exact = flags.bool().any(0) | (torch.arange(start, start + t, device=dev) < m.exact_first)
    exact |= tf.loud(energy.double(), energy_threshold)
    sym = torch.empty(r, 2, n, t32, dtype=torch.uint8, device=dev)
    c.encode_symbols(*geom, t32, q.data_ptr(), exact.to(torch.uint8).data_ptr(), sym.data_ptr(), s)
    escapes = q.transpose(2, 3)[sym[..., :t] == tf.ESCAPE]  # synchronizes (a count): the flag is read after
    if bool(bad):
        raise CodecInputError(tf.NONFINITE)
    return sym, exact, escapes


def _escape_index(esc: torch.Tensor, count: int, r: int, n: int, t: int) -> tuple[torch.Tensor, ...] | None:
    """``(rp, tok, j)`` of the escape symbols ``esc`` (bool ``[R, 2, N, T]``) in ``(row, j)`` order,
    row ``= rp T + tok``; None when ``count`` (the escaped coefficients given) is 0. One synchronization
    (the count of ``nonzero``).

    Raises:
        ValueError: ``count`` is not the number of escape symbols (checked when it is not 0)."""
    if count == 0:
        return None
    idx = torch.nonzero(esc.reshape(r * 2, n, t).transpose(1, 2), as_tuple=True)
    if idx[0].numel() != count:
        raise ValueError(f"{idx[0].numel()} escape symbols, {count} escaped coefficients given")
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
    overwrites them), bit for bit :func:`.transform.inverse` of the same coefficients.

    Args:
        sym: uint8 ``[R, 2, N, T]`` (a view of the padded streams is fine); escapes: the escaped
            coefficients (any integer dtype, stream order); f: ``[R, 2, N]``; start: the chunk's
            first position; dtype: bf16 or fp16.

    Returns:
        ``dtype`` ``[L, 2, T, H, D]`` on the device.

    Raises:
        ValueError: ``sym`` or ``f`` of another shape; escaped coefficients given that are not one per
            escape symbol (with none given, the escape symbols are not counted: the caller checks,
            as :func:`lmtier.codec.pca.decode` does).
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
    r, t, n = m.rows, sym.shape[3], m.vector_size
    geom = _geom(m, t)
    _, _, mu = tf.vectors(m, str(dev))
    stream = torch.cuda.current_stream(dev)
    s = stream.cuda_stream
    esc = sym == tf.ESCAPE
    qt = (sym.to(torch.int16) - tf.OFFSET).contiguous()  # the kernel reads [R, 2, N, T] raw
    idx = _escape_index(esc, escapes.numel(), r, n, t)  # the count checked before the scatter
    if idx is not None:
        qt.masked_scatter_(esc, escapes.to(torch.int16))  # stream order is [R, 2, N, T]'s
    esc_row, esc_col, esc_hi = _escape_rows(idx, qt, r, n, t)
    rowsum = torch.empty(r, 2, t, dtype=torch.int64, device=dev)
    cos, sin = _rope(m, start, t, dev)
    out = torch.empty(m.num_layers, 2, t, m.num_heads, m.head_size, dtype=dtype, device=dev)
    with _using(dec, t, dev, stream) as gs:
        c.decode_pre(*geom, qt.data_ptr(), gs.a.data_ptr(), rowsum.data_ptr(), s)
        gs.run(stream)
        c.decode_post(_dtype_code(c, dtype), *geom, gs.out.data_ptr(), rowsum.data_ptr(), esc_row.data_ptr(),
                      esc_col.data_ptr(), esc_hi.data_ptr(), dec.cat_t.data_ptr(), ff.data_ptr(), mu.data_ptr(),
                      _ptr(cos), _ptr(sin), out.data_ptr(), s)  # fmt: skip
    return out
