"""lmtier as a library: cache a prompt's KV with a Hugging Face model and reuse it for a new prompt.

Runs on CPU with a tiny randomly initialised Llama (no download). It

1. prefills a "system prompt + question 1" and stores the KV of every full chunk (the tail
   shorter than ``chunk_size`` is not stored; the output says how many chunks were stored),
2. for "system prompt + question 2" looks up the cached prefix, retrieves its KV into a
   ``DynamicCache`` and prefills only the remaining tokens (the output says how many chunks hit),
3. checks that the logits equal a full prefill of the second prompt.

The system prompt spans at least two full chunks at the configured ``chunk_size`` (100 tokens at
the default 16, 516 at the README's 256), so chunks are stored and hit at any chunk size.

    python examples/library_api.py [--config lmtier.yaml]

With ``--config`` (or ``LMTIER_CONFIG_FILE``) the tiers come from an lmtier/LMCache YAML file;
by default a 64 MiB CPU pool is used. The model runs in float32, and the lossy codec
(``remote_serde`` / ``local_disk_serde: cachegen``) needs a bfloat16/float16 KV cache: with the
README's ``lmtier.yaml`` set ``remote_serde: naive``. A configuration that cannot be used here ends
in one line saying why (exit status 1).
"""

from __future__ import annotations

import argparse
import logging

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from lmtier.config import ConfigError, LMTierConfig, load_config
from lmtier.hf import KVCacheStore
from lmtier.keys import Namespace
from lmtier.manager import TierManager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="lmtier YAML config (default: 64 MiB CPU pool)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.manual_seed(0)

    def unusable(e: ConfigError) -> SystemExit:
        return SystemExit(f"{parser.prog} (a float32 model on CPU): {e}")

    try:
        config = (
            load_config(args.config)
            if args.config
            else LMTierConfig.from_dict({"chunk_size": 16, "max_local_cpu_size": 64 / 1024})
        )
    except ConfigError as e:
        raise unusable(e) from None
    chunk_size = config.chunk_size
    # Shared prefix: at least two full chunks plus 4 tokens (6 chunks + 4 at chunk_size 16).
    system_len = max(100, 2 * chunk_size + 4)

    cfg_model = LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(1024, system_len + 64),
    )
    model = LlamaForCausalLM(cfg_model).eval()
    head_size = cfg_model.hidden_size // cfg_model.num_attention_heads
    ns = Namespace(
        model="example/tiny-llama-random@seed0",
        num_layers=cfg_model.num_hidden_layers,
        num_kv_heads=cfg_model.num_key_value_heads,
        head_size=head_size,
        kv_dtype="float32",
        chunk_size=chunk_size,
    )

    system = torch.randint(0, 1000, (system_len,)).tolist()
    prompt1 = system + torch.randint(0, 1000, (20,)).tolist()
    prompt2 = system + torch.randint(0, 1000, (30,)).tolist()

    try:
        manager = TierManager.from_config(config, ns)
    except ConfigError as e:  # e.g. remote_serde: cachegen (a bf16/fp16 codec) with this float32 model
        raise unusable(e) from None
    with manager:
        kv_store = KVCacheStore(manager, ns)

        # 1. Prefill prompt 1 and store its KV (asynchronously; flush waits for it).
        with torch.no_grad():
            out1 = model(torch.tensor([prompt1]), use_cache=True)
        futures = kv_store.store(prompt1, out1.past_key_values, cache_salt="tenant-a")
        manager.flush()
        stored = sum(f.result() for f in futures)
        tail = len(prompt1) - len(futures) * chunk_size
        print(
            f"prompt 1: {len(prompt1)} tokens = {len(futures)} full chunks of {chunk_size} tokens + {tail} "
            f"(a tail shorter than a chunk is not stored); stored {stored} chunks ({ns.chunk_bytes} bytes each)"
        )
        if not futures:
            print(f"prompt 1 is shorter than one chunk ({chunk_size} tokens): nothing stored")

        # 2. Prompt 2 shares the system prompt: reuse its cached prefix.
        hit = kv_store.lookup(prompt2, cache_salt="tenant-a")
        hit = min(hit, len(prompt2) - 1)  # always compute at least the last token
        n, layers = kv_store.retrieve(prompt2[:hit], cache_salt="tenant-a")
        print(
            f"prompt 2: {len(prompt2)} tokens, hit {n // chunk_size} chunks: {n} tokens loaded from the cache, "
            f"{len(prompt2) - n} to prefill"
        )
        cache = DynamicCache()
        for i, (k, v) in enumerate(layers):
            cache.update(k, v, i)
        with torch.no_grad():
            rest = model(torch.tensor([prompt2[n:]]), past_key_values=cache if n else None, use_cache=True)
            full = model(torch.tensor([prompt2]), use_cache=False)

        # 3. Same logits as a full prefill (up to float rounding of a different reduction order).
        diff = (rest.logits[0, -1] - full.logits[0, -1]).abs().max().item()
        print(f"max |logit difference| vs full prefill: {diff:.2e}")
        assert diff < 1e-4, diff
        print("tier counters:", dict(manager.counters))


if __name__ == "__main__":
    main()
