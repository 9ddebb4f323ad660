"""Sealed shared tiers: records authenticated (GMAC) and optionally encrypted (AES-256-GCM) with a
secret key. :class:`~lmtier.tiers.seal.tier.SealedTier` (:mod:`lmtier.tiers.seal.tier`, which
imports ``cryptography``) and the key sources, key ids and rotation ring
(:mod:`lmtier.tiers.seal.keys`, imported by the configuration; no cryptography needed there).
"""

from lmtier.tiers.seal.keys import KeyRing, SealKey, load_key, load_keyring, parse_sources

__all__ = ["KeyRing", "SealKey", "load_key", "load_keyring", "parse_sources"]
