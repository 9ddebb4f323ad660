"""Chunk keys: a stable cryptographic hash chain over token ids inside a KV namespace.

A *chunk* is ``chunk_size`` consecutive tokens of KV cache for all layers of one tensor-parallel
rank. Every full chunk of a prompt gets a 32-byte key::

    h_0 = BLAKE2b-256(person="lmtier-root", uint64_le(len(ns_digest)) || ns_digest || scope_encoding)
    h_i = BLAKE2b-256(person="lmtier-chunk", h_{i-1} || uint32_le(tokens[(i-1)*C : i*C]))

so key ``i`` commits to the namespace, the request's scope and *every* token of chunks ``1..i`` (a
prefix hash chain, as in vLLM's prefix caching, ``vllm/v1/core/kv_cache_utils.py::hash_block_tokens``,
but with a cryptographic hash so keys can be shared between tenants, processes and machines).
Nothing here depends on Python's ``hash()``, ``repr`` or ``PYTHONHASHSEED``: keys are identical in
every process of every machine.

The :class:`Namespace` binds everything that makes KV bytes incompatible: model identity, KV
geometry and dtype, canonical-format version, codec and the tensor-parallel rank/size. Two
namespaces that differ in any field produce disjoint key spaces.

The :class:`KeyScope` binds what separates KV of equal token ids *within* a namespace: the
client's ``cache_salt``, the LoRA adapter, the multimodal inputs and prompt embeddings. Its
encoding (:meth:`KeyScope.encoding`) is injective: every field is tagged, optional fields carry a
presence byte, strings and bytes are length-prefixed and the fields come in a fixed order, so no
value of one field (a ``cache_salt`` of ``"lora=sql#1@/a"``, a delimiter, NUL, 1 MiB of text) can
spell another field or another composition. A plain ``cache_salt`` argument is the scope with only
that field set. (Up to format version 1 the vLLM connector joined these fields into one delimited
``cache_salt`` string, which a client-chosen salt could reproduce: issue 20; version 2 keys differ
from every version-1 key, so old records are misses.)

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
    "KeyScope",
    "LoraScope",
    "MMInput",
    "Namespace",
    "chunk_keys",
    "num_full_chunks",
]

_MAX_TOKEN_ID = 2**32 - 1
_ROOT_PERSON = b"lmtier-root"
_CHUNK_PERSON = b"lmtier-chunk"
_NS_PERSON = b"lmtier-ns"
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_SCOPE_MAGIC = b"LMTSCOPE\x02"  # the scope encoding of format version 2 (see KeyScope.encoding)


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


def _enc_bytes(tag: bytes, raw: bytes) -> bytes:
    return tag + _U64.pack(len(raw)) + raw


def _enc_opt(tag: bytes, body: bytes | None) -> bytes:
    # A presence byte, then the (self-delimiting) body: absent and present-but-empty never meet.
    return tag + (b"\x00" if body is None else b"\x01" + body)


def _as_salt(value: Any) -> bytes | None:
    """``cache_salt`` as bytes; ``None`` for no salt (``None``, ``""`` and ``b""``)."""
    if value is None:
        return None
    if isinstance(value, str):
        raw = value.encode("utf-8")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
    else:
        raise TypeError(f"cache_salt must be str, bytes or None, got {type(value).__name__}")
    return raw or None  # "" means "no salt", as in vLLM (its prefix cache and its OpenAI validator)


def _check_str(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be a str, got {type(value).__name__} ({value!r})")


def _check_int(owner: str, name: str, value: Any) -> None:
    if type(value) is not int or not -(2**63) <= value < 2**63:
        raise TypeError(f"{owner}.{name} must be an int in the signed 64-bit range, got {value!r}")


@dataclass(frozen=True)
class LoraScope:
    """The LoRA adapter a request runs with (vLLM's ``LoRARequest``).

    Args:
        name: ``lora_name``; int_id: ``lora_int_id``; path: ``lora_path`` (any strs / int, encoded
            length-prefixed, so e.g. a name containing ``"#"`` or ``"@"`` cannot imitate another
            adapter). vLLM's own prefix cache keys LoRA by name and path
            (``vllm/v1/core/kv_cache_utils.py::_gen_lora_extra_hash_keys``); the id is added so an
            adapter loaded again under a new id is a miss, never a stale hit.

    Raises:
        TypeError: a field of another type.
    """

    name: str
    int_id: int
    path: str

    def __post_init__(self) -> None:
        _check_str("LoraScope", "name", self.name)
        _check_int("LoraScope", "int_id", self.int_id)
        _check_str("LoraScope", "path", self.path)

    def _encode(self) -> bytes:
        return _enc_str(b"n", self.name) + _enc_int(b"i", self.int_id) + _enc_str(b"p", self.path)


@dataclass(frozen=True)
class MMInput:
    """One multimodal input of a request (vLLM's ``MultiModalFeatureSpec``).

    Args:
        identifier: the input's content hash (``identifier``, else ``mm_hash``); offset, length:
            its placeholder tokens in the prompt (``mm_position.offset`` / ``.length``, tokens).

    Raises:
        TypeError: a field of another type.
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        _check_str("MMInput", "identifier", self.identifier)
        _check_int("MMInput", "offset", self.offset)
        _check_int("MMInput", "length", self.length)

    def _encode(self) -> bytes:
        return _enc_str(b"h", self.identifier) + _enc_int(b"o", self.offset) + _enc_int(b"l", self.length)


@dataclass(frozen=True)
class KeyScope:
    """What separates the KV of equal token ids inside one :class:`Namespace`.

    Args:
        cache_salt: the client's / tenant's salt (vLLM's ``cache_salt``): ``str`` (UTF-8 encoded,
            so ``"a"`` and ``b"a"`` are the same salt), ``bytes`` or ``None``. ``None``, ``""`` and
            ``b""`` all mean "no salt" (as in vLLM, whose prefix cache ignores an empty salt and
            whose OpenAI server rejects it); stored normalised (``bytes`` or ``None``).
        lora: the LoRA adapter, or ``None`` for the base model.
        mm: the multimodal inputs in prompt order (a tuple of :class:`MMInput`; a list is
            converted).
        prompt_embeds: a digest of the request's prompt embeddings (vLLM's mixed token/embedding
            prompts, whose embedded positions hold placeholder token ids), or ``None``.

    Every field enters :meth:`encoding` tagged and length-prefixed, so two scopes have the same
    encoding (and the same keys) only if all their fields are equal.

    Raises:
        TypeError: a field of another type.
    """

    cache_salt: str | bytes | None = None
    lora: LoraScope | None = None
    mm: tuple[MMInput, ...] = ()
    prompt_embeds: bytes | None = None
    _encoding: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_salt", _as_salt(self.cache_salt))
        if self.lora is not None and not isinstance(self.lora, LoraScope):
            raise TypeError(f"KeyScope.lora must be a LoraScope or None, got {type(self.lora).__name__}")
        if not isinstance(self.mm, (tuple, list)) or not all(isinstance(m, MMInput) for m in self.mm):
            raise TypeError(f"KeyScope.mm must be a tuple of MMInput, got {self.mm!r}")
        object.__setattr__(self, "mm", tuple(self.mm))
        if self.prompt_embeds is not None and not isinstance(self.prompt_embeds, bytes):
            raise TypeError(f"KeyScope.prompt_embeds must be bytes or None, got {type(self.prompt_embeds).__name__}")
        parts = [
            _SCOPE_MAGIC,
            _enc_opt(b"s", None if self.cache_salt is None else _U64.pack(len(self.cache_salt)) + self.cache_salt),
            _enc_opt(b"L", None if self.lora is None else self.lora._encode()),
            b"M" + _U64.pack(len(self.mm)) + b"".join(m._encode() for m in self.mm),
            _enc_opt(b"E", None if self.prompt_embeds is None else _enc_bytes(b"e", self.prompt_embeds)),
        ]
        object.__setattr__(self, "_encoding", b"".join(parts))

    @property
    def is_empty(self) -> bool:
        """True when no field is set (the unsalted base-model key space)."""
        return self.cache_salt is None and self.lora is None and not self.mm and self.prompt_embeds is None

    def encoding(self) -> bytes:
        """The injective byte encoding hashed into every key's root (see the module doc):
        ``b"LMTSCOPE\\x02"`` then, in this order, ``s`` salt, ``L`` LoRA (name, id, path), ``M``
        multimodal inputs (count, then identifier, offset, length each), ``E`` prompt-embeds digest;
        optional fields carry a presence byte, strs/bytes a uint64_le length, ints are int64_le."""
        return self._encoding


def _scope(cache_salt: Any) -> KeyScope:
    if isinstance(cache_salt, KeyScope):
        return cache_salt
    return KeyScope(cache_salt=cache_salt)


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


def chunk_keys(
    token_ids: Any, namespace: Namespace, *, cache_salt: str | bytes | KeyScope | None = None
) -> list[bytes]:
    """Keys of every *full* chunk of ``token_ids`` in ``namespace``.

    Args:
        token_ids: 1-D token ids: ``list[int]``, a NumPy integer array or a torch integer tensor
            (any device; copied to host). Every id must lie in ``[0, 2**32 - 1]``.
        namespace: the KV namespace (model, geometry, dtype, codec, TP rank, ``chunk_size``).
        cache_salt: optional per-request/tenant salt (vLLM's ``cache_salt``), or a whole
            :class:`KeyScope` (salt, LoRA adapter, multimodal inputs, prompt embeddings). ``None``,
            ``""`` and ``b""`` all mean "no salt"; any non-empty salt gives a disjoint key space.
            ``str`` salts are UTF-8 encoded, so ``"a"`` and ``b"a"`` are the same salt. A plain salt
            ``s`` is the same as ``KeyScope(cache_salt=s)``; no salt string equals any scope with a
            LoRA adapter, multimodal input or prompt embeddings set.

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
    scope = _scope(cache_salt).encoding()
    toks = _tokens_u32(token_ids)
    chunk = namespace.chunk_size
    n_chunks = toks.shape[0] // chunk
    if n_chunks == 0:
        return []
    ns = namespace.digest()
    h = hashlib.blake2b(_U64.pack(len(ns)) + ns + scope, digest_size=KEY_BYTES, person=_ROOT_PERSON).digest()
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
