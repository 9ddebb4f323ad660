"""How the PCA level's ratio on unseen chunks depends on the tokens its basis was fitted on (RESULTS
§4.1u): a small random-weight Llama (4 layers, 4 KV heads x 64: N = 256 at G = 1) with the KV spectra
of a trained model's (``lmtier.bench.ttft.model.shape_kv_spectrum``), fitted on 2, 8, 16, 24 and 48 tokens per
value of N of other random token ids (seed 4321, as ``lmtier bench ttft`` fits), then the
``pca_default`` records of a 7,424-token prompt (seed 1234, the TTFT bench's) encoded at their
positions: the ratio of their real bytes, beside the fit's own (ideal, in-sample) ratio.

    python benchmarks/pca_fit_tokens.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmtier.bench.ttft.model import TRAINED_KV_ALPHA, prefix_kv, shape_kv_spectrum  # noqa: E402
from lmtier.codec import pca  # noqa: E402
from lmtier.codec.pca import hf  # noqa: E402

LAYERS, KV_HEADS, HEAD = 4, 4, 64
PROMPT, CHUNK = 7424, 256


def model() -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=LAYERS, num_attention_heads=16,
        num_key_value_heads=KV_HEADS, head_dim=HEAD, vocab_size=32000, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        m = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    shape_kv_spectrum(m, TRAINED_KV_ALPHA)
    return m


def main() -> int:
    m = model()

    def kv_of(seed: int, n: int) -> torch.Tensor:
        ids = torch.randint(0, 32000, (1, n), generator=torch.Generator().manual_seed(seed))
        return prefix_kv(m, ids, n, LAYERS)

    kv, cal = kv_of(1234, PROMPT), kv_of(4321, 48 * KV_HEADS * HEAD)
    raw = CHUNK * LAYERS * 2 * KV_HEADS * HEAD * 2
    n = KV_HEADS * HEAD
    for per_value in (2, 8, 16, 24, 48):
        tokens = per_value * n
        t0 = time.perf_counter()
        fitted = pca.fit(
            [cal[:, :, s : s + CHUNK] for s in range(0, tokens, CHUNK)],
            list(range(0, tokens, CHUNK)),
            inv_freq=hf.rotary_inv_freq(m),
            layer_group=1,
            name="pca_fit_tokens",
        )
        fit_s = time.perf_counter() - t0
        sizes = [
            len(pca.encode(kv[:, :, s : s + CHUNK], start=s, model=fitted, level="pca_default"))
            for s in range(0, PROMPT, CHUNK)
        ]
        print(
            f"{per_value:2d} tokens per value ({tokens} tokens, fit {fit_s:.1f} s): unseen prompt "
            f"{len(sizes) * raw / sum(sizes):.3f}x, in-sample ideal "
            f"{fitted.info['calibration_ratios']['pca_default']:.3f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
