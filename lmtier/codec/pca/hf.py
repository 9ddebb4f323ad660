"""The calibration inputs of the PCA codec level (issue 19) from a Hugging Face transformers model.

A PCA basis is fitted on the KV cache of calibration texts, keys with RoPE undone, weighted by how
the model sees an error (RESULTS §4.1f; ``benchmarks/codec_pca.py`` is the experiment). This module
runs the model and returns what the fit needs, as a :class:`Calibration`: the canonical KV of each
text, the rotary inverse frequencies and the model metric. :func:`collect` loads a checkpoint
directory (local files only, CPU); :func:`collect_from_model` takes a loaded ``(model, tokenizer)``
(e.g. a layer-pruned model built in memory); :func:`metric_from` and :func:`rotary_inv_freq` are the
two facts on their own; :func:`checkpoint_geometry` reads a checkpoint's KV geometry from its
``config.json`` alone (for checks before loading).

Supported models: decoder-only causal LMs of the Llama family layout (``model.get_decoder()`` with
``.layers[i].self_attn.{q_proj, o_proj}`` as ``nn.Linear`` and ``.rotary_emb``), full rotary
embedding of an even head size, a rope type without attention scaling and with frequencies that do
not depend on the sequence length (e.g. ``default``, ``llama3``; not ``yarn``, ``longrope``,
``dynamic``). Anything else raises :class:`CalibrationError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmtier.errors import LMTierError
from lmtier.hf import cache_layers, pack_kv_chunk

__all__ = [
    "Calibration",
    "CalibrationError",
    "checkpoint_geometry",
    "collect",
    "collect_from_model",
    "metric_from",
    "rotary_inv_freq",
]


class CalibrationError(LMTierError, ValueError):
    """A checkpoint, model or input the PCA calibration cannot use; the message names the problem."""


@dataclass(frozen=True)
class Calibration:
    """What a PCA basis is fitted on, for one model.

    Attributes:
        kv: one canonical KV per text, ``torch.bfloat16`` ``[L, 2, T, H, D]`` on the CPU (``L``
            layers, K then V, ``T`` tokens at positions ``0 .. T-1``, ``H`` KV heads, head size
            ``D``): the model's cache cast to bf16, K post-RoPE exactly as the model caches it.
        inv_freq: ``np.float64`` ``[D/2]``, radians per position: the rotary inverse frequencies of
            the model's rotary embedding module (the checkpoint config's rope type and scaling, e.g.
            llama3's, applied), widened from its float32 buffer. They must equal what vLLM applies
            (``vllm/model_executor/layers/rotary_embedding``: ``_compute_inv_freq``, float32, the
            same formulas): a basis fitted with other frequencies undoes RoPE wrongly on vLLM's KV.
        metric: ``torch.float64`` ``[L, 2, H*D, H*D]`` on the CPU (see :func:`metric_from`).
        model_name: the model's name (:func:`collect`: the checkpoint directory's name).
    """

    kv: list[torch.Tensor]
    inv_freq: np.ndarray
    metric: torch.Tensor
    model_name: str


@dataclass(frozen=True)
class _Geometry:
    attention: list[torch.nn.Module]  # one per layer, each with q_proj and o_proj (nn.Linear)
    num_heads: int  # query heads
    num_kv_heads: int
    head_size: int


def _geometry(model: Any) -> _Geometry:
    """The checked attention layout of ``model``; raises :class:`CalibrationError` naming the module."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise CalibrationError(f"not a transformers model: {type(model).__name__}")
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise CalibrationError(f"{type(model).__name__}: no decoder layers (.layers): not a decoder-only causal LM")
    names = {id(m): n for n, m in model.named_modules()}
    attention = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            raise CalibrationError(f"{names[id(layer)]} ({type(layer).__name__}) has no self_attn")
        for proj in ("q_proj", "o_proj"):
            if not isinstance(getattr(attn, proj, None), torch.nn.Linear):
                raise CalibrationError(
                    f"{names[id(attn)]} ({type(attn).__name__}) has no {proj} (nn.Linear): only separate "
                    "q_proj / o_proj projections are supported"
                )
        attention.append(attn)
    nq, nkv = model.config.num_attention_heads, model.config.num_key_value_heads
    q_out = attention[0].q_proj.out_features
    if nq % nkv or q_out % nq:
        raise CalibrationError(f"{nq} query heads, {nkv} KV heads, q_proj width {q_out}: not a GQA layout")
    d = q_out // nq
    if d % 2:
        raise CalibrationError(f"head size {d} is odd: RoPE pairs channel i with i + D/2")
    for attn in attention:
        if attn.q_proj.out_features != nq * d or attn.o_proj.in_features != nq * d:
            raise CalibrationError(f"{names[id(attn)]}: q_proj / o_proj widths differ from {nq} heads of {d}")
    return _Geometry(attention, nq, nkv, d)


def rotary_inv_freq(model: Any) -> np.ndarray:
    """``np.float64`` ``[D/2]``: the rotary inverse frequencies of ``model`` (its decoder's
    ``rotary_emb.inv_freq``, radians per position; see :attr:`Calibration.inv_freq`).

    Raises:
        CalibrationError: no rotary embedding module; a rope type with attention scaling != 1
            (cos/sin scaled, e.g. yarn) or frequencies that change with the sequence length
            (dynamic, longrope); a partial rotary embedding (fewer than ``D/2`` frequencies).
    """
    geo = _geometry(model)
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    rope_type, scaling = getattr(rotary, "rope_type", None), getattr(rotary, "attention_scaling", None)
    if not isinstance(inv_freq, torch.Tensor) or rope_type is None or scaling is None:
        raise CalibrationError(
            f"{type(model).__name__}: no rotary embedding of the transformers layout "
            "(get_decoder().rotary_emb with inv_freq, rope_type, attention_scaling)"
        )
    if scaling != 1.0:
        raise CalibrationError(
            f"rope type {rope_type!r} scales cos/sin by {scaling} (attention_scaling != 1): unsupported"
        )
    if "dynamic" in rope_type or rope_type == "longrope":  # transformers' dynamic_rope_update rewrites them
        raise CalibrationError(f"rope type {rope_type!r}: frequencies change with the sequence length: unsupported")
    if inv_freq.shape != (geo.head_size // 2,):
        raise CalibrationError(
            f"rotary inverse frequencies of shape {tuple(inv_freq.shape)} for head size {geo.head_size}: "
            "partial rotary embeddings are unsupported"
        )
    return inv_freq.detach().cpu().double().numpy()


def _check_ids(token_ids: Sequence[torch.Tensor]) -> None:
    if len(token_ids) == 0:
        raise CalibrationError("no calibration texts")
    for i, ids in enumerate(token_ids):
        if ids.dim() != 1 or ids.dtype != torch.int64:
            raise CalibrationError(f"text {i}: token ids must be 1-D int64, got {tuple(ids.shape)} {ids.dtype}")
        if ids.numel() < 2:
            raise CalibrationError(f"text {i} has {ids.numel()} token(s); at least 2 are needed")


def _run(model: Any, token_ids: Sequence[torch.Tensor], *, keep_kv: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward per token sequence: (the metric, the bf16 canonical KV of each if ``keep_kv``)."""
    _check_ids(token_ids)
    geo = _geometry(model)
    nl, nq, nkv, d = len(geo.attention), geo.num_heads, geo.num_kv_heads, geo.head_size
    q2 = torch.zeros(nl, nq, d, dtype=torch.float64)  # sum over tokens of the squared queries
    count = 0
    kvs = []

    def hook(l):
        def fn(mod, inp, out):
            q2[l] += out[0].double().reshape(-1, nq, d).pow(2).sum(0).cpu()

        return fn

    hooks = [attn.q_proj.register_forward_hook(hook(l)) for l, attn in enumerate(geo.attention)]
    try:
        with torch.no_grad():
            for ids in token_ids:
                out = model(ids[None].to(model.device), use_cache=True)
                count += ids.numel()
                if keep_kv:
                    layers = cache_layers(out.past_key_values)
                    t, dtype = ids.numel(), layers[0][0].dtype
                    kv = pack_kv_chunk(layers, 0, t).view(dtype).view(nl, 2, t, nkv, d)
                    kvs.append(kv.to("cpu", torch.bfloat16))
    finally:
        for h in hooks:
            h.remove()
    q2 = q2 / count
    q2 = (q2 + q2.roll(d // 2, dims=-1)) / 2  # pair (i, i + D/2) averaged over the rotation
    metric = torch.zeros(nl, 2, nkv * d, nkv * d, dtype=torch.float64)
    g = nq // nkv
    for l, attn in enumerate(geo.attention):
        wo = attn.o_proj.weight.detach().double().cpu()  # [hidden, nq * d]
        for h in range(nkv):
            blk = slice(h * d, (h + 1) * d)
            metric[l, 0, blk, blk] = torch.diag(q2[l, h * g : (h + 1) * g].sum(0))
            for j in range(h * g, (h + 1) * g):
                w = wo[:, j * d : (j + 1) * d]
                metric[l, 1, blk, blk] += w.T @ w
    return metric, kvs


def metric_from(model: Any, token_ids: Sequence[torch.Tensor]) -> torch.Tensor:
    """The model metric: ``torch.float64`` ``[L, 2, H*D, H*D]`` on the CPU, block-diagonal over KV
    heads (zero between heads): the squared error of a key or value as the model sees it.

    K (RoPE undone): the logit error ``sum_j (q_j . e)**2`` over the query heads ``j`` sharing the KV
    head (GQA: query heads ``h*g .. h*g+g-1`` for KV head ``h``), averaged over the rotation of each
    RoPE pair: diagonal, ``(E q_i**2 + E q_{i+D/2}**2) / 2`` with ``E`` the mean over all tokens of
    ``token_ids`` of ``q_proj``'s output (queries before RoPE). V: the error after the output
    projection, ``sum_j W_o[:, j]^T W_o[:, j]`` over the same query heads (``W_o[:, j]`` the
    ``[hidden, D]`` columns of query head ``j``). Approximations: the softmax and the attention
    weights are ignored, the cross terms between the query heads sharing a KV head are dropped, and
    K's cross-pair terms vanish only for pairs that rotate fast. (``benchmarks/codec_pca.py``'s
    ``model_metric``, RESULTS §4.1f.)

    Args:
        model: a loaded transformers causal LM (any dtype / device; accumulated in float64).
        token_ids: token sequences, each ``int64`` 1-D ``[T_i]`` with ``T_i >= 2``; one forward each.

    Raises:
        CalibrationError: an unsupported model (see the module doc), no sequences, or a bad one.
    """
    return _run(model, token_ids, keep_kv=False)[0]


def _check_inputs(texts: Iterable[str], max_tokens: int) -> list[str]:
    """``texts`` as a list, each checked to be a ``str`` (a ``str`` or ``bytes`` itself is refused:
    iterating it would give one text per character); ``max_tokens >= 2``."""
    if isinstance(texts, (str, bytes, bytearray)) or not isinstance(texts, Iterable):
        raise CalibrationError(
            f"texts must be a sequence of str, got a {type(texts).__name__} (a single text: pass [text])"
        )
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise CalibrationError(f"text {i} is a {type(text).__name__}, not a str")
    if max_tokens < 2:
        raise CalibrationError(f"max_tokens must be >= 2, got {max_tokens}")
    return texts


def collect_from_model(
    model: Any, tokenizer: Any, texts: Sequence[str], *, model_name: str, max_tokens: int = 4096
) -> Calibration:
    """:class:`Calibration` of a loaded ``(model, tokenizer)`` on ``texts``: each text tokenized as
    the tokenizer encodes it by default (special tokens it adds included), cut to its first
    ``max_tokens`` tokens, one forward with ``use_cache=True`` giving its KV and its queries.

    Raises:
        CalibrationError: ``max_tokens < 2``; ``texts`` a ``str`` or ``bytes`` (not a sequence of
            texts), empty, or holding anything but a ``str``; a text of fewer than 2 tokens; an
            unsupported model (see the module doc and :func:`rotary_inv_freq`).
    """
    texts = _check_inputs(texts, max_tokens)
    inv_freq = rotary_inv_freq(model)
    ids = [torch.tensor(tokenizer(t).input_ids[:max_tokens], dtype=torch.int64) for t in texts]
    metric, kv = _run(model, ids, keep_kv=True)
    return Calibration(kv=kv, inv_freq=inv_freq, metric=metric, model_name=model_name)


def checkpoint_geometry(model_dir: str | Path) -> tuple[int, int, int] | None:
    """``(L, H, D)`` -- layers, KV heads, head size -- as the ``config.json`` of the checkpoint in
    ``model_dir`` states them, read without transformers or the weights: ``num_hidden_layers``,
    ``num_key_value_heads`` (default ``num_attention_heads``), ``head_dim`` (default
    ``hidden_size // num_attention_heads``). ``None`` if the file is unreadable or lacks these as
    positive integers. A check before loading only: :func:`collect`'s KV is the geometry of record.
    """
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None

    def positive(key: str) -> int | None:
        v = config.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    nl, nq, hidden = positive("num_hidden_layers"), positive("num_attention_heads"), positive("hidden_size")
    nkv = positive("num_key_value_heads") or nq
    d = positive("head_dim") or (hidden // nq if hidden and nq and hidden % nq == 0 else None)
    return (nl, nkv, d) if nl and nkv and d else None


def _load(path: Path, what: str, load: Callable[[], Any]) -> Any:
    """``load()``; any error it raises as a :class:`CalibrationError` naming ``path`` and ``what``.

    Catches ``Exception``: transformers, huggingface_hub, safetensors and torch each raise their own
    type for an unusable checkpoint (OSError, ValueError, RuntimeError, SafetensorError,
    StrictDataclassFieldValidationError, ...); the original stays chained as ``__cause__``.
    """
    try:
        return load()
    except Exception as e:
        why = " ".join(str(e).split()) or "no message"
        raise CalibrationError(f"{path}: cannot load the {what}: {type(e).__name__}: {why}") from e


def collect(
    model_dir: str | Path, texts: Sequence[str], *, max_tokens: int = 4096, dtype: torch.dtype = torch.float32
) -> Calibration:
    """:func:`collect_from_model` of the checkpoint in ``model_dir`` (transformers, local files only,
    loaded in ``dtype`` on the CPU; ``model_name`` = the directory's name, ``.`` resolved).

    Raises:
        CalibrationError: the directory or its ``config.json`` is missing; transformers cannot load
            the config (invalid JSON, an unknown ``model_type``, a bad field), the tokenizer (no
            tokenizer files) or the model (no weights, a truncated or corrupt weights file, shapes
            that differ from the config), the message naming the directory and transformers' error;
            the checkpoint is not a causal LM; or as :func:`collect_from_model` (the texts and
            ``max_tokens`` are checked before anything is loaded).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    texts = _check_inputs(texts, max_tokens)
    path = Path(model_dir)
    if not path.is_dir():
        raise CalibrationError(f"checkpoint directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise CalibrationError(f"{path} holds no config.json: not a transformers checkpoint")
    config = _load(path, "config", lambda: AutoConfig.from_pretrained(path, local_files_only=True))
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise CalibrationError(f"{path}: model type {config.model_type!r} is not a causal LM")
    tokenizer = _load(path, "tokenizer", lambda: AutoTokenizer.from_pretrained(path, local_files_only=True))
    model = _load(
        path, "model", lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
    )
    return collect_from_model(model, tokenizer, texts, model_name=path.resolve().name, max_tokens=max_tokens)
