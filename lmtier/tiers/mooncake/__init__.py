"""Remote tier on Mooncake Store: :class:`MooncakeTier` (:mod:`lmtier.tiers.mooncake.tier`) and its
client settings (:mod:`lmtier.tiers.mooncake.settings`: ``MOONCAKE_CONFIG_PATH`` and the
``mooncake_*`` keys). URLs (``mooncakestore://HOST:PORT/``) are parsed by :mod:`lmtier.remote_url`.
The ``mooncake`` package is imported only when a tier is built (``pip install lmtier[mooncake]``).
"""

from lmtier.tiers.mooncake.settings import MooncakeSettings
from lmtier.tiers.mooncake.tier import MooncakeTier

__all__ = ["MooncakeTier", "MooncakeSettings"]
