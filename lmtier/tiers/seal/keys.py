"""Record keys of the sealed shared tiers: where they come from, how they are checked, how they are
named (key ids) and the subkey each one yields. No cryptography import (the config uses this module).

Sources. A key is never written in the configuration; the config names where it is:

* ``file:PATH`` — a file holding the key as hex text (``openssl rand -hex 32 > PATH``), surrounding
  white space ignored. A file that group or others may read is accepted with a warning (as ``ssh``
  would refuse it, but an operator may mount secrets read-only through a group).
* ``env:NAME`` — the environment variable ``NAME`` holding the key as hex text.

A key is 32 to 64 bytes (64 to 128 hex digits): 256 bits at least, BLAKE2b's key limit at most.
Anything else — an unreadable or empty file, an unset variable, text that is not hex, a key too
short or too long, a source that is neither ``file:`` nor ``env:`` — is a :class:`ConfigError` at
start-up naming the config key and the path or variable, never the key text.

Key ids and subkeys. Each master key ``K`` yields, with keyed BLAKE2b (RFC 7693) as a PRF and a
personalization string per use (so the values are independent):

* ``key_id = BLAKE2b-64(key=K, person="lmtier-seal-kid")`` — 8 bytes stored in every sealed record,
  so a reader picks the verification key without trying them all. It reveals nothing useful about
  ``K`` (a 64-bit PRF output of a secret of >= 256 bits).
* ``aes_key = BLAKE2b-256(key=K, person="lmtier-seal-aes")`` — the AES-256-GCM key of
  :mod:`lmtier.tiers.seal.tier` (authentication and encryption).

Rotation (one signing key, a list of accepted keys): :class:`KeyRing` holds the signing key first
and then the keys accepted for verification only. The rolling procedure that never rejects a
genuine record: (1) on every node add the new key to ``remote_auth_accept_keys``; (2) on every node
make it ``remote_auth_key`` and move the old one to ``remote_auth_accept_keys``; (3) once records
signed with the old key have aged out (or at once, accepting those misses), drop it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

from lmtier.config_schema import ConfigError

__all__ = [
    "KEY_ID_BYTES",
    "MIN_KEY_BYTES",
    "MAX_KEY_BYTES",
    "SealKey",
    "KeyRing",
    "load_key",
    "load_keyring",
    "parse_sources",
]

log = logging.getLogger("lmtier.tiers.seal")

KEY_ID_BYTES = 8
MIN_KEY_BYTES = 32
MAX_KEY_BYTES = 64  # BLAKE2b's key limit
_MAX_FILE_CHARS = 4 * MAX_KEY_BYTES  # hex digits plus generous white space
_PERSON_KID = b"lmtier-seal-kid"
_PERSON_AES = b"lmtier-seal-aes"


@dataclass(frozen=True, repr=False)
class SealKey:
    """One master key: its id, its AES-256 subkey and where it came from (never its bytes in repr).

    Attributes:
        key_id: 8 bytes (see the module doc).
        aes_key: 32 bytes, the AES-256-GCM key derived from the master key.
        source: ``file:PATH`` or ``env:NAME`` (safe to log).
    """

    key_id: bytes
    aes_key: bytes = field(repr=False)
    source: str = ""

    @classmethod
    def from_bytes(cls, master: bytes, *, source: str = "") -> SealKey:
        """Derive the id and subkey of ``master`` (32..64 bytes).

        Raises:
            ValueError: ``master`` of another length.
        """
        if not MIN_KEY_BYTES <= len(master) <= MAX_KEY_BYTES:
            raise ValueError(f"a seal key must be {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes, got {len(master)}")
        kid = hashlib.blake2b(key=master, digest_size=KEY_ID_BYTES, person=_PERSON_KID).digest()
        aes = hashlib.blake2b(key=master, digest_size=32, person=_PERSON_AES).digest()
        return cls(kid, aes, source)

    def __repr__(self) -> str:
        return f"SealKey(key_id={self.key_id.hex()}, source={self.source!r})"


@dataclass(frozen=True)
class KeyRing:
    """The signing key and the further keys accepted when verifying (immutable, hashable).

    Attributes:
        signing: the key new records are sealed with (always accepted).
        others: keys accepted for verification only (rotation), in configuration order.
    """

    signing: SealKey
    others: tuple[SealKey, ...] = ()

    def __post_init__(self) -> None:
        seen: set[bytes] = set()
        for k in (self.signing, *self.others):
            if k.key_id in seen:
                raise ValueError(f"key {k.source or k.key_id.hex()} is listed twice (key id {k.key_id.hex()})")
            seen.add(k.key_id)

    @classmethod
    def of(cls, signing: SealKey, *others: SealKey) -> KeyRing:
        """A ring signing with ``signing`` and accepting it and ``others``.

        Raises:
            ValueError: the same key (or two keys with one id) listed twice.
        """
        return cls(signing, tuple(others))

    @property
    def accepted(self) -> dict[bytes, SealKey]:
        """``{key_id: key}`` of every key a record may be sealed with (the signing key included)."""
        return {k.key_id: k for k in (self.signing, *self.others)}

    def describe(self) -> str:
        """``"signing <id> (<source>), accepting <id>, ..."`` (ids and sources only: safe to log)."""
        text = f"signing key {self.signing.key_id.hex()} ({self.signing.source})"
        if self.others:
            text += ", also accepting " + ", ".join(f"{k.key_id.hex()} ({k.source})" for k in self.others)
        return text


def _bad(config_key: str, source: str, why: str) -> ConfigError:
    # The source (a path or a variable name) is safe to show; a value that is not a source might be
    # a key pasted into the config, so it is never echoed.
    shown = source if source.startswith(("file:", "env:")) else "<not shown>"
    return ConfigError(f"lmtier config: {config_key}={shown}: {why}")


def parse_sources(config_key: str, value: str | None) -> tuple[str, ...]:
    """The comma-separated key sources of ``value`` (``None`` or ``""``: none), each ``file:PATH`` or
    ``env:NAME``, checked for form only (:func:`load_key` reads them).

    Raises:
        ConfigError: an item that is not ``file:PATH`` / ``env:NAME`` (its text not shown).
    """
    if value is None or not value.strip():
        return ()
    out = []
    for item in (s.strip() for s in value.split(",")):
        if item.startswith("file:") and len(item) > len("file:"):
            out.append(item)
        elif item.startswith("env:") and item[4:].replace("_", "a").isalnum():
            out.append(item)
        else:
            raise _bad(
                config_key,
                item,
                "each item must be 'file:PATH' or 'env:NAME' naming where the key is (the key itself "
                "never goes in the configuration)",
            )
    return tuple(out)


def _decode_hex(config_key: str, source: str, text: str) -> bytes:
    text = text.strip()
    try:
        master = bytes.fromhex(text)
    except ValueError:
        raise _bad(config_key, source, "the key must be hex text (e.g. openssl rand -hex 32)") from None
    if not MIN_KEY_BYTES <= len(master) <= MAX_KEY_BYTES:
        raise _bad(
            config_key,
            source,
            f"holds a key of {len(master)} bytes; a seal key is {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes "
            f"({2 * MIN_KEY_BYTES}..{2 * MAX_KEY_BYTES} hex digits)",
        )
    return master


def load_key(config_key: str, source: str, env: Mapping[str, str]) -> SealKey:
    """Read, decode and check the key at ``source`` (``file:PATH`` or ``env:NAME``).

    Args:
        config_key: the config key naming ``source`` (in errors).
        env: the environment for ``env:`` sources.

    Raises:
        ConfigError: see the module doc (the message never shows key text).
    """
    if source.startswith("file:"):
        path = os.path.expanduser(source[len("file:") :])
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):  # checked before open: a FIFO would block it
                raise _bad(config_key, source, "not a regular file")
            with open(path, encoding="ascii", errors="strict") as f:
                text = f.read(_MAX_FILE_CHARS + 1)
            if len(text) > _MAX_FILE_CHARS:
                raise _bad(config_key, source, f"the key file holds more than {_MAX_FILE_CHARS} characters")
        except UnicodeDecodeError:
            raise _bad(config_key, source, "the key must be hex text (e.g. openssl rand -hex 32)") from None
        except OSError as e:
            raise _bad(config_key, source, f"cannot read the key file ({e.strerror or type(e).__name__})") from None
        if st.st_mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning(
                "lmtier: seal key file %s may be read by group/others (mode %o); chmod 600 it",
                path,
                stat.S_IMODE(st.st_mode),
            )
    elif source.startswith("env:"):
        name = source[len("env:") :]
        text = env.get(name)
        if text is None or not text.strip():
            raise _bad(config_key, source, f"environment variable {name} is unset or empty")
    else:
        raise _bad(config_key, source, "must be 'file:PATH' or 'env:NAME'")
    return SealKey.from_bytes(_decode_hex(config_key, source, text), source=source)


def load_keyring(
    signing_source: str, accept_sources: tuple[str, ...], env: Mapping[str, str], *, keys: tuple[str, str]
) -> KeyRing:
    """The :class:`KeyRing` of a signing source and the sources of further accepted keys.

    Args:
        keys: the two config keys (signing, accepted), named in errors.

    Raises:
        ConfigError: an unreadable/malformed key, or one key listed twice.
    """
    signing = load_key(keys[0], signing_source, env)
    others = [load_key(keys[1], s, env) for s in accept_sources]
    try:
        return KeyRing.of(signing, *others)
    except ValueError as e:
        raise ConfigError(f"lmtier config: {keys[1]}: {e}") from None
