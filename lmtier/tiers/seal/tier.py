"""Sealed records on a shared tier: every value authenticated with a secret key, optionally encrypted.

:class:`SealedTier` wraps a shared tier (:class:`~lmtier.tiers.redis.RedisTier`,
:class:`~lmtier.tiers.mooncake.MooncakeTier`) and implements the whole
:class:`~lmtier.tiers.base.Tier` protocol by forwarding to it, as :class:`~lmtier.tiers.codec.CodecTier`
does. ``put`` seals the payload (:meth:`Sealer.seal_into`) and stores the sealed bytes under the same
key; ``get_into`` fetches them and opens them (:meth:`Sealer.open_into`) into the caller's buffer. The
tier manager builds ``CodecTier -> SealedTier -> RedisTier/MooncakeTier``: chunks are compressed,
then sealed (and encrypted), then framed by the inner tier's own record (magic, key, xxh3 checksums:
corruption is still caught there first, cheaply).

Sealed layout (version 1; integers little-endian)::

    off  size field
      0     4 magic          b"LMSL"
      4     1 version        1
      5     1 alg            1 = authenticated (GMAC), 2 = authenticated and encrypted (AES-256-GCM)
      6     2 reserved       0
      8     8 key_id         the id of the key that sealed it (lmtier.tiers.seal.keys)
     16    12 nonce          random per record (os.urandom)
     28     4 reserved       0
     32     8 body_bytes     bytes of the body (= the payload's bytes in both algorithms)
     40    32 chunk_key      the key the record is stored under
     72    16 namespace      the 16-byte namespace digest of the writer
     88     8 reserved       0
     96     n body           the payload (alg 1) or its AES-GCM ciphertext (alg 2)
   96+n    16 tag            the GCM tag

The tag authenticates the 96 header bytes — so the algorithm, key id, nonce, length, chunk key and
namespace — and the body: for alg 1 it is AES-256-GCM with an empty plaintext and
``header || body`` as associated data (GMAC, NIST SP 800-38D); for alg 2 the body is the ciphertext
of the payload and ``header`` is the associated data. A record verifies only under an accepted key
(the reader's :class:`~lmtier.tiers.seal.keys.KeyRing`, looked up by ``key_id``), for the very chunk
key it is read under and the reader's namespace: a value copied to another key, one written
without the key or with another key, a rotated-out key, any flipped bit, a truncated or extended
value — each is a miss, counted, and deleted from the inner tier (:class:`SealError` names why).
A reader accepts both algorithms (the writer chooses; turning encryption on needs no flag day).

Algorithm (decision): authentication alone is GMAC, not keyed BLAKE2b or HMAC-SHA256 from
hashlib, because on x86 hosts with AES-NI and carry-less multiply GHASH runs an order of magnitude
faster than either (``lmtier bench seal``; benchmarks/RESULTS.md section 3.4)
and, like them, releases the GIL; the target is a MAC that costs a few percent of a Redis load, and
BLAKE2b/HMAC at about one GB/s per core would cost about as much as the load itself. GMAC also
shares one key, one library (``cryptography``, i.e. OpenSSL) and one code path with encryption.
Its limit: nonces are random 96-bit values, so one key must seal at most 2**32 records (NIST SP
800-38D, section 8.3); a repeated nonce under one key would expose the GHASH key and allow forgeries
— rotate keys long before (docs/threat_model.md). Keys are derived per use from the configured
master key (:mod:`lmtier.tiers.seal.keys`).

Costs: ``put`` copies (alg 1) or encrypts (alg 2) the payload into a pooled scratch buffer behind
the header — the inner tier takes one contiguous buffer; ``get_into`` reads the sealed bytes into a
pooled scratch buffer and copies (alg 1) or decrypts (alg 2) the body into ``out``. CUDA payloads and
destinations go through :class:`~lmtier.tiers.device.PinnedBounce` as in the host tiers.

``contains``/``contains_many`` are the inner tier's and do not verify (a planted value looks present
until it is read: the load then misses and vLLM recomputes). Replay: a genuine older record of the
same chunk key and namespace verifies (the chunk key binds the content, so it holds the same KV
unless the writer was compromised); nothing here prevents it.

Thread-safe (sealing keeps no shared state; scratch buffers come from a locked pool).
Logging: ``logging.getLogger("lmtier.tiers.seal")``.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import struct
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from lmtier.errors import LMTierError
from lmtier.geometry import KEY_BYTES
from lmtier.tiers.base import Eviction, Tier, TierUsage
from lmtier.tiers.buffers import BouncePool, host_view
from lmtier.tiers.device import PinnedBounce, is_cuda_tensor
from lmtier.tiers.seal.keys import KeyRing

__all__ = [
    "SEAL_MAGIC",
    "SEAL_VERSION",
    "HEADER_BYTES",
    "TAG_BYTES",
    "OVERHEAD_BYTES",
    "NAMESPACE_BYTES",
    "SealMode",
    "SealError",
    "Sealer",
    "SealedTier",
]

log = logging.getLogger("lmtier.tiers.seal")

SEAL_MAGIC = b"LMSL"
SEAL_VERSION = 1
NAMESPACE_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16
_HEADER = struct.Struct("<4sBBH8s12sIQ32s16s8s")
HEADER_BYTES = _HEADER.size
OVERHEAD_BYTES = HEADER_BYTES + TAG_BYTES
"""Bytes a sealed record adds to its payload (header and tag)."""
assert HEADER_BYTES == 96, HEADER_BYTES
_ZERO8 = bytes(8)


def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` (equal lengths) with the GIL released: NumPy copies without it, a memoryview
    slice assignment holds it for the whole copy (measured: a Python thread running beside a 64 MiB
    copy was slowed 8x, and the copy 3.6x) — the tier's callers are I/O threads beside vLLM's."""
    if src.nbytes:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


class SealMode(enum.IntEnum):
    """What :meth:`Sealer.seal_into` does to a payload (the ``alg`` byte of the header)."""

    AUTHENTICATE = 1
    """GMAC over header and payload; the payload is stored in the clear."""
    ENCRYPT = 2
    """AES-256-GCM: the payload is stored encrypted, header and ciphertext authenticated."""


class SealError(LMTierError, ValueError):
    """A sealed record does not open.

    Attributes:
        reason: ``"unsealed"`` (no seal header: written without a key, or not by lmtier),
            ``"malformed"`` (bad version/algorithm/reserved bits/length), ``"unknown_key"`` (sealed
            with a key the reader does not accept), ``"mismatch"`` (sealed for another chunk key or
            namespace), ``"bad_tag"`` (the tag does not verify: forged or altered).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Sealer:
    """Seals and opens records with a :class:`~lmtier.tiers.seal.keys.KeyRing` (see the module doc).

    Args:
        ring: the signing key and the accepted keys.
        namespace: 16-byte namespace digest bound into every record (the reader's must match).
        mode: what :meth:`seal_into` does (opening accepts both modes).

    Raises:
        ValueError: a namespace that is not 16 bytes.
    """

    def __init__(self, ring: KeyRing, *, namespace: bytes = bytes(NAMESPACE_BYTES), mode: SealMode) -> None:
        if len(namespace) != NAMESPACE_BYTES:
            raise ValueError(f"Sealer: namespace must be {NAMESPACE_BYTES} bytes, got {len(namespace)}")
        self.ring = ring
        self.namespace = bytes(namespace)
        self.mode = SealMode(mode)
        self._aead = {kid: AESGCM(k.aes_key) for kid, k in ring.accepted.items()}

    @staticmethod
    def sealed_bytes(payload_bytes: int) -> int:
        """Bytes of the sealed record of a ``payload_bytes`` payload."""
        return payload_bytes + OVERHEAD_BYTES

    def seal_into(self, dst: memoryview, payload: memoryview, key: bytes, *, nonce: bytes | None = None) -> int:
        """Seal ``payload`` for chunk ``key`` into ``dst`` (writable, >= :meth:`sealed_bytes`).

        Args:
            dst: writable flat ``uint8`` host buffer.
            payload: flat host buffer of the payload (any length).
            key: the 32-byte key the record will be stored under.
            nonce: 12 bytes (tests only; default: ``os.urandom(12)`` — never reuse one under a key).

        Returns:
            Bytes written to ``dst`` (:meth:`sealed_bytes` of the payload).

        Raises:
            ValueError: a key that is not 32 bytes, a too-small ``dst``.
        """
        key = bytes(key)
        if len(key) != KEY_BYTES:
            raise ValueError(f"Sealer: key must be {KEY_BYTES} bytes, got {len(key)}")
        n = payload.nbytes
        total = self.sealed_bytes(n)
        if dst.nbytes < total:
            raise ValueError(f"Sealer: dst of {dst.nbytes} bytes < {total}")
        nonce = os.urandom(NONCE_BYTES) if nonce is None else bytes(nonce)
        signing = self.ring.signing
        head = _HEADER.pack(
            SEAL_MAGIC, SEAL_VERSION, self.mode, 0, signing.key_id, nonce, 0, n, key, self.namespace, _ZERO8
        )
        aead = self._aead[signing.key_id]
        dst[:HEADER_BYTES] = head
        if self.mode == SealMode.ENCRYPT:
            aead.encrypt_into(nonce, payload, head, dst[HEADER_BYTES:total])
        else:
            _copy(dst[HEADER_BYTES : HEADER_BYTES + n], payload)
            dst[HEADER_BYTES + n : total] = aead.encrypt(nonce, b"", dst[: HEADER_BYTES + n])
        return total

    def open_into(self, src: memoryview, out: memoryview, key: bytes) -> int | None:
        """Verify the sealed record ``src`` for chunk ``key`` and write its payload into ``out``.

        Args:
            src: the sealed record, exactly (flat host buffer).
            out: writable flat ``uint8`` host buffer; on a :class:`SealError` its contents are
                unspecified (it may hold unauthenticated bytes).
            key: the 32-byte key the record was read under.

        Returns:
            Payload bytes, or None when ``out`` is too small for a well-formed record (not an
            authentication failure).

        Raises:
            SealError: the record does not open (its ``reason`` says why).
        """
        total = src.nbytes
        if total < OVERHEAD_BYTES:
            raise SealError("unsealed" if total < 4 or src[:4] != SEAL_MAGIC else "malformed", f"{total} bytes")
        magic, version, alg, r0, kid, nonce, r1, n, ckey, ns, r2 = _HEADER.unpack(src[:HEADER_BYTES])
        if magic != SEAL_MAGIC:
            raise SealError("unsealed", "no seal header (written without a key?)")
        if version != SEAL_VERSION or alg not in (SealMode.AUTHENTICATE, SealMode.ENCRYPT) or r0 or r1 or r2 != _ZERO8:
            raise SealError("malformed", f"version {version}, alg {alg}, reserved fields {r0}/{r1}/{r2.hex()}")
        if total != self.sealed_bytes(n):
            raise SealError("malformed", f"{total} bytes for a body of {n}")
        aead = self._aead.get(kid)
        if aead is None:
            raise SealError("unknown_key", f"sealed with key {kid.hex()}, which this reader does not accept")
        if ckey != bytes(key) or ns != self.namespace:
            raise SealError("mismatch", "sealed for another chunk key or namespace")
        if out.nbytes < n:
            return None
        body_end = HEADER_BYTES + n
        try:
            if alg == SealMode.ENCRYPT:
                aead.decrypt_into(nonce, src[HEADER_BYTES:total], src[:HEADER_BYTES], out[:n])
            else:
                aead.decrypt(nonce, src[body_end:total], src[:body_end])
                _copy(out[:n], src[HEADER_BYTES:body_end])
        except InvalidTag:
            raise SealError("bad_tag", "the tag does not verify (forged or altered)") from None
        return n


class SealedTier(Tier):
    """A tier decorator: records sealed with a key ring (see the module doc).

    Args:
        inner: the shared tier (closed by :meth:`close`).
        ring: signing and accepted keys (:func:`lmtier.tiers.seal.keys.load_keyring`).
        namespace: 16-byte namespace digest bound into every record.
        mode: :attr:`SealMode.AUTHENTICATE` (default) or :attr:`SealMode.ENCRYPT`.

    Attributes:
        name: the inner tier's name. sealer: the :class:`Sealer`.
        counters: ``puts``, ``put_failures``, ``hits``, ``misses``, ``auth_failures`` (records that
            did not open; each deleted from the inner tier) and ``auth_<reason>`` per
            :attr:`SealError.reason`.
    """

    def __init__(
        self,
        inner: Tier,
        ring: KeyRing,
        *,
        namespace: bytes = bytes(NAMESPACE_BYTES),
        mode: SealMode = SealMode.AUTHENTICATE,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.sealer = Sealer(ring, namespace=namespace, mode=mode)
        self.counters: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._scratch = BouncePool(max_cached=4)
        self._device = PinnedBounce(max_cached=2)
        inner.add_eviction_listener(self._on_inner_evicted)
        log.info("%s tier: records sealed (%s), %s", self.name, self.sealer.mode.name.lower(), ring.describe())

    # ---- Tier --------------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return bool(self.inner.contains(key))

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [bool(f) for f in self.inner.contains_many(keys)]

    def batches_contains(self) -> bool:
        return self.inner.batches_contains()

    def delete(self, key: bytes) -> bool:
        return bool(self.inner.delete(key))

    def forget(self, key: bytes) -> bool:
        return bool(self.inner.forget(key))

    def usage(self) -> TierUsage:
        """The inner tier's usage (bytes of sealed records)."""
        return self.inner.usage()

    @property
    def tenant_budgets(self) -> Any:
        return self.inner.tenant_budgets

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        return self.inner.tenant_stats()

    def put(self, key: bytes, payload: Any, **kw: Any) -> bool:
        """Seal ``payload`` (contiguous host buffer or CUDA tensor) and store it under ``key``
        (``kw``, i.e. ``tenant=``, goes to the inner put).

        Raises:
            ValueError: a key that is not 32 bytes.
        """
        with self._device.host_payload(payload) as mv:
            buf = self._scratch.acquire(self.sealer.sealed_bytes(mv.nbytes))
            try:
                m = self.sealer.seal_into(buf.mv, mv, key)
                ok = bool(self.inner.put(key, buf.mv[:m], **kw))
            finally:
                self._scratch.release(buf)
        self._count("puts" if ok else "put_failures")
        return ok

    def get_into(self, key: bytes, out: Any) -> int | None:
        """Fetch the sealed record of ``key`` and write its payload into ``out`` (writable
        contiguous host buffer or CUDA tensor, >= payload bytes). Returns the payload bytes, or None
        (a miss, a too-small ``out``, or a record that does not open — then deleted and counted).
        After None the contents of ``out`` must not be used."""
        return self._device.get_into(out, lambda mv: self._get_host(bytes(key), mv))

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any]) -> list[int | None]:
        """:meth:`get_into` of several chunks; over an inner tier that batches gets
        (:meth:`~lmtier.tiers.base.Tier.batches_gets`) with one ``inner.get_many_into`` of the sealed
        records into scratch buffers, then each opened in turn (host ``outs``; CUDA tensors go one by
        one through :meth:`get_into`).

        Raises:
            ValueError: ``keys`` and ``outs`` differ in length.
        """
        if len(keys) != len(outs):
            raise ValueError(f"SealedTier.get_many_into: {len(keys)} keys, {len(outs)} outs")
        if not self.inner.batches_gets() or len(keys) < 2 or any(is_cuda_tensor(o) for o in outs):
            return [self.get_into(k, o) for k, o in zip(keys, outs, strict=True)]
        views = [host_view(o, writable=True) for o in outs]
        caps = [self.sealer.sealed_bytes(v.nbytes) for v in views]
        bufs = [self._scratch.acquire(c) for c in caps]
        try:
            got = self.inner.get_many_into(
                [bytes(k) for k in keys], [b.mv[:c] for b, c in zip(bufs, caps, strict=True)]
            )
            return [self._open(bytes(k), b.mv, n, v) for k, b, n, v in zip(keys, bufs, got, views, strict=True)]
        finally:
            for b in bufs:
                self._scratch.release(b)

    def batches_gets(self) -> bool:
        return self.inner.batches_gets()

    def event_counts(self) -> dict[str, int]:
        return {**self.inner.event_counts(), **super().event_counts()}

    def _get_host(self, key: bytes, out: memoryview) -> int | None:
        cap = self.sealer.sealed_bytes(out.nbytes)
        buf = self._scratch.acquire(cap)
        try:
            return self._open(key, buf.mv, self.inner.get_into(key, buf.mv[:cap]), out)
        finally:
            self._scratch.release(buf)

    def _open(self, key: bytes, sealed: memoryview, n: int | None, out: memoryview) -> int | None:
        """Open the sealed record of ``n`` bytes at the start of ``sealed`` into ``out`` (None ``n``:
        the inner miss); counts the hit or miss; a record that does not open is deleted."""
        if n is None:
            self._count("misses")
            return None
        try:
            got = self.sealer.open_into(sealed[:n], out, key)
        except SealError as e:
            log.warning("%s: record of chunk %s does not open (%s); deleted", self.name, key.hex()[:16], e)
            self._count("auth_failures")
            self._count(f"auth_{e.reason}")
            self._count("misses")
            self.inner.delete(key)
            return None
        self._count("hits" if got is not None else "misses")
        return got

    def close(self) -> None:
        self.inner.remove_eviction_listener(self._on_inner_evicted)
        try:
            self.inner.close()
        finally:
            self._scratch.close()
            self._device.close()

    # ---- helpers -----------------------------------------------------------------------------

    def _on_inner_evicted(self, ev: Eviction) -> None:
        failed = self._notify_evicted(Eviction(self.name, ev.keys))
        if failed:
            self._count("evict_listener_errors", failed)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n
