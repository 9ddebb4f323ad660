"""Mooncake Store client settings: the JSON file named by ``MOONCAKE_CONFIG_PATH`` and lmtier's
``mooncake_*`` keys, resolved into one frozen :class:`MooncakeSettings`.

Pure Python (no ``mooncake`` import): :mod:`lmtier.config` resolves the settings at load time, so a
bad file or key is a :class:`~lmtier.config_schema.ConfigError` naming it before any tier starts.

Sources, later ones winning per field: the defaults below; the JSON file of
``MOONCAKE_CONFIG_PATH`` (LMCache's and vLLM's convention; Mooncake's own key names, sizes in
bytes or as ``"512MB"``/``"1GB"`` strings); the lmtier YAML keys ``mooncake_local_hostname``,
``mooncake_metadata_server``, ``mooncake_global_segment_size`` (GiB), ``mooncake_local_buffer_size``
(GiB), ``mooncake_protocol``, ``mooncake_device_name``. The master address is ``remote_url``'s
(``mooncakestore://HOST:PORT/``); a file whose ``master_server_address`` names another one is an
error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lmtier.config_checks import physical_memory_bytes
from lmtier.config_schema import GIB, ConfigError, config_error

__all__ = [
    "CONFIG_PATH_ENV",
    "FILE_KEYS",
    "YAML_KEYS",
    "PROTOCOLS",
    "MooncakeSettings",
    "resolve_settings",
    "parse_size",
]

CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"
PROTOCOLS = ("tcp", "rdma")
"""``protocol`` values lmtier accepts (Mooncake's Python-level transports)."""

FILE_KEYS = frozenset(
    {
        "local_hostname",
        "metadata_server",
        "global_segment_size",
        "local_buffer_size",
        "protocol",
        "device_name",
        "master_server_address",
    }
)
"""Keys of the ``MOONCAKE_CONFIG_PATH`` file lmtier reads (others are an error naming them)."""

YAML_KEYS = {
    "mooncake_local_hostname": "local_hostname",
    "mooncake_metadata_server": "metadata_server",
    "mooncake_global_segment_size": "global_segment_size",
    "mooncake_local_buffer_size": "local_buffer_size",
    "mooncake_protocol": "protocol",
    "mooncake_device_name": "device_name",
}
"""lmtier config key -> settings field."""

_SIZE_FIELDS = ("global_segment_size", "local_buffer_size")
"""Settings fields that are bytes of this process's memory (GiB in the YAML keys)."""

_SUFFIXES = (("kb", 1 << 10), ("mb", 1 << 20), ("gb", 1 << 30), ("tb", 1 << 40), ("k", 1 << 10))
_SUFFIXES += (("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40), ("b", 1))


@dataclass(frozen=True)
class MooncakeSettings:
    """The arguments of ``MooncakeDistributedStore.setup``.

    Attributes:
        master_server_address: ``host:port`` of the master (from ``remote_url``).
        local_hostname: the address other clients reach this one at; ``None``: the local address
            of the route to the master (resolved when the tier starts).
        metadata_server: ``"P2PHANDSHAKE"`` (default; no metadata service) or an
            ``http://host:port/metadata`` / etcd address.
        global_segment_size: bytes of this process's memory mounted into the store (0: none; the
            chunks then live in other clients' segments, e.g. a standalone ``mooncake_client``).
            At most this machine's physical memory (:func:`resolve_settings` checks): the client
            allocates and registers the whole segment in this process at start, so a larger value
            can never be backed, and a typo in GiB (``1024`` for ``1``) would otherwise surface only as
            an allocation failure or the OOM killer once the engine is up.
        local_buffer_size: bytes of the client's own transfer buffer (the same bound, same reason).
        protocol: ``"tcp"`` or ``"rdma"``.
        device_name: RDMA device(s), e.g. ``"mlx5_0"`` (``""`` for tcp).
    """

    master_server_address: str
    local_hostname: str | None = None
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = 1 << 30
    local_buffer_size: int = 64 << 20
    protocol: str = "tcp"
    device_name: str = ""


def parse_size(key: str, value: Any) -> int:
    """Bytes of a JSON size: a non-negative int, or text such as ``"512MB"``, ``"1.5 GB"``, ``"4096"``.

    Raises:
        ConfigError: naming ``key``.
    """
    if isinstance(value, bool):
        raise config_error(key, value, "must be a size in bytes")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        mult = 1
        for suffix, m in _SUFFIXES:
            if text.endswith(suffix):
                text, mult = text[: -len(suffix)], m
                break
        try:
            f = float(text)
        except ValueError:
            raise config_error(key, value, "must be a size such as 1073741824, '512MB' or '1GB'") from None
        if not math.isfinite(f):
            raise config_error(key, value, "must be finite")
        n = int(f * mult)
    else:
        raise config_error(key, value, "must be a size in bytes (int) or a string such as '1GB'")
    if n < 0:
        raise config_error(key, value, "must be >= 0")
    return n


def _file_values(path: str) -> dict[str, Any]:
    where = f"{CONFIG_PATH_ENV}={path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ConfigError(f"lmtier config: {where}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"lmtier config: {where}: malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"lmtier config: {where}: must hold a JSON object, got {type(data).__name__}")
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{where} key {k}"
        if k not in FILE_KEYS:
            raise config_error(key, v, f"unknown key (known: {sorted(FILE_KEYS)})")
        if k in _SIZE_FIELDS:
            out[k] = parse_size(key, v)
        elif not isinstance(v, str):
            raise config_error(key, v, "must be a string")
        else:
            out[k] = v
    return out


def resolve_settings(master_address: str, yaml_values: Mapping[str, Any], env: Mapping[str, str]) -> MooncakeSettings:
    """The settings of a ``mooncakestore://`` remote tier.

    Args:
        master_address: ``host:port`` from ``remote_url``.
        yaml_values: the lmtier config's values of :data:`YAML_KEYS` (``None`` = unset; sizes in GiB).
        env: the environment (``MOONCAKE_CONFIG_PATH``).

    Raises:
        ConfigError: an unreadable or malformed file, an unknown file key, a wrong type or value
            (the message names the key and, for the file, the variable and path), a file
            ``master_server_address`` other than ``remote_url``'s, a global segment or local buffer
            larger than this machine's physical memory (``os.sysconf``; unchecked where the platform
            does not say).
    """
    fields: dict[str, Any] = {}
    given: dict[str, tuple[str, Any]] = {}  # size field -> (the key that set it, its value as written)
    path = env.get(CONFIG_PATH_ENV) or None
    if path is not None:
        raw = _file_values(path)
        fields.update(raw)
        for f in _SIZE_FIELDS:
            if f in raw:
                given[f] = (f"{CONFIG_PATH_ENV}={path!r} key {f}", raw[f])
        file_master = fields.pop("master_server_address", None)
        if file_master is not None and file_master.strip() != master_address:
            raise config_error(
                f"{CONFIG_PATH_ENV}={path!r} key master_server_address",
                file_master,
                f"disagrees with remote_url's master {master_address!r}",
            )
    for key, field_name in YAML_KEYS.items():
        v = yaml_values.get(key)
        if v is None:
            continue
        if field_name in _SIZE_FIELDS:
            if v < 0:
                raise config_error(key, v, "must be >= 0 (GiB)")
            given[field_name] = (key, v)
            v = int(v * GIB)
        fields[field_name] = v
    ram = physical_memory_bytes()
    for f in _SIZE_FIELDS:
        if ram and f in given and fields[f] > ram:
            key, v = given[f]
            raise config_error(
                key,
                v,
                f"{fields[f] / GIB:.1f} GiB exceeds this machine's physical memory ({ram / GIB:.1f} GiB); "
                "the Mooncake client allocates and registers it in this process",
            )
    s = MooncakeSettings(master_server_address=master_address, **fields)
    src = "mooncake_protocol / the protocol key of " + CONFIG_PATH_ENV
    if s.protocol not in PROTOCOLS:
        raise config_error("mooncake_protocol", s.protocol, f"must be one of {list(PROTOCOLS)} (from {src})")
    if s.protocol == "rdma" and not s.device_name:
        raise config_error(
            "mooncake_device_name", s.device_name, "must name the RDMA device(s) when the protocol is rdma"
        )
    if not s.metadata_server.strip():
        raise config_error("mooncake_metadata_server", s.metadata_server, "must not be empty")
    if s.local_hostname is not None and not s.local_hostname.strip():
        raise config_error("mooncake_local_hostname", s.local_hostname, "must not be empty")
    if s.local_buffer_size <= 0:
        raise config_error("mooncake_local_buffer_size", s.local_buffer_size, "must be > 0 bytes")
    return s


def local_address_towards(host: str, port: int) -> str:
    """The local IP address of the route to ``host:port`` (a UDP ``connect``: no packet is sent);
    ``"127.0.0.1"`` when it cannot be found."""
    import socket

    try:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
