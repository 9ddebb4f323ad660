"""The eigen-spectrum of a trained model's KV: the source of ``lmtier.bench.ttft.model.TRAINED_KV_ALPHA``.

For each layer of SmolLM2-135M-Instruct (``models/``), the covariance of its ``k_proj`` and ``v_proj``
outputs (all KV heads, before RoPE: what the PCA levels code once RoPE is undone) over 2,048 tokens of
the GPL-3, the first 32 tokens left out (the attention sink); the eigenvalues normalized to sum 1, the
median curve over the layers; its energy share in the top 1/8, 1/4, 1/2 of the components and a
power-law fit ``lambda_i ~ i**-alpha`` over ranks 2 .. N/2.

    python benchmarks/kv_spectrum.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import codec_corpus as CC  # noqa: E402


def main() -> int:
    import transformers

    path = ROOT / "models" / "SmolLM2-135M-Instruct"
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok(CC.source_text("license:GPL-3"), return_tensors="pt").input_ids[:, :2048]
    outs: dict[tuple[str, int], torch.Tensor] = {}
    for li, layer in enumerate(model.model.layers):
        for kind in ("k", "v"):
            proj = getattr(layer.self_attn, f"{kind}_proj")
            proj.register_forward_hook(lambda mod, i, o, key=(kind, li): outs.__setitem__(key, o[0].detach()))
    with torch.no_grad():
        model(ids)
    for kind in ("k", "v"):
        curves = []
        for li in range(len(model.model.layers)):
            x = outs[kind, li][32:].double()
            x = x - x.mean(0)
            ev = torch.linalg.eigvalsh(x.T @ x / len(x)).flip(0).clamp_min(0)
            curves.append((ev / ev.sum()).numpy())
        c = np.median(np.stack(curves), 0)
        n, cum = len(c), np.cumsum(c)
        i = np.arange(1, n + 1)
        sel = (i >= 2) & (i <= n // 2)
        alpha = -np.polyfit(np.log(i[sel]), np.log(c[sel]), 1)[0]
        shares = [round(float(cum[int(n * f) - 1]), 3) for f in (1 / 8, 1 / 4, 1 / 2)]
        print(f"{kind.upper()}: N = {n}, energy in the top 1/8, 1/4, 1/2: {shares}, alpha {alpha:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
