"""PCA model files for tensor parallelism: one model per distinct slice of KV heads that the ranks hold.

With ``tensor_parallel_size`` = ``tp``, vLLM gives rank ``r`` the KV heads ``[r H/tp, (r+1) H/tp)``
when the checkpoint's ``H`` KV heads divide among the ranks, else (``tp`` a multiple of ``H``) one head,
``r // (tp / H)``, replicated on ``tp / H`` ranks (``vllm/model_executor/layers/linear.py``,
``QKVParallelLinear``: ``num_kv_head_replicas``). A basis spans the values of the heads it was fitted on,
so each slice gets its own :class:`~.model.PCAModel`, fitted on that slice of the calibration KV; the
ranks holding the same slice share one.

File layout (little endian)::

    b"LMTPCATP"     8 bytes magic
    version         uint32 (RANKS_FILE_VERSION)
    tp_size         uint32
    num_kv_heads    uint32: the checkpoint's KV heads (all ranks')
    num_models      uint32: the slices, min(tp_size, num_kv_heads)
    index           num_models x (offset uint64, length uint64) from the file start
    models          each a whole model file (:func:`.model.to_bytes`: its own SHA-256 and model id),
                    at a 64-byte aligned offset, zero padding between
    sha256          32 bytes: SHA-256 of every byte before it

Records name the rank's model (its id and digest), as with one model.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .model import _ALIGN, RANKS_MAGIC, PCAModel, PCAModelError, from_bytes
from .model import to_bytes as model_bytes

__all__ = [
    "RANKS_FILE_VERSION",
    "RANKS_MAGIC",
    "RankModels",
    "rank_heads",
    "load_file",
    "save_ranks",
    "ranks_to_bytes",
    "ranks_from_bytes",
]

RANKS_FILE_VERSION = 1
_HEAD = struct.Struct("<8sIIII")
_ENTRY = struct.Struct("<QQ")
_MAX_MODELS = 1 << 12


def rank_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``(first, end)``: the KV heads rank ``tp_rank`` of ``tp_size`` holds, as vLLM splits them.

    Raises:
        ValueError: ``tp_rank`` outside ``[0, tp_size)``, or ``num_kv_heads`` and ``tp_size`` that
            neither divides (vLLM refuses them too)."""
    h, tp, r = int(num_kv_heads), int(tp_size), int(tp_rank)
    if h < 1 or tp < 1 or not 0 <= r < tp:
        raise ValueError(f"rank {r} of tensor_parallel_size {tp} with {h} KV heads")
    if h >= tp:
        if h % tp:
            raise ValueError(f"{h} KV heads do not split over tensor_parallel_size {tp}")
        return r * (h // tp), (r + 1) * (h // tp)
    if tp % h:
        raise ValueError(f"tensor_parallel_size {tp} is not a multiple of the {h} KV heads")
    first = r // (tp // h)
    return first, first + 1


@dataclass(frozen=True)
class RankModels:
    """The models of a tensor-parallel PCA model file.

    Attributes:
        tp_size: the ranks it was calibrated for.
        num_kv_heads: the checkpoint's KV heads (all ranks').
        models: one :class:`~.model.PCAModel` per slice of heads (:func:`rank_heads`), in head order:
            ``min(tp_size, num_kv_heads)`` of them, each of ``num_heads`` = the slice's heads.
    """

    tp_size: int
    num_kv_heads: int
    models: tuple[PCAModel, ...]

    def __post_init__(self) -> None:
        want = min(self.tp_size, self.num_kv_heads)
        if len(self.models) != want:
            raise PCAModelError(
                f"{len(self.models)} models for tensor_parallel_size {self.tp_size} and {self.num_kv_heads} KV "
                f"heads; {want} expected"
            )
        rank_heads(self.num_kv_heads, self.tp_size, 0)  # a split vLLM makes
        per, first = self.heads_per_rank, self.models[0]
        for i, m in enumerate(self.models):
            if not isinstance(m, PCAModel) or m.num_heads != per:
                got = m.num_heads if isinstance(m, PCAModel) else type(m).__name__
                raise PCAModelError(f"model {i} holds {got} KV heads; each rank holds {per}")
            if (m.num_layers, m.head_size, sorted(m.levels)) != (
                first.num_layers,
                first.head_size,
                sorted(first.levels),
            ):
                raise PCAModelError(
                    f"model {i} has L={m.num_layers}, D={m.head_size}, levels {sorted(m.levels)}; model 0 "
                    f"L={first.num_layers}, D={first.head_size}, levels {sorted(first.levels)}"
                )
            if (m.inv_freq is None) != (first.inv_freq is None) or (
                m.inv_freq is not None and not np.array_equal(m.inv_freq, first.inv_freq)
            ):
                raise PCAModelError(f"model {i}'s rotary frequencies differ from model 0's")
            said = m.info.get("kv_heads")  # the calibration command's record of the slice it fitted
            if said is not None and (not isinstance(said, (list, tuple)) or list(said) != [i * per, (i + 1) * per]):
                raise PCAModelError(
                    f"model {i} was fitted on KV heads {said}, its slot holds [{i * per}, {(i + 1) * per}]"
                )

    @property
    def heads_per_rank(self) -> int:
        """The KV heads each rank holds (and each model spans)."""
        return max(1, self.num_kv_heads // self.tp_size)

    def for_rank(self, tp_rank: int) -> PCAModel:
        """The model of rank ``tp_rank``'s heads. Raises ValueError: a rank outside ``[0, tp_size)``."""
        first, _ = rank_heads(self.num_kv_heads, self.tp_size, tp_rank)
        return self.models[first // self.heads_per_rank]


def ranks_to_bytes(ranks: RankModels) -> bytes:
    """The file's bytes of ``ranks``."""
    blobs = [model_bytes(m) for m in ranks.models]
    off = -(-(_HEAD.size + _ENTRY.size * len(blobs)) // _ALIGN) * _ALIGN
    index, at = [], off
    for b in blobs:
        index.append((at, len(b)))
        at = -(-(at + len(b)) // _ALIGN) * _ALIGN
    out = bytearray(index[-1][0] + index[-1][1])  # a RankModels holds at least one model
    out[: _HEAD.size] = _HEAD.pack(RANKS_MAGIC, RANKS_FILE_VERSION, ranks.tp_size, ranks.num_kv_heads, len(blobs))
    for i, ((o, n), b) in enumerate(zip(index, blobs, strict=True)):
        _ENTRY.pack_into(out, _HEAD.size + _ENTRY.size * i, o, n)
        out[o : o + n] = b
    return bytes(out) + hashlib.sha256(out).digest()


def ranks_from_bytes(data: bytes, where: str = "<bytes>") -> RankModels:
    """Parse and verify a tensor-parallel model file's bytes (``where`` names it in errors).

    Raises:
        PCAModelError: truncated, another version, checksum mismatch, an index outside the file, or a
            model that does not verify or does not fit the split."""

    def bad(why: str) -> PCAModelError:
        return PCAModelError(f"PCA model {where}: {why}; not used")

    if len(data) < _HEAD.size + 32:
        raise bad(f"truncated ({len(data)} bytes)")
    magic, version, tp, h, count = _HEAD.unpack_from(data, 0)
    if magic != RANKS_MAGIC:
        raise bad(f"not a tensor-parallel PCA model file (magic {bytes(magic)!r})")
    if version != RANKS_FILE_VERSION:
        raise bad(f"tensor-parallel file version {version}, this reader knows {RANKS_FILE_VERSION}")
    if hashlib.sha256(data[:-32]).digest() != data[-32:]:
        raise bad("checksum mismatch (corrupted or truncated)")
    try:  # the split before any model is read: a count or split vLLM cannot make reads nothing
        rank_heads(h, tp, 0)
    except ValueError as e:
        raise bad(str(e)) from None
    if count != min(tp, h):
        raise bad(f"{count} models for tensor_parallel_size {tp} and {h} KV heads; {min(tp, h)} expected")
    if not 0 < count <= _MAX_MODELS or _HEAD.size + _ENTRY.size * count > len(data) - 32:
        raise bad(f"an index of {count} models does not fit")
    spans, at = [], _HEAD.size + _ENTRY.size * count
    for i in range(count):  # ascending, disjoint, aligned: the file's bytes bound what is parsed
        o, n = _ENTRY.unpack_from(data, _HEAD.size + _ENTRY.size * i)
        if o < at or o % _ALIGN or n > len(data) - 32 - o:
            raise bad(f"model {i} lies outside the file or over another (offset {o}, {n} bytes)")
        spans.append((o, n))
        at = o + n
    models = [from_bytes(data[o : o + n], f"{where} (model {i} of {count})") for i, (o, n) in enumerate(spans)]
    try:
        return RankModels(tp, h, tuple(models))
    except (PCAModelError, ValueError) as e:
        raise bad(str(e)) from None


def load_file(path: str | Path) -> PCAModel | RankModels:
    """Read and verify a PCA model file: one model (:func:`.model.load`) or one per slice of KV heads
    (:class:`RankModels`), as its magic says. Raises PCAModelError, OSError."""
    data = Path(path).read_bytes()
    if data[: len(RANKS_MAGIC)] == RANKS_MAGIC:
        return ranks_from_bytes(data, str(path))
    return from_bytes(data, str(path))


def save_ranks(ranks: RankModels, path: str | Path) -> list[int]:
    """Write ``ranks`` to ``path`` atomically (mode 0600); returns each model's
    :attr:`~.model.PCAModel.model_id`, in head order."""
    from lmtier.codec.autotables import write_table_file

    write_table_file(path, ranks_to_bytes(ranks))
    return [m.model_id for m in ranks.models]
