"""P2P configuration (issue 16): LMCache's keys, lmtier's keys, strict validation naming the key.
No NIXL or Redis needed."""

from __future__ import annotations

import pytest

from lmtier import envs
from lmtier.config import ConfigError, LMTierConfig, load_config
from lmtier.config_schema import DISABLED_LMCACHE_FEATURES, IGNORED_LMCACHE_KEYS, KEYS
from lmtier.tiers.p2p.settings import KEYS as P2P_KEYS

TOKEN = {"TOK": "0123456789abcdef-token"}
BASE = dict(
    enable_p2p=True,
    p2p_host="10.0.0.7",
    p2p_init_ports=[28200, 28201],
    p2p_directory_url="redis://dir.example:6379/0",
    p2p_token_env="TOK",
)


def build(env=TOKEN, **kw):
    values = {**BASE, **kw}
    return LMTierConfig.from_dict({k: v for k, v in values.items() if v is not ...}, env=env)


def test_lmcache_style_file_loads():
    c = build(p2p_allowed_peers="10.0.0.8, 10.0.0.9:28200")
    p = c.p2p
    assert p is not None and p.init_ports == (28200, 28201) and p.token == b"0123456789abcdef-token"
    assert p.node_id(0) == "10.0.0.7:28200" and p.node_id(1) == "10.0.0.7:28201"
    assert p.allows("10.0.0.8:1") and p.allows("10.0.0.9:28200") and not p.allows("10.0.0.9:28201")
    assert p.directory.host == "dir.example" and p.timeout_s == 1.0
    assert "0123456789abcdef" not in repr(c) + repr(c.to_dict())  # the token is never shown
    assert c.to_dict()["p2p_init_ports"] == "28200,28201"
    assert LMTierConfig.from_dict({}).p2p is None


def test_every_p2p_key_is_in_the_schema_and_enable_p2p_is_no_longer_disabled():
    assert set(P2P_KEYS) | {"enable_p2p"} <= set(KEYS)
    assert "enable_p2p" not in DISABLED_LMCACHE_FEATURES
    assert "p2p_lookup_ports" in IGNORED_LMCACHE_KEYS


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(p2p_host=None), "p2p_host"),
        (dict(p2p_host=" "), "p2p_host"),
        (dict(p2p_host="a b"), "p2p_host"),
        (dict(p2p_init_ports=None), "p2p_init_ports"),
        (dict(p2p_init_ports=[]), "p2p_init_ports"),
        (dict(p2p_init_ports=[0]), "p2p_init_ports"),
        (dict(p2p_init_ports=[5, 5]), "p2p_init_ports"),
        (dict(p2p_init_ports=["x"]), "p2p_init_ports"),
        (dict(p2p_init_ports="1,x"), "p2p_init_ports"),
        (dict(p2p_directory_url=None), "p2p_directory_url"),
        (dict(p2p_directory_url="http://x"), "p2p_directory_url"),
        (dict(p2p_directory_url="redis-cluster://a:1,b:2"), "p2p_directory_url"),
        (dict(p2p_token_env="UNSET_VAR"), "p2p_token_env"),
        (dict(p2p_timeout_s=0), "p2p_timeout_s"),
        (dict(p2p_entry_ttl_s=-1), "p2p_entry_ttl_s"),
        (dict(p2p_timeout_s=1e300), "p2p_timeout_s"),  # accepted before: every socket setup overflowed
        (dict(p2p_entry_ttl_s=1e300), "p2p_entry_ttl_s"),  # accepted before: Redis refused the expiry
        (dict(p2p_entry_ttl_s=1e-9), "p2p_entry_ttl_s"),  # accepted before: entries expired in 1 ms
        (dict(p2p_timeout_s="1"), "p2p_timeout_s"),
        (dict(enable_p2p="yes"), "enable_p2p"),
        (dict(local_cpu=False), "enable_p2p"),
        (dict(p2p_token_env=None), "enable_p2p"),  # neither allow-list nor token
    ],
)
def test_invalid_settings_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=rf"\b{key}="):
        build(**kw)


@pytest.mark.parametrize("url", ["mooncakestore://m:50051/", "http://x"])
def test_directory_url_error_lists_only_the_schemes_it_takes(url):
    """The error listed mooncakestore:// among the schemes, then refused it (a newcomer's report)."""
    with pytest.raises(ConfigError, match=r"p2p_directory_url=.*scheme must be one of") as e:
        build(p2p_directory_url=url)
    assert "mooncakestore" not in str(e.value).replace(url, "") and "redis://" in str(e.value)


def test_short_token_is_refused():
    with pytest.raises(ConfigError, match="p2p_token_env=.*>= 16 bytes"):
        build(env={"TOK": "short"})


def test_directory_defaults_to_a_redis_remote_url():
    c = build(p2p_directory_url=None, remote_url="redis://r:6380/1")
    assert c.p2p.directory.port == 6380 and c.p2p.directory.db == 1
    with pytest.raises(ConfigError, match="p2p_directory_url="):
        build(p2p_directory_url=None, remote_url="mooncakestore://m:50051/")


def test_allow_list_alone_is_enough():
    c = build(p2p_token_env=None, p2p_allowed_peers="10.0.0.8")
    assert c.p2p.token is None and c.p2p.allowed_peers == ("10.0.0.8",)


def test_node_id_needs_a_port_per_rank():
    with pytest.raises(ConfigError, match="p2p_init_ports=.*TP rank 2"):
        build().p2p.node_id(2)


def test_p2p_keys_without_enable_p2p_warn(caplog):
    c = LMTierConfig.from_dict({"p2p_host": "h", "p2p_init_ports": 1})
    assert c.p2p is None
    assert "p2p_host='h' without enable_p2p" in caplog.text


def test_environment_overrides(tmp_path):
    env = {
        **TOKEN,
        "LMTIER_ENABLE_P2P": "1",
        "LMTIER_P2P_HOST": "h1",
        "LMTIER_P2P_INIT_PORTS": "7001,7002",
        "LMTIER_P2P_DIRECTORY_URL": "redis://d:1/0",
        "LMTIER_P2P_TOKEN_ENV": "TOK",
        "LMTIER_P2P_TIMEOUT_S": "0.25",
    }
    c = load_config(env=env)
    assert c.p2p.init_ports == (7001, 7002) and c.p2p.timeout_s == 0.25 and c.p2p.host == "h1"
    with pytest.raises(ConfigError, match="LMTIER_P2P_INIT_PORTS"):
        load_config(env={**env, "LMTIER_P2P_INIT_PORTS": "7001,x"})
    assert envs.get("LMTIER_REQUIRE_NIXL", {}) is False


def test_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "enable_p2p: true\np2p_host: 127.0.0.1\np2p_init_ports: [28200]\np2p_lookup_ports: [28201]\n"
        "p2p_directory_url: redis://127.0.0.1:6379/0\np2p_allowed_peers: 127.0.0.1\n"
    )
    c = load_config(f, env={})
    assert c.p2p.node_id(0) == "127.0.0.1:28200"
