"""zstd (levels 3 and 19) on the split bf16 byte planes of real SmolLM2 KV, the generic-compressor
reference beside lmtier's codec (RESULTS.md §4.4). Usage: .venv/bin/python benchmarks/zstd_compare.py"""

import torch
import zstandard

from lmtier.bench.codec import model_kv
from lmtier.bench.codec_kernels import zstd_planes
from lmtier.codec import quant as Q

kv, what = model_kv("models/SmolLM2-135M-Instruct", 4, 256)
print("real:", what, tuple(kv.shape), kv.dtype)
z = zstd_planes(kv.to(torch.bfloat16))
print("real KV zstd-3 split planes:", {k: round(v, 3) for k, v in z.items()})
# zstd-19 on the same planes
hi = b"".join(Q.quantize(kv[i].to(torch.bfloat16), "lossless")[0].numpy().tobytes() for i in range(kv.shape[0]))
lo = b"".join(Q.quantize(kv[i].to(torch.bfloat16), "lossless")[1].numpy().tobytes() for i in range(kv.shape[0]))
c = zstandard.ZstdCompressor(level=19)
n = kv.numel() * 2
print("real KV zstd-19 split planes ratio:", round(n / (len(c.compress(hi)) + len(c.compress(lo))), 3))
raw = kv.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
print("real KV zstd-3 unsplit ratio:", round(n / len(zstandard.ZstdCompressor(level=3).compress(raw)), 3))
