"""``chunk_size`` against vLLM's block size (issue 20 section 5): the connector refuses a chunk size
that is not a multiple of the engine's block size at start, naming both values; ``load_config``,
where no block size is known, warns about one that is not a multiple of vLLM's default."""

from __future__ import annotations

import logging
import os

import pytest

from lmtier.config import ConfigError, LMTierConfig, load_config
from lmtier.config_checks import VLLM_DEFAULT_BLOCK_SIZE
from lmtier.testing.vllm import MODEL_DIR, require_vllm, write_yaml


@pytest.mark.parametrize("chunk", [100, 8, 24, 250])
def test_load_config_warns_chunk_size_not_multiple_of_default_block_size(tmp_path, caplog, chunk):
    path = write_yaml(tmp_path / "lmtier.yaml", {"chunk_size": chunk, "max_local_cpu_size": 0.01})
    with caplog.at_level(logging.WARNING, logger="lmtier.config"):
        cfg = load_config(path, env={})
    assert cfg.chunk_size == chunk  # the library API accepts it
    msgs = [r.getMessage() for r in caplog.records if r.name == "lmtier.config"]
    assert any(f"chunk_size={chunk}" in m and f"{VLLM_DEFAULT_BLOCK_SIZE}" in m for m in msgs), msgs


@pytest.mark.parametrize("chunk", [16, 32, 256, 4096])
def test_load_config_quiet_for_multiples_of_default_block_size(tmp_path, caplog, chunk):
    path = write_yaml(tmp_path / "lmtier.yaml", {"chunk_size": chunk, "max_local_cpu_size": 0.01})
    with caplog.at_level(logging.WARNING, logger="lmtier.config"):
        load_config(path, env={})
    assert not [r for r in caplog.records if "chunk_size" in r.getMessage()]


def test_from_dict_warns_too(caplog):
    with caplog.at_level(logging.WARNING, logger="lmtier.config"):
        LMTierConfig.from_dict({"chunk_size": 100, "max_local_cpu_size": 0.01})
    assert "chunk_size=100" in caplog.text


def _vllm_config(block: int):
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    mc = ModelConfig(model=str(MODEL_DIR), dtype="float32", max_model_len=2048, seed=0, skip_tokenizer_init=True)
    sc = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    kt = KVTransferConfig(
        kv_connector="LMTierConnector",
        kv_connector_module_path="lmtier.integration.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        engine_id="chunk-size-check",
    )
    return VllmConfig(
        model_config=mc,
        scheduler_config=sc,
        cache_config=CacheConfig(block_size=block),
        kv_transfer_config=kt,
        device_config=DeviceConfig("cpu"),
    )


@pytest.mark.vllm
@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
@pytest.mark.parametrize(("chunk", "block"), [(100, 16), (48, 32), (16, 32)])
def test_connector_start_refuses_chunk_size_not_multiple_of_block_size(tmp_path, monkeypatch, role, chunk, block):
    """The README's rule, enforced where vLLM's block size is known: the connector does not start,
    and the error names the chunk size and the block size."""
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from lmtier.integration.vllm.connector import LMTierConnector

    cfg = write_yaml(tmp_path / "lmtier.yaml", {"chunk_size": chunk, "max_local_cpu_size": 0.01})
    monkeypatch.setenv("LMTIER_CONFIG_FILE", str(cfg))
    vc = _vllm_config(block)
    assert vc.cache_config.block_size == block
    with pytest.raises(ConfigError) as e:
        LMTierConnector(vc, getattr(KVConnectorRole, role))
    msg = str(e.value)
    assert f"chunk_size={chunk}" in msg and f"block size {block}" in msg, msg
    assert os.environ["LMTIER_CONFIG_FILE"] == str(cfg)
