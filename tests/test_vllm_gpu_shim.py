"""lmtier.testing.vllm_gpu_shim: the ops that stand in for vLLM 0.33's compiled ones on the GPU
benchmark machine, and the platform plugin's entry point. CPU parts here; the CUDA paths (UVA view,
cuMemcpyBatchAsync) in the ``gpu`` test (also run by scripts/gpu_vllm_bench.sh as the self-test)."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest
import torch

from lmtier.testing.vllm_gpu_shim import ENTRY_POINT, ops, write_entry_point


def test_weak_ref_tensor_cpu_aliases_memory():
    base = torch.arange(60, dtype=torch.float32).view(5, 12)
    t = base[1:4, 2:11:3]  # storage offset and non-unit strides
    w = ops.weak_ref_tensor(t)
    assert (w.data_ptr(), w.shape, w.stride(), w.dtype) == (t.data_ptr(), t.shape, t.stride(), t.dtype)
    assert torch.equal(w, t)
    base[2, 5] = -7.0  # a write through the original shows in the alias: same memory
    assert w[1, 1].item() == -7.0
    with pytest.raises(ValueError, match="empty"):
        ops.weak_ref_tensor(torch.empty(0))


def test_extent_bytes_counts_the_strided_footprint():
    t = torch.empty(4, 10, dtype=torch.bfloat16)[:, :3]
    assert ops._extent_bytes(t) == ((3 * 10 + 2) + 1) * 2


def test_cuda_view_needs_pinned_cpu():
    with pytest.raises(ValueError, match="pinned"):
        ops.cuda_view_from_cpu_tensor(torch.zeros(4))


@pytest.mark.parametrize(
    "bad",
    [
        dict(src=torch.zeros(2, dtype=torch.int32)),
        dict(sizes=torch.zeros(3, dtype=torch.int64)),
    ],
)
def test_swap_blocks_batch_rejects_bad_arrays(bad):
    args = dict(src=torch.zeros(2, dtype=torch.int64), dst=torch.zeros(2, dtype=torch.int64))
    args["sizes"] = torch.zeros(2, dtype=torch.int64)
    args.update(bad)
    with pytest.raises(ValueError):
        ops.swap_blocks_batch(args["src"], args["dst"], args["sizes"])


def test_swap_blocks_batch_empty_is_a_no_op():
    e = torch.zeros(0, dtype=torch.int64)
    ops.swap_blocks_batch(e, e, e)  # no driver call, no CUDA needed


def test_gated_activations_match_pytorch():
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1))
    g, u = x[..., :8], x[..., 8:]
    want = {
        "silu_and_mul": torch.nn.functional.silu(g) * u,
        "mul_and_silu": g * torch.nn.functional.silu(u),
        "gelu_and_mul": torch.nn.functional.gelu(g) * u,
        "gelu_tanh_and_mul": torch.nn.functional.gelu(g, approximate="tanh") * u,
    }
    assert set(want) == set(ops.GATED_ACTIVATIONS)
    for name, fn in ops.GATED_ACTIVATIONS.items():
        out = torch.full((3, 5, 8), float("nan"))
        fn(out, x)
        assert torch.equal(out, want[name]), name


def test_entry_point_is_discoverable(tmp_path, monkeypatch):
    write_entry_point(tmp_path)
    write_entry_point(tmp_path)  # idempotent
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = importlib.metadata.entry_points(group="vllm.platform_plugins")
    ours = [ep for ep in eps if ep.name == "lmtier_cuda_shim"]
    assert len(ours) == 1 and f"{ours[0].name} = {ours[0].value}" == ENTRY_POINT
    assert ours[0].load().__name__ == "detect"
    assert "lmtier.testing.vllm_gpu_shim.platform" not in sys.modules  # loading the plugin imports no vLLM platform


def test_detect_without_gpu_names_no_platform(monkeypatch):
    from lmtier.testing.vllm_gpu_shim import plugin

    monkeypatch.setattr(plugin, "gpu_count", lambda: 0)
    assert plugin.detect() is None


@pytest.mark.gpu
def test_selftest_on_cuda():
    from lmtier.testing.vllm_gpu_shim import selftest

    results = selftest.run()
    assert [name for name, ok, _ in results if not ok] == [], results
