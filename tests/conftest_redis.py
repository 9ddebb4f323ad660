"""Redis fixtures; import into tests/conftest.py with ``from tests.conftest_redis import *`` or
``from conftest_redis import *`` (they only depend on tests/redis_server.py).

Fixtures:
  * ``redis_server`` (function scope): a fresh :class:`RedisServer` (kill/restart/pause allowed).
  * ``redis_url`` (function scope): its URL.
  * ``redis_server_auth`` (function scope): a server started with ``--requirepass``.
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

__all__ = ["redis_server", "redis_url", "redis_server_auth", "RedisServer"]


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
