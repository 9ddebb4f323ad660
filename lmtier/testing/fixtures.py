"""pytest fixtures of the Redis and Mooncake harnesses (:mod:`lmtier.testing.redis`,
:mod:`lmtier.testing.mooncake`); ``tests/conftest.py`` and
``benchmarks/conftest.py`` import them with ``from lmtier.testing.fixtures import *``.

Fixtures (function scope; each skips, or fails under ``LMTIER_REQUIRE_REDIS=1``, without redis-server):
  * ``redis_server``: a fresh :class:`~lmtier.testing.redis.RedisServer` (kill/restart/pause allowed).
  * ``redis_url``: its URL.
  * ``redis_server_auth``: a server started with ``--requirepass``.
  * ``redis_cluster``: a 3-master Redis Cluster (``.url`` is ``redis-cluster://h:p,h:p,h:p``, ``.nodes``).
  * ``mooncake_store``: a fresh :class:`~lmtier.testing.mooncake.MooncakeCluster` — a
    ``mooncake_master`` and one standalone store server holding 512 MiB (``.url`` is
    ``mooncakestore://127.0.0.1:PORT/``; ``.master`` can be killed, paused, restarted); skips, or
    fails under ``LMTIER_REQUIRE_MOONCAKE=1``, without the mooncake package.
"""

from __future__ import annotations

import pytest

from lmtier.testing import mooncake as _mooncake
from lmtier.testing.redis import RedisServer, start_cluster_or_skip, start_or_skip

__all__ = ["redis_server", "redis_url", "redis_server_auth", "redis_cluster", "mooncake_store", "RedisServer"]


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
    c = start_cluster_or_skip()
    yield c
    c.close()


@pytest.fixture
def mooncake_store():
    """A master + one store server (``mooncakestore://`` at ``.url``)."""
    c = _mooncake.start_or_skip()
    yield c
    c.close()
