"""Chunk geometry, the KV dtype table, the key size and the canonical format version: one definition
of each, used by the layout, keys, records, codec, tiers and manager.

Canonical chunk (format version :data:`CANONICAL_FORMAT_VERSION`): ``T`` tokens of KV of all layers
of one tensor-parallel rank in one C-contiguous buffer of shape :data:`CANONICAL_AXES`,

    [num_layers][num_planes][num_tokens][num_kv_heads][head_size]   elements of the cache's dtype

with 2 planes (K, V) for regular attention and 1 plane for MLA (its joint latent, ``num_kv_heads =
1``, ``head_size`` = the latent size, e.g. 576). :class:`ChunkGeometry` computes its sizes.

Dtypes (:data:`KV_DTYPES`): each KV element type lmtier stores has one row — the name used in a
:class:`lmtier.keys.Namespace` (``kv_dtype``), its size in bytes, the torch dtype, the code that
record headers carry (:class:`DTypeCode`, used by :mod:`lmtier.codec.format` and
:mod:`lmtier.record`), whether the codec takes it, and accepted aliases (``bf16``, ``half``...).
fp8 caches arrive from vLLM as ``torch.uint8`` and are moved as bytes.

This module does not import torch at import time (keys and records are torch-free); the torch
side of the table resolves on first use.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "KEY_BYTES",
    "CANONICAL_FORMAT_VERSION",
    "CANONICAL_AXES",
    "DTypeCode",
    "KVDType",
    "KV_DTYPES",
    "KV_DTYPE_BYTES",
    "CODEC_DTYPE_NAMES",
    "TORCH_KV_DTYPES",
    "kv_dtype",
    "torch_dtype",
    "torch_itemsize",
    "torch_itemsizes",
    "ChunkGeometry",
]

KEY_BYTES = 32
"""Length of a chunk key in bytes (BLAKE2b-256, :mod:`lmtier.keys`); every tier and record checks it."""

CANONICAL_FORMAT_VERSION = 2
"""Version of the canonical chunk byte layout *and* of the key derivation (:mod:`lmtier.keys`),
bound into every key's namespace: a change of either must bump it, so old chunks become unreachable
rather than misread. 2: the request scope (``cache_salt``, LoRA adapter, multimodal inputs) is
encoded injectively (:class:`lmtier.keys.KeyScope`, issue 20); the byte layout is that of 1."""

CANONICAL_AXES = ("num_layers", "num_planes", "num_tokens", "num_kv_heads", "head_size")
"""The axes of a canonical chunk, outermost first (``[L][P][T][H][D]``)."""


class DTypeCode(enum.IntEnum):
    """Element-type code in record headers (codec records, :mod:`lmtier.codec.format`; tier records,
    :mod:`lmtier.record` ``dtype_code``). Values are part of the on-disk formats: never renumber."""

    UNSPECIFIED = 0
    BFLOAT16 = 1
    FLOAT16 = 2
    FLOAT32 = 3
    FLOAT8_E4M3 = 4
    FLOAT8_E5M2 = 5
    UINT8 = 6


@dataclass(frozen=True)
class KVDType:
    """One KV element type.

    Attributes:
        name: the :class:`lmtier.keys.Namespace` ``kv_dtype`` name (bound into keys: never rename).
        itemsize: bytes per element.
        torch_name: attribute of the ``torch`` module (``"float8_e4m3fn"``).
        code: :class:`DTypeCode` in record headers (``UNSPECIFIED`` where the formats have none).
        codec: True if the codec (:mod:`lmtier.codec`) takes it (16-bit floats).
        aliases: other accepted spellings (``"bf16"``, ``"half"``...).
    """

    name: str
    itemsize: int
    torch_name: str
    code: DTypeCode
    codec: bool = False
    aliases: tuple[str, ...] = ()


KV_DTYPES: tuple[KVDType, ...] = (
    KVDType("float32", 4, "float32", DTypeCode.FLOAT32, aliases=("fp32",)),
    KVDType("float16", 2, "float16", DTypeCode.FLOAT16, codec=True, aliases=("fp16", "half")),
    KVDType("bfloat16", 2, "bfloat16", DTypeCode.BFLOAT16, codec=True, aliases=("bf16",)),
    KVDType("fp8_e4m3", 1, "float8_e4m3fn", DTypeCode.FLOAT8_E4M3, aliases=("float8_e4m3fn",)),
    KVDType("fp8_e5m2", 1, "float8_e5m2", DTypeCode.FLOAT8_E5M2, aliases=("float8_e5m2",)),
    KVDType("uint8", 1, "uint8", DTypeCode.UINT8),
    KVDType("int8", 1, "int8", DTypeCode.UNSPECIFIED),
)
"""Every KV element type lmtier stores (one row each)."""

_BYTE_ONLY_TORCH_NAMES = ("float8_e4m3fnuz", "float8_e5m2fnuz")
"""torch dtypes a KV layout may hand over and lmtier moves as bytes, without a namespace name."""

KV_DTYPE_BYTES: dict[str, int] = {d.name: d.itemsize for d in KV_DTYPES}
"""Namespace ``kv_dtype`` name -> bytes per element."""

CODEC_DTYPE_NAMES: tuple[str, ...] = tuple(d.name for d in KV_DTYPES if d.codec)
"""Namespace ``kv_dtype`` names the codec takes."""

_BY_NAME: dict[str, KVDType] = {}
for _d in KV_DTYPES:
    for _n in (_d.name, *_d.aliases):
        assert _n not in _BY_NAME, _n
        _BY_NAME[_n] = _d


@cache
def _torch_table() -> dict[Any, KVDType]:
    import torch

    return {getattr(torch, d.torch_name): d for d in KV_DTYPES if hasattr(torch, d.torch_name)}


def kv_dtype(dtype: Any) -> KVDType:
    """The table row of ``dtype``: a name, an alias, a ``torch.dtype`` or a :class:`KVDType`.

    Raises:
        ValueError: not a KV dtype lmtier stores (the message lists the names).
    """
    if isinstance(dtype, KVDType):
        return dtype
    if isinstance(dtype, str):
        row = _BY_NAME.get(dtype)
    else:
        try:
            row = _torch_table().get(dtype)
        except TypeError:  # unhashable
            row = None
    if row is None:
        raise ValueError(f"unsupported KV dtype {dtype!r}; supported: {sorted(KV_DTYPE_BYTES)}")
    return row


def torch_dtype(dtype: Any) -> torch.dtype:
    """The ``torch.dtype`` of a name, alias or row (``"bf16"`` -> ``torch.bfloat16``); ValueError if unknown."""
    import torch

    return getattr(torch, kv_dtype(dtype).torch_name)


@cache
def torch_itemsizes() -> dict[Any, int]:
    """``{torch.dtype: bytes per element}`` of every torch dtype a KV layout may hand over: the
    table's, plus the fp8 variants moved as bytes (``float8_e4m3fnuz``...) where torch has them."""
    import torch

    out = {t: d.itemsize for t, d in _torch_table().items()}
    for name in _BYTE_ONLY_TORCH_NAMES:
        if hasattr(torch, name):
            out[getattr(torch, name)] = 1
    return out


def torch_itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of a torch KV dtype (see :func:`torch_itemsizes`).

    Raises:
        ValueError: a dtype lmtier does not move (the message lists the supported ones).
    """
    try:
        return torch_itemsizes()[dtype]
    except KeyError:
        raise ValueError(
            f"unsupported KV cache dtype {dtype}; supported: {sorted(map(str, torch_itemsizes()))}"
        ) from None


class _TorchKVDTypes(Mapping):
    """``{namespace kv_dtype name: torch.dtype}``, resolved on first use (no torch import before)."""

    def _table(self) -> dict[str, Any]:
        return {d.name: t for t, d in _torch_table().items()}

    def __getitem__(self, name: str) -> Any:
        return self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return f"TORCH_KV_DTYPES({self._table()!r})"


TORCH_KV_DTYPES: Mapping[str, torch.dtype] = _TorchKVDTypes()
"""Namespace ``kv_dtype`` name -> ``torch.dtype`` (a read-only mapping; torch is imported on first use)."""


@dataclass(frozen=True)
class ChunkGeometry:
    """The shape and sizes of canonical chunks of one tensor-parallel rank.

    Attributes:
        num_layers: attention layers in a chunk (> 0).
        num_planes: 2 (K, V) or 1 (MLA latent).
        num_kv_heads: KV heads of this rank (1 for MLA).
        head_size: elements per head row (the latent size for MLA).
        itemsize: bytes per element (see :func:`kv_dtype`).

    Raises:
        ValueError: a non-positive size or a plane count other than 1 or 2.
    """

    num_layers: int
    num_planes: int
    num_kv_heads: int
    head_size: int
    itemsize: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "itemsize"):
            v = getattr(self, name)
            if type(v) is not int or v <= 0:
                raise ValueError(f"ChunkGeometry.{name} must be a positive int, got {v!r}")
        if self.num_planes not in (1, 2):
            raise ValueError(f"ChunkGeometry.num_planes must be 1 (MLA) or 2 (K and V), got {self.num_planes!r}")

    @classmethod
    def of(cls, num_layers: int, num_planes: int, num_kv_heads: int, head_size: int, dtype: Any) -> ChunkGeometry:
        """Geometry with the element size of ``dtype`` (a name, alias or torch dtype, fp8 variants included)."""
        if isinstance(dtype, (str, KVDType)):
            itemsize = kv_dtype(dtype).itemsize
        else:
            itemsize = torch_itemsize(dtype)
        return cls(num_layers, num_planes, num_kv_heads, head_size, itemsize)

    @property
    def mla(self) -> bool:
        """True for one latent plane (MLA)."""
        return self.num_planes == 1

    @property
    def row_bytes(self) -> int:
        """Bytes of one (token, head) row of one plane: ``head_size * itemsize``."""
        return self.head_size * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """Canonical bytes per token over all layers, planes and heads."""
        return self.num_layers * self.num_planes * self.num_kv_heads * self.row_bytes

    def chunk_bytes(self, num_tokens: int) -> int:
        """Bytes of one canonical chunk of ``num_tokens`` tokens."""
        return num_tokens * self.bytes_per_token

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Canonical chunk shape ``(L, P, T, H, D)`` in elements (see :data:`CANONICAL_AXES`)."""
        return (self.num_layers, self.num_planes, num_tokens, self.num_kv_heads, self.head_size)
