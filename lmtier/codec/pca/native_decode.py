"""One PCA record's CUDA decode queued by one native call (``lmtier._C.pca.decode_record``,
``csrc/pca_decode.cpp``): the rANS calls side by side, ``decode_pre_symbols``, the escaped
coefficients placed on the device (``csrc/pca_escapes.cu``: no wait for their count, where
:func:`.kernels.queue_decode` waits twice), the batched GEMMs and ``decode_post``: the same bits as
the Python-driven kernels, with the interpreter out of the ~20 launches between them. The host's
part: the record's checks, one page-locked upload (the coder's descriptors, the record's payload, the
exact tokens' index) into one device workspace, one read-back of the checks (:class:`Checks`): the
native call does those too, in a page-locked block of its pool (``csrc/pca_stage.cpp``), with the
GIL released; Python checks the record and allocates the workspace and the chunk.
"""

from __future__ import annotations

import contextlib
import logging
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import torch

from lmtier import cuda_streams
from lmtier.codec import rans
from lmtier.errors import LMTierError

from . import imatmul, kernels, streams
from . import transform as tf
from .model import PCAModel

__all__ = [
    "available",
    "enable",
    "queue",
    "Layout",
    "layout",
    "Checks",
    "NativeRefused",
    "disable",
    "enabled",
]

log = logging.getLogger(__name__)

_ALIGN = 256
_state = {"enabled": True, "disabled": ""}
"""``enabled``: :func:`enable`'s switch (on by default); ``disabled``: why it is off for this process
("" while not), set by :func:`disable` after it raised once (then every record takes
:func:`.kernels.queue_decode`'s path)."""


def enable(on: bool = True) -> None:
    """Decode PCA records on CUDA by one native call each (``on``, the default) or by the Python-driven
    kernels, for this process."""
    _state["enabled"] = bool(on)


def available() -> bool:
    """True when :func:`enable` turned it on, the extension has ``decode_record`` and the PCA kernels,
    cuBLAS was found (the native GEMMs have no one-by-one fallback) and :func:`disable` was not
    called."""
    c = kernels._native() if kernels.available() else None
    if not _state["enabled"] or c is None or not hasattr(c, "decode_record") or _state["disabled"]:
        return False
    return kernels.cublas_found()


@contextlib.contextmanager
def enabled(on: bool = True):
    """A block whose decodes (of any thread) take the native call (``on``) or the Python-driven
    kernels; :func:`enable`'s setting again after it (benchmarks and tests time and check both)."""
    before = _state["enabled"]
    enable(on)
    try:
        yield
    finally:
        enable(before)


def disable(why: str) -> None:
    """Turn the native decode off for this process (logged once)."""
    if not _state["disabled"]:
        log.warning("lmtier: PCA records decode through the Python-driven kernels from now on (%s)", why)
    _state["disabled"] = why


def _up(x: int) -> int:
    return -(-x // _ALIGN) * _ALIGN


class NativeRefused(LMTierError):
    """``decode_record`` raised (a step it queues refused: cuBLAS a GEMM, a geometry check): the record
    is not at fault; the caller decodes it the Python-driven way."""


class Layout(NamedTuple):
    """Byte offsets in one record's device workspace (each region 256-byte aligned): what the native
    decode writes (symbols, GEMM operands and outputs, scratch), the checks read back
    (``status`` .. ``checks_end``: int32 ``[S]`` coder status, int64 ``[S]`` symbol counts, int32 escape
    count), then ``upload``: where the page-locked upload lands (descriptors, then the payload at
    ``upload + payload``)."""

    sym: int
    lo: int
    rowsum: int
    esc_row: int
    y: int
    scratch: int
    gemm: int
    esc_scratch: int
    status: int
    counts: int
    esc_count: int
    checks_end: int
    upload: int
    payload: int
    scratch_bytes: int
    streams_per_call: int
    groups_per_batch: int


def layout(rows: int, n: int, t: int, n8: int, p8: int) -> Layout:
    """The :class:`Layout` of a record of ``rows`` (R) layer groups, ``n`` (N) components, ``t`` tokens,
    the decode matrix's ``n8``, ``p8`` (with :func:`.streams.streams_per_call` and
    :data:`.kernels.GEMM_BYTES` as they are now)."""
    b, (r0, r1) = streams.streams_per_call(n), kernels._slices(rows, t, p8)[0]
    return _layout(rows, n, t, n8, p8, b, r1 - r0, kernels.GEMM_WORKSPACE)


def escape_scratch_bytes(rows: int, n: int, t: int) -> int:
    """Device bytes of the native escape path's scratch (``escape_scratch_bytes`` in
    ``csrc/pca_escapes.cu``: run counts and bases, row counts, a flag, row fill counters)."""
    runs, rws = 2 * rows * n, 2 * rows * t
    return 4 * ((runs + 1) + rws + 1 + rws + 1)


@lru_cache(maxsize=64)
def _layout(rows: int, n: int, t: int, n8: int, p8: int, b: int, gpb: int, gemm_ws: int) -> Layout:
    s, t32 = 2 * rows, streams.run_length(t)
    calls = -(-s // b)
    scratch_bytes = _up(rans.decode_scratch_bytes(b))
    sizes = [
        ("sym", s * n * t32),
        ("lo", s * t * n8),
        ("rowsum", rows * 2 * t * 8),
        ("esc_row", (rows * 2 * t + 1) * 4),
        ("y", 2 * gpb * t * 2 * p8 * 4),
        ("scratch", calls * scratch_bytes),
        ("gemm", gemm_ws),
        ("esc_scratch", escape_scratch_bytes(rows, n, t)),
    ]
    off, at = {}, 0
    for name, size in sizes:
        off[name], at = at, at + _up(size)
    status, counts = at, at + _up(4 * s)  # the checks: one contiguous region
    esc_count = counts + 8 * s
    checks_end = esc_count + 4
    upload = _up(checks_end)
    return Layout(**off, status=status, counts=counts, esc_count=esc_count, checks_end=checks_end, upload=upload,
                  payload=_up(s * rans.DECODE_DESC.itemsize), scratch_bytes=scratch_bytes, streams_per_call=b,
                  groups_per_batch=gpb)  # fmt: skip


class Checks(NamedTuple):
    """How to read a record's checks (the bytes ``Layout.status .. checks_end`` on the host)."""

    streams: int
    length: int
    counts: int
    esc_count: int
    escapes: int
    """The record's escaped coefficients (its metadata's): the escape symbols must number as many."""

    def verify(self, got: np.ndarray) -> None:
        """Raise ValueError naming a stream that did not decode or decoded to another count, or escape
        symbols other in number than the record announced, in the host copy ``got`` (uint8) of the
        checks."""
        s = self.streams
        counts = got[self.counts : self.counts + 8 * s].view(np.int64)
        streams.check_decoded(got[: 4 * s].view(np.int32), counts, self.length)
        if (found := int(got[self.esc_count : self.esc_count + 4].view(np.int32)[0])) != self.escapes:
            raise ValueError(f"{found} escape symbols, {self.escapes} announced")


def queue(
    m: PCAModel,
    payload: np.ndarray,
    offs: np.ndarray,
    lens: np.ndarray,
    exact: np.ndarray,
    n_esc: int,
    tables: torch.Tensor,
    f: torch.Tensor,
    start: int,
    dtype: torch.dtype,
    dev: torch.device,
    *,
    run_luts: torch.Tensor | None = None,
    tables_ok: torch.Tensor | None = None,
    spans_checked: bool = False,
) -> tuple[torch.Tensor, Any, Checks]:
    """Queue the decode of a record on ``dev``'s current stream.

    Args:
        payload: the record's payload (uint8, host); offs, lens: int64 offsets and lengths of its
            ``2R`` streams then its escapes, exact bitmap and exact tokens in it; exact: bool ``[T]``;
            n_esc: its escaped coefficients (its metadata's, the escapes section's int16 count);
            tables, f: the level's (on ``dev``); start: the first position; dtype: bf16 or fp16.
        run_luts: :func:`lmtier.codec.rans.build_run_luts` of ``tables`` (None: the coder builds each
            run's lookups).
        tables_ok: :func:`lmtier.codec.rans.build_tables_ok` of ``tables`` (None: each rANS call
            reads its tables to check them).
        spans_checked: the streams' spans and headers were checked (:func:`.scan.scan` passed the
            record); False: :func:`.streams.check_spans` checks them.

    Returns:
        (``dtype`` ``[L, 2, T, H, D]`` on ``dev``, being decoded; the ``lmtier._C.pca.DecodeStage``
        whose buffer (uint8, page-locked host memory) holds the checks once the stream passed them;
        their :class:`Checks`).

    Raises:
        ValueError: a stream header that does not fit the layout (:func:`.streams.check_spans`), or
            ``T`` = 0 (nothing to decode).
        NativeRefused: ``decode_record`` raised (the caller decodes otherwise).
        torch.OutOfMemoryError: as any allocation.
    """
    if exact.size == 0:
        raise ValueError("a record of 0 tokens has nothing to decode")
    with cuda_streams.device(dev):  # the native call picks its side streams and cuBLAS handle by it
        return _queue(m, payload, offs, lens, exact, n_esc, tables, f, start, dtype, dev, run_luts, tables_ok,
                      spans_checked)  # fmt: skip


def _queue(m, payload, offs, lens, exact, n_esc, tables, f, start, dtype, dev, run_luts, tables_ok, spans_checked):
    c = kernels._native()
    r, n, t = m.rows, m.vector_size, int(exact.size)
    s, t32 = 2 * r, streams.run_length(t)
    length = n * t32
    if not spans_checked:
        streams.check_spans(payload, offs[:s], lens[:s], length, n)
    try:
        rans.check_run_luts(run_luts, tables.shape[0])
        if tables_ok is not None and (
            tuple(tables_ok.shape) != (-(-tables.shape[0] // 32),)
            or tables_ok.dtype != torch.int32
            or tables_ok.device != tables.device
            or not tables_ok.is_contiguous()
        ):
            raise ValueError(
                f"tables_ok {tables_ok.dtype} {tuple(tables_ok.shape)} on {tables_ok.device} for "
                f"{tables.shape[0]} tables on {tables.device} (rans.build_tables_ok of them)"
            )
    except ValueError as e:  # the caller's lookups, not the record: refused as the native call's
        raise NativeRefused(str(e)) from None
    dec = imatmul.prepared(m, dev)[1]
    if not dec.n8 == dec.p8 == -(-n // 8) * 8:  # the native call's rule: d_int is N x N
        raise NativeRefused(f"decode matrix of N8 {dec.n8}, P8 {dec.p8} for N = {n}")
    lay = layout(r, n, t, dec.n8, dec.p8)
    used = int((offs + lens).max())
    idx = np.flatnonzero(exact)
    idx_at = -(-(lay.payload + used) // 8) * 8
    esc_at = _up(lay.upload + idx_at + 8 * idx.size)  # esc_col, esc_hi: int32 [n_esc] each
    ws = torch.empty(esc_at + 8 * n_esc, dtype=torch.uint8, device=dev)
    base = ws.data_ptr()
    mu = tf.vectors(m, str(dev))[2]
    cos, sin = kernels._rope(m, start, t, dev)
    out = torch.empty(m.num_layers, 2, t, m.num_heads, m.head_size, dtype=dtype, device=dev)
    ff = f if f.dtype == torch.float64 and f.is_contiguous() else f.to(torch.float64).contiguous()
    args = dict(
        dtype=kernels._dtype_code(c, dtype), L=m.num_layers, T=t, H=m.num_heads, D=m.head_size, G=m.layer_group,
        t32=t32, num_streams=s, tables_per_stream=n, streams_per_call=lay.streams_per_call,
        tables=tables.data_ptr(), run_luts=0 if run_luts is None else run_luts.data_ptr(),
        counts=base + lay.counts, status=base + lay.status, scratch=base + lay.scratch,
        scratch_bytes=lay.scratch_bytes, sym=base + lay.sym,
        escapes=base + lay.upload + lay.payload + int(offs[s]) if n_esc else 0, num_escapes=n_esc,
        esc_col=base + esc_at if n_esc else 0, esc_hi=base + esc_at + 4 * n_esc if n_esc else 0,
        esc_scratch=base + lay.esc_scratch, lo=base + lay.lo, rowsum=base + lay.rowsum,
        esc_count=base + lay.esc_count, esc_row=base + lay.esc_row, y=base + lay.y,
        groups_per_batch=lay.groups_per_batch, p8=dec.p8, dcat=dec.cat_t.data_ptr(), f=ff.data_ptr(),
        mu=mu.data_ptr(), cos_t=kernels._ptr(cos), sin_t=kernels._ptr(sin), out=out.data_ptr(),
        gemm_workspace=base + lay.gemm, gemm_workspace_bytes=kernels.GEMM_WORKSPACE,
        stream=cuda_streams.raw(dev),
    )  # fmt: skip
    checks = Checks(s, length, lay.counts - lay.status, lay.esc_count - lay.status, n_esc)
    try:
        stage = c.decode_record(**args, payload=payload, offs=offs, lens=lens, exact_idx=idx, upload=base + lay.upload,
                                payload_at=lay.payload, idx_at=idx_at, checks=base + lay.status,
                                checks_bytes=lay.checks_end - lay.status,
                                tables_ok=0 if tables_ok is None else tables_ok.data_ptr())  # fmt: skip
    except (RuntimeError, ValueError) as e:  # the record's own checks ran above
        raise NativeRefused(str(e)) from None
    kernels._decode_paths["symbols"] += 1
    kernels._decode_paths["fused"] += 1
    kernels._stats["batched"] += -(-r // lay.groups_per_batch)  # the GEMM batches, one cuBLAS call each
    return out, stage, checks
