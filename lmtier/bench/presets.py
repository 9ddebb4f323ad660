"""The model presets of every ``lmtier bench`` subcommand: one table (``--model-preset NAME``).

Each :class:`ModelPreset` gives the KV geometry of one tensor-parallel rank (what the transfer,
disk, remote and codec benchmarks size their chunks by) and, where the model is Llama-shaped, the
``transformers.LlamaConfig`` fields the TTFT benchmark builds a random-weight model from (the MLA
preset has none: ``lmtier bench ttft`` refuses it and asks for ``--model PATH``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lmtier.geometry import torch_dtype

__all__ = ["ModelPreset", "PRESETS", "preset", "preset_help"]


@dataclass(frozen=True)
class ModelPreset:
    """KV geometry of one tensor-parallel rank of a model, and its Llama shape where it has one.

    Attributes:
        name: the preset name (lower case).
        num_layers, num_kv_heads, head_size: KV geometry (MLA: one latent plane of ``head_size``).
        dtype: torch dtype name of the KV cache.
        kind: ``"kv"`` (K and V planes) or ``"mla"`` (one latent plane).
        llama: ``transformers.LlamaConfig`` keyword arguments of a random-weight model of this
            shape (``num_hidden_layers``, ``num_key_value_heads`` and ``head_dim`` equal the
            geometry), or ``None`` when the model is not Llama-shaped.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    kind: str = "kv"
    llama: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.llama is not None:
            want = {
                "num_hidden_layers": self.num_layers,
                "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_size,
            }
            got = {k: self.llama.get(k) for k in want}
            if got != want:
                raise ValueError(f"preset {self.name}: Llama shape {got} disagrees with the geometry {want}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def num_planes(self) -> int:
        return 1 if self.kind == "mla" else 2

    def bytes_per_token(self) -> int:
        """Canonical KV bytes per token over all layers and planes."""
        esize = torch.tensor([], dtype=self.torch_dtype).element_size()
        return self.num_layers * self.num_planes * self.num_kv_heads * self.head_size * esize


def _llama(
    hidden: int,
    inter: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    max_pos: int,
    rope_theta: float,
    eps: float,
    **extra: Any,
) -> dict[str, Any]:
    return dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        rope_theta=rope_theta,
        rms_norm_eps=eps,
        **extra,
    )


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            "llama-3.1-8b", 32, 8, 128, llama=_llama(4096, 14336, 32, 32, 8, 128, 128256, 131072, 500000.0, 1e-5)
        ),
        # one tensor-parallel rank of Llama-3.1-70B at TP8: 8 query heads, 1 KV head, a 1/8 MLP and
        # vocab shard, full hidden size (the all-reduces are not modelled): per-GPU compute and KV
        ModelPreset(
            "llama-3.1-70b-tp8", 80, 1, 128, llama=_llama(8192, 3584, 80, 8, 1, 128, 16032, 131072, 500000.0, 1e-5)
        ),
        # Qwen2.5-7B's shape as a Llama (no q/k/v biases: < 0.1 % of the FLOPs)
        ModelPreset(
            "qwen2.5-7b", 28, 4, 128, llama=_llama(3584, 18944, 28, 28, 4, 128, 152064, 32768, 1000000.0, 1e-6)
        ),
        ModelPreset("deepseek-v3-mla", 61, 1, 576, kind="mla"),
        ModelPreset("smollm2-135m", 30, 3, 64, llama=_llama(576, 1536, 30, 9, 3, 64, 49152, 8192, 100000.0, 1e-5)),
        # CPU smoke runs; a larger init so attention is peaked (with 0.02 a 64-wide model attends almost
        # uniformly and a misplaced KV would not change its logits)
        ModelPreset(
            "tiny", 2, 2, 16, llama=_llama(64, 128, 2, 4, 2, 16, 256, 65536, 10000.0, 1e-5, initializer_range=0.2)
        ),
    )
}


def preset(name: str) -> ModelPreset:
    """The :class:`ModelPreset` of a preset name (case-insensitive).

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {', '.join(sorted(PRESETS))}")
    return PRESETS[key]


def preset_help() -> str:
    """One line per preset for ``--model-preset``'s help."""
    return "; ".join(
        f"{g.name} = {g.num_layers} layers x {g.num_planes} planes x {g.num_kv_heads} heads x {g.head_size}"
        for g in PRESETS.values()
    )
