"""P2P sharing over NIXL: node B reads chunks straight out of node A's CPU pool.

* :mod:`lmtier.tiers.p2p.settings` — the ``enable_p2p`` / ``p2p_*`` keys (pure Python).
* :mod:`lmtier.tiers.p2p.directory` — who holds which chunk, in Redis/Valkey (redis-py).
* :mod:`lmtier.tiers.p2p.transport` — the NIXL agent: registration, peers, one-sided READs.
* :mod:`lmtier.tiers.p2p.tier` — :class:`~lmtier.tiers.p2p.tier.P2PTier`, the tier the manager
  consults after disk and before remote, and the publisher of this node's CPU pool.

Only the settings are imported here (the config loads them); import the tier from
:mod:`lmtier.tiers.p2p.tier` (it needs ``redis``, and ``nixl_cu12`` when built). docs/p2p.md.
"""

from lmtier.tiers.p2p.settings import P2PSettings

__all__ = ["P2PSettings"]
