"""The model side of ``lmtier bench ttft``: the transformers model, the lean last-token forward
over a KV cache the benchmark fills, and that forward as CUDA graphs.

The model is a Llama-shaped ``transformers`` ``LlamaForCausalLM`` with random weights built from a
:data:`lmtier.bench.presets.PRESETS` entry (SDPA; compute cost is what matters), or a local model
(``--model PATH``). :class:`LeanDecoder` runs one token through ``model.model.layers`` (no
``generate``/cache machinery) attending per-layer K/V views the caller hands it: here, strided views
of the vLLM-style paged cache that lmtier's load paths fill (:class:`lmtier.bench.ttft.pipeline.PagedKV`).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from lmtier.bench.presets import PRESETS

__all__ = ["build_model", "LeanDecoder", "GraphForward", "prefix_kv", "TRAINED_KV_ALPHA", "shape_kv_spectrum"]

TRAINED_KV_ALPHA = {"k": 1.27, "v": 0.85}
"""Power-law exponents ``alpha`` of a trained model's KV spectrum, ``lambda_i ~ i**-alpha``: the
eigenvalues of the covariance of one layer's ``k_proj`` / ``v_proj`` outputs (all KV heads, before
RoPE), fitted over ranks 2 .. N/2, median over the layers of SmolLM2-135M-Instruct on 2,048 tokens of
the GPL-3 (its K: 73 % of the energy in the top eighth of the components, V: 53 %;
``benchmarks/kv_spectrum.py``, benchmarks/RESULTS.md §4.1p). A random-weight model's KV is far
flatter (~36 % in the top eighth)."""


def build_model(
    preset: str, model_path: str | None, device: torch.device, dtype: torch.dtype, kv_spectrum: str = "model"
):
    """``(model, name)``: the local model at ``model_path`` (Llama-like, SDPA), else a random-weight
    ``LlamaForCausalLM`` of preset ``preset`` (seed 0), on ``device`` in ``dtype``, in eval mode.
    ``kv_spectrum`` "trained" (random weights only): each layer's ``k_proj`` / ``v_proj`` reshaped by
    :func:`shape_kv_spectrum` to :data:`TRAINED_KV_ALPHA`; "model": the weights as built.

    Raises:
        ValueError: a preset without a Llama shape (MLA) and no ``model_path``; ``kv_spectrum`` other
            than "model" / "trained", or "trained" with ``model_path``.
    """
    import transformers

    if kv_spectrum not in ("model", "trained"):
        raise ValueError(f"kv_spectrum must be 'model' or 'trained', got {kv_spectrum!r}")
    if model_path and kv_spectrum != "model":
        raise ValueError("kv_spectrum 'trained' reshapes a random-weight model; a local model keeps its own")
    if model_path:
        kw = dict(attn_implementation="sdpa")
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **kw)
        except TypeError:
            model = transformers.AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=dtype, **kw)
        model = model.to(device)
        name = model_path
    else:
        shape = PRESETS[preset].llama
        if shape is None:
            raise ValueError(f"preset {preset} has no Llama shape")
        cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=False)
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
        name = f"{preset} (random weights)"
        if kv_spectrum == "trained":
            shape_kv_spectrum(model, TRAINED_KV_ALPHA)
            name = f"{preset} (random weights, K/V spectra of a trained model's)"
    model.eval()
    try:
        model.config._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001 - read-only on some versions; SDPA is the default anyway
        pass
    return model, name


@torch.no_grad()
def shape_kv_spectrum(model, alpha: dict[str, float]) -> None:
    """Give each layer's K and V the eigen-spectrum ``lambda_i ~ i**-alpha`` (``alpha["k"]``,
    ``alpha["v"]``; ranks from 1) for near-isotropic inputs: ``W = U diag(s) V^T`` of ``k_proj`` /
    ``v_proj`` (``[H_kv D, hidden]``) gets ``s_i ~ i**(-alpha / 2)``, scaled to keep ``||W||_F`` (the
    KV's overall magnitude). In place, on the weights' device (SVD in float32). A random-weight model's
    hidden states are near isotropic, so its KV covariance follows ``W W^T``: a trained model's KV
    concentrates its energy in few components (:data:`TRAINED_KV_ALPHA`), which transform codecs (the
    PCA levels) exploit and a random model would hide."""
    for layer in model.model.layers:
        for kind, proj in (("k", layer.self_attn.k_proj), ("v", layer.self_attn.v_proj)):
            w = proj.weight.float()
            u, sv, vh = torch.linalg.svd(w, full_matrices=False)
            target = torch.arange(1, sv.numel() + 1, device=w.device, dtype=torch.float32) ** (-alpha[kind] / 2)
            target *= w.norm() / target.norm()
            proj.weight.copy_(((u * target) @ vh).to(proj.weight.dtype))


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
        self.scaling = getattr(a0, "scaling", self.head_dim**-0.5)
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
    def forward(
        self, token: torch.Tensor, pos: torch.Tensor, n: int, k_of, v_of, new_k, new_v, wait=None
    ) -> torch.Tensor:
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

    def __init__(
        self,
        lean: LeanDecoder,
        token: torch.Tensor,
        pos: torch.Tensor,
        k_of,
        v_of,
        new_k,
        new_v,
        capture: bool = True,
        warmup: int = 2,
    ) -> None:
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


def prefix_kv(model, ids: torch.Tensor, n: int, num_layers: int) -> torch.Tensor:
    """The prefill KV of ``ids[:, :n]`` in canonical order ``[L, 2, n, H, D]`` (model dtype, on the
    model's device, contiguous): what every load must reproduce bit for bit."""
    with torch.no_grad():
        out = model.model(input_ids=ids[:, :n], use_cache=True)
    cache = out.past_key_values
    kv = torch.stack(
        [
            torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)])
            for k, v in (_cache_kv(cache, l) for l in range(num_layers))
        ]
    )[:, :, :n].contiguous()
    del out, cache
    return kv
