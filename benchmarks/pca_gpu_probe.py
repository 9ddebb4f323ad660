"""Experiment (issue 19): can the PCA levels' integer transform run on the GPU as float64 GEMMs with the
CPU reference's exact bits, and how fast? Not the product (``lmtier.codec.pca`` is CPU-only).

For Llama-3.1-8B's geometry (32 layers, 8 KV heads x 128, groups of 4 layers: N = 4,096, R = 8) and
256-token chunks: random int16 encode/decode matrices and fixed-point inputs of the documented ranges
(``|x_int|, |e_int|, |q|, |d_int| <= 32767``), ``acc = x_int @ e_int`` (float64, exact: integer
partial sums below 2**53), ``q = round(acc * k)``, ``acc2 = q @ d_int``; the GPU's results are compared
bit for bit with the CPU's (torch float64 matmul, any order: exact) and timed with CUDA events
(median of 20; GB/s of the bf16 chunk, 33.5 MB). Ceiling: the H200's FP64 tensor-core peak (67 TFLOPS).

Run: ``python benchmarks/pca_gpu_probe.py [--tokens 256] [--chunks 1,4] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--chunks", default="1,4")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    nl, h, d, g = 32, 8, 128, 4
    r, n = nl // g, g * h * d
    gen = torch.Generator().manual_seed(0)
    e = torch.randint(-32767, 32768, (r, 2, n, n), generator=gen, dtype=torch.int32).to(torch.float64)
    dm = torch.randint(-32767, 32768, (r, 2, n, n), generator=gen, dtype=torch.int32).to(torch.float64)
    k = torch.rand(r, 2, n, generator=gen, dtype=torch.float64) * 2e-9
    dev = torch.device("cuda")
    e_d, dm_d, k_d = e.to(dev), dm.to(dev), k.to(dev)
    out = dict(geometry=dict(L=nl, H=h, D=d, G=g, N=n, R=r, tokens=a.tokens), gpu=torch.cuda.get_device_name(), runs=[])
    for c in (int(x) for x in a.chunks.split(",")):
        t = a.tokens * c
        x = torch.randint(-32767, 32768, (r, 2, t, n), generator=gen, dtype=torch.int32).to(torch.float64)
        t0 = time.perf_counter()
        acc = x @ e
        q = torch.round(acc * k[:, :, None, :]).clamp_(-32767, 32767)
        acc2 = q @ dm
        cpu_s = time.perf_counter() - t0
        x_d = x.to(dev)
        fwd, inv = [], []
        for _ in range(22):
            s0, s1, s2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            s0.record()
            acc_d = x_d @ e_d
            q_d = torch.round(acc_d * k_d[:, :, None, :]).clamp_(-32767, 32767)
            s1.record()
            acc2_d = q_d @ dm_d
            s2.record()
            torch.cuda.synchronize()
            fwd.append(s0.elapsed_time(s1))
            inv.append(s1.elapsed_time(s2))
        fwd, inv = sorted(fwd[2:]), sorted(inv[2:])
        nbytes = nl * 2 * t * h * d * 2
        row = dict(
            chunks=c,
            bit_identical_acc=bool(torch.equal(acc_d.cpu(), acc)),
            bit_identical_q=bool(torch.equal(q_d.cpu(), q)),
            bit_identical_acc2=bool(torch.equal(acc2_d.cpu(), acc2)),
            encode_ms=fwd[len(fwd) // 2],
            decode_ms=inv[len(inv) // 2],
            encode_gbps=nbytes / fwd[len(fwd) // 2] / 1e6,
            decode_gbps=nbytes / inv[len(inv) // 2] / 1e6,
            tflops_encode=2 * r * 2 * t * n * n / fwd[len(fwd) // 2] / 1e9,
            cpu_s=cpu_s,
            cpu_threads=torch.get_num_threads(),
        )
        out["runs"].append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
