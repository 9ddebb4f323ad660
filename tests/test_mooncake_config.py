"""Mooncake Store configuration: the mooncakestore:// URL, the MOONCAKE_CONFIG_PATH JSON file and the
mooncake_* keys (lmtier.remote_url, lmtier.tiers.mooncake.settings, lmtier.config). No server needed."""

from __future__ import annotations

import json

import pytest

from lmtier import envs
from lmtier.config import ConfigError, LMTierConfig, load_config
from lmtier.config_checks import physical_memory_bytes
from lmtier.config_schema import GIB
from lmtier.remote_url import MooncakeEndpoint, RedisEndpoint, RemoteURLError, parse_mooncake_url, parse_remote_url
from lmtier.tiers.mooncake.settings import MooncakeSettings

URL = "mooncakestore://10.1.2.3:50051/"


def test_parse_url():
    assert parse_mooncake_url(URL) == MooncakeEndpoint("10.1.2.3", 50051)
    assert parse_mooncake_url("MOONCAKESTORE://h:1") == MooncakeEndpoint("h", 1)
    e = parse_mooncake_url("mooncakestore://[::1]:7/")
    assert e.host == "::1" and e.master_address == "[::1]:7" and e.describe() == "mooncakestore://[::1]:7/"
    assert isinstance(parse_remote_url(URL), MooncakeEndpoint)
    assert isinstance(parse_remote_url("redis://h:1/0"), RedisEndpoint)


@pytest.mark.parametrize(
    "url,why",
    [
        ("mooncakestore://h/", "missing port"),
        ("mooncakestore://h:/", "missing port"),
        ("mooncakestore://h:1/x", "unexpected path"),
        ("mooncakestore://h:1/?a=b", "no query"),
        ("mooncakestore://u:p@h:1/", "no credentials"),
        ("mooncakestore://h:1,g:2/", "one master"),
        ("mooncakestore://h:70000/", "outside"),
        ("mooncake://h:1/", "scheme"),
    ],
)
def test_bad_urls_name_remote_url(url, why):
    with pytest.raises(RemoteURLError, match=why) as e:
        parse_remote_url(url)
    assert e.value.config_key == "remote_url"
    with pytest.raises(ConfigError, match=f"remote_url=.*{why}"):
        LMTierConfig.from_dict({"remote_url": url})


def test_defaults_and_yaml_keys():
    c = LMTierConfig.from_dict({"remote_url": URL})
    assert c.remote.mooncake == MooncakeSettings("10.1.2.3:50051")
    assert c.remote.mooncake.protocol == "tcp" and c.remote.mooncake.metadata_server == "P2PHANDSHAKE"
    assert c.remote.scheme == "mooncakestore" and c.remote.hosts == (("10.1.2.3", 50051),) and c.remote.db == 0
    c = LMTierConfig.from_dict(
        {
            "remote_url": URL,
            "mooncake_local_hostname": "10.0.0.9",
            "mooncake_metadata_server": "http://10.1.2.3:8080/metadata",
            "mooncake_global_segment_size": 2,
            "mooncake_local_buffer_size": 0.25,
            "mooncake_protocol": "rdma",
            "mooncake_device_name": "mlx5_0",
        }
    )
    m = c.remote.mooncake
    assert (m.local_hostname, m.global_segment_size, m.local_buffer_size) == ("10.0.0.9", 2 << 30, 256 << 20)
    assert (m.protocol, m.device_name, m.metadata_server) == ("rdma", "mlx5_0", "http://10.1.2.3:8080/metadata")
    d = c.to_dict()
    assert d["mooncake_global_segment_size"] == 2.0 and d["mooncake_protocol"] == "rdma"
    assert LMTierConfig.from_dict({"remote_url": "redis://h:1/0"}).remote.mooncake is None


@pytest.mark.parametrize(
    "values,key",
    [
        ({"mooncake_protocol": "udp"}, "mooncake_protocol"),
        ({"mooncake_protocol": "rdma"}, "mooncake_device_name"),
        ({"mooncake_global_segment_size": -1}, "mooncake_global_segment_size"),
        ({"mooncake_global_segment_size": "1GB"}, "mooncake_global_segment_size"),
        ({"mooncake_local_buffer_size": 0}, "mooncake_local_buffer_size"),
        ({"mooncake_metadata_server": " "}, "mooncake_metadata_server"),
        ({"mooncake_local_hostname": 5}, "mooncake_local_hostname"),
        ({"remote_password_env": "PW"}, "remote_password_env"),
    ],
)
def test_errors_name_the_key(values, key):
    with pytest.raises(ConfigError, match=f"{key}="):
        LMTierConfig.from_dict({"remote_url": URL, **values})


RAM = physical_memory_bytes()
needs_ram = pytest.mark.skipif(RAM == 0, reason="the platform does not report physical memory")


@needs_ram
@pytest.mark.parametrize("key", ["mooncake_global_segment_size", "mooncake_local_buffer_size"])
def test_sizes_above_physical_memory_name_the_key(key):
    """The client allocates and registers the segment (and buffer) in this process: more than the
    machine's RAM can never be backed, so it is a config error naming the key, not an OOM later."""
    over = (RAM // GIB) + 1  # whole GiB, just above this machine's RAM
    with pytest.raises(ConfigError, match=rf"{key}={float(over)!r}: {over}\.0 GiB exceeds this machine's physical"):
        LMTierConfig.from_dict({"remote_url": URL, key: float(over)})
    # at the bound it is accepted, to the byte
    at = RAM / GIB
    assert getattr(LMTierConfig.from_dict({"remote_url": URL, key: at}).remote.mooncake, key[9:]) == int(at * GIB)


@needs_ram
def test_file_segment_above_physical_memory_names_the_file_key(tmp_path):
    f = tmp_path / "mc.json"
    f.write_text(json.dumps({"global_segment_size": RAM + 4096}))
    env = {"MOONCAKE_CONFIG_PATH": str(f)}
    with pytest.raises(ConfigError, match=rf"MOONCAKE_CONFIG_PATH=.* key global_segment_size={RAM + 4096}: .*physical"):
        LMTierConfig.from_dict({"remote_url": URL}, env=env)
    # the YAML key overrides the file's value, and only the value in force is checked
    m = LMTierConfig.from_dict({"remote_url": URL, "mooncake_global_segment_size": 0.5}, env=env).remote.mooncake
    assert m.global_segment_size == 512 << 20


def test_mooncake_keys_without_mooncake_url_warn(caplog):
    LMTierConfig.from_dict({"remote_url": "redis://h:1/0", "mooncake_protocol": "tcp"})
    assert "mooncake_protocol='tcp' without a mooncakestore:// remote_url" in caplog.text


def test_config_path_file(tmp_path):
    f = tmp_path / "mc.json"
    f.write_text(
        json.dumps(
            {
                "local_hostname": "192.168.0.2",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": "3GB",
                "local_buffer_size": 134217728,
                "protocol": "tcp",
                "device_name": "",
                "master_server_address": "10.1.2.3:50051",
            }
        )
    )
    env = {"MOONCAKE_CONFIG_PATH": str(f)}
    m = LMTierConfig.from_dict({"remote_url": URL}, env=env).remote.mooncake
    assert m == MooncakeSettings("10.1.2.3:50051", "192.168.0.2", "P2PHANDSHAKE", 3 << 30, 128 << 20, "tcp", "")
    # lmtier keys win over the file; load_config reads the variable from its env
    y = tmp_path / "lmtier.yaml"
    y.write_text(f"remote_url: {URL}\nmooncake_global_segment_size: 0.5\n")
    m = load_config(y, env=env).remote.mooncake
    assert m.global_segment_size == 512 << 20 and m.local_hostname == "192.168.0.2"
    assert envs.get("MOONCAKE_CONFIG_PATH", env) == str(f)


@pytest.mark.parametrize(
    "content,match",
    [
        ("{not json", "malformed JSON"),
        ("[1]", "must hold a JSON object"),
        ('{"global_segment_size": "lots"}', "key global_segment_size='lots'"),
        ('{"global_segment_size": -5}', "key global_segment_size=-5: must be >= 0"),
        ('{"protocol": 1}', "key protocol=1: must be a string"),
        ('{"transfer_timeout": 1}', "key transfer_timeout=1: unknown key"),
        ('{"master_server_address": "10.9.9.9:1"}', "master_server_address='10.9.9.9:1': disagrees with remote_url"),
        ('{"protocol": "rdma"}', "mooncake_device_name"),
    ],
)
def test_config_path_errors_name_file_and_key(tmp_path, content, match):
    f = tmp_path / "mc.json"
    f.write_text(content)
    with pytest.raises(ConfigError, match=match) as e:
        LMTierConfig.from_dict({"remote_url": URL}, env={"MOONCAKE_CONFIG_PATH": str(f)})
    if "mooncake_device_name" not in match:
        assert "MOONCAKE_CONFIG_PATH=" in str(e.value)


def test_config_path_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="MOONCAKE_CONFIG_PATH=.*cannot read"):
        LMTierConfig.from_dict({"remote_url": URL}, env={"MOONCAKE_CONFIG_PATH": str(tmp_path / "nope.json")})


def test_env_overrides_of_mooncake_keys():
    c = load_config(None, env={"LMTIER_REMOTE_URL": URL, "LMTIER_MOONCAKE_GLOBAL_SEGMENT_SIZE": "0.25"})
    assert c.remote.mooncake.global_segment_size == 256 << 20
    with pytest.raises(ConfigError, match="LMTIER_MOONCAKE_LOCAL_BUFFER_SIZE"):
        load_config(None, env={"LMTIER_REMOTE_URL": URL, "LMTIER_MOONCAKE_LOCAL_BUFFER_SIZE": "big"})
