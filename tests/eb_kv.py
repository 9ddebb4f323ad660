"""KV the error-bounded codec tests run on (tests/test_gpu_codec_bound.py): SmolLM2-135M's real KV,
and seeded KV-like chunks of SmolLM2's and of a Llama-3.1-8B-like geometry.

Real KV: SmolLM2-135M-Instruct's prefill (float32, cast to bf16) of the first 512 tokens of the
GPL-3 text, split into two 256-token chunks ``[30, 2, 256, 3, 64]`` — the text and chunks
tests/test_codec_bound.py's real-model test uses. It comes from the model under ``models/`` when
present (and ``transformers``), else from a file of two ``lossless`` codec records (the exact bf16
bits, checksummed) written here by::

    PYTHONPATH=. .venv/bin/python -m tests.eb_kv --write .whl/eb_kv/smollm2_gpl3.lmkc

for machines without the model (the lent GPU machine: ``carry`` ``.whl``; ``$LMTIER_EB_KV`` names
another file). None of them: :func:`smollm2_real` returns None and the tests that need it skip.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import numpy as np
import torch

from lmtier.codec import chunk as CH
from lmtier.codec import format as fmt

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
KV_FILE = Path(os.environ.get("LMTIER_EB_KV", ROOT / ".whl" / "eb_kv" / "smollm2_gpl3.lmkc"))
TEXT = Path("/usr/share/common-licenses/GPL-3")

SMOL = (30, 2, 256, 3, 64)
"""SmolLM2-135M's canonical chunk ``[L, 2, T, H, D]`` (256 tokens)."""
LLAMA8B = (32, 2, 256, 8, 128)
"""Llama-3.1-8B's canonical chunk (one tensor-parallel rank of 8 KV heads)."""


def kv_like(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Seeded KV-like bf16 chunk: tests/test_codec_bound.py's generator (Gaussian with per-channel
    magnitudes, outlier key channels, a large first token, a shared key offset)."""
    from tests.test_codec_bound import kv_like as gen

    return gen(seed, shape)


def _from_model() -> list[torch.Tensor] | None:
    if not (MODEL / "model.safetensors").exists() or not TEXT.exists():
        return None
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        return None
    tok = AutoTokenizer.from_pretrained(MODEL)
    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = torch.tensor(tok(TEXT.read_text()[:6000]).input_ids[:512])[None]
    with torch.no_grad():
        cache = m(ids, use_cache=True).past_key_values
    kv = torch.stack([torch.stack([ly.keys[0].transpose(0, 1), ly.values[0].transpose(0, 1)]) for ly in cache.layers])
    return [c.to(torch.bfloat16).contiguous() for c in (kv[:, :, :256], kv[:, :, 256:512])]


def _from_file(path: Path) -> list[torch.Tensor] | None:
    if not path.is_file():
        return None
    buf = np.fromfile(path, np.uint8)
    out, off = [], 0
    while off < buf.size:
        rec = np.ascontiguousarray(buf[off:])
        n = fmt.unpack(rec).nbytes
        x = torch.empty(SMOL, dtype=torch.bfloat16)
        CH.decode_chunk(rec[:n], x, expected_shape=SMOL, dtype=torch.bfloat16, level="lossless")
        out.append(x)
        off += n
    return out


@functools.lru_cache(maxsize=1)
def smollm2_real() -> tuple[torch.Tensor, ...] | None:
    """The two real SmolLM2 chunks (CPU bf16 ``[30, 2, 256, 3, 64]``), or None (no model, no file)."""
    got = _from_model() or _from_file(KV_FILE)
    return None if got is None else tuple(got)


def source() -> str:
    """Where :func:`smollm2_real` takes the KV from (for skip reasons and logs)."""
    if (MODEL / "model.safetensors").exists():
        return f"model {MODEL}"
    return f"file {KV_FILE}" if KV_FILE.is_file() else f"none (no {MODEL}, no {KV_FILE})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="write SmolLM2's real KV chunks as lossless codec records")
    ap.add_argument("--write", type=Path, required=True, help="output file")
    args = ap.parse_args(argv)
    chunks = _from_model()
    if chunks is None:
        print(f"needs {MODEL} and transformers", file=sys.stderr)
        return 2
    recs = [CH.encode_chunk(c, shape=SMOL, dtype=torch.bfloat16, level="lossless") for c in chunks]
    args.write.parent.mkdir(parents=True, exist_ok=True)
    args.write.write_bytes(b"".join(recs))
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(chunks, _from_file(args.write)))
    print(f"{args.write}: {len(chunks)} chunks {SMOL} bf16, {sum(map(len, recs))} bytes (lossless records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
