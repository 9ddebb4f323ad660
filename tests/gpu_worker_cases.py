"""What the GPU worker tests share (tests/test_gpu_connector_worker.py,
tests/test_gpu_connector_worker_loads.py): the geometry, a CUDA paged KV cache in vLLM's layouts
(:class:`Cache`, with its reference gather / scatter from :mod:`lmtier.reference`), a
:class:`~lmtier.integration.vllm.worker.ConnectorWorker` over a pinned CPU pool (and a DiskTier),
tokens, block lists, and the waits for a request's stores. Needs a CUDA device to build a cache."""

from __future__ import annotations

import time

import torch

from lmtier import reference
from lmtier.integration.vllm.worker import ConnectorWorker, StoreOp
from lmtier.keys import Namespace, chunk_keys
from lmtier.layout import KVLayout, make_paged_kv_cache
from lmtier.manager import TierManager
from lmtier.tiers.cpu import CPUPool
from tests.test_connector_worker import Recorder  # one definition of the worker callbacks' recorder

LAYERS, HEADS, HEAD = 6, 8, 128
CHUNK = 64
LOGICAL_BLOCKS = 24
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of GPU time at H200 clocks
_NS_DTYPE = {torch.bfloat16: "bfloat16", torch.uint8: "fp8_e4m3"}

ORDERS = ["LBNHC", "BLHNC"]
DTYPES = [torch.bfloat16, torch.uint8]  # uint8 = an fp8 cache as vLLM hands it over
SPLITS = [(16, 16), (32, 16)]  # (vLLM block size, kernel block size)

SRC = [3, 17, 5, 0, 9, 12, 21, 8, 15, 2, 19, 6]
DST = [20, 1, 14, 7, 22, 4, 11, 23, 10, 16, 13, 18]


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(raw_bytes(a), raw_bytes(b))


class Cache:
    """A CUDA paged KV cache of ``LOGICAL_BLOCKS`` vLLM blocks in one buffer of physical ``order``."""

    def __init__(self, order="LBNHC", dtype=torch.bfloat16, bs=16, kbs=16, *, seed=0):
        self.order, self.dtype, self.bs, self.kbs = order, dtype, bs, kbs
        self.kernel_blocks = LOGICAL_BLOCKS * (bs // kbs)
        self.buf, self.views = self._alloc()
        self.randomize(seed)
        self.layout = KVLayout.from_layer_views(self.views, kind="kv")

    def _alloc(self):
        return make_paged_kv_cache(
            self.order,
            num_layers=LAYERS,
            num_blocks=self.kernel_blocks,
            block_size=self.kbs,
            num_heads=HEADS,
            head_size=HEAD,
            dtype=self.dtype,
            device="cuda",
            kind="kv",
        )

    def randomize(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        n = self.buf.numel() * self.buf.element_size()
        self.buf.view(-1).view(torch.uint8).copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))

    def like(self, seed: int | None = None) -> Cache:
        """Another buffer of the same geometry: random (``seed``) or a copy of this one."""
        c = object.__new__(Cache)
        c.__dict__.update(self.__dict__)
        c.buf, c.views = self._alloc()
        if seed is None:
            c.buf.copy_(self.buf)
        else:
            c.randomize(seed)
        c.layout = KVLayout.from_layer_views(c.views, kind="kv")
        return c

    def slots(self, block_ids, start: int, stop: int) -> torch.Tensor:
        t = torch.arange(start, stop)
        return (torch.as_tensor(block_ids)[t // self.bs] * self.bs + t % self.bs).view(1, -1)

    def rows(self, block_ids, start: int, stop: int) -> torch.Tensor:
        """Reference canonical rows ``[1, L, 2, T, H, D]`` of tokens ``[start, stop)``."""
        return reference.gather_ref(self.views, self.slots(block_ids, start, stop), kind="kv")

    def tokens(self, block_ids, start: int, stop: int) -> torch.Tensor:
        return raw_bytes(self.rows(block_ids, start, stop)).cpu()

    def scatter_ref(self, block_ids, start: int, stop: int, rows: torch.Tensor) -> None:
        reference.scatter_ref(self.views, self.slots(block_ids, start, stop), rows, kind="kv")


def namespace_of(dtype) -> Namespace:
    return Namespace(
        model="test-gpu-worker",
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_size=HEAD,
        kv_dtype=_NS_DTYPE[dtype],
        chunk_size=CHUNK,
    )


def cpu_pool(ns: Namespace, slots: int = 40) -> CPUPool:
    return CPUPool(slots * (ns.chunk_bytes + 4096), ns.chunk_bytes)  # pinned arena (a CUDA device is present)


def disk_tier(tmp_path):
    from lmtier.tiers.disk import DiskTier

    return DiskTier([str(tmp_path / "disk")], 256 << 20, sync="none", use_kvikio="never")


def make_worker(cache: Cache, managers, manager=None, **kw):
    ns = namespace_of(cache.dtype)
    mgr = manager or TierManager(cpu=cpu_pool(ns))
    managers.append(mgr)
    rec = Recorder()
    w = ConnectorWorker(
        cache.layout,
        mgr,
        chunk_size=CHUNK,
        block_size=cache.bs,
        namespace=ns,
        on_stat=rec.stat,
        on_stored=rec.on_stored,
        **kw,
    )
    assert w.is_cuda and w.store_engine is not None
    return w, mgr, rec


def random_tokens(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=g).tolist()


def blocks_for(cache: Cache, ids: list[int], ntok: int) -> list[int]:
    return ids[: -(-ntok // cache.bs)]


def wait_reported(w: ConnectorWorker, rid: str, timeout_s: float = 30.0) -> None:
    """Poll ``finished_sending`` (as ``get_transfer_results`` does each step) until ``rid`` is reported."""
    deadline = time.monotonic() + timeout_s
    while rid not in w.finished_sending():
        assert time.monotonic() < deadline, f"{rid} never reported in finished_sending"
        time.sleep(0.001)


def finish_request(w: ConnectorWorker, rid: str) -> None:
    """The request finished (``request_finished`` -> True): wait until the worker releases its blocks."""
    if rid not in w.finished_sending([rid]):
        wait_reported(w, rid)


def pool_chunk(mgr: TierManager, key: bytes, nbytes: int) -> torch.Tensor:
    slot = mgr.cpu.acquire(key)
    assert slot is not None, "chunk not in the CPU pool"
    try:
        return slot.view[:nbytes].clone()
    finally:
        mgr.cpu.release(slot)


def stored_through_to_disk(cache: Cache, managers, tmp_path, *, seed: int, chunks: int = 2, disk=None, **worker_kw):
    """A worker (``worker_kw``: more of its arguments) over a CPU pool + ``disk`` (default: a
    DiskTier in ``tmp_path``) that stored ``chunks`` chunks of ``random_tokens(chunks * CHUNK, seed)``
    from blocks SRC and wrote them through to disk. Returns ``(worker, manager, recorder, tokens,
    src blocks, dst blocks, keys)``."""
    ns = namespace_of(cache.dtype)
    mgr = TierManager(cpu=cpu_pool(ns), disk=disk if disk is not None else disk_tier(tmp_path))
    w, _, rec = make_worker(cache, managers, mgr, **worker_kw)
    n = chunks * CHUNK
    toks = random_tokens(n, seed=seed)
    src, dst = blocks_for(cache, SRC, n), blocks_for(cache, DST, n)
    keys = chunk_keys(toks, ns)
    w.store(StoreOp("stored", toks, None, 0, src))
    finish_request(w, "stored")
    assert mgr.flush(timeout_s=60)
    assert all(mgr.disk.contains(k) for k in keys), "publish did not write the chunks through to disk"
    return w, mgr, rec, toks, src, dst, keys
