"""Remote tier (tier 3): Redis / Valkey, single instance or Redis Cluster, through redis-py.

:class:`RedisTier` (:mod:`lmtier.tiers.redis.tier`), its reply reader
(:mod:`lmtier.tiers.redis.resp`), per-tenant budgets (:mod:`lmtier.tiers.redis.budget`) and circuit
breaker (:mod:`lmtier.tiers.breaker`). URLs are
parsed by :mod:`lmtier.remote_url` (no redis-py needed there).
"""

from lmtier.tiers.breaker import CircuitBreaker
from lmtier.tiers.redis.tier import RedisTier

__all__ = ["RedisTier", "CircuitBreaker"]
