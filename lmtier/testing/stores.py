"""The shared stores of the main job's two-node phases (Redis, Mooncake Store, the P2P directory):
starting them on loopback, their config templates, and what they hold. Used by ``scripts/demo.py``
and ``benchmarks/ab_connectors.py`` (one definition)."""

from __future__ import annotations

import re
import socket
import string
import time
from collections.abc import Callable
from pathlib import Path

import requests

from lmtier.errors import LMTierError
from lmtier.testing.mooncake import MooncakeCluster, MooncakeUnavailable
from lmtier.testing.redis import RedisServer, RedisUnavailable
from lmtier.testing.vllm import REPO

__all__ = [
    "CONFIG_DIR",
    "MOONCAKE_SEGMENT_BYTES",
    "P2P_TOKEN_ENV",
    "SHARED_SOURCE",
    "SHARED_STORES",
    "StoreUnavailable",
    "mooncake_info",
    "p2p_directory_names",
    "redis_info",
    "shared_store_info",
    "start_shared_store",
    "wait_p2p_published",
    "write_config",
]

CONFIG_DIR = REPO / "scripts" / "demo_config"
"""The main job's lmtier config templates (``${KEY}`` placeholders)."""
SHARED_STORES = {"redis": "cpu_redis.yaml", "mooncake": "cpu_mooncake.yaml", "p2p": "cpu_p2p.yaml"}
"""Shared-store phases (node A cold, node B warm from the store) -> their config template."""
SHARED_SOURCE = {"redis": "remote", "mooncake": "remote", "p2p": "p2p"}
"""The lmtier tier (``vllm:lmtier_hit_tokens_total{tier}``) node B of each shared phase must load from."""
P2P_TOKEN_ENV = "DEMO_P2P_TOKEN"
"""The variable cpu_p2p.yaml's ``p2p_token_env`` names (a fresh random token per run)."""
MOONCAKE_SEGMENT_BYTES = 1 << 30
"""Memory the Mooncake store server mounts (the main job's full workload's KV is ~0.3 GiB)."""


class StoreUnavailable(LMTierError, RuntimeError):
    """A shared store could not be started (no binary, exited, did not listen); the message says why."""


def write_config(
    template: str, work: Path, name: str | None = None, env: dict[str, str] | None = None, **values: str
) -> Path:
    """Fill in ``CONFIG_DIR/template`` (``${KEY}`` from ``values``; extra values are ignored), write it
    to ``work/lmtier_<name or the template's stem>.yaml`` and validate it with lmtier's parser (``env``:
    the variables the servers will see that the config names, such as a P2P token). Returns its path.

    Raises:
        KeyError: a placeholder has no value. lmtier.config.ConfigError: the filled config is invalid.
    """
    text = string.Template((CONFIG_DIR / template).read_text()).substitute(**values)
    out = work / f"lmtier_{name or Path(template).stem}.yaml"
    out.write_text(text)
    from lmtier.config import load_config

    load_config(out, env=dict(env or {}))
    return out


def start_shared_store(
    kind: str, log: Callable[[str], None] = print
) -> tuple[RedisServer | MooncakeCluster, dict[str, str]]:
    """Start the store of a shared-store phase (``kind`` in :data:`SHARED_STORES`) on 127.0.0.1 with
    free ports. Returns it (``.close()`` stops it) and the values its config template needs.

    Raises:
        StoreUnavailable: it did not start. ValueError: unknown ``kind``.
    """
    if kind in ("redis", "p2p"):  # p2p: the redis-server holds only the P2P directory
        try:  # lmtier.testing.redis: 127.0.0.1, a free port, no persistence
            redis = RedisServer().start()
        except RedisUnavailable as e:
            raise StoreUnavailable(str(e)) from None
        log(f"redis{' (P2P directory only)' if kind == 'p2p' else ''}: ready on 127.0.0.1:{redis.port}")
        return redis, {"REDIS_PORT": str(redis.port)}
    if kind == "mooncake":
        try:  # lmtier.testing.mooncake: mooncake_master + one store server holding the data
            cluster = MooncakeCluster(servers=1, segment_bytes=MOONCAKE_SEGMENT_BYTES).start()
        except MooncakeUnavailable as e:
            raise StoreUnavailable(f"Mooncake Store did not start: {e}") from None
        log(
            f"mooncake: master on {cluster.master.address}, store server on 127.0.0.1:{cluster.servers[0].port} "
            f"({MOONCAKE_SEGMENT_BYTES >> 20} MiB)"
        )
        return cluster, {"MOONCAKE_MASTER": cluster.master.address}
    raise ValueError(f"unknown shared store {kind!r}")


def redis_info(port: int) -> dict[str, str]:
    """A few INFO fields (keys, memory) through a raw socket: no client library needed."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"INFO\r\n")
            buf = b""
            while True:
                part = s.recv(65536)
                if not part:
                    break
                buf += part
                m = re.match(rb"\$(\d+)\r\n", buf)
                if m and len(buf) >= m.end() + int(m.group(1)):
                    break
    except OSError as e:
        return {"error": str(e)}
    info = dict(line.split(":", 1) for line in buf.decode(errors="replace").splitlines() if ":" in line)
    keep = ("used_memory_human", "db0", "total_commands_processed", "keyspace_hits", "keyspace_misses")
    return {k: info[k].strip() for k in keep if k in info}


def mooncake_info(cluster: MooncakeCluster) -> dict[str, str]:
    """A few of the master's Prometheus metrics (keys, bytes allocated, clients)."""
    try:
        text = requests.get(f"http://127.0.0.1:{cluster.master.metrics_port}/metrics", timeout=5).text
    except requests.RequestException as e:
        return {"error": str(e)}
    keep = ("master_key_count", "master_allocated_bytes", "master_active_clients")
    # plain "name value" lines (lmtier.testing.server.parse_metrics keeps only vLLM's and lmtier's series)
    lines = [line for line in text.splitlines() if line and not line.startswith("#") and " " in line]
    fields = dict(line.split(None, 1) for line in lines)
    return {k: fields[k].strip() for k in keep if k in fields}


def shared_store_info(store: RedisServer | MooncakeCluster) -> dict[str, str]:
    """:func:`redis_info` or :func:`mooncake_info`, whichever ``store`` is."""
    return redis_info(store.port) if isinstance(store, RedisServer) else mooncake_info(store)


def p2p_directory_names(port: int) -> set[bytes]:
    """Names of the chunk entries in the P2P directory on 127.0.0.1:``port`` (hashes
    ``lmtier:p2p:<ns>:c:<key>``, lmtier.tiers.p2p.directory; one per chunk however many nodes hold
    it); empty when unreachable."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5, socket_connect_timeout=5)
    try:
        return set(client.scan_iter(match="lmtier:p2p:*:c:*", count=1000))
    except redis.RedisError:
        return set()
    finally:
        client.close()


def wait_p2p_published(port: int, chunks: int, timeout_s: float, before: set[bytes] | None = None) -> int:
    """Wait until the directory on ``port`` lists at least ``chunks`` chunks not in ``before`` (node
    A's publisher announces what entered its pool in the background), at most ``timeout_s`` seconds.
    Returns how many it lists."""
    deadline = time.monotonic() + timeout_s
    while True:
        n = len(p2p_directory_names(port) - (before or set()))
        if n >= chunks or time.monotonic() > deadline:
            return n
        time.sleep(0.2)
