"""Layer-by-layer loads vs loading before the forward, through the connector's worker code (CUDA).

What ``LMTierConnector`` does on a CPU-tier hit, without vLLM: the prefix's chunks (``--chunk``
tokens, canonical bytes) sit in lmtier's pinned CPU pool; a request of ``N`` cached + ``--new``
tokens arrives. Time to the end of its forward (host wall clock, ``torch.cuda.synchronize`` at the
end), median of ``--iters``:

* ``sync``      — ``ConnectorWorker.load`` (all chunks into the paged cache, waited for: what
  ``start_load_kv`` does with ``layerwise_loads`` off), then the forward;
* ``layerwise`` — ``ConnectorWorker.load_layerwise`` + per layer ``wait_layer(l)`` right before layer
  ``l``'s attention (``wait_for_layer_load``), ``finish_layerwise`` after the forward;
* ``lw_P:Q[:R]`` (``--variants``) — layer by layer with ``P`` layers per event, stream priority ``Q``
  and ``R`` staging ring slots (the shipped default: ``num_layers // 8`` layers per event, the
  highest priority, the worker's ring);
* ``forward``   — the forward alone, KV resident (the floor); ``load`` — ``ConnectorWorker.load`` alone;
  ``memcpy``    — one contiguous pinned host-to-device copy of the same bytes (the link's ceiling).

The forward is a synthetic decoder with a model's real per-layer work (``--preset``, default
Llama-3.1-8B: bf16 weights of the right shapes — QKV, O, gate/up, down — random, and SDPA of the
new tokens over the layer's KV read from the paged cache through the request's block ids), one
layer after the other on the current stream; it reads exactly the blocks the load writes, so a
missing wait shows up as a wrong result. ``layerwise`` is checked against ``sync``: the attention
outputs of the last layer must be bit-identical, and the loaded cache must equal the stored bytes.

Run on a CUDA machine: ``python benchmarks/bench_layerwise.py [--lengths 1024,4096,16384] [--json F]``
(without CUDA it runs on the CPU as a smoke test: ``--preset tiny --lengths 512``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lmtier.bench.common import print_table, system_header, write_json
from lmtier.integration.vllm.worker import ConnectorWorker, LoadOp, StoreOp
from lmtier.keys import Namespace
from lmtier.layout import KVLayout, make_paged_kv_cache
from lmtier.manager import TierManager
from lmtier.tiers.cpu import CPUPool
from lmtier.transfer import CudaTransferEngine

SHAPES = {
    # layers, hidden, q heads, kv heads, head dim, intermediate
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336),
    "qwen2.5-7b": (28, 3584, 28, 4, 128, 18944),
    "llama-3.1-70b-tp8": (80, 8192, 8, 1, 128, 3584),
    "tiny": (4, 256, 4, 2, 64, 512),  # CPU smoke runs
}


class Decoder:
    """Per-layer work of a Llama-shaped decoder for ``q`` new tokens over a paged KV cache."""

    def __init__(self, shape, views: list[torch.Tensor], block_size: int, dev) -> None:
        L, hid, hq, hkv, d, inter = shape
        self.L, self.hid, self.hq, self.hkv, self.d = L, hid, hq, hkv, d
        self.views = views
        self.bs = block_size
        g = torch.Generator(device=dev).manual_seed(0)
        mk = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g) * 0.02  # noqa: E731
        self.w = [(mk(hid, (hq + 2 * hkv) * d), mk(hq * d, hid), mk(hid, 2 * inter), mk(inter, hid)) for _ in range(L)]

    @staticmethod
    def norm(x: torch.Tensor) -> torch.Tensor:  # RMSNorm without a weight (keeps 32 random layers finite)
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)

    def layer(self, l: int, x: torch.Tensor, blocks: torch.Tensor, n_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        wqkv, wo, wgu, wd = self.w[l]
        q_len = x.shape[0]
        qkv = self.norm(x) @ wqkv
        q = qkv[:, : self.hq * self.d].view(q_len, self.hq, self.d).transpose(0, 1)
        # the cached context: this layer's [B, H, N, 2D] view at the request's blocks
        kv = self.views[l].index_select(0, blocks)  # [nb, H, N, 2D]
        kv = kv.permute(1, 0, 2, 3).reshape(self.hkv, -1, 2 * self.d)[:, :n_ctx]
        k = kv[..., : self.d].repeat_interleave(self.hq // self.hkv, 0)
        v = kv[..., self.d :].repeat_interleave(self.hq // self.hkv, 0)
        att = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)).squeeze(0)
        h = x + att.transpose(0, 1).reshape(q_len, -1) @ wo
        gu = self.norm(h) @ wgu
        gate, up = gu.chunk(2, dim=-1)
        return h + (F.silu(gate) * up) @ wd, att

    def forward(self, x, blocks, n_ctx, wait=None):
        att = None
        for l in range(self.L):
            if wait is not None:
                wait(l)
            x, att = self.layer(l, x, blocks, n_ctx)
        return x, att


def _memcpy_timer(nbytes: int, dev: torch.device, cuda: bool, sync) -> Callable[[], None]:
    """A function copying `nbytes` bytes host -> `dev` in one copy (pinned host memory when `cuda`), then `sync()`.

    The host and device buffers live as long as the returned function.
    """
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    devbuf = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def t_memcpy():
        devbuf.copy_(host, non_blocking=True)
        sync()

    return t_memcpy


def run(args) -> dict:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shape = SHAPES[args.preset]
    L, hid, hq, hkv, d, _ = shape
    bs, chunk = args.block_size, args.chunk
    lengths = [int(x) for x in args.lengths.split(",")]
    n_max = max(lengths)
    per_req_blocks = -(-(n_max + args.new) // bs)
    num_blocks = 2 * per_req_blocks + 8
    buf, views = make_paged_kv_cache(
        args.order,
        num_layers=L,
        num_blocks=num_blocks,
        block_size=bs,
        num_heads=hkv,
        head_size=d,
        dtype=torch.bfloat16,
        device=dev,
    )
    buf.normal_()  # finite values (the attention reads the new tokens' blocks too)
    layout = KVLayout.from_layer_views(views, kind="kv")
    ns = Namespace(
        model=f"bench-{args.preset}", num_layers=L, num_kv_heads=hkv, head_size=d, kv_dtype="bfloat16", chunk_size=chunk
    )
    n_chunks = n_max // chunk
    pool = CPUPool((n_chunks + 4) * (ns.chunk_bytes + 4096), ns.chunk_bytes)
    mgr = TierManager(cpu=pool)
    w = ConnectorWorker(layout, mgr, chunk_size=chunk, block_size=bs, namespace=ns)
    dec = Decoder(shape, views, bs, dev)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    src, dst = perm[:per_req_blocks], perm[per_req_blocks : 2 * per_req_blocks]
    toks = torch.randint(0, 100_000, (n_max,), generator=torch.Generator().manual_seed(2)).tolist()
    w.store(StoreOp("prefix", toks, None, 0, src))
    w.poll_stores(block=True)
    sync()
    x0 = torch.randn(
        args.new, hid, device=dev, dtype=torch.bfloat16, generator=torch.Generator(device=dev).manual_seed(3)
    )
    rows = []
    for n in lengths:
        n = n // chunk * chunk
        ntok = n + args.new
        blocks = torch.tensor(dst[: -(-ntok // bs)], device=dev)
        op = LoadOp("r", toks[:n], None, 0, dst[: -(-ntok // bs)])
        nbytes = n // chunk * ns.chunk_bytes

        def poison():  # the load destination holds NaNs before every run
            for v in views:
                v.index_fill_(0, blocks[: n // bs], float("nan"))

        def t_sync():
            assert w.load(op) == set()
            out = dec.forward(x0, blocks, ntok)
            sync()
            return out

        def t_layerwise():
            assert w.load_layerwise([op]) == {}
            out = dec.forward(x0, blocks, ntok, wait=w.wait_layer)
            unsafe = w.finish_layerwise()
            sync()
            w.drain_layerwise()
            assert unsafe == {}
            return out

        def t_forward():
            out = dec.forward(x0, blocks, ntok)
            sync()
            return out

        def t_load():
            assert w.load(op) == set()

        t_memcpy = _memcpy_timer(nbytes, dev, cuda, sync)  # owns its buffers: `del t_memcpy` frees them

        def timed(fn, prep=None):
            xs = []
            for i in range(args.warmup + args.iters):
                if prep is not None:
                    prep()
                sync()
                t0 = time.perf_counter()
                fn()
                dt = (time.perf_counter() - t0) * 1e3
                if i >= args.warmup:
                    xs.append(dt)
            return statistics.median(xs)

        # correctness first: layerwise == sync, bit for bit, on a poisoned destination
        poison()
        ref_x, ref_att = t_sync()
        ref_cache = torch.stack([v.index_select(0, blocks[: n // bs]) for v in views]).clone()
        poison()
        got_x, got_att = t_layerwise()
        got_cache = torch.stack([v.index_select(0, blocks[: n // bs]) for v in views])
        cache_exact = bool(torch.equal(ref_cache.view(torch.int16), got_cache.view(torch.int16)))
        out_exact = bool(torch.equal(ref_x.view(torch.int16), got_x.view(torch.int16)))
        finite = bool(torch.isfinite(got_x.float()).all())
        exact = cache_exact and out_exact and finite
        if not exact:
            print(
                f"N={n}: layerwise vs sync: cache bit-exact {cache_exact}, output bit-exact {out_exact} "
                f"(max |diff| {(ref_x.float() - got_x.float()).abs().max().item():.3g}), finite {finite}"
            )
        row = {"N": n, "MiB": round(nbytes / 2**20, 1)}
        row["forward_ms"] = timed(t_forward)
        row["memcpy_ms"] = timed(t_memcpy)
        row["load_ms"] = timed(t_load, poison)
        row["sync_ms"] = timed(t_sync, poison)
        row["layerwise_ms"] = timed(t_layerwise, poison)
        if cuda:  # other layer-engine settings (layers per event, stream priority) than the default
            shipped = w._layers.engine
            for name in args.variants.split(","):
                if not name:
                    continue
                lpp, prio, ring = ([int(v) for v in name.split(":")] + [3])[:3]
                w._layers.engine = CudaTransferEngine(layout, chunk, layers_per_piece=lpp, priority=prio, ring=ring)
                poison()
                t_layerwise()
                got = torch.stack([v.index_select(0, blocks[: n // bs]) for v in views])
                exact = exact and bool(torch.equal(ref_cache.view(torch.int16), got.view(torch.int16)))
                row[f"lw_{name}_ms"] = timed(t_layerwise, poison)
            w._layers.engine = shipped
        row["ideal_ms"] = max(row["memcpy_ms"], row["forward_ms"])
        row["layerwise/sync"] = row["layerwise_ms"] / row["sync_ms"]
        row["load_pct_memcpy"] = 100 * row["memcpy_ms"] / row["load_ms"]
        row["bit_exact"] = exact
        rows.append(row)
        print(
            f"N={n}: sync {row['sync_ms']:.2f} ms, layerwise {row['layerwise_ms']:.2f} ms "
            f"({row['layerwise/sync']:.3f}x), forward {row['forward_ms']:.2f}, load {row['load_ms']:.2f}, "
            f"memcpy {row['memcpy_ms']:.2f}, bit-exact {exact}",
            flush=True,
        )
        del t_memcpy
    w.close()
    mgr.close(persist=False)
    return {
        "system": system_header(),
        "preset": args.preset,
        "chunk": chunk,
        "block_size": bs,
        "new": args.new,
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--new", type=int, default=64, help="new (uncached) prompt tokens per request")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--order", default="LBNHC", choices=["LBNHC", "BLHNC"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--variants",
        default="2:-64,4:0,8:-64,4:-64:8,4:-64:16,2:-64:16",
        help="extra layer-by-layer settings to time, comma-separated "
        "LAYERS_PER_EVENT:STREAM_PRIORITY[:RING_SLOTS] (ring default 3)",
    )
    p.add_argument("--json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: running on the CPU (a smoke run; nothing overlaps there)")
    res = run(args)
    extra = [k for k in res["rows"][0] if k.startswith("lw_")] if res["rows"] else []
    print_table(
        res["rows"],
        [
            "N",
            "MiB",
            "memcpy_ms",
            "load_ms",
            "forward_ms",
            "sync_ms",
            "layerwise_ms",
            *extra,
            "ideal_ms",
            "layerwise/sync",
            "bit_exact",
        ],
    )
    write_json(args.json, res)


if __name__ == "__main__":
    main()
