"""lmtier.testing: the one server harness (Redis, vLLM server/engine, process memory) that tests,
benchmarks, the demo and the soak import — no sys.path imports of scripts/ or tests/ helpers."""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from lmtier.testing import redis as tredis
from lmtier.testing.server import metric_delta, parse_metrics

REPO = Path(__file__).resolve().parent.parent


def test_no_sys_path_imports_of_scripts_or_tests_helpers():
    bad = re.compile(
        r"sys\.path\.(insert|append)\([^)]*[\"'](scripts|tests)[\"']|^\s*import demo\b|"
        r"from (tests\.)?(redis_server|conftest_redis|vllm_helpers) import|lmtier\.bench\.procmem|"
        r"from lmtier\.bench import procmem",
        re.M,
    )
    hits = [
        f"{p.relative_to(REPO)}: {m.group(0).strip()}"
        for d in ("tests", "benchmarks", "scripts", "lmtier", "examples")
        for p in (REPO / d).rglob("*.py")
        if p.name != "test_testing_harness.py"
        for m in bad.finditer(p.read_text(errors="replace"))
    ]
    assert hits == []


def test_find_redis_server_honours_the_env_override(tmp_path, monkeypatch):
    exe = tmp_path / "my-redis"
    exe.write_text("#!/bin/sh\n")
    monkeypatch.setenv("LMTIER_REDIS_SERVER", str(exe))
    assert tredis.find_redis_server() is None  # not executable
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    assert tredis.find_redis_server() == str(exe)
    monkeypatch.delenv("LMTIER_REDIS_SERVER")
    assert tredis.find_redis_server() in (None, shutil.which("redis-server"), str(tredis._BUNDLE))


def test_redis_server_maxmemory(tmp_path):
    srv = tredis.start_or_skip(maxmemory=64 << 20)
    try:
        import redis

        r = redis.Redis(host="127.0.0.1", port=srv.port)
        assert int(r.config_get("maxmemory")["maxmemory"]) == 64 << 20
        assert srv.url == f"redis://127.0.0.1:{srv.port}/0"
    finally:
        srv.close()
    assert not os.path.exists(srv.dir)


def test_parse_metrics_and_delta():
    text = (
        '# HELP x\nlmtier_hits_total{engine="0",model_name="m"} 3\nvllm:prompt_tokens_total{engine="0"} 10\n'
        "vllm:other 5\nlmtier_hits_created 1\n"
    )
    m = parse_metrics(text)
    assert m == {"lmtier_hits_total": 3.0, "vllm:prompt_tokens_total": 10.0}
    assert metric_delta({"lmtier_hits_total": 1.0}, m) == {"lmtier_hits_total": 2.0, "vllm:prompt_tokens_total": 10.0}


@pytest.mark.parametrize("module", ["redis", "fixtures", "vllm", "server", "procs", "procmem"])
def test_harness_modules_import(module):
    __import__(f"lmtier.testing.{module}")


def test_no_hash_derived_seeds():
    """Python's hash() of a str changes with PYTHONHASHSEED: a seed made from it tests other data
    in every run (issue 14). Seeds are constants or derived with a stable function (zlib.crc32)."""
    bad = re.compile(r"(seed|Random|default_rng|RandomState)\s*\(\s*(abs\()?hash\(")
    hits = [
        f"{p.relative_to(REPO)}:{i + 1}"
        for d in ("tests", "benchmarks", "lmtier/bench")
        for p in (REPO / d).rglob("*.py")
        for i, line in enumerate(p.read_text(errors="replace").splitlines())
        if bad.search(line)
    ]
    assert hits == []


@pytest.mark.parametrize("size", [8192, 8192 + 5, 8192 + 40, 1 << 20])
def test_corrupt_file_changes_the_file(tmp_path, size):
    """The engine harness's disk fault flips bytes of every record at least 8 KiB long: at exactly
    8 KiB its two 16-byte ranges were the same bytes, flipped twice (the file came out unchanged)."""
    from lmtier.testing.vllm import _corrupt_file

    f = tmp_path / "r.lmt"
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    f.write_bytes(data)
    assert _corrupt_file(str(f))
    got = f.read_bytes()
    assert len(got) == size and got != data
    assert sum(a != b for a, b in zip(got, data)) >= 16


def test_redis_server_output_goes_to_a_file_and_a_failed_start_names_it(tmp_path):
    # a server that writes far more than a pipe holds (64 KiB) before it exits: with its output on
    # an unread pipe it would block instead; the exit message carries the tail of what it wrote
    exe = tmp_path / "noisy-redis"
    exe.write_text('#!/bin/sh\nyes "warning line" | head -c 300000\necho "FATAL: bad config" >&2\nexit 1\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    srv = tredis.RedisServer(binary=str(exe))
    try:
        with pytest.raises(tredis.RedisUnavailable, match="FATAL: bad config"):
            srv.start(timeout_s=20)
        assert os.path.getsize(os.path.join(srv.dir, "redis-server.log")) > 300000
    finally:
        srv.close()
