"""The PCA levels under tensor parallelism: what splitting a basis by the ranks' KV heads costs.

SmolLM2-135M has 3 KV heads, so ``vllm serve --tensor-parallel-size 3`` gives each rank one. This
calibrates the model twice with the product's command (``python -m lmtier.codec.pca``, TP = 1 and
``--tensor-parallel-size 3``, the same calibration-only texts of ``codec_corpus.CALIBRATION_TEXTS``),
then codes the held-out matrix texts' context KV (``codec_corpus.MATRIX_TEXTS``, split
``held-out``) as the tiers would: each 256-token chunk, per rank its heads' slice with its model
(:func:`lmtier.codec.pca.load_file`, ``RankModels.for_rank``; :func:`lmtier.codec.pca.encode` /
``decode``), and scores the decoded KV as ``codec_quality.py`` does (teacher-forced continuation:
Δppl, top-1 agreement, KL against the bf16 KV). Ratio: the bf16 bytes over every record's bytes
(all ranks').

    python benchmarks/codec_pca_tp.py [--max-tokens 2048] [--texts N] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import codec_corpus as CC  # noqa: E402
import codec_quality as Q  # noqa: E402

from lmtier.codec import pca  # noqa: E402
from lmtier.codec.pca import calibrate  # noqa: E402

TP = 3
CHUNK = 256
LEVELS = ("pca_high", "pca_default")


def _calibrate(folder: Path, tp: int, max_tokens: int, texts: int) -> tuple[Path, float]:
    args = []
    for name, src in list(CC.CALIBRATION_TEXTS.items())[:texts]:
        f = folder / f"{name}.txt"
        f.write_text(CC.source_text(src), encoding="utf-8")
        args += ["--text-file", str(f)]
    out = folder / f"smollm2_tp{tp}.lmtpca"
    argv = ["--model", str(Q.MODEL_DIR), *args, "--max-tokens", str(max_tokens), "--out", str(out)]
    t0 = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = calibrate.main([*argv, "--tensor-parallel-size", str(tp)] if tp > 1 else argv)
    if rc != 0:
        raise SystemExit(f"calibration TP={tp} failed ({rc})")
    return out, time.monotonic() - t0


def _code(kv: torch.Tensor, models: list[pca.PCAModel], heads: list[tuple[int, int]], level: str):
    """(decoded KV, record bytes) of ``kv`` [L, 2, T, H, D] bf16, chunk by chunk, rank by rank."""
    out, nbytes = torch.empty_like(kv), 0
    for s in range(0, kv.shape[2], CHUNK):
        for m, (h0, h1) in zip(models, heads, strict=True):
            chunk = kv[:, :, s : s + CHUNK, h0:h1].contiguous()
            rec = pca.encode(chunk, start=s, model=m, level=level)
            nbytes += len(rec)
            out[:, :, s : s + CHUNK, h0:h1] = pca.decode(rec, model=m)
    return out, nbytes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=2048, help="calibration tokens per text")
    ap.add_argument("--texts", type=int, default=4, help="calibration-only texts used (of 8)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    rows, fits = [], {}
    with tempfile.TemporaryDirectory() as d:
        files = {}
        for tp in (1, TP):
            files[tp], fits[tp] = _calibrate(Path(d), tp, a.max_tokens, a.texts)
            print(f"# calibration TP={tp}: {fits[tp]:.0f} s", flush=True)
        loaded = {tp: pca.load_file(f) for tp, f in files.items()}
        setups = {
            1: ([loaded[1]], [(0, loaded[1].num_heads)]),
            TP: (
                [loaded[TP].for_rank(r) for r in range(TP)],
                [pca.rank_heads(loaded[TP].num_kv_heads, TP, r) for r in range(TP)],
            ),
        }
        for name, (_, split) in CC.MATRIX_TEXTS.items():
            if split != "held-out":
                continue
            text = Q.get_text(name)
            kv = text["kv_fp32"].to(torch.bfloat16)
            ref = Q.continuation_logprobs(text, kv)
            nxt = text["ids"][text["ctx"] + 1 :]
            for level in LEVELS:
                for tp, (models, heads) in setups.items():
                    dec, nbytes = _code(kv, models, heads, level)
                    r = Q.compare(ref, Q.continuation_logprobs(text, dec), nxt)
                    r.update(text=name, level=level, tp=tp, ratio=kv.numel() * 2 / nbytes, record_bytes=nbytes)
                    rows.append(r)
                    print(
                        f"{name:<12s} {level:<12s} TP={tp}  ratio {r['ratio']:.3f}x  dppl {r['dppl_pct']:+.2f} %  "
                        f"top1 {r['top1']:.1f} %  KL {r['kl']:.4f}",
                        flush=True,
                    )
    if a.json:
        a.json.write_text(
            json.dumps(dict(rows=rows, calibration_s=fits, args=vars(a) | {"json": str(a.json)}), indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
