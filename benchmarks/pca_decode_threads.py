"""The PCA level's CUDA decode as a tier's I/O threads run it, in a loop (issue 19): ``--threads``
threads each decode one record at a time on its own stream (``lmtier.bench.codec_pca.decode_one``:
``decode_queued(...).result()``), over and over for ``--seconds``; prints GB/s of bf16 KV. Made to run
under ``py-spy record --gil`` (scripts/gpu_run.sh's ``decspy`` step): which Python code holds the GIL
while several threads decode. Llama-3.1-8B geometry at G = 1, the codec_pca bench's synthetic model
and chunks.

    python benchmarks/pca_decode_threads.py [--threads 4] [--chunks 8] [--seconds 20] [--level pca_default]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an A/B may put another lmtier first

from lmtier.bench import codec_pca as bench  # noqa: E402
from lmtier.codec import pca  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--level", default="pca_default")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    geom = (32, 8, 128, 1)
    m = bench.model_for(geom, bench.MIN_CALIB_TOKENS)
    chunks = [bench.synthetic_kv(geom, 256, 256 * i, 100 + i).to(dev) for i in range(a.chunks)]
    recs = [pca.encode(c, start=256 * i, model=m, level=a.level) for i, c in enumerate(chunks)]
    gb = sum(c.numel() * c.element_size() for c in chunks) / 1e9
    pool = ThreadPoolExecutor(a.threads, thread_name_prefix="decode")
    list(pool.map(lambda r: bench.decode_one(r, m, dev), recs))  # warm-up: lookups, handles, streams
    torch.cuda.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < a.seconds:
        list(pool.map(lambda r: bench.decode_one(r, m, dev), recs))
        n += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"{a.level}: {n} passes of {a.chunks} records with {a.threads} threads: {n * gb / dt:.1f} GB/s of bf16 KV")
    pool.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
