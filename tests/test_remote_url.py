"""lmtier.remote_url: the one parser of remote URLs, shared by the config (RemoteConfig.endpoint)
and the Redis tier (built from that endpoint). Issue 14, defect 3: the config's parser and the
tier's disagreed (a lone ``secret@`` was a password for one and a user name for the other;
``unix:///path?password=x``, documented by the tier, was rejected by the config) and the tier parsed
the URL again. The tests marked "old:" failed on that code."""

from __future__ import annotations

import pytest

from lmtier.config import ConfigError, LMTierConfig
from lmtier.remote_url import RedisEndpoint, RemoteURLError, TLSOptions, parse_redis_url, redact_url


def key(i: int) -> bytes:
    return bytes([i]) * 32


# ---------------------------------------------------------------------------------------- grammar
@pytest.mark.parametrize(
    "url,scheme,hosts,sock,db,user,pw",
    [
        ("redis://localhost", "redis", (("localhost", 6379),), None, 0, None, None),
        ("REDIS://h:1/2", "redis", (("h", 1),), None, 2, None, None),
        ("redis://h:1?db=4", "redis", (("h", 1),), None, 4, None, None),
        ("redis://secret@h:6379", "redis", (("h", 6379),), None, 0, None, "secret"),
        ("redis://:p%40ss@h", "redis", (("h", 6379),), None, 0, None, "p@ss"),
        ("redis://al%20ice:pw@h", "redis", (("h", 6379),), None, 0, "al ice", "pw"),
        ("redis://alice:@h", "redis", (("h", 6379),), None, 0, "alice", None),
        ("redis://h?password=x", "redis", (("h", 6379),), None, 0, None, "x"),
        ("unix:///run/r.sock?password=x&db=2", "unix", (), "/run/r.sock", 2, None, "x"),
        ("unix://:pw@/run/r.sock", "unix", (), "/run/r.sock", 0, None, "pw"),
        ("redis-cluster://a:1,[::1]:2,c", "redis-cluster", (("a", 1), ("::1", 2), ("c", 6379)), None, 0, None, None),
    ],
)
def test_grammar(url, scheme, hosts, sock, db, user, pw):
    e = parse_redis_url(url)
    assert (e.scheme, e.hosts, e.socket_path, e.db, e.username, e.password) == (scheme, hosts, sock, db, user, pw)
    cfg = LMTierConfig.from_dict({"remote_url": url}).remote
    assert cfg.endpoint == e and cfg.password == pw and (cfg.scheme, cfg.hosts, cfg.db) == (scheme, hosts, db)


def test_scheme_errors_list_what_the_key_takes():
    """remote_url takes the Redis schemes and mooncakestore://; a Redis-only parse lists the Redis ones."""
    with pytest.raises(ConfigError, match=r"remote_url=.*scheme must be one of \['redis://'.*'mooncakestore://'\]"):
        LMTierConfig.from_dict({"remote_url": "http://h"})
    with pytest.raises(RemoteURLError, match=r"scheme must be one of \['redis://'.*\] \(a Redis/Valkey URL\)") as e:
        parse_redis_url("mooncakestore://h:1/")
    assert "mooncakestore://'" not in e.value.why


@pytest.mark.parametrize(
    "url,why",
    [
        ("http://h", "scheme"),
        ("redis://", "missing host"),
        ("redis://h:x", "port"),
        ("redis://h:0", "port"),
        ("redis://h/x", "database"),
        ("redis://h/1?db=2", "twice"),
        ("redis://a,b", "several hosts"),
        ("redis-cluster://a/1", "no database"),
        ("redis://:a@h?password=b", "twice"),
        ("unix://h/s", "unix:///"),
        ("unix://", "socket path"),
        ("redis://h?ssl_cert_reqs=none", "unsupported"),
        ("rediss://h?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
        ("rediss://h?ssl_check_hostname=perhaps", "ssl_check"),
        ("rediss://h?ssl_ca_certs=/nonexistent", "ssl_ca_certs"),
        ("redis://h#frag", "'#' is not allowed"),  # was host 'h#frag'
        ("redis://h:6379/0#x", "'#' is not allowed"),
        ("redis://[::1", "no closing"),  # was host '::1'
        ("redis://h?db=1&db=2", "given twice"),  # was db 2, the last one
        ("rediss://h?ssl_cert_reqs=none&ssl_cert_reqs=required", "given twice"),
        ("redis://h:\u00b2", "port"),  # '²'.isdigit() is True, int('²') a bare ValueError
        ("redis://h/\u00b2", "database"),
        ("unix:///tmp/" + "s" * 103, "longer than 107 bytes"),  # was "not reachable" at start, misses forever
        # a cluster seed list naming one node twice was accepted (redis-py keeps one of them quietly)
        ("redis-cluster://a:1,b:2,a:1", r"host 'a:1' listed twice: each cluster node once"),
        ("redis-cluster://a,a:6379", r"host 'a:6379' listed twice \(as 'a'\)"),
        ("rediss-cluster://Node1:7000,node1:7000", r"host 'node1:7000' listed twice \(as 'Node1:7000'\)"),
        ("redis-cluster://[::1]:1,[0::1]:1", r"host '\[0::1\]:1' listed twice \(as '\[::1\]:1'\)"),
    ],
)
def test_malformed(url, why):
    with pytest.raises(RemoteURLError, match=why) as ei:
        parse_redis_url(url)
    assert ei.value.config_key == "remote_url" and isinstance(ei.value, ValueError)
    with pytest.raises(ConfigError, match=f"remote_url.*{why}"):
        LMTierConfig.from_dict({"remote_url": url})


def test_cluster_nodes_differing_in_port_or_host_are_distinct():
    e = parse_redis_url("redis-cluster://a:1,a:2,b:1,[::1]:1,[::2]:1")
    assert e.hosts == (("a", 1), ("a", 2), ("b", 1), ("::1", 1), ("::2", 1))


def test_duplicate_cluster_host_error_hides_the_password():
    with pytest.raises(ConfigError, match=r"redis-cluster://:\*\*\*@a:1,a:1.*'a:1' listed twice") as ei:
        LMTierConfig.from_dict({"remote_url": "redis-cluster://:s3cret@a:1,a:1"})
    assert "s3cret" not in str(ei.value)


def test_tls(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    e = parse_redis_url(f"rediss://h?ssl_ca_certs={ca}&ssl_check_hostname=false")
    assert e.tls == TLSOptions(ca_certs=str(ca), cert_reqs="required", check_hostname=False)
    assert parse_redis_url("rediss-cluster://a:1?ssl_cert_reqs=none").tls == TLSOptions(
        cert_reqs="none", check_hostname=False
    )
    assert parse_redis_url("redis://h").tls is None


def test_password_env():
    e = parse_redis_url("redis://h", password_env="PW", env={"PW": "hunter2"})
    assert e.password == "hunter2"
    with pytest.raises(RemoteURLError, match="not set") as ei:
        parse_redis_url("redis://h", password_env="PW", env={})
    assert ei.value.config_key == "remote_password_env"
    # old: the tier let the variable win over a password in the URL; the config refused both
    with pytest.raises(RemoteURLError, match="set only one"):
        parse_redis_url("redis://:x@h", password_env="PW", env={"PW": "y"})
    with pytest.raises(ConfigError, match="remote_password_env.*set only one"):
        LMTierConfig.from_dict({"remote_url": "redis://:x@h", "remote_password_env": "PW"}, env={"PW": "y"})


def test_passwords_never_shown():
    for url, shown in [
        ("redis://bob:topsecret@h:1/0", "redis://bob:***@h:1/0"),
        ("redis://topsecret@h", "redis://***@h"),
        ("unix:///s?db=1&password=topsecret", "unix:///s?db=1&password=***"),
        ("redis://:top/secret@h", "redis://:***@h"),
    ]:
        assert redact_url(url) == shown
        cfg = LMTierConfig.from_dict({"remote_url": url.replace("top/secret", "topsecret")}).remote
        assert "topsecret" not in repr(cfg) and "topsecret" not in str(cfg)
        assert "topsecret" not in repr(cfg.endpoint) and "topsecret" not in cfg.endpoint.describe()
    cfg = LMTierConfig.from_dict({"remote_url": "redis://bob:topsecret@h:1/0"})
    assert "topsecret" not in str(cfg.to_dict()) and "topsecret" not in repr(cfg)
    with pytest.raises(ConfigError) as ei:
        LMTierConfig.from_dict({"remote_url": "redis://:topsecret@h:99999"})
    assert "topsecret" not in str(ei.value)


# -------------------------------------------------------------------- the tier uses the config's parse
def test_lone_userinfo_is_a_password_for_the_tier(redis_server_auth):
    """old: the config read ``redis://secret@host`` as a password, the tier as a user name (and the
    server rejected the login)."""
    from lmtier.tiers.factory import default_remote_factory
    from lmtier.tiers.redis import RedisTier

    srv = redis_server_auth
    url = f"redis://{srv.password}@127.0.0.1:{srv.port}/0"
    assert parse_redis_url(url).password == srv.password and parse_redis_url(url).username is None
    t = RedisTier(url, timeout_s=2.0)
    try:
        assert t.ping() and t.put(key(1), b"abc")
    finally:
        t.close()
    cfg = LMTierConfig.from_dict({"remote_url": url, "remote_timeout_s": 2.0})
    t = default_remote_factory(cfg.remote, None)  # what TierManager.from_config builds
    try:
        assert isinstance(t, RedisTier) and t.endpoint is cfg.remote.endpoint  # the config's parse, not a second
        assert t.timeout_s == 2.0 and t.get_into(key(1), bytearray(3)) == 3
    finally:
        t.close()


def test_unix_socket_password_in_query_through_the_config(tmp_path):
    """old: ``unix:///path?password=x`` (the tier's documented form) was a ConfigError."""
    from lmtier.keys import Namespace
    from lmtier.manager import TierManager
    from lmtier.testing.redis import start_or_skip

    sock = str(tmp_path / "r.sock")
    srv = start_or_skip(password="pw-unix", extra_args=("--unixsocket", sock, "--unixsocketperm", "700"))
    try:
        cfg = LMTierConfig.from_dict(
            {"chunk_size": 16, "local_cpu": False, "remote_url": f"unix://{sock}?db=1&password=pw-unix"}
        )
        assert cfg.remote.endpoint == RedisEndpoint("unix", socket_path=sock, db=1)
        assert cfg.remote.password == "pw-unix"
        ns = Namespace(model="m", num_layers=1, num_kv_heads=1, head_size=8, kv_dtype="float32", chunk_size=16)
        with TierManager.from_config(cfg, ns) as m:
            data = bytes(range(256)) * (ns.chunk_bytes // 256)
            assert m.store(key(2), data).result(10)
            out = bytearray(ns.chunk_bytes)
            assert m.retrieve_into(key(2), out) == ns.chunk_bytes and bytes(out) == data
    finally:
        srv.close()


def test_tier_endpoint_and_password_env_do_not_mix(monkeypatch):
    from lmtier.tiers.redis import RedisTier

    monkeypatch.setenv("LMTIER_TEST_PW2", "y")
    with pytest.raises(ValueError, match="set only one"):
        RedisTier("redis://:x@127.0.0.1:1/0", password_env="LMTIER_TEST_PW2")
    with pytest.raises(ValueError, match="password_env"):
        RedisTier(parse_redis_url("redis://127.0.0.1:1/0"), password_env="LMTIER_TEST_PW2")
    with pytest.raises(ValueError, match="off"):
        RedisTier.from_config(LMTierConfig.from_dict({}).remote)
