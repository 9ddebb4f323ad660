"""Sealed shared tiers: records authenticated (GMAC) and optionally encrypted (AES-256-GCM) with a
secret key. :class:`~lmtier.tiers.seal.tier.SealedTier` (:mod:`lmtier.tiers.seal.tier`, which
imports ``cryptography``), the key sources, key ids and rotation ring (:mod:`lmtier.tiers.seal.keys`,
imported by the configuration; no cryptography needed there) and :func:`seal_remote`, the tier
manager's wiring.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from lmtier.tiers.base import Tier
from lmtier.tiers.seal.keys import KeyRing, SealKey, load_key, load_keyring, parse_sources

if TYPE_CHECKING:
    from lmtier.config import RemoteConfig
    from lmtier.keys import Namespace

__all__ = ["KeyRing", "SealKey", "load_key", "load_keyring", "parse_sources", "seal_remote"]

log = logging.getLogger("lmtier.tiers.seal")

_WARNED_UNSEALED: set[str] = set()


def seal_remote(tier: Tier, remote: RemoteConfig, namespace: Namespace) -> Tier:
    """The remote ``tier`` as the configuration wants it sealed.

    With ``remote_auth_key`` (``remote.keyring``): ``tier`` in a
    :class:`~lmtier.tiers.seal.tier.SealedTier` (``remote_encrypt``: AES-256-GCM, else GMAC) bound to
    ``namespace`` (its 16-byte digest); the tier manager puts the codec above it (compress, then seal).
    Without: ``tier`` itself, and a warning, once per process and URL, saying what that exposes.
    """
    if remote.keyring is None:
        url = remote.redacted_url or ""
        if url not in _WARNED_UNSEALED:
            _WARNED_UNSEALED.add(url)
            log.warning(
                "lmtier: remote tier %s: records are NOT authenticated (no remote_auth_key): anyone who can "
                "write to the store can plant KV under a chunk key they can compute, and this server will "
                "load it into attention; anyone who can read the store reads every chunk. Set "
                "remote_auth_key (and remote_encrypt) — docs/threat_model.md",
                url,
            )
        return tier
    from lmtier.tiers.seal.tier import SealedTier, SealMode

    mode = SealMode.ENCRYPT if remote.encrypt else SealMode.AUTHENTICATE
    return SealedTier(tier, remote.keyring, namespace=namespace.digest()[:16], mode=mode)
