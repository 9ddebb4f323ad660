"""Chunk keys: a stable cryptographic hash chain over token ids inside a KV namespace.

A *chunk* is ``chunk_size`` consecutive tokens of KV cache for all layers of one tensor-parallel
rank. Every full chunk of a prompt gets a 32-byte key::

    h_0 = BLAKE2b-256(person="lmtier-root", len(ns) || ns_digest || salt_tag || len(salt) || salt)
    h_i = BLAKE2b-256(person="lmtier-chunk", h_{i-1} || uint32_le(tokens[(i-1)*C : i*C]))

so key ``i`` commits to the namespace, the salt and *every* token of chunks ``1..i`` (a prefix
hash chain, as in vLLM's prefix caching, ``vllm/v1/core/kv_cache_utils.py::hash_block_tokens``,
but with a cryptographic hash so keys can be shared between tenants, processes and machines).
Nothing here depends on Python's ``hash()``, ``repr`` or ``PYTHONHASHSEED``: keys are identical in
every process of every machine.

The :class:`Namespace` binds everything that makes KV bytes incompatible: model identity, KV
geometry and dtype, canonical-format version, codec and the tensor-parallel rank/size. Two
namespaces that differ in any field produce disjoint key spaces.

Partial tail chunks are never keyed (and therefore never stored or loaded): a prefix hit is
chunk-granular, and a partial chunk would have to be loaded over blocks that vLLM may already hold
or compute itself, with a token count that the key cannot express. The last
``len(tokens) % chunk_size`` tokens of a prompt are always recomputed by prefill.

Logging: ``logging.getLogger("lmtier.keys")`` (nothing is logged on the hot path).
"""

from __future__ import annotations

import array
import hashlib
import struct
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from lmtier.geometry import CANONICAL_FORMAT_VERSION, KEY_BYTES, KV_DTYPE_BYTES, ChunkGeometry

__all__ = [
    "KEY_BYTES",
    "CANONICAL_FORMAT_VERSION",
    "KV_DTYPE_BYTES",
    "Namespace",
    "chunk_keys",
    "num_full_chunks",
]

_MAX_TOKEN_ID = 2**32 - 1
_ROOT_PERSON = b"lmtier-root"
_CHUNK_PERSON = b"lmtier-chunk"
_NS_PERSON = b"lmtier-ns"
_U64 = struct.Struct("<Q")


def _enc_str(tag: bytes, value: str) -> bytes:
    raw = value.encode("utf-8")
    return tag + _U64.pack(len(raw)) + raw


def _enc_int(tag: bytes, value: int) -> bytes:
    # Signed 64-bit; all namespace ints are validated >= 0 (tp_rank) or > 0.
    return tag + struct.pack("<q", value)


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two chunks' KV bytes (in)compatible.

    Args:
        model: model identity, e.g. the HF repo id plus revision (``"meta-llama/Llama-3.1-8B@a1b2"``)
            or a weights checksum. Non-empty. Two different fine-tunes must use different strings.
        num_layers: number of attention layers stored in a chunk (> 0).
        num_kv_heads: KV heads of this tensor-parallel rank (> 0; 1 for MLA).
        head_size: elements per head (> 0; the latent size for MLA).
        kv_dtype: element dtype name, one of :data:`KV_DTYPE_BYTES` (e.g. ``"bfloat16"``,
            ``"fp8_e4m3"``).
        kv_planes: 2 for separate K and V, 1 for MLA's joint latent.
        chunk_size: tokens per chunk (> 0).
        format_version: canonical chunk layout version (default :data:`CANONICAL_FORMAT_VERSION`).
        codec: ``"none"`` for raw canonical bytes, else the codec name (e.g. ``"cachegen"``).
        tp_rank, tp_size: tensor-parallel rank (``0 <= tp_rank < tp_size``) and size.

    Raises:
        ValueError / TypeError: on any invalid field (message names the field and value).
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    kv_dtype: str
    kv_planes: int = 2
    chunk_size: int = 256
    format_version: int = CANONICAL_FORMAT_VERSION
    codec: str = "none"
    tp_rank: int = 0
    tp_size: int = 1
    _digest: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model", "kv_dtype", "codec"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TypeError(f"Namespace.{name} must be a non-empty str, got {value!r}")
        for name in ("num_layers", "num_kv_heads", "head_size", "chunk_size", "format_version", "tp_size"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"Namespace.{name} must be a positive int, got {value!r}")
        if type(self.tp_rank) is not int or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"Namespace.tp_rank must be an int in [0, tp_size={self.tp_size}), got {self.tp_rank!r}")
        if self.kv_planes not in (1, 2) or type(self.kv_planes) is not int:
            raise ValueError(f"Namespace.kv_planes must be 1 (MLA) or 2 (K and V), got {self.kv_planes!r}")
        if self.kv_dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"Namespace.kv_dtype must be one of {sorted(KV_DTYPE_BYTES)}, got {self.kv_dtype!r}")
        object.__setattr__(self, "_digest", self._compute_digest())

    def _compute_digest(self) -> bytes:
        # Tagged, length-prefixed fields in a fixed order: unambiguous and independent of Python's
        # hash/repr. Adding a field means a new tag *and* a format_version bump.
        parts = [
            b"LMTNS\x01",
            _enc_str(b"m", self.model),
            _enc_int(b"L", self.num_layers),
            _enc_int(b"H", self.num_kv_heads),
            _enc_int(b"D", self.head_size),
            _enc_str(b"t", self.kv_dtype),
            _enc_int(b"P", self.kv_planes),
            _enc_int(b"C", self.chunk_size),
            _enc_int(b"V", self.format_version),
            _enc_str(b"c", self.codec),
            _enc_int(b"r", self.tp_rank),
            _enc_int(b"R", self.tp_size),
        ]
        return hashlib.blake2b(b"".join(parts), digest_size=32, person=_NS_PERSON).digest()

    def digest(self) -> bytes:
        """32-byte BLAKE2b-256 digest of the canonical, length-prefixed field encoding.

        Stable across processes, machines and Python versions.
        """
        return self._digest

    @property
    def dtype_bytes(self) -> int:
        """Bytes per KV element."""
        return KV_DTYPE_BYTES[self.kv_dtype]

    @property
    def geometry(self) -> ChunkGeometry:
        """The canonical chunk geometry of this namespace (:class:`lmtier.geometry.ChunkGeometry`)."""
        return ChunkGeometry(self.num_layers, self.kv_planes, self.num_kv_heads, self.head_size, self.dtype_bytes)

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        """Shape ``(L, P, T, H, D)`` of one full chunk in elements of ``kv_dtype``
        (``[num_layers][kv_planes][chunk_size][num_kv_heads][head_size]``)."""
        return self.geometry.chunk_shape(self.chunk_size)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one full chunk in the canonical (uncompressed) layout
        ``[num_layers][kv_planes][chunk_size][num_kv_heads][head_size]``."""
        return self.geometry.chunk_bytes(self.chunk_size)

    def as_dict(self) -> dict[str, Any]:
        """Public fields as a plain dict (for logs and record headers)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


def _salt_bytes(cache_salt: str | bytes | None) -> bytes:
    if cache_salt is None:
        return b"\x00"
    if isinstance(cache_salt, str):
        raw = cache_salt.encode("utf-8")
    elif isinstance(cache_salt, (bytes, bytearray, memoryview)):
        raw = bytes(cache_salt)
    else:
        raise TypeError(f"cache_salt must be str, bytes or None, got {type(cache_salt).__name__}")
    if not raw:
        return b"\x00"  # "" means "no salt", same as None
    return b"\x01" + _U64.pack(len(raw)) + raw


def _tokens_u32(token_ids: Any) -> np.ndarray:
    """Validate ``token_ids`` and return them as a 1-D little-endian uint32 numpy array."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency of lmtier
        torch = None
    if torch is not None and isinstance(token_ids, torch.Tensor):
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids must be an integer tensor, got dtype {token_ids.dtype}")
        token_ids = token_ids.detach().cpu().numpy()
    if isinstance(token_ids, np.ndarray):
        if token_ids.dtype.kind not in "iu":
            raise TypeError(f"token_ids must be an integer array, got dtype {token_ids.dtype}")
        arr = token_ids
    else:
        try:
            arr = np.frombuffer(array.array("q", token_ids), dtype=np.int64)
        except OverflowError:
            raise ValueError(f"token_ids contain an id outside [0, {_MAX_TOKEN_ID}]") from None
        except TypeError:
            seq = list(token_ids)
            bad = next((t for t in seq if not isinstance(t, (int, np.integer)) or isinstance(t, bool)), None)
            if bad is None:  # e.g. numpy ints that array() rejected
                arr = np.asarray(seq, dtype=np.int64)
            else:
                raise TypeError(f"token_ids must be ints, got {type(bad).__name__} ({bad!r})") from None
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(arr.shape)}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > _MAX_TOKEN_ID:
            raise ValueError(f"token_ids contain an id outside [0, {_MAX_TOKEN_ID}]: min={lo}, max={hi}")
    return arr.astype("<u4", copy=False)


def num_full_chunks(num_tokens: int, chunk_size: int) -> int:
    """Number of full chunks in ``num_tokens`` tokens (the partial tail is not counted)."""
    return num_tokens // chunk_size


def chunk_keys(token_ids: Any, namespace: Namespace, *, cache_salt: str | bytes | None = None) -> list[bytes]:
    """Keys of every *full* chunk of ``token_ids`` in ``namespace``.

    Args:
        token_ids: 1-D token ids: ``list[int]``, a NumPy integer array or a torch integer tensor
            (any device; copied to host). Every id must lie in ``[0, 2**32 - 1]``.
        namespace: the KV namespace (model, geometry, dtype, codec, TP rank, ``chunk_size``).
        cache_salt: optional per-request/tenant salt (vLLM's ``cache_salt``). ``None`` and ``""``
            both mean "no salt"; any non-empty salt gives a disjoint key space. ``str`` salts are
            UTF-8 encoded, so ``"a"`` and ``b"a"`` are the same salt.

    Returns:
        ``len(token_ids) // namespace.chunk_size`` keys of :data:`KEY_BYTES` bytes; key ``i``
        covers tokens ``[i*C, (i+1)*C)`` and, through the chain, all tokens before them. The keys
        of a prefix are a prefix of the keys. The partial tail chunk is not keyed (see module doc).

    Raises:
        TypeError: non-integer ids, or ``cache_salt`` of another type.
        ValueError: ids outside ``[0, 2**32 - 1]``, or ``token_ids`` not 1-D.

    Cost: one BLAKE2b per chunk over ``4 * chunk_size`` bytes (~0.2 ms for 32K tokens).
    """
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
    salt = _salt_bytes(cache_salt)
    toks = _tokens_u32(token_ids)
    chunk = namespace.chunk_size
    n_chunks = toks.shape[0] // chunk
    if n_chunks == 0:
        return []
    ns = namespace.digest()
    h = hashlib.blake2b(_U64.pack(len(ns)) + ns + salt, digest_size=KEY_BYTES, person=_ROOT_PERSON).digest()
    data = memoryview(np.ascontiguousarray(toks[: n_chunks * chunk])).cast("B")
    step = 4 * chunk
    keys: list[bytes] = []
    blake = hashlib.blake2b
    for i in range(n_chunks):
        hasher = blake(h, digest_size=KEY_BYTES, person=_CHUNK_PERSON)
        hasher.update(data[i * step : (i + 1) * step])
        h = hasher.digest()
        keys.append(h)
    return keys
