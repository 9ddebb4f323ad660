"""Check the shim's ops on a CUDA machine before an engine relies on them (test scaffolding).

``python -m lmtier.testing.vllm_gpu_shim.selftest`` prints one line per check and exits non-zero
when one fails:

* ``get_cuda_view_from_cpu_tensor``: a kernel writing through the view is seen in the pinned tensor;
* ``weak_ref_tensor``: same address, dtype, shape, strides and values;
* ``swap_blocks_batch``: random blocks GPU -> pinned CPU (source order STREAM) and back (ANY), scattered
  block ids, compared byte for byte with the expected result; the driver entry point it used.
"""

from __future__ import annotations

import sys

import torch


def run() -> list[tuple[str, bool, str]]:
    """The checks: (name, passed, detail)."""
    from lmtier.testing.vllm_gpu_shim import ops

    ops.register()
    res = []
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)

    cpu = torch.zeros(3, 1000, dtype=torch.int32, pin_memory=True)
    view = torch.ops._C.get_cuda_view_from_cpu_tensor(cpu)
    view.add_(torch.arange(3000, dtype=torch.int32, device=dev).view(3, 1000))
    torch.cuda.synchronize()
    ok = view.device.type == "cuda" and torch.equal(cpu, torch.arange(3000, dtype=torch.int32).view(3, 1000))
    res.append(("get_cuda_view_from_cpu_tensor", ok, f"view on {view.device}"))

    t = torch.randn(64, 48, generator=g).to(dev, torch.bfloat16)[:, 8:40]
    w = torch.ops._C.weak_ref_tensor(t)
    ok = (w.data_ptr(), w.dtype, w.shape, w.stride()) == (t.data_ptr(), t.dtype, t.shape, t.stride())
    res.append(("weak_ref_tensor", ok and torch.equal(w, t), f"strides {w.stride()}"))

    nblocks, block_bytes = 64, 48 * 1024
    gpu = torch.randint(0, 256, (nblocks, block_bytes), dtype=torch.uint8, generator=g).to(dev)
    host = torch.zeros(nblocks, block_bytes, dtype=torch.uint8, pin_memory=True)
    src_ids = torch.randperm(nblocks, generator=g)[:24]
    dst_ids = torch.randperm(nblocks, generator=g)[:24]

    def ptrs(base: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return (base.data_ptr() + ids.to(torch.int64) * block_bytes).contiguous()

    sizes = torch.full((24,), block_bytes, dtype=torch.int64)
    side = torch.cuda.Stream()  # the batch call refuses the legacy default stream; vLLM uses its own streams
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            torch.ops._C_cache_ops.swap_blocks_batch(ptrs(gpu, src_ids), ptrs(host, dst_ids), sizes, False)
    except RuntimeError as e:
        res.append(("swap_blocks_batch", False, f"driver entry point {ops.batch_api()}: {e}"))
        return res
    torch.cuda.synchronize()
    ok_out = torch.equal(host[dst_ids], gpu[src_ids].cpu())
    gpu2 = torch.zeros_like(gpu)
    back = torch.randperm(nblocks, generator=g)[:24]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.ops._C_cache_ops.swap_blocks_batch(ptrs(host, dst_ids), ptrs(gpu2, back), sizes, True)
    torch.cuda.synchronize()
    ok_in = torch.equal(gpu2[back].cpu(), host[dst_ids]) and int(gpu2.sum()) == int(
        host[dst_ids].sum(dtype=torch.int64)
    )
    res.append(
        ("swap_blocks_batch", ok_out and ok_in, f"driver entry point {ops.batch_api()}, out {ok_out} in {ok_in}")
    )
    return res


def main() -> int:
    """Run the checks, print them; 0 when all pass."""
    if not torch.cuda.is_available():
        print("selftest: no CUDA device")
        return 2
    bad = 0
    for name, ok, detail in run():
        print(f"shim selftest {'ok  ' if ok else 'FAIL'} {name}: {detail}")
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
