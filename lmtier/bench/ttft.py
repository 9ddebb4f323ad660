"""``lmtier bench ttft``: time to first token, recomputing the prefill vs loading its KV from a tier.

Model: a Llama-3.1-8B-shaped ``transformers`` ``LlamaForCausalLM`` with random weights (bf16, SDPA;
compute cost is what matters), ``--model PATH`` for a real local model, ``--preset tiny`` for CPU
smoke runs. Per context length ``N`` (median of ``--iters`` after ``--warmup`` runs):

* ``recompute`` — prefill of ``N + 1`` tokens until the logits of the last position exist.
* ``cpu`` — the prefix's KV (``N`` tokens, built once by a prefill) sits in pinned host memory as
  canonical chunks (``[L][2][T][H][D]``, ``--chunk-tokens`` 256; the tail chunk holds only the
  valid tokens). TTFT = host->device copy of the KV + a lean forward of the last token, overlapped
  layer by layer: the copies of layer ``l`` (one contiguous K run and one V run per chunk, straight
  into the per-layer ``[N + 1, H, D]`` buffers the attention reads through a ``[1, H, N + 1, D]``
  view) run on a side stream and record one event per layer; the forward (our own loop over
  ``model.model.layers``, no ``generate``/cache machinery) waits on layer ``l``'s event right
  before layer ``l``'s attention. On CUDA the lean forward runs as CUDA graphs (``--graphs auto``;
  :class:`GraphForward`: one graph per decoder layer, one for the embedding, one for norm +
  ``lm_head``, captured per N over static buffers; layer ``l``'s graph is replayed after the
  stream waits on layer ``l``'s load event), falling back to eager with a printed reason if capture
  fails (``fwd_mode`` per row). ``load_ms`` (copies alone), ``fwd_ms`` (forward alone, KV resident,
  the mode used), ``fwd_eager_ms`` and ``cpu_eager_ms`` (the eager forward) are reported too, plus
  (``--compare-layouts``) the eager forward with contiguous ``[1, H, N, D]`` K/V and the GPU
  transpose that would produce them (the alternative to the strided view).
* ``disk`` — the chunks as :class:`lmtier.tiers.disk.DiskTier` records (O_DIRECT, checksummed) in
  ``--disk-dir``; the page cache is dropped once per N when permitted (before every load if
  O_DIRECT is unavailable). Chunk reads (``--inflight`` in flight, a ring of pinned slots) are pipelined with their H2D copies; the last chunk's copies are
  issued layer by layer so the forward overlaps them.
* ``disk+codec`` (level ``default``) and ``disk+<level>`` (``--codec-levels``, default
  ``default,lossless``) — the chunks as :mod:`lmtier.codec` records (quantize + rANS, encoded once
  when stored, untimed) in the disk tier; the load reads the (smaller) records, copies them to the
  device and decodes them there (batched rANS + dequantize on the copy stream), pipelined with the
  reads, the last chunk in layer groups overlapped with the forward (:class:`CodecTier`).
  ``*_ratio`` = bf16 bytes / record bytes (whole records: header, index, streams). Lossy levels'
  records use static rANS tables calibrated untimed on the same model's KV of *other* input (random
  token ids of another seed; ``--codec-tables``, :func:`setup_codec_tables`), uploaded to the
  device once; ``--codec-tables none`` gives per-stream tables. Lossy levels are checked bit for bit
  against the reference decoder (:func:`lmtier.codec.quant.dequantize`); their logits are reported, not judged.
* ``redis`` / ``redis+codec`` — like disk / disk+codec (level ``default``) through
  :class:`lmtier.tiers.redis.RedisTier`: against ``--redis-url`` (or ``$LMTIER_REDIS_URL``), else a
  private ``redis-server`` on loopback when one is found (``$LMTIER_REDIS_SERVER``, PATH, or the bundle
  ``scripts/bundle_redis.sh`` leaves in ``.whl/redis``); skipped with a line otherwise.

Reads: ``--inflight`` (default 4) records in flight, each ``get_into`` a pinned, page-aligned slot of a
ring of ``--ring`` (default 6), so O_DIRECT reads land in pinned memory with no bounce; the disk's own
parallel ceiling (``--inflight`` O_DIRECT reads of 8 MiB at once) is measured next to ``dd`` and gives
``disk+*_limit_pct`` (record bytes / the better of the two).

Ceilings measured in the same run: pinned H2D bandwidth (contiguous copy) -> the CPU tier's
physical limit ``N x bytes/token / BW``; ``dd`` O_DIRECT read bandwidth of the disk directory ->
the disk tier's limit. Correctness: every cached path's next-token logits are compared with the
recompute logits (max abs diff <= RTOL x max|logit| and cosine >= MIN_COS, see below; loaded KV
buffers are NaN-filled first so a path that skips a byte cannot pass), and the loaded prefix KV must
equal the prefill's bit for bit (the hard guard); a control (chunk 0's KV loaded where chunk 1
belongs: a wrong-index load) shows how far a wrong path lands.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F

from lmtier.bench.common import print_table, progress, system_header, write_json

DEFAULT_LENGTHS = "1024,2048,4096,7500,16384,32768"

MODEL_PRESETS = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5),
    # one tensor-parallel rank of Llama-3.1-70B at TP8: 8 query heads, 1 KV head, a 1/8 MLP and
    # vocab shard, full hidden size (the all-reduces are not modelled): per-GPU compute and KV
    "llama-3.1-70b-tp8": dict(hidden_size=8192, intermediate_size=3584, num_hidden_layers=80, num_attention_heads=8,
                              num_key_value_heads=1, head_dim=128, vocab_size=16032, max_position_embeddings=131072,
                              rope_theta=500000.0, rms_norm_eps=1e-5),
    # Qwen2.5-7B's shape as a Llama (no q/k/v biases: < 0.1 % of the FLOPs)
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, head_dim=128, vocab_size=152064, max_position_embeddings=32768,
                       rope_theta=1000000.0, rms_norm_eps=1e-6),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=65536,
                 rope_theta=10000.0, rms_norm_eps=1e-5,
                 # larger init so attention is peaked (with 0.02 a 64-wide model attends almost
                 # uniformly and a misplaced KV would not change its logits)
                 initializer_range=0.2),
}

# Next-token logits of a cached path "match" recompute when max|diff| <= RTOL * max|ref logits| and
# cosine >= MIN_COS. The two sides run different kernels (a full prefill with a causal mask vs one
# query over loaded KV: other GEMM shapes, other reduction orders), so in bf16 (8-bit mantissa) the
# hidden state picks up ~2^-9 relative rounding per op and layer; through 32 layers the logits
# differ by a few % of their absolute max (measured on the H200: 0.273 = 5.1 % at N = 1024 with
# cosine 0.999 and the KV bit-exact), while the direction stays put (cosine >= 0.999). So: a loose
# max-abs bound with 2x margin over that, a tight cosine, and the bit-exact KV check as the hard
# guard (a load that moves or drops a byte fails it whatever the logits say).
RTOL = 0.10
MIN_COS = 0.995

TIERS = ("cpu", "disk", "disk+codec", "disk+lossless", "redis", "redis+codec")


def codec_tag(level: str) -> str:
    """Column prefix of the disk tier with the codec at ``level`` (``default`` is "disk+codec")."""
    return "disk+codec" if level == "default" else f"disk+{level}"


# ----------------------------------------------------------------------------------- model


def build_model(args, device: torch.device, dtype: torch.dtype):
    import transformers

    if args.model:
        kw = dict(attn_implementation="sdpa")
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **kw)
        except TypeError:
            model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype, **kw)
        model = model.to(device)
        name = args.model
    else:
        cfg = transformers.LlamaConfig(**MODEL_PRESETS[args.preset], tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        old = torch.get_default_dtype()
        torch.manual_seed(0)
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = transformers.LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(old)
        model = model.to(device=device, dtype=dtype)
        name = f"{args.preset} (random weights)"
    model.eval()
    try:
        model.config._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001 - read-only on some versions; SDPA is the default anyway
        pass
    return model, name


class LeanDecoder:
    """Last-token forward over per-layer K/V buffers, written against the Llama module layout.

    Works for models whose decoder layers have ``input_layernorm``, ``self_attn`` (``q/k/v/o_proj``,
    optional ``q_norm``/``k_norm``), ``post_attention_layernorm`` and ``mlp``, and whose base model
    has ``embed_tokens``, ``rotary_emb`` and ``norm`` (Llama, Mistral, Qwen2/3).
    """

    def __init__(self, model) -> None:
        base = model.model
        self.model = model
        self.base = base
        self.layers = list(base.layers)
        a0 = self.layers[0].self_attn
        for attr in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(a0, attr):
                raise RuntimeError(f"lean decoder: attention module {type(a0).__name__} has no {attr}")
        cfg = model.config
        self.num_layers = len(self.layers)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hq = cfg.num_attention_heads
        self.hkv = cfg.num_key_value_heads
        self.group = self.hq // self.hkv
        self.scaling = getattr(a0, "scaling", self.head_dim ** -0.5)
        mod = sys.modules[type(a0).__module__]
        self.rope = mod.apply_rotary_pos_emb
        self.q_norm = hasattr(a0, "q_norm")

    def embed(self, token: torch.Tensor) -> torch.Tensor:
        return self.base.embed_tokens(token)  # [1, 1, hidden]

    def rope_of(self, x: torch.Tensor, pos: torch.Tensor):
        return self.base.rotary_emb(x, pos)

    def layer_step(self, l: int, x: torch.Tensor, cos, sin, k_of, v_of, new_k, new_v, wait=None) -> torch.Tensor:
        """Decoder layer ``l`` for one token: returns the new hidden state (``x`` is not modified)."""
        D, hq, hkv, g = self.head_dim, self.hq, self.hkv, self.group
        layer = self.layers[l]
        at = layer.self_attn
        h = layer.input_layernorm(x)
        q = at.q_proj(h).view(1, 1, hq, D)
        k = at.k_proj(h).view(1, 1, hkv, D)
        v = at.v_proj(h).view(1, 1, hkv, D)
        if self.q_norm:
            q, k = at.q_norm(q), at.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        new_k(l).copy_(k[0, :, 0])
        new_v(l).copy_(v[0, 0])
        if wait is not None:
            wait(l)
        # GQA with one query token: the G query heads of KV head i are "G query positions".
        o = F.scaled_dot_product_attention(q.reshape(1, hkv, g, D), k_of(l), v_of(l), scale=self.scaling)
        x = x + at.o_proj(o.reshape(1, 1, hq * D))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.base.norm(x)[:, -1])

    @torch.no_grad()
    def forward(self, token: torch.Tensor, pos: torch.Tensor, n: int, k_of, v_of, new_k, new_v,
                wait=None) -> torch.Tensor:
        """Logits ``[1, vocab]`` of one token at position ``n`` attending keys ``0..n``.

        ``new_k(l)`` / ``new_v(l)``: ``[H, D]`` views where this token's K/V go; ``k_of(l)`` /
        ``v_of(l)``: ``[1, H, n + 1, D]`` views the attention reads; ``wait(l)`` is called right
        before layer ``l``'s attention (stream-waits on the layer's load event).
        """
        x = self.embed(token)
        cos, sin = self.rope_of(x, pos)
        for l in range(self.num_layers):
            x = self.layer_step(l, x, cos, sin, k_of, v_of, new_k, new_v, wait)
        return self.head(x)


class GraphForward:
    """The lean last-token forward for one ``N`` and one KV buffer as CUDA graphs: one graph for
    the embedding, one per decoder layer, one for the final norm + ``lm_head``.

    Static buffers: the hidden state ``x`` (each layer graph reads it and writes the layer's output
    back into it), RoPE ``cos``/``sin`` of position ``n`` (computed once, outside the graphs), the
    token, the KV buffer (captured by address) and the logits (the last graph's output, overwritten
    by every replay). :meth:`run` replays them in order on the current stream and calls
    ``wait(l)`` (a ``stream.wait_event`` on layer ``l``'s load event) before layer ``l``'s graph, so
    the layer-by-layer load still overlaps the forward. All graphs share one memory pool and are
    always replayed in capture order, never concurrently (what sharing a pool requires).

    ``capture=False`` runs the same static-buffer steps eagerly (CPU tests; identical math).
    Capture raises on failure; the caller falls back to :meth:`LeanDecoder.forward`.
    """

    def __init__(self, lean: LeanDecoder, token: torch.Tensor, pos: torch.Tensor, k_of, v_of, new_k, new_v,
                 capture: bool = True, warmup: int = 2) -> None:
        self.lean = lean
        self.graphs = None
        with torch.no_grad():
            x0 = lean.embed(token)
            self.x = torch.empty_like(x0)
            self.cos, self.sin = (t.clone() for t in lean.rope_of(x0, pos))
        self.logits = None

        def embed():
            self.x.copy_(lean.embed(token))

        def layer(l):
            def f():
                self.x.copy_(lean.layer_step(l, self.x, self.cos, self.sin, k_of, v_of, new_k, new_v))
            return f

        def final():
            self.logits = lean.head(self.x)

        self.steps = [embed] + [layer(l) for l in range(lean.num_layers)] + [final]
        if not capture:
            return
        dev = self.x.device
        cur = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(cur)
        with torch.no_grad():
            with torch.cuda.stream(side):  # warm-up on a side stream (lazy init, cuBLAS workspaces)
                for _ in range(max(1, warmup)):
                    for f in self.steps:
                        f()
            cur.wait_stream(side)
            torch.cuda.synchronize(dev)
            pool = torch.cuda.graph_pool_handle()
            graphs = []
            for f in self.steps:
                g = torch.cuda.CUDAGraph()
                try:  # thread_local: other threads' CUDA calls (none expected) do not void the capture
                    ctx = torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local")
                except TypeError:  # older torch
                    ctx = torch.cuda.graph(g, pool=pool)
                with ctx:
                    f()
                graphs.append(g)
            torch.cuda.synchronize(dev)
        self.graphs = graphs

    def run(self, wait=None) -> torch.Tensor:
        """Logits ``[1, vocab]`` (a static buffer: valid until the next :meth:`run`)."""
        L = self.lean.num_layers
        if self.graphs is None:
            with torch.no_grad():
                self.steps[0]()
                for l in range(L):
                    if wait is not None:
                        wait(l)
                    self.steps[1 + l]()
                self.steps[-1]()
            return self.logits
        g = self.graphs
        g[0].replay()
        for l in range(L):
            if wait is not None:
                wait(l)
            g[1 + l].replay()
        g[-1].replay()
        return self.logits

    def close(self) -> None:
        self.graphs = None
        self.steps = []
        self.logits = None


def _cache_kv(cache, l: int):
    """(keys, values) ``[1, H, N, D]`` of layer ``l`` from a transformers cache of any vintage."""
    if hasattr(cache, "layers"):
        return cache.layers[l].keys, cache.layers[l].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[l], cache.value_cache[l]
    return cache[l][0], cache[l][1]


# ----------------------------------------------------------------------------------- helpers


class Dev:
    """Stream/event plumbing that degrades to synchronous no-ops on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def event(self):
        return torch.cuda.Event() if self.cuda else None


def pinned_empty(nbytes: int, cuda: bool):
    """Page-aligned (pinned with CUDA) uint8 host memory: (owner, tensor)."""
    try:
        from lmtier.memory import HostBuffer

        hb = HostBuffer(nbytes, pinned=cuda)
        return hb, hb.tensor
    except Exception:  # noqa: BLE001 - extension not built for this Python: fall back to torch
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        return t, t


def median(xs):
    return statistics.median(xs) if xs else None


def timed(dev: Dev, fn, iters: int, warmup: int, before=None):
    """Median wall ms of ``fn`` (device synced after), ``before()`` untimed ahead of each run."""
    out = None
    times = []
    for i in range(warmup + iters):
        if before is not None:
            before()
        dev.sync()
        t0 = time.perf_counter()
        out = fn()
        dev.sync()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return median(times), times, out


def compare(ref: torch.Tensor, got: torch.Tensor, kv=None, ref_kv=None) -> dict:
    """Logits ``got`` vs ``ref`` within the bf16 tolerance, and (if given) the loaded prefix KV
    bit-identical to the prefill's."""
    ref, got = ref.float().reshape(-1), got.float().reshape(-1)
    diff = (ref - got).abs().max().item()
    scale = ref.abs().max().item()
    cos = F.cosine_similarity(ref, got, dim=0).item()
    ok = math.isfinite(diff) and diff <= RTOL * scale and cos >= MIN_COS
    out = {"max_abs_diff": diff, "ref_absmax": scale, "cosine": cos, "logits_ok": bool(ok)}
    if kv is not None:
        out["kv_exact"] = bool(torch.equal(kv, ref_kv))
        ok = ok and out["kv_exact"]
    out["ok"] = bool(ok)
    return out


def drop_caches() -> str | None:
    """Drop the page cache; returns None on success, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"


def fs_type(path: str) -> str:
    path = os.path.realpath(path)
    best, typ = "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) >= len(best):
                    best, typ = parts[1], parts[2]
    except OSError:
        pass
    return typ


def default_disk_dir() -> str:
    """A temp dir on a real disk filesystem (not tmpfs/overlay, where O_DIRECT is missing or
    the page cache is the medium): $TMPDIR, /var/tmp, /tmp, the cwd, $HOME — the first that fits."""
    cands = [os.environ.get("TMPDIR"), "/var/tmp", "/tmp", os.getcwd(), os.path.expanduser("~")]
    for base in cands:
        if base and os.path.isdir(base) and os.access(base, os.W_OK) \
                and fs_type(base) not in ("tmpfs", "ramfs", "overlay", "devtmpfs", "?"):
            return tempfile.mkdtemp(prefix="lmtier-ttft-", dir=base)
    return tempfile.mkdtemp(prefix="lmtier-ttft-", dir=os.getcwd())


def dd_read_gbps(directory: str, nbytes: int, inflight: int = 4, piece_bytes: int = 8 << 20) -> dict:
    """dd O_DIRECT (16 MiB blocks) write then read of ``nbytes`` in ``directory``: GB/s each; plus
    ``read_par``: the same file read with O_DIRECT, ``inflight`` reads of ``piece_bytes`` in flight
    (:func:`lmtier.bench.common.odirect_read_gbps`) — the device's parallel read ceiling, which
    the tier's pipelined reads (several records in flight) can approach and dd (one read) cannot."""
    mib16 = 16 << 20
    count = max(1, nbytes // mib16)
    path = os.path.join(directory, "dd-ceiling.bin")
    res = {}
    try:
        for name, cmd in (
            ("write", ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "oflag=direct", "conv=fdatasync"]),
            ("read", ["dd", f"if={path}", "of=/dev/null", "bs=16M", f"count={count}", "iflag=direct"]),
        ):
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            res[name] = count * mib16 / (time.perf_counter() - t0) / 1e9
        from lmtier.bench.common import odirect_read_gbps

        res["read_par"] = odirect_read_gbps(path, piece_bytes=piece_bytes, inflight=inflight)
        res["read_par_inflight"] = inflight
        res["read_par_piece_MiB"] = piece_bytes / (1 << 20)
    except (OSError, subprocess.CalledProcessError) as e:
        res["error"] = str(e)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    return res


def chunk_key(tag: str, n: int, c: int) -> bytes:
    return hashlib.sha256(f"lmtier-ttft/{tag}/{n}/{c}".encode()).digest()


class RedisProc:
    """A private redis-server on 127.0.0.1 (no persistence), stopped by :meth:`stop`."""

    def __init__(self, binary: str, maxmemory: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="lmtier-ttft-redis-")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--maxmemory", str(maxmemory), "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer PING within 10 s")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def find_redis_server() -> str | None:
    """The redis-server to start: ``$LMTIER_REDIS_SERVER``, else ``redis-server`` on PATH, else the
    bundle of scripts/bundle_redis.sh in the checkout (``.whl/redis/redis-server``); None if none."""
    env = os.environ.get("LMTIER_REDIS_SERVER")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("redis-server")
    if found:
        return found
    bundled = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                           ".whl", "redis", "redis-server")
    return bundled if os.access(bundled, os.X_OK) else None


# ----------------------------------------------------------------------------------- codec


class _InPlace:
    """A "tier" whose records already sit in the slots handed to :meth:`Bench.codec_ttft`."""

    name = "pinned host memory"

    def __init__(self, sizes: dict[int, int], tag: str, n: int) -> None:
        self.by_key = {chunk_key(tag, n, c): nb for c, nb in sizes.items()}

    def get_into(self, key: bytes, out) -> int | None:
        return self.by_key.get(key)


class CodecTier:
    """``disk+codec``: canonical chunks stored as :mod:`lmtier.codec` records, decoded on the device.

    Store (once, untimed): :func:`lmtier.codec.quant.quantize` on the chunk's device, every section
    entropy-coded by :func:`lmtier.codec.rans.encode` — with the static table set of
    :meth:`set_tables` (calibrated offline on other input of the same model, table switching per
    channel run: :mod:`lmtier.codec.calibrate`) when one is set and the chunk's T allows table
    switching, else per-stream adaptive tables — and packed by
    :func:`lmtier.codec.format.pack` into one record per chunk. Sections per layer, all rANS streams:
    quantized levels ``[K symbols, V symbols, scale codes]`` (``[H, D, T]`` symbol streams, codes in
    :mod:`~lmtier.codec.quant`'s side order); ``lossless`` ``[K hi, V hi, K lo, V lo]`` byte planes.

    Load (timed): the record is read into a pinned slot, its header and section index parsed on the
    host (:func:`~lmtier.codec.format.unpack`, structure only — the disk tier already verified the
    record's checksum), the record and the decode descriptors go to the device in two async copies,
    one batched rANS decode (``lmtier._C.rans.decode``, the call under
    :func:`~lmtier.codec.rans.decode_into`, with descriptors already on the device: nothing allocated
    or uploaded per call; the static table set went to the device once, in :meth:`set_tables`) writes
    symbols and side data into device buffers, and a batched dequantize
    (the reference's arithmetic, bit-identical) writes the chunk straight into the KV buffer — all on
    the copy stream, so chunk ``c``'s decode overlaps chunk ``c + 1``'s read. The last chunk is decoded
    in layer groups, each recording the load events of its layers, so the forward overlaps it.
    Decode status and decoded lengths are checked once after the forward (one small D2H).
    """

    def __init__(self, bench: "Bench", level: str) -> None:
        from lmtier.codec import chunk as cchunk
        from lmtier.codec import format as cformat
        from lmtier.codec import levels, quant, rans

        self.b = bench
        self.cchunk, self.cformat, self.quant, self.rans = cchunk, cformat, quant, rans
        self.lv = levels.get_level(level)
        self.lossless = self.lv.lossless
        self.S = cchunk.sections_per_layer(self.lv)
        if bench.dtype not in cchunk.CODEC_DTYPES:
            raise RuntimeError(f"the codec takes bf16/fp16 KV, not {bench.dtype}")
        if bench.dev.cuda:
            from lmtier import _C

            if not _C.built_with_cuda():
                raise RuntimeError("lmtier._C was built without CUDA: no GPU rANS decoder (build with LMTIER_CUDA=ON)")
        self.sizes: dict[int, int] = {}  # chunk index -> record bytes (for the current N)
        self.records: list[np.ndarray] = []  # the current N's records (host; for the in-memory run)
        self.bufs = None
        self.tables = None  # lmtier.codec.chunk.StaticTables or None (per-stream tables)
        self.tables_mem = None  # the table set where the decoder reads it (device tensor / host array)
        self.t_addr, self.num_tables = 0, 0
        self.ring = bench.args.ring  # device buffer sets (decode of chunk c uses set c % ring)
        # the compiled dequantize kernel (lmtier.codec.native) when it covers this level and geometry:
        # one launch per chunk instead of the torch ops of chunk.dequantize_layers (~80 launches)
        self.native = None
        if not getattr(bench.args, "torch_dequant", False):
            try:
                from lmtier.codec import native

                if native.supported(self.lv, (bench.L, 2, bench.T, bench.H, bench.D), bench.device):
                    self.native = native
            except (ImportError, AttributeError):
                pass

    # ---- store ----------------------------------------------------------------------------

    def set_tables(self, tables) -> None:
        """Use the static table set ``tables`` (:class:`lmtier.codec.chunk.StaticTables`, e.g. from
        :func:`lmtier.codec.calibrate.calibrate`; None: per-stream tables) for the records stored from
        now on. The set is copied to the decoder's memory once, here (on CUDA: one upload of
        ``num_tables * 512`` bytes), never per load.

        Raises:
            ValueError: a lossless level with tables, or tables that do not fit this geometry.
        """
        if tables is None:
            self.tables = self.tables_mem = None
            self.t_addr, self.num_tables = 0, 0
            return
        b = self.b
        if self.lossless:
            raise ValueError("static tables are for the quantized levels")
        if tables.section_tables.size != b.L * self.S:
            raise ValueError(f"table set has {tables.section_tables.size} sections, the records have {b.L * self.S}")
        t = np.ascontiguousarray(tables.tables, np.uint16)
        if b.dev.cuda:
            mem = torch.from_numpy(t.view(np.uint8).reshape(-1).copy()).to(b.device)
            torch.cuda.synchronize(b.device)
            addr = mem.data_ptr()
        else:
            mem = t
            addr = t.ctypes.data
        self.tables, self.tables_mem = tables, mem
        self.t_addr, self.num_tables = addr, int(t.shape[0])

    def encode(self, chunk: torch.Tensor) -> np.ndarray:
        """One record (uint8 host array) for a canonical chunk ``[L, 2, T, H, D]`` on any device
        (:func:`lmtier.codec.chunk.encode_chunk` with the static tables of :meth:`set_tables`, if
        any; a chunk whose T rules out table switching gets per-stream tables)."""
        rec = self.cchunk.encode_chunk(chunk, shape=tuple(chunk.shape), dtype=chunk.dtype, level=self.lv,
                                       tables=self.tables)
        return np.frombuffer(rec, np.uint8)

    def reference(self, chunk: torch.Tensor) -> torch.Tensor:
        """What decoding the chunk's record must give, by the reference quantizer (bit for bit)."""
        if self.lossless:
            return chunk
        sym, side = self.quant.quantize(chunk.contiguous(), self.lv)
        return self.quant.dequantize(sym, side, self.lv, tuple(chunk.shape), chunk.dtype)

    # ---- per-N device state -----------------------------------------------------------------

    def prepare(self, n: int, slot_bytes: int) -> None:
        """Device buffers for a ring of ``R`` records of up to ``slot_bytes`` and N's chunks."""
        b, R = self.b, self.ring
        L, H, D, T = b.L, b.H, b.D, b.T
        C = len(b.chunk_spans(n))
        ns = self.S * L
        dev = b.device
        sym_bytes, side_bytes = self.cchunk.decoded_buffer_bytes(self.lv, (L, 2, T, H, D))
        mk = lambda nb: torch.empty(nb, dtype=torch.uint8, device=dev)  # noqa: E731
        desc_bytes = ns * self.rans.DECODE_DESC.itemsize
        dv = {
            "sym": [mk(sym_bytes) for _ in range(R)],
            "side": [mk(side_bytes) for _ in range(R)],
            "stage": [mk(slot_bytes) for _ in range(R)] if b.dev.cuda else None,
            "gdesc": [mk(desc_bytes) for _ in range(R)] if b.dev.cuda else None,
            "status": torch.zeros(C * ns, dtype=torch.int32, device=dev),
            "lens": torch.zeros(C * ns, dtype=torch.int64, device=dev),
            "scratch": mk(max(1, self.rans.decode_scratch_bytes(ns))) if b.dev.cuda else None,
        }
        if self.native is not None:  # contiguous chunk per ring slot, per-chunk native status, batches by (slot, T)
            dv["chunk"] = [torch.empty(L * 2 * T * H * D, dtype=b.dtype, device=dev) for _ in range(R)]
            dv["nstatus"] = torch.zeros(C, dtype=torch.int32, device=dev)
            dv["nbatch"] = {}
        owner, hd = pinned_empty(R * desc_bytes, b.dev.cuda)
        dv["hdesc_owner"] = owner
        dv["hdesc_t"] = [hd[i * desc_bytes:(i + 1) * desc_bytes] for i in range(R)]
        dv["hdesc"] = [hd[i * desc_bytes:(i + 1) * desc_bytes].numpy().view(self.rans.DECODE_DESC) for i in range(R)]
        # expected decoded lengths, per chunk and section (checked after every load)
        exp = np.zeros(C * ns, np.int64)
        for c, (_, tc) in enumerate(b.chunk_spans(n)):
            exp[c * ns:(c + 1) * ns] = self.rel_dst(tc)[2]
        dv["exp_lens"] = torch.from_numpy(exp).to(dev)
        self.bufs = dv

    def release(self) -> None:
        self.bufs = None
        self.sizes = {}
        self.records = []

    def rel_dst(self, tc: int):
        """Per section of a ``tc``-token chunk: (goes to the side buffer?, offset in its buffer, capacity)
        — :func:`lmtier.codec.chunk.section_layout`."""
        b = self.b
        return self.cchunk.section_layout(self.lv, (b.L, 2, tc, b.H, b.D))

    # ---- load -----------------------------------------------------------------------------

    def stage(self, c: int, r: int, tc: int, slot: torch.Tensor, got: int):
        """Parse chunk ``c``'s record (in pinned ``slot``), enqueue its H2D copies; returns the
        decode descriptor array (host) and its device address (None on the CPU)."""
        b, dv = self.b, self.bufs
        rec = self.cformat.unpack(slot[:got], verify_checksum=False)
        try:
            self.cchunk.check_record_info(rec.info, expected_shape=(b.L, 2, tc, b.H, b.D), dtype=b.dtype, level=self.lv)
        except ValueError as e:
            raise RuntimeError(f"codec record of chunk {c}: {e}") from None
        tid = rec.info.table_id
        if tid != self.cformat.NO_TABLE and (self.tables is None or tid != int(self.tables.table_id)):
            raise RuntimeError(f"codec record of chunk {c} was coded with static table set {tid}, the decoder has "
                               f"{'none' if self.tables is None else self.tables.table_id}")
        to_side, off, cap = self.rel_dst(tc)
        desc = dv["hdesc"][r]
        if b.dev.cuda:
            dv["stage"][r][:got].copy_(slot[:got], non_blocking=True)
            base = dv["stage"][r].data_ptr()
        else:
            base = slot.data_ptr()
        desc["src"] = base + rec.section_offsets()
        desc["src_bytes"] = rec.section_lengths()
        desc["dst"] = np.where(to_side, dv["side"][r].data_ptr(), dv["sym"][r].data_ptr()) + off
        desc["dst_capacity"] = cap
        if b.dev.cuda:
            g = dv["gdesc"][r]
            g.copy_(dv["hdesc_t"][r], non_blocking=True)  # pinned (desc is a view of it) -> device
            return desc, g.data_ptr()
        return desc, None

    def decode(self, c: int, desc, gaddr, l0: int, l1: int) -> None:
        """Batched rANS decode of layers ``[l0, l1)`` of chunk ``c`` (current stream)."""
        b, dv = self.b, self.bufs
        R_ = self.rans._R
        ns, S = self.S * b.L, self.S
        k = (c * ns + l0 * S)
        cnt = (l1 - l0) * S
        st, ln = dv["status"], dv["lens"]
        if b.dev.cuda:
            R_.decode(True, gaddr + l0 * S * desc.itemsize, cnt, self.t_addr, self.num_tables,
                      ln.data_ptr() + 8 * k, st.data_ptr() + 4 * k, dv["scratch"].data_ptr(), dv["scratch"].numel(), 0,
                      torch.cuda.current_stream(b.device).cuda_stream)
        else:
            sub = np.ascontiguousarray(desc[l0 * S:l1 * S])
            R_.decode(False, sub.ctypes.data, cnt, self.t_addr, self.num_tables, ln.data_ptr() + 8 * k,
                      st.data_ptr() + 4 * k, 0, 0, 0, 0)

    def dequant(self, r: int, tc: int, kv: torch.Tensor, s: int, l0: int, l1: int) -> None:
        """Decoded symbols/side of ring slot ``r`` -> ``kv[l0:l1, :, s:s + tc]`` (current stream), the
        arithmetic of :func:`lmtier.codec.quant.dequantize`: whole chunks through the compiled
        kernel (:func:`lmtier.codec.native.dequantize_batch` into the slot's contiguous chunk, then
        one device copy into ``kv``), layer ranges through :func:`lmtier.codec.chunk.dequantize_layers`."""
        b, dv = self.b, self.bufs
        if self.native is not None and (l0, l1) == (0, b.L):
            nat, shape = self.native, (b.L, 2, tc, b.H, b.D)
            batch = dv["nbatch"].get((r, tc))
            if batch is None:  # built once per (slot, chunk length); the descriptor upload is not on the hot path
                ch = dv["chunk"][r][:b.L * 2 * tc * b.H * b.D].view(shape)
                batch = nat.make_batch([ch], [dv["sym"][r][:nat.symbol_bytes(shape)]],
                                       [dv["side"][r][:nat.side_bytes(self.lv, shape)]])
                dv["nbatch"][(r, tc)] = batch
            c = s // b.T
            nat.dequantize_batch(batch, self.lv, status=dv["nstatus"][c:c + 1])
            kv[:, :, s:s + tc].copy_(batch.keep[0])
            return
        self.cchunk.dequantize_layers(dv["sym"][r], dv["side"][r], self.lv, (b.L, 2, tc, b.H, b.D),
                                      kv[l0:l1, :, s:s + tc], l0, l1)

    def check_status(self, n: int) -> None:
        dv = self.bufs
        if self.native is not None:
            self.native.check_status(dv["nstatus"], "dequantize")
        C = len(self.b.chunk_spans(n))
        m = C * self.S * self.b.L
        bad = (dv["status"][:m] != 0) | (dv["lens"][:m] != dv["exp_lens"][:m])
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            st = int(dv["status"][i])
            raise RuntimeError(f"codec decode failed: chunk {i // (self.S * self.b.L)}, section "
                               f"{i % (self.S * self.b.L)}: {self.rans.STATUS_NAMES.get(st, st)} "
                               f"(decoded {int(dv['lens'][i])} of {int(dv['exp_lens'][i])} symbols)")


CALIB_SEED = 4321
"""Seed of the random token ids the codec tables are calibrated on (the measured prompts use 1234)."""


def _table_file_geometry(path: str):
    with np.load(path) as z:  # allow_pickle defaults to False: arrays only
        return tuple(int(v) for v in z["geometry"]) if "geometry" in z.files else None


def _table_file_arrays(path: str) -> dict[str, dict]:
    """``{level name: {"sym", "scale", "geometry"}}`` of a :func:`lmtier.codec.calibrate.save` file."""
    out: dict[str, dict] = {}
    with np.load(path) as z:  # allow_pickle defaults to False: arrays only
        geo = z["geometry"]
        for k in z.files:
            if k.endswith(".sym"):
                name = k[: -len(".sym")]
                out[name] = {"sym": z[k], "scale": z[f"{name}.scale"], "geometry": geo}
    return out


def setup_codec_tables(b: "Bench", args, say) -> dict | None:
    """Give every quantized codec tier a static table set for this model, before any timed run.

    ``--codec-tables none``: per-stream tables (nothing done). Otherwise the tables are calibrated
    the way a deployment would do it offline: on the prefill KV of ``--codec-calib-tokens`` random
    token ids drawn with :data:`CALIB_SEED` (not the measured prompts), cut into ``--chunk-tokens``
    chunks, by :func:`lmtier.codec.calibrate.calibrate` — once per (model, level), untimed, kept in
    memory. With ``--codec-tables PATH`` the levels found in the file (a
    :func:`lmtier.codec.calibrate.save` ``.npz``) are loaded instead and missing ones are calibrated
    and written back. Returns the facts for the JSON (None with ``none`` or no quantized tier).

    Raises:
        SystemExit: a table file of another geometry.
    """
    from lmtier.codec import calibrate as ccal

    mode = (args.codec_tables or "none").strip()
    lossy = {t: c for t, c in b.codecs.items() if not c.lossless}
    if mode.lower() == "none" or not lossy:
        if b.codecs:
            say("codec tables: per-stream (every rANS stream carries its own table)"
                + (" (--codec-tables none)" if mode.lower() == "none" else ""))
        return None
    geo = (b.L, b.H, b.D)
    path = None if mode.lower() == "calibrate" else mode
    loaded: dict[str, object] = {}
    if path is not None and os.path.exists(path):
        fg = _table_file_geometry(path)
        if fg != geo:
            raise SystemExit(f"lmtier bench ttft: --codec-tables {path}: geometry {fg}, the model has (L, H, D) = {geo}")
        for c in lossy.values():
            tab = ccal.load(path, c.lv)
            if tab is not None:
                loaded[c.lv.name] = tab
    need = [c.lv.name for c in lossy.values() if c.lv.name not in loaded]
    info: dict = {"mode": "file" if path else "calibrate", "path": path, "channels_per_table": ccal.channels_per_table(geo),
                  "levels": {}}
    if need:
        key = (b.model_name, args.dtype, geo, args.codec_calib_tokens, b.T)
        cache = b.table_cache.setdefault(key, {})
        todo = [nm for nm in need if nm not in cache]
        if todo:
            maxpos = getattr(b.model.config, "max_position_embeddings", None) or args.codec_calib_tokens
            nt = max(1, min(args.codec_calib_tokens, maxpos))
            gen = torch.Generator().manual_seed(CALIB_SEED)
            cids = torch.randint(0, b.model.config.vocab_size, (1, nt), generator=gen).to(b.device)
            t0 = time.perf_counter()
            kv = b.prefix_kv(cids, nt).cpu()
            chunks = [kv[:, :, s:s + b.T] for s in range(0, nt, b.T)]
            info["calib_tokens"], info["calib_seed"], info["calib_prefill_s"] = nt, CALIB_SEED, time.perf_counter() - t0
            for nm in todo:
                t0 = time.perf_counter()
                tab, arr = ccal.calibrate(chunks, nm)
                cache[nm] = (tab, arr, time.perf_counter() - t0)
            del kv, chunks
            if b.dev.cuda:
                torch.cuda.empty_cache()
        for nm in need:
            loaded[nm] = cache[nm][0]
            info["levels"][nm] = {"calibrated_s": cache[nm][2]}
        if path is not None:
            per = _table_file_arrays(path) if os.path.exists(path) else {}
            per.update({nm: cache[nm][1] for nm in need})
            ccal.save(path, per)
    for t, c in lossy.items():
        tab = loaded[c.lv.name]
        c.set_tables(tab)
        d = info["levels"].setdefault(c.lv.name, {})
        d.update(table_id=int(tab.table_id), num_tables=int(tab.tables.shape[0]),
                 table_bytes=int(tab.tables.shape[0]) * 512, source="file" if c.lv.name not in need else "calibrated")
    src = (f"calibrated on the prefill KV of {info['calib_tokens']} other random token ids (seed {CALIB_SEED}, "
           f"not the measured prompts) in {info['calib_prefill_s']:.1f} s + "
           + ", ".join(f"{nm} {info['levels'][nm]['calibrated_s']:.1f} s" for nm in need)
           if "calib_tokens" in info else "")
    say("codec tables: static, table switching per run of " + f"{info['channels_per_table']} channel(s); "
        + "; ".join(f"{c.lv.name}: {info['levels'][c.lv.name]['num_tables']:,} tables "
                    f"({info['levels'][c.lv.name]['table_bytes'] / 1e6:.1f} MB, uploaded once), "
                    f"{info['levels'][c.lv.name]['source']}" for c in lossy.values())
        + (f"; {src}" if src else "") + (f"; file {path}" if path else "")
        + "; chunks whose T rules out table switching (a tail chunk) use per-stream tables; lossless: per-stream")
    return info


# ----------------------------------------------------------------------------------- the bench


class Bench:
    def __init__(self, args) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.dev = Dev(self.device)
        self.dtype = getattr(torch, args.dtype)
        self.model, self.model_name = build_model(args, self.device, self.dtype)
        self.lean = LeanDecoder(self.model)
        self.L, self.H, self.D = self.lean.num_layers, self.lean.hkv, self.lean.head_dim
        self.esize = torch.tensor([], dtype=self.dtype).element_size()
        self.bpt = self.L * 2 * self.H * self.D * self.esize  # canonical bytes per token
        self.T = args.chunk_tokens
        self.copy_mode = self._pick_copy_mode(args.copy_mode)
        self.notes: list[str] = []
        self.gf: GraphForward | None = None  # CUDA graphs of the lean forward for the current N
        self.fwd_mode = "eager"
        self.disk_odirect = True
        self.codecs: dict[str, CodecTier] = {}
        self.table_cache: dict = {}  # (model, dtype, geometry, calib tokens, T) -> {level: (tables, arrays, s)}
        self.disk_par_bw: float | None = None  # parallel O_DIRECT read ceiling (same run)

    # ---- copy plans ------------------------------------------------------------------------

    def _pick_copy_mode(self, mode: str) -> str:
        if not self.dev.cuda:
            return "torch"
        if mode != "auto":
            return mode
        try:
            from lmtier import _C

            if not (_C.built_with_cuda() and _C.cuda_device_count() > 0):
                return "torch"
        except Exception:  # noqa: BLE001 - extension not built for this Python
            return "torch"
        # probe cudaMemcpyBatchAsync once (needs a recent driver); fall back to one memcpy per run
        src = torch.arange(4096, dtype=torch.uint8).pin_memory()
        dst = torch.zeros(4096, dtype=torch.uint8, device=self.device)
        try:
            with torch.cuda.stream(self.dev.copy_stream):
                _C.memcpy_batch_async([dst.data_ptr(), dst.data_ptr() + 2048], [src.data_ptr(), src.data_ptr() + 2048],
                                      [2048, 2048], self.dev.copy_stream.cuda_stream)
            self.dev.sync()
            if torch.equal(dst.cpu(), src):
                return "batch"
            print("lmtier bench ttft: cudaMemcpyBatchAsync probe copied wrong bytes; using one memcpy per run")
        except Exception as e:  # noqa: BLE001
            print(f"lmtier bench ttft: cudaMemcpyBatchAsync unusable ({e}); using one memcpy per run")
        return "memcpy"

    def chunk_spans(self, n: int) -> list[tuple[int, int]]:
        """(first token, tokens) of each canonical chunk of an ``n``-token prefix."""
        return [(s, min(self.T, n - s)) for s in range(0, n, self.T)]

    def plan(self, n: int, kv: torch.Tensor, host_chunks: list[torch.Tensor], chunks=None):
        """Per layer, the (dst view, src view) pairs of K and V of each chunk (``chunks`` indexes
        ``host_chunks``; default all)."""
        spans = self.chunk_spans(n)
        idx = range(len(spans)) if chunks is None else chunks
        per_layer = [[] for _ in range(self.L)]
        for c in idx:
            s, tc = spans[c]
            src = host_chunks[c][: tc * self.bpt].view(self.dtype).view(self.L, 2, tc, self.H, self.D)
            for l in range(self.L):
                for p in range(2):
                    per_layer[l].append((kv[l, p, s:s + tc], src[l, p]))
        return per_layer

    def issue(self, pairs) -> None:
        """Enqueue copies (on the current stream) for a list of (dst, src) pairs."""
        if not pairs:
            return
        mode = self.copy_mode
        if mode == "torch":
            for d, s in pairs:
                d.copy_(s, non_blocking=True)
            return
        from lmtier import _C

        stream = torch.cuda.current_stream(self.device).cuda_stream
        if mode == "memcpy":
            for d, s in pairs:
                _C.memcpy_async(d.data_ptr(), s.data_ptr(), s.numel() * self.esize, stream)
        else:
            _C.memcpy_batch_async([d.data_ptr() for d, _ in pairs], [s.data_ptr() for _, s in pairs],
                                  [s.numel() * self.esize for _, s in pairs], stream)

    # ---- paths -----------------------------------------------------------------------------

    def views(self, kv: torch.Tensor, n: int):
        """(k_of, v_of, new_k, new_v) over the token-major buffer ``kv [L, 2, n + 1, H, D]``."""
        return (lambda l: kv[l, 0, : n + 1].permute(1, 0, 2).unsqueeze(0),
                lambda l: kv[l, 1, : n + 1].permute(1, 0, 2).unsqueeze(0),
                lambda l: kv[l, 0, n], lambda l: kv[l, 1, n])

    def fwd(self, n: int, kv, tok, pos, wait=None, eager: bool = False) -> torch.Tensor:
        """The lean last-token forward over ``kv``: the CUDA graphs captured for this N when there
        are (and ``eager`` is False), else the eager :meth:`LeanDecoder.forward`."""
        if self.gf is not None and not eager:
            return self.gf.run(wait)
        k_of, v_of, new_k, new_v = self.views(kv, n)
        return self.lean.forward(tok, pos, n, k_of, v_of, new_k, new_v, wait=wait)

    def make_graphs(self, n: int, kv, tok, pos) -> str:
        """Capture the lean forward for this N (``--graphs``); returns the mode used, and on failure
        falls back to eager with a printed reason."""
        self.close_graphs()
        want = self.args.graphs
        if want == "off":
            return "eager (--graphs off)"
        if want == "nocapture":
            self.gf = GraphForward(self.lean, tok, pos, *self.views(kv, n), capture=False)
            return "static buffers, no capture (--graphs nocapture)"
        if not self.dev.cuda:
            return "eager (no CUDA: graphs need a GPU)"
        try:
            self.gf = GraphForward(self.lean, tok, pos, *self.views(kv, n), capture=True)
            return "cuda-graphs"
        except Exception as e:  # noqa: BLE001 - any capture failure: measure eagerly instead
            self.close_graphs()
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001
                pass
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            print(f"lmtier bench ttft: N={n}: CUDA graph capture of the lean forward failed ({why}); "
                  "using the eager forward", file=sys.stderr, flush=True)
            return f"eager (graph capture failed: {why})"

    def close_graphs(self) -> None:
        if self.gf is not None:
            self.gf.close()
            self.gf = None

    def cached_ttft(self, n: int, kv, per_layer, tok, pos, eager: bool = False) -> torch.Tensor:
        """Layer-by-layer load on the copy stream overlapped with the lean forward."""
        dev = self.dev
        if not dev.cuda:
            for pairs in per_layer:
                self.issue(pairs)
            return self.fwd(n, kv, tok, pos, eager=eager)
        cs = dev.copy_stream
        cs.wait_stream(torch.cuda.current_stream(self.device))  # kv free (previous readers done)
        events = []
        with torch.cuda.stream(cs):
            for pairs in per_layer:
                self.issue(pairs)
                ev = torch.cuda.Event()
                ev.record(cs)
                events.append(ev)
        cur = torch.cuda.current_stream(self.device)
        return self.fwd(n, kv, tok, pos, wait=lambda l: cur.wait_event(events[l]), eager=eager)

    def tier_ttft(self, n: int, kv, tier, tag: str, slots, tok, pos) -> torch.Tensor:
        """Read chunks from ``tier`` into the pinned ring ``slots`` (``--inflight`` reads in flight), H2D each
        as it lands; the last chunk's copies go layer by layer, overlapped with the forward."""
        dev = self.dev
        spans = self.chunk_spans(n)
        C, R = len(spans), len(slots)
        slot_ev = [None] * R
        cs = dev.copy_stream
        if dev.cuda:
            cs.wait_stream(torch.cuda.current_stream(self.device))

        def read(c):
            r = c % R
            if slot_ev[r] is not None:
                slot_ev[r].synchronize()  # the slot's previous H2D has finished
            got = tier.get_into(chunk_key(tag, n, c), slots[r][: spans[c][1] * self.bpt])
            if got != spans[c][1] * self.bpt:
                raise RuntimeError(f"{tier.name} tier: chunk {c} of N={n} missing or short ({got})")
            return c

        events = []
        with ThreadPoolExecutor(max_workers=max(1, min(self.args.inflight, R - 1))) as pool:
            futs = {}
            nxt = 0
            while nxt < min(C, R):  # a read into slot r is submitted only after r's last H2D was enqueued
                futs[nxt] = pool.submit(read, nxt)
                nxt += 1
            for c in range(C):
                futs.pop(c).result()
                per_layer = self._plan_one(n, kv, slots[c % R], c)
                last = c == C - 1
                if dev.cuda:
                    with torch.cuda.stream(cs):
                        for pairs in per_layer:
                            self.issue(pairs)
                            if last:
                                ev = torch.cuda.Event()
                                ev.record(cs)
                                events.append(ev)
                        ev = torch.cuda.Event()
                        ev.record(cs)
                        slot_ev[c % R] = ev
                else:
                    for pairs in per_layer:
                        self.issue(pairs)
                if nxt < C:
                    futs[nxt] = pool.submit(read, nxt)
                    nxt += 1
        if not dev.cuda:
            return self.fwd(n, kv, tok, pos)
        cur = torch.cuda.current_stream(self.device)
        return self.fwd(n, kv, tok, pos, wait=lambda l: cur.wait_event(events[l]))

    def codec_ttft(self, n: int, kv, tier, tag: str, codec: CodecTier, slots, tok, pos) -> torch.Tensor:
        """Like :meth:`tier_ttft` with codec records: read (``--inflight``) -> H2D of the record ->
        batched rANS decode + dequantize into ``kv`` on the copy stream; the last chunk in layer
        groups with per-layer events so the forward overlaps it."""
        dev = self.dev
        spans = self.chunk_spans(n)
        C, R = len(spans), len(slots)
        slot_ev = [None] * R
        cs = dev.copy_stream
        if dev.cuda:
            cs.wait_stream(torch.cuda.current_stream(self.device))
        # layer groups for the last chunk (so the forward overlaps its dequantize); with the compiled
        # dequantize a whole chunk takes ~0.1 ms on the GPU, and one launch beats several
        groups = 1 if codec.native is not None else max(1, min(self.args.codec_groups, self.L))
        bounds = [self.L * i // groups for i in range(groups + 1)]

        def read(c):
            r = c % R
            if slot_ev[r] is not None:
                slot_ev[r].synchronize()  # the slot's previous H2D copies have finished
            got = tier.get_into(chunk_key(tag, n, c), slots[r])
            if got != codec.sizes[c]:
                raise RuntimeError(f"{tag}: record of chunk {c} (N={n}) missing or of the wrong size ({got})")
            return got

        events = [None] * self.L
        RD = codec.ring
        desc_ev = [None] * RD
        with ThreadPoolExecutor(max_workers=max(1, min(self.args.inflight, R - 1))) as pool:
            futs = {}
            nxt = 0
            while nxt < min(C, R):
                futs[nxt] = pool.submit(read, nxt)
                nxt += 1
            for c in range(C):
                got = futs.pop(c).result()
                r, rd = c % R, c % RD  # host slot, device buffers (+ pinned descriptor slot)
                s0, tc = spans[c]
                last = c == C - 1
                if desc_ev[rd] is not None:
                    desc_ev[rd].synchronize()  # descriptor slot's previous H2D done
                with (torch.cuda.stream(cs) if dev.cuda else contextlib.nullcontext()):
                    desc, gaddr = codec.stage(c, rd, tc, slots[r], got)
                    if dev.cuda:
                        ev = torch.cuda.Event()
                        ev.record(cs)
                        slot_ev[r] = desc_ev[rd] = ev  # pinned slot and descriptors reusable after this
                    for l0, l1 in (zip(bounds[:-1], bounds[1:]) if last else [(0, self.L)]):
                        codec.decode(c, desc, gaddr, l0, l1)
                        codec.dequant(rd, tc, kv, s0, l0, l1)
                        if last and dev.cuda:
                            ev = torch.cuda.Event()
                            ev.record(cs)
                            for l in range(l0, l1):
                                events[l] = ev
                if nxt < C:
                    futs[nxt] = pool.submit(read, nxt)
                    nxt += 1
        if not dev.cuda:
            out = self.fwd(n, kv, tok, pos)
        else:
            cur = torch.cuda.current_stream(self.device)
            out = self.fwd(n, kv, tok, pos, wait=lambda l: cur.wait_event(events[l]))
            cur.wait_stream(cs)
        codec.check_status(n)
        return out

    def _codec_kv_exact(self, codec: CodecTier, kv, ref_kv, spans) -> bool:
        return all(torch.equal(kv[:, :, s0:s0 + tc], codec.reference(ref_kv[:, :, s0:s0 + tc])) for s0, tc in spans)

    def _codec_in_memory(self, n, kv, tag, codec: CodecTier, host, row, ref_kv, spans, tok, pos, rec_ms) -> None:
        """The same decode pipeline with the records already in pinned host memory (the ``host``
        buffer; no reads): H2D + device decode + forward. Splits ``{tag}_ms`` into disk vs codec
        cost; also what a compressed CPU tier would give."""
        offs, o = [], 0
        for rec in codec.records:
            offs.append(o)
            o += -(-rec.size // 4096) * 4096
        if o > host.numel():
            row[f"{tag}_mem_note"] = "records do not fit the host buffer: not measured"
            return
        mslots = []
        for rec, off in zip(codec.records, offs):
            host[off:off + rec.size].numpy()[:] = rec
            mslots.append(host[off:off + -(-rec.size // 4096) * 4096])
        mem = _InPlace(codec.sizes, tag, n)
        run = lambda: self.codec_ttft(n, kv, mem, tag, codec, mslots, tok, pos)  # noqa: E731
        kv.fill_(float("nan"))
        run()
        self.dev.sync()
        if codec.lossless:
            ok = torch.equal(kv[:, :, :n], ref_kv)
        else:
            ok = self._codec_kv_exact(codec, kv, ref_kv, spans)
        if not ok:
            raise RuntimeError(f"{tag}: in-memory decode gave different KV than the reference")
        row[f"{tag}_mem_ms"], _, _ = timed(self.dev, run, self.args.iters, max(0, self.args.warmup - 1))
        row[f"{tag}_mem_pct"] = 100 * row[f"{tag}_mem_ms"] / rec_ms

    def _plan_one(self, n: int, kv, buf: torch.Tensor, c: int):
        s, tc = self.chunk_spans(n)[c]
        src = buf[: tc * self.bpt].view(self.dtype).view(self.L, 2, tc, self.H, self.D)
        return [[(kv[l, p, s:s + tc], src[l, p]) for p in range(2)] for l in range(self.L)]

    # ---- ceilings --------------------------------------------------------------------------

    def h2d_gbps(self, host: torch.Tensor, nbytes: int) -> float | None:
        if not self.dev.cuda:
            return None
        nbytes = min(nbytes, host.numel())
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        src = host[:nbytes]
        cs = self.dev.copy_stream

        def go():
            with torch.cuda.stream(cs):
                dst.copy_(src, non_blocking=True)

        ms, _, _ = timed(self.dev, go, iters=5, warmup=2)
        del dst
        return nbytes / ms / 1e6

    # ---- one context length ----------------------------------------------------------------

    def prefix_kv(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """The prefill KV of ``ids[:, :n]`` in canonical order ``[L, 2, n, H, D]`` (model dtype, on the
        bench device, contiguous)."""
        with torch.no_grad():
            out = self.model.model(input_ids=ids[:, :n], use_cache=True)
        cache = out.past_key_values
        kv = torch.stack([torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)])
                          for k, v in (_cache_kv(cache, l) for l in range(self.L))])[:, :, :n].contiguous()
        del out, cache
        return kv

    def run_length(self, n: int, ids: torch.Tensor, host: torch.Tensor, disk, redis, slots, h2d: float | None,
                   disk_bw: float | None, drop_note: list) -> dict:
        a, dev = self.args, self.dev
        it, wu = a.iters, a.warmup
        row: dict = {"N": n, "kv_MB": n * self.bpt / 1e6}
        model = self.model
        inp = ids[:, : n + 1]
        tok = ids[:, n : n + 1]
        pos = torch.tensor([[n]], device=self.device)

        # (1) recompute
        with torch.no_grad():
            rec_ms, rec_all, ref = timed(
                dev, lambda: model(input_ids=inp, use_cache=False, logits_to_keep=1).logits[:, -1], it, wu)
        ref = ref.float()
        row["recompute_ms"] = rec_ms
        row["recompute_all_ms"] = rec_all

        # build the prefix KV once (prefill of N tokens) as canonical chunks in pinned memory
        spans = self.chunk_spans(n)
        # reference prefix KV in canonical order [L, 2, n, H, D] (also what every load must reproduce bit for bit)
        ref_kv = self.prefix_kv(ids, n)
        host_chunks = []
        off = 0
        for s, tc in spans:
            nb = tc * self.bpt
            hc = host[off : off + nb]
            off += -(-nb // 4096) * 4096
            hc.view(self.dtype).view(self.L, 2, tc, self.H, self.D).copy_(ref_kv[:, :, s:s + tc])
            host_chunks.append(hc)
        dev.sync()

        kv = torch.empty(self.L, 2, n + 1, self.H, self.D, dtype=self.dtype, device=self.device)
        per_layer = self.plan(n, kv, host_chunks)
        k_of, v_of, new_k, new_v = self.views(kv, n)

        # the lean forward for this N: CUDA graphs (captured over kv, tok, pos) or eager
        kv[:, :, :n].copy_(ref_kv)
        row["fwd_mode"] = self.make_graphs(n, kv, tok, pos)
        if self.gf is not None:
            with torch.no_grad():
                g_out = self.fwd(n, kv, tok, pos).float().clone()
                e_out = self.fwd(n, kv, tok, pos, eager=True).float()
            row["graph_vs_eager_maxdiff"] = (g_out - e_out).abs().max().item()
            del g_out, e_out

        # correctness of the CPU-tier path (NaN-filled buffers: a skipped byte cannot pass)
        kv.fill_(float("nan"))
        with torch.no_grad():
            got = self.cached_ttft(n, kv, per_layer, tok, pos)
        dev.sync()
        row["check_cpu"] = compare(ref, got, kv[:, :, :n], ref_kv)
        # control: what a wrong-index load looks like — chunk 1's place holds chunk 0's KV. (A
        # permutation of whole (K, V) pairs would be invisible: attention is a set operation.)
        if len(spans) > 1:
            with torch.no_grad():
                kv[:, :, :n].copy_(ref_kv)
                s1, t1 = spans[1]
                kv[:, :, s1:s1 + t1].copy_(ref_kv[:, :, :t1])
                got_w = self.lean.forward(tok, pos, n, k_of, v_of, new_k, new_v)
            row["check_control_wrong_kv"] = compare(ref, got_w, kv[:, :, :n], ref_kv)

        # (2) CPU tier
        with torch.no_grad():
            row["cpu_ms"], row["cpu_all_ms"], _ = timed(
                dev, lambda: self.cached_ttft(n, kv, per_layer, tok, pos), it, wu)
            if self.gf is not None:
                row["cpu_eager_ms"], _, _ = timed(
                    dev, lambda: self.cached_ttft(n, kv, per_layer, tok, pos, eager=True), it, wu)

            # load alone, forward alone, and the contiguous-[1,H,N,D] alternative
            def load_only():
                if dev.cuda:
                    dev.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(dev.copy_stream):
                        for pairs in per_layer:
                            self.issue(pairs)
                else:
                    for pairs in per_layer:
                        self.issue(pairs)

            row["load_ms"], _, _ = timed(dev, load_only, it, wu)
            row["fwd_ms"], _, _ = timed(dev, lambda: self.fwd(n, kv, tok, pos), it, wu)
            if self.gf is not None:
                row["fwd_eager_ms"], _, _ = timed(dev, lambda: self.fwd(n, kv, tok, pos, eager=True), it, wu)
            else:
                row["fwd_eager_ms"] = row["fwd_ms"]
            if a.compare_layouts:
                hnd = torch.empty(self.L, 2, self.H, n + 1, self.D, dtype=self.dtype, device=self.device)
                row["transpose_ms"], _, _ = timed(dev, lambda: hnd.copy_(kv.permute(0, 1, 3, 2, 4)), it, wu)
                row["fwd_contig_ms"], _, _ = timed(dev, lambda: self.lean.forward(
                    tok, pos, n, lambda l: hnd[l, 0].unsqueeze(0), lambda l: hnd[l, 1].unsqueeze(0),
                    lambda l: hnd[l, 0, :, n], lambda l: hnd[l, 1, :, n]), it, wu)
                del hnd
        if h2d:
            row["h2d_GBs"] = h2d
            row["cpu_limit_ms"] = n * self.bpt / h2d / 1e6
            row["cpu_limit_pct"] = 100 * row["cpu_limit_ms"] / rec_ms
            row["load_GBs"] = n * self.bpt / row["load_ms"] / 1e6
        row["cpu_pct"] = 100 * row["cpu_ms"] / rec_ms

        # (3) disk tier, (4) disk + codec (per level), (5) redis
        tiers = [(disk, "disk", None), (redis, "redis", None)]
        if redis is not None and "disk+codec" in self.codecs:
            tiers.append((redis, "redis+codec", self.codecs["disk+codec"]))
        if disk is not None:  # last: their in-memory runs overwrite the host chunks
            tiers += [(disk, tag, codec) for tag, codec in self.codecs.items()]

        def drop():
            why = drop_caches()
            if why and not drop_note:
                drop_note.append(why)

        for tier, tag, codec in tiers:
            if tier is None:
                continue
            try:
                tslots = slots
                if codec is None:
                    for c, hc in enumerate(host_chunks):
                        if not tier.put(chunk_key(tag, n, c), hc):
                            raise RuntimeError(f"{tag} tier: put of chunk {c} (N={n}) failed")
                else:  # encode once, when stored (untimed, like the prefill that made the KV)
                    t0 = time.perf_counter()
                    codec.sizes = {}
                    for c, (s0, tc) in enumerate(spans):
                        rec = codec.encode(ref_kv[:, :, s0:s0 + tc])
                        codec.sizes[c] = rec.size
                        codec.records.append(rec)
                        if not tier.put(chunk_key(tag, n, c), rec):
                            raise RuntimeError(f"{tag}: put of chunk {c} (N={n}) failed")
                    row[f"{tag}_encode_s"] = time.perf_counter() - t0
                    # records coded with the static table set (others: per-stream tables, e.g. a tail
                    # chunk whose T rules out table switching, or --codec-tables none)
                    row[f"{tag}_static_records"] = sum(
                        1 for _, tc in spans if codec.tables is not None and codec.tables.run_lens(tc) is not None)
                    stored = sum(codec.sizes.values())
                    row[f"{tag}_ratio"] = n * self.bpt / stored
                    row[f"{tag}_MB"] = stored / 1e6
                    need = -(-max(codec.sizes.values()) // 4096) * 4096
                    if need > slots[0].numel():
                        ring_owner, ring = pinned_empty(self.args.ring * need, dev.cuda)
                        tslots = [ring[i * need:(i + 1) * need] for i in range(self.args.ring)]
                    codec.prepare(n, tslots[0].numel())
                # O_DIRECT reads bypass the page cache: drop it once; without O_DIRECT before every load
                before = drop if (tier is disk and not self.disk_odirect) else None
                load = (lambda: self.tier_ttft(n, kv, tier, tag, tslots, tok, pos)) if codec is None else \
                    (lambda: self.codec_ttft(n, kv, tier, tag, codec, tslots, tok, pos))
                kv.fill_(float("nan"))
                with torch.no_grad():
                    if tier is disk:
                        drop()
                    got = load()
                    dev.sync()
                    if codec is None or codec.lossless:
                        row[f"check_{tag}"] = compare(ref, got, kv[:, :, :n], ref_kv)
                    else:
                        # lossy: the decoded KV must equal the reference decoder's bit for bit; the
                        # logits are reported (quality), not judged
                        c_ok = compare(ref, got)
                        c_ok["kv_exact"] = self._codec_kv_exact(codec, kv, ref_kv, spans)
                        c_ok["lossy"] = True
                        c_ok["kv_rel_err"] = ((kv[:, :, :n].float() - ref_kv.float()).norm()
                                              / ref_kv.float().norm()).item()
                        c_ok["ok"] = bool(c_ok["kv_exact"] and math.isfinite(c_ok["max_abs_diff"]))
                        row[f"check_{tag}"] = c_ok
                    # the correctness load above warmed this path up: one warm-up fewer
                    row[f"{tag}_ms"], row[f"{tag}_all_ms"], _ = timed(dev, load, it, max(0, wu - 2), before=before)
                    if codec is not None and tier is disk:
                        self._codec_in_memory(n, kv, tag, codec, host, row, ref_kv, spans, tok, pos, rec_ms)
                row[f"{tag}_pct"] = 100 * row[f"{tag}_ms"] / rec_ms
                row[f"{tag}_GBs"] = n * self.bpt / row[f"{tag}_ms"] / 1e6  # effective (bf16 KV delivered)
                for c in range(len(host_chunks)):
                    tier.delete(chunk_key(tag, n, c))
                if codec is not None:
                    codec.release()
                    tslots = ring_owner = ring = None
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - one tier failing must not lose the other numbers
                row[f"{tag}_error"] = f"{type(e).__name__}: {e}"
                print(f"N={n}: {tag} tier failed: {row[f'{tag}_error']}", file=sys.stderr)
                row[f"check_{tag}"] = {"ok": False, "logits_ok": False, "error": row[f"{tag}_error"],
                                       "max_abs_diff": float("nan"), "ref_absmax": float("nan"), "cosine": float("nan")}
                for k in (f"{tag}_ms", f"{tag}_pct", f"{tag}_GBs"):
                    row.pop(k, None)
                if codec is not None:
                    codec.release()
                    for c in range(len(host_chunks)):
                        tier.delete(chunk_key(tag, n, c))
        self.close_graphs()
        if disk is not None and disk_bw:
            row["disk_dd_GBs"] = disk_bw
            row["disk_limit_pct"] = 100 * (n * self.bpt / disk_bw / 1e6) / rec_ms
            par = self.disk_par_bw
            if par:
                row["disk_par_GBs"] = par
            best = max(disk_bw, par or 0)
            for tag in self.codecs:
                if row.get(f"{tag}_MB"):
                    # the read alone at the best same-run device ceiling (dd or parallel O_DIRECT)
                    row[f"{tag}_limit_pct"] = 100 * (row[f"{tag}_MB"] / best) / rec_ms  # MB / (GB/s) = ms
        del kv, per_layer, ref_kv
        return row


def break_even(rows: list[dict], tier: str) -> int | None:
    """Shortest N at which the tier's TTFT beats recompute."""
    for r in sorted(rows, key=lambda r: r["N"]):
        if r.get(f"{tier}_ms") is not None and r[f"{tier}_ms"] < r["recompute_ms"]:
            return r["N"]
    return None


def plot(rows: list[dict], path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["N"] for r in rows]
    for key, label, style in (("recompute_ms", "recompute (prefill)", "o-"), ("cpu_ms", "CPU tier (pinned)", "s-"),
                              ("cpu_limit_ms", "CPU tier physical limit (H2D)", ":"),
                              ("disk_ms", "disk tier (O_DIRECT)", "^-"), ("disk+codec_ms", "disk + codec", "v-"),
                              ("disk+lossless_ms", "disk + lossless codec", "<-"),
                              ("redis_ms", "Redis (loopback)", "d-"), ("redis+codec_ms", "Redis + codec", "D-")):
        pts = [(r["N"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs], rotation=45)
    ax.set_xlabel("context length N (tokens)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return None


def run(args) -> dict:
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("lmtier bench ttft: --device cuda but no CUDA device is available")
    if args.device == "cpu":
        torch.set_num_threads(max(1, min(args.threads, os.cpu_count() or 1)))
    lines: list[str] = []

    def say(msg: str) -> None:
        lines.append(msg)
        if not args.quiet:
            print(msg, flush=True)

    t_start = time.perf_counter()
    b = Bench(args)
    dev = b.dev
    cfg = b.model.config
    lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
    maxpos = getattr(cfg, "max_position_embeddings", None)
    skipped = []
    if maxpos:
        for n in [n for n in lengths if n + 1 > maxpos]:
            skipped.append({"N": n, "why": f"N + 1 > max_position_embeddings {maxpos}"})
        lengths = [n for n in lengths if n + 1 <= maxpos]
    say(f"model: {b.model_name}: {b.L} layers, {cfg.num_attention_heads} heads, {b.H} KV heads x {b.D}, "
        f"{args.dtype}, {args.device}; {b.bpt:,} B of KV per token; chunks of {b.T} tokens; "
        f"H2D copy mode: {b.copy_mode}")

    # host memory for the CPU tier (all chunks of the largest prefix) and the tier read ring
    maxn = max(lengths) if lengths else 0
    host_bytes = sum(-(-tc * b.bpt // 4096) * 4096 for _, tc in b.chunk_spans(maxn)) if maxn else 4096
    host_owner, host = pinned_empty(host_bytes, dev.cuda)
    slot_bytes = -(-b.T * b.bpt // 4096) * 4096
    ring_owner, ring = pinned_empty(args.ring * slot_bytes, dev.cuda)
    slots = [ring[i * slot_bytes:(i + 1) * slot_bytes] for i in range(args.ring)]

    h2d = b.h2d_gbps(host, min(host_bytes, 1 << 30)) if dev.cuda else None
    if h2d:
        say(f"pinned H2D ceiling (contiguous copy, same run): {h2d:.1f} GB/s")

    # disk tier
    disk = None
    disk_dir = None
    disk_bw = None
    dd = {}
    drop_note: list[str] = []
    if not args.no_disk:
        from lmtier.tiers.disk import DiskTier

        disk_dir = args.disk_dir or default_disk_dir()
        os.makedirs(disk_dir, exist_ok=True)
        root = tempfile.mkdtemp(prefix="tier-", dir=disk_dir)
        disk = DiskTier([root], capacity_bytes=host_bytes * 2 + (64 << 20), io_threads=args.disk_threads)
        odirect = any(disk._direct.values())
        b.disk_odirect = odirect
        dd = dd_read_gbps(disk_dir, max(16 << 20, min(args.dd_bytes, host_bytes)), inflight=args.inflight)
        disk_bw = dd.get("read")
        b.disk_par_bw = dd.get("read_par")
        why = drop_caches()
        say(f"disk tier: {disk_dir} ({fs_type(disk_dir)}), O_DIRECT {'on' if odirect else 'OFF (unsupported here)'}, "
            f"{args.disk_threads} I/O threads; dd O_DIRECT 16 MiB: "
            + (f"read {dd['read']:.2f} GB/s, write {dd['write']:.2f} GB/s" if "read" in dd else f"failed ({dd.get('error')})")
            + (f"; O_DIRECT {args.inflight} x 8 MiB reads in flight: {dd['read_par']:.2f} GB/s" if "read_par" in dd else "")
            + ("" if why is None else f"; page cache can NOT be dropped ({why})")
            + ("; O_DIRECT reads bypass the page cache (dropped once per tier and N)" if odirect else
               "; page cache dropped before every load"))
    else:
        say("disk tier: skipped (--no-disk)")

    # codec
    levels = [x.strip() for x in (args.codec_levels or "").split(",") if x.strip()]
    if disk is None:
        say("disk+codec: skipped (no disk tier)")
    elif not levels:
        say("disk+codec: skipped (--codec-levels '')")
    else:
        for lvname in levels:
            try:
                b.codecs[codec_tag(lvname)] = CodecTier(b, lvname)
            except Exception as e:  # noqa: BLE001 - codec missing / not built / wrong dtype
                say(f"disk+codec ({lvname}): skipped — {type(e).__name__}: {e}")
        if b.codecs:
            say("disk+codec: " + ", ".join(f"{t} = level {c.lv.name}" for t, c in b.codecs.items())
                + f"; records encoded once when stored, decoded on the {'GPU' if dev.cuda else 'CPU'} "
                + ("(rANS + the compiled dequantize kernel, whole chunks)" if any(c.native for c in b.codecs.values())
                   else f"(rANS + dequantize in torch ops), last chunk in {args.codec_groups} layer groups"))
    say(f"lean forward: " + ("CUDA graphs, one per layer + embed + head, captured per N (eager fallback "
                             "on capture failure, reported per N)" if args.graphs == "auto" and dev.cuda else
                             {"off": "eager (--graphs off)", "nocapture": "static buffers without capture "
                              "(--graphs nocapture)"}.get(args.graphs, "eager (no CUDA)")))

    # redis
    redis = None
    redis_proc = None
    binary = find_redis_server()
    url = args.redis_url or os.environ.get("LMTIER_REDIS_URL")
    if args.no_redis:
        say("redis: skipped (--no-redis)")
    elif url is None and binary is None:
        say("redis: skipped — no server given (--redis-url / LMTIER_REDIS_URL) and no redis-server binary "
            "(PATH, LMTIER_REDIS_SERVER; scripts/bundle_redis.sh packs one for machines without it)")
    else:
        try:
            from lmtier.tiers.redis import RedisTier

            if url is None:
                redis_proc = RedisProc(binary, maxmemory=host_bytes * 3 + (256 << 20))
                url = redis_proc.url
            redis = RedisTier(url, timeout_s=30.0, connect_timeout_s=5.0, max_connections=max(4, args.inflight + 1),
                              max_value_bytes=max(512 << 20, slot_bytes))
            if not redis.ping():
                raise RuntimeError(f"no answer from {url}")
            say(f"redis: {'private redis-server (' + binary + ')' if redis_proc else 'server'} on {url}, RedisTier "
                f"({'direct' if redis.direct_reads else 'parser'} reads, {redis.piece_bytes >> 20} MiB pieces), "
                f"{args.inflight} reads in flight")
        except Exception as e:  # noqa: BLE001
            say(f"redis: skipped — could not start/connect ({type(e).__name__}: {e})")
            if redis_proc:
                redis_proc.stop()
            redis, redis_proc = None, None

    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, cfg.vocab_size, (1, maxn + 1), generator=gen).to(b.device)

    # global warm-up (allocator, cuBLAS/SDPA kernels, lazy transformers setup) before any length
    with torch.no_grad():
        wn = min(64, maxn)
        for _ in range(2):
            b.model(input_ids=ids[:, : wn + 1], use_cache=False, logits_to_keep=1)
        dev.sync()

    rows = []
    codec_tables = None
    try:
        # static codec tables: calibrated (or loaded) once per level, untimed, before any timed run
        codec_tables = setup_codec_tables(b, args, say) if b.codecs else None
        for n in progress(lengths, desc="ttft", disable=args.quiet):
            try:
                row = b.run_length(n, ids, host, disk, redis, slots, h2d, disk_bw, drop_note)
                rows.append(row)
            except torch.cuda.OutOfMemoryError as e:
                skipped.append({"N": n, "why": f"out of GPU memory ({str(e).splitlines()[0][:120]})"})
                say(f"N={n}: skipped — out of GPU memory")
            finally:
                if dev.cuda:
                    torch.cuda.empty_cache()
    finally:
        if disk is not None:
            disk.close()
            if not args.keep_disk:
                shutil.rmtree(root, ignore_errors=True)
                if not args.disk_dir:
                    shutil.rmtree(disk_dir, ignore_errors=True)
        if redis is not None:
            redis.close()
        if redis_proc is not None:
            redis_proc.stop()
    if drop_note:
        say(f"note: page cache could not be dropped ({drop_note[0]}); DiskTier reads use O_DIRECT, so it is bypassed")

    res = {
        "bench": "ttft",
        "system": system_header(),
        "model": b.model_name,
        "device": args.device,
        "dtype": args.dtype,
        "geometry": {"num_layers": b.L, "num_kv_heads": b.H, "head_size": b.D, "bytes_per_token": b.bpt,
                     "chunk_tokens": b.T},
        "copy_mode": b.copy_mode,
        "iters": args.iters,
        "warmup": args.warmup,
        "ceilings": {"h2d_GBs": h2d, "disk_dd_GBs": dd or None, "disk_dir": disk_dir,
                     "page_cache_dropped": (not drop_note) if disk is not None else None},
        "tolerance": {"rtol_of_logit_absmax": RTOL, "min_cosine": MIN_COS,
                      "hard_guard": "loaded KV bit-identical to the prefill's (lossy codec: to the reference decoder's)"},
        "graphs": args.graphs,
        "codec_levels": {t: c.lv.name for t, c in b.codecs.items()},
        "codec_tables": codec_tables,
        "rows": rows,
        "skipped": skipped,
        "break_even": {t: break_even(rows, t) for t in TIERS},
        "notes": lines,
        "elapsed_s": None,
    }
    res["control_detected"] = all(not r["check_control_wrong_kv"]["logits_ok"]
                                  for r in rows if "check_control_wrong_kv" in r)
    res["checks_ok"] = all(r[k]["ok"] for r in rows for k in r if k.startswith("check_") and k != "check_control_wrong_kv")
    res["elapsed_s"] = time.perf_counter() - t_start
    return res


def report(res: dict, args) -> None:
    rows = res["rows"]
    cols = ["N", "recompute_ms", "cpu_ms", "cpu_pct", "cpu_limit_pct", "cpu_eager_ms", "h2d_GBs", "load_ms", "fwd_ms",
            "fwd_eager_ms", "disk_ms", "disk_pct", "disk_limit_pct", "disk_dd_GBs", "disk_par_GBs", "disk_GBs"]
    for t in TIERS:
        if t.startswith("disk+"):
            cols += [f"{t}_ms", f"{t}_pct", f"{t}_limit_pct", f"{t}_ratio", f"{t}_mem_ms"]
    cols += ["redis_ms", "redis_pct", "redis+codec_ms", "redis+codec_pct"]
    if any("fwd_contig_ms" in r for r in rows):
        cols += ["transpose_ms", "fwd_contig_ms"]
    cols = [c for c in cols if any(r.get(c) is not None for r in rows) or c in ("N", "recompute_ms", "cpu_ms")]
    print()
    print(f"TTFT, median of {res['iters']} after {res['warmup']} warm-up ({res['model']}, {res['dtype']}, "
          f"{res['device']}); *_pct = % of recompute; *_limit_pct = bytes / same-run ceiling")
    print_table(rows, cols)
    print()
    chk = []
    for r in rows:
        d = {"N": r["N"]}
        for k in ("cpu", "disk", *(t for t in TIERS if t.startswith("disk+")), "redis", "redis+codec", "control_wrong_kv"):
            c = r.get(f"check_{k}")
            if c:
                d[f"{k}_maxdiff"] = c["max_abs_diff"]
                d[f"{k}_cos"] = round(c["cosine"], 5)
                if "kv_exact" in c:
                    d[f"{k}_kv_exact"] = c["kv_exact"]
                if c.get("lossy"):
                    d[f"{k}_kv_relerr"] = c["kv_rel_err"]
                d[f"{k}_ok"] = "ok" if c["ok"] else ("(expected)" if k == "control_wrong_kv" else "MISMATCH")
        d["logit_absmax"] = r["check_cpu"]["ref_absmax"]
        chk.append(d)
    print(f"next-token logits vs recompute (match: max|diff| <= {RTOL} x max|logit| and cosine >= {MIN_COS}, and the "
          "loaded KV bit-exact; lossy codec levels: KV bit-exact vs the reference decoder, logits reported only; "
          "control = chunk 0's KV loaded in chunk 1's place: its logits should NOT match)")
    modes = sorted({r.get("fwd_mode", "eager") for r in rows})
    print("lean forward mode: " + "; ".join(f"{m} (N = {', '.join(str(r['N']) for r in rows if r.get('fwd_mode', 'eager') == m)})"
                                            for m in modes))
    print_table(chk, list(dict.fromkeys(k for d in chk for k in d)))
    print()
    for t in TIERS:
        if not any(r.get(f"{t}_ms") is not None for r in rows):
            continue
        be = res["break_even"][t]
        print(f"break-even {t}: " + (f"loads beat recompute from N = {be}" if be is not None
                                     else "never within the measured lengths"))
    for s in res["skipped"]:
        print(f"skipped N={s['N']}: {s['why']}")
    ctl = [r["check_control_wrong_kv"]["logits_ok"] for r in rows if "check_control_wrong_kv" in r]
    if any(ctl):
        print("warning: the wrong-KV control passed the logits check at some N: on this model the logits check "
              "alone is not discriminating; the bit-exact KV check (kv_exact) still guards every load")
    print(f"logit checks: {'all match' if res['checks_ok'] else 'MISMATCH — a cached path is wrong'}; "
          f"elapsed {res['elapsed_s']:.1f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="lmtier bench ttft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--preset", "--model-preset", dest="preset", type=str.lower, default="llama-3.1-8b",
                   help=f"random-weight model shape (ignored with --model): {', '.join(sorted(MODEL_PRESETS))}; "
                        "llama-3.1-70b-tp8 = one TP rank's shard (no all-reduce); the MLA preset of the other "
                        "subcommands has no transformers shape here (use --model)")
    p.add_argument("--model", default=None, help="path of a local transformers model (Llama-like)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated context lengths N")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--copy-mode", choices=["auto", "batch", "memcpy", "torch"], default="auto",
                   help="H2D copies: batch = one cudaMemcpyBatchAsync per layer (lmtier._C), memcpy = one "
                        "cudaMemcpyAsync per K/V run, torch = Tensor.copy_(non_blocking=True)")
    p.add_argument("--compare-layouts", action="store_true",
                   help="also time the forward over contiguous [1,H,N,D] K/V and the GPU transpose to it")
    p.add_argument("--disk-dir", default=None, help="directory on the disk to test (default: a temp dir on disk)")
    p.add_argument("--disk-threads", type=int, default=4)
    p.add_argument("--dd-bytes", type=int, default=1 << 30, help="bytes dd writes/reads for the disk ceiling")
    p.add_argument("--keep-disk", action="store_true")
    p.add_argument("--no-disk", action="store_true")
    p.add_argument("--no-redis", action="store_true")
    p.add_argument("--redis-url", default=None,
                   help="use this Redis server (default: $LMTIER_REDIS_URL, else start a private redis-server "
                        "on loopback when one is found: $LMTIER_REDIS_SERVER, PATH, .whl/redis)")
    p.add_argument("--ring", type=int, default=6, help="pinned read slots for the disk/redis pipeline")
    p.add_argument("--inflight", type=int, default=4,
                   help="tier reads in flight (at most --ring - 1) in the disk/redis pipelines")
    p.add_argument("--graphs", choices=["auto", "off", "nocapture"], default="auto",
                   help="lean forward as CUDA graphs (auto: on CUDA, eager fallback if capture fails); off: eager; "
                        "nocapture: the graph code path run eagerly (tests)")
    p.add_argument("--codec-levels", default="default,lossless",
                   help="codec levels for the disk+codec tiers (comma-separated; '' to skip)")
    p.add_argument("--codec-tables", default="calibrate",
                   help="rANS tables of the lossy codec tiers: 'calibrate' (static tables calibrated, untimed, on "
                        "the KV of other random token ids of the same model, once per level), a PATH (.npz of "
                        "lmtier.codec.calibrate.save: loaded; levels it lacks are calibrated and written into "
                        "it), or 'none' (per-stream tables in every record)")
    p.add_argument("--codec-calib-tokens", type=int, default=4096,
                   help="tokens of calibration input for --codec-tables calibrate / PATH")
    p.add_argument("--codec-groups", type=int, default=4,
                   help="layer groups the last chunk is decoded in (each releases its layers to the forward)")
    p.add_argument("--torch-dequant", action="store_true",
                   help="dequantize with torch ops (chunk.dequantize_layers) instead of the compiled kernel")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (CPU runs)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG path for TTFT vs N per tier")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.preset not in MODEL_PRESETS and not args.model:
        p.error(f"--model-preset {args.preset!r}: the ttft bench builds a Llama-shaped transformers model; "
                f"choose from {', '.join(sorted(MODEL_PRESETS))} or pass --model PATH")
    if args.ring < 2:
        p.error("--ring must be >= 2")
    if args.inflight < 1:
        p.error("--inflight must be >= 1")
    if args.codec_calib_tokens < 1:
        p.error("--codec-calib-tokens must be >= 1")
    res = run(args)
    report(res, args)
    write_json(args.json, res)
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        why = plot(res["rows"], args.plot, f"TTFT vs context: {res['model']} on "
                   f"{res['system'].get('gpu', res['device'])}")
        print(f"plot: skipped — {why}" if why else f"wrote {args.plot}")
    return 0 if res["checks_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
