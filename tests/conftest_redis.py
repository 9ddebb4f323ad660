"""Redis fixtures; import into tests/conftest.py with ``from tests.conftest_redis import *`` or
``from conftest_redis import *`` (they only depend on tests/redis_server.py).

Fixtures:
  * ``redis_server`` (function scope): a fresh :class:`RedisServer` (kill/restart/pause allowed).
  * ``redis_url`` (function scope): its URL.
  * ``redis_server_auth`` (function scope): a server started with ``--requirepass``.
  * ``redis_cluster`` (function scope): a 3-master Redis Cluster (``.url``, ``.nodes``).
"""

from __future__ import annotations

import os
import sys

import pytest

try:
    from .redis_server import RedisServer, start_or_skip
except ImportError:  # imported as a top-level module
    sys.path.insert(0, os.path.dirname(__file__))
    from redis_server import RedisServer, start_or_skip  # noqa: E402

__all__ = ["redis_server", "redis_url", "redis_server_auth", "redis_cluster", "RedisServer"]


@pytest.fixture
def redis_server():
    srv = start_or_skip()
    yield srv
    srv.close()


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url


@pytest.fixture
def redis_server_auth():
    srv = start_or_skip(password="s3cret-pw")
    yield srv
    srv.close()


@pytest.fixture
def redis_cluster():
    """A 3-master Redis Cluster (``.url`` is ``redis-cluster://h:p,h:p,h:p``)."""
    try:
        from .redis_server import RedisClusterServers, RedisUnavailable
    except ImportError:
        from redis_server import RedisClusterServers, RedisUnavailable
    try:
        c = RedisClusterServers().start()
    except RedisUnavailable as e:
        if os.environ.get("LMTIER_REQUIRE_REDIS") == "1":
            pytest.fail(f"LMTIER_REQUIRE_REDIS=1 but no Redis Cluster: {e}")
        pytest.skip(f"no Redis Cluster: {e}")
    yield c
    c.close()
