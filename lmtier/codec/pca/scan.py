"""A PCA record's host checks in one native call (``lmtier._C.pca_scan``, ``csrc/pca_scan.cpp``): the
fast path of :func:`.codec._parse` and :func:`.streams.check_spans` for records laid out as
:func:`.codec.encode` writes them, without the interpreter's ~30 small steps (each holding the GIL a
decoding thread shares). It accepts a subset of what those checks accept; :func:`scan` returns None
for anything else, and the caller's Python checks then accept the record or name what is wrong.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import torch

from lmtier.codec import format as fmt
from lmtier.codec.chunk import CODEC_DTYPES

from . import streams
from .levels import PCA_LEVELS_BY_ID, PCALevel
from .model import PCAModel

__all__ = ["Scanned", "scan", "available"]

_DTYPES = {int(v): k for k, v in CODEC_DTYPES.items()}


class Scanned(NamedTuple):
    """A record that passed every host check (checksum included), as the native decode takes it."""

    level: PCALevel
    start: int
    n_esc: int
    dtype: torch.dtype
    tokens: int
    payload: np.ndarray
    """uint8, the record's payload (a view of the record)."""
    offs: np.ndarray
    """int64 ``[2R + 3]``: the payload offsets of the streams, escapes, exact bitmap, exact tokens."""
    lens: np.ndarray
    """int64 ``[2R + 3]``: their byte lengths."""
    exact: np.ndarray
    """bool ``[T]``: the exact tokens."""


def _native() -> Any:
    from lmtier import _C

    return getattr(_C, "pca_scan", None)


def available() -> bool:
    """Whether the extension has the scan (a build older than it has not: every record then takes the
    Python checks)."""
    return _native() is not None


@lru_cache(maxsize=8)
def _spec(m: PCAModel) -> Any:
    """``m``'s ``ScanSpec``: the record format's constants (:mod:`lmtier.codec.format`) and what a
    record of ``m`` must be (:func:`.codec._parse`'s checks)."""
    from .codec import _META, MAX_POSITION, sections_per_layer

    sizes = {k.itemsize for k in _DTYPES.values()}
    assert len(sizes) == 1, sizes  # the scan checks the exact tokens' bytes with one element size
    levels = [i for i, lv in PCA_LEVELS_BY_ID.items() if lv.name in m.levels]
    geometry = (m.num_layers, m.num_heads, m.head_size, sections_per_layer(m), m.rows, m.vector_size,
                streams.streams_per_call(m.vector_size))  # fmt: skip
    return _native().ScanSpec(
        magic=fmt.MAGIC, version=fmt.FORMAT_VERSION, header_bytes=fmt.HEADER_BYTES,
        max_sections=fmt.MAX_SECTIONS, levels=levels, dtypes=sorted(_DTYPES), dtype_bytes=sizes.pop(),
        model_id=m.model_id, geometry=geometry, meta_bytes=_META.size, digest=m.digest,
        max_position=MAX_POSITION,
    )  # fmt: skip


def scan(record: Any, m: PCAModel) -> Scanned | None:
    """The record's checked fields, or None: the scan refused it (the caller's Python checks decide)
    or the extension lacks the scan.

    Args:
        record: the record's bytes (bytes-like or uint8 NumPy array, host).
        m: the model it must have been coded with.

    Raises:
        ValueError: the checksum does not match (:func:`lmtier.codec.format.check_checksum`).
    """
    c = _native()
    if c is None:
        return None
    mv = fmt._as_bytes_view(record)
    got = c.scan(_spec(m), mv)
    if got is None:
        return None
    level, dtype, t, n_esc, start, at, end, checksum, offs, lens, exact = got
    fmt.check_checksum(mv, end, checksum)
    payload = np.frombuffer(mv, np.uint8, count=end - at, offset=at)
    return Scanned(PCA_LEVELS_BY_ID[level], start, n_esc, _DTYPES[dtype], t, payload, offs, lens, exact)
