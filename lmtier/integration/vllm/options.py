"""``kv_connector_extra_config`` of :class:`lmtier.integration.vllm.LMTierConnector`, parsed strictly.

vLLM hands the connector the JSON object a user wrote under ``kv_connector_extra_config``
(``--kv-transfer-config``, or ``LLM(kv_transfer_config=...)``). :meth:`ConnectorOptions.parse` turns
it into a frozen :class:`ConnectorOptions` and rejects what it does not understand, as
:func:`lmtier.config.load_config` does for the YAML: an unknown key or a value of the wrong type is
a ``ValueError`` naming the key. Booleans are parsed, never truth-tested: ``"false"`` is False
(``bool("false")`` is True, which once turned asynchronous loads *on*).

Keys (all optional):

* ``async_loads`` (bool, default true): remote hits and large disk hits load in the background
  (vLLM parks the request in ``WAITING_FOR_REMOTE_KVS``); false: every load is synchronous, before
  the forward.
* ``sync_disk_load_mib`` (number >= 0, MiB of this rank's bytes, default
  :data:`DEFAULT_SYNC_DISK_LOAD_MIB`) and ``sync_disk_load_busy_mib`` (default 0): a hit whose claimed
  chunks outside the CPU pool are all on disk and hold at most this many MiB loads synchronously,
  like a CPU hit. The first limit applies while the request is the only one the scheduler holds,
  the second while others are running or waiting. 0 loads those disk hits asynchronously.
* ``layerwise_loads`` (``"auto"`` (default), true or false): synchronous loads are copied layer by
  layer and the forward waits for each layer in ``wait_for_layer_load``. true: on any device (vLLM
  is asked for PIECEWISE CUDA graphs); ``"auto"``: on a CUDA cache when vLLM's CUDA graph mode has no
  full graphs.
* ``load_failure_policy`` (``"recompute"`` or ``"fail"``; default: not set): what vLLM does with a
  request whose KV load failed. Not set: recompute (the connector sets vLLM's
  ``kv_load_failure_policy`` to ``recompute`` unless the deployment set it to ``recompute``
  already). ``"fail"``: vLLM's ``fail`` (the request ends with ``finish_reason == "error"``). vLLM's
  own ``kv_load_failure_policy: fail`` cannot be told apart from its default (``fail``), so it is
  this key that keeps ``fail``; see :func:`lmtier.integration.vllm.connector.resolve_load_failure_policy`.

Load policy (:mod:`lmtier.integration.vllm.loadpolicy`: a tier's chunks are loaded only while its
effective load bandwidth beats recomputing them, ``KV bytes per token x prefill tokens/s``):

* ``load_policy`` (``"auto"`` (default) or ``"always"``): ``always`` loads every hit, as before the
  policy existed (its estimates are still logged and exported).
* ``prefill_tokens_per_s`` (number > 0; default: measured from the engine's steps): the prefill
  rate the break-even bandwidth is computed from.
* ``load_prior_gbps`` (object: tier name (``cpu``, ``disk``, ``p2p``, ``remote``) -> GB/s > 0;
  default none): a tier's bandwidth until it was measured; a tier without one loads until then.
* ``load_min_samples`` (integer >= 1, default 3): measured samples of a tier (and timed prefill
  steps) before the measured value replaces the prior.
* ``load_hysteresis`` (number in [0, 1), default 0.1): a tier stops loading below
  ``(1 - h) x break-even`` and loads again above ``(1 + h) x break-even``.
* ``load_probe_s`` (number >= 0, default 30): seconds between probes of a tier that stopped
  loading (a probe loads at most 2 of its chunks for one request); 0: never probe.

This module imports nothing from vLLM.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lmtier.config_schema import KEYS as CONFIG_KEYS
from lmtier.integration.vllm.loadpolicy import LOAD_POLICIES

__all__ = [
    "ConnectorOptions",
    "DEFAULT_SYNC_DISK_LOAD_MIB",
    "LOAD_FAILURE_POLICIES",
    "parse_bool",
    "parse_layerwise",
    "parse_load_failure_policy",
    "parse_load_policy",
    "parse_load_priors",
]

# Disk hits up to this many MiB (of this rank) load synchronously when no other request is in the
# scheduler (``sync_disk_load_mib``).
DEFAULT_SYNC_DISK_LOAD_MIB = 256.0

_PREFIX = "lmtier: kv_connector_extra_config"

LOAD_FAILURE_POLICIES = ("recompute", "fail")
"""The values of ``load_failure_policy`` (vLLM's ``kv_load_failure_policy`` values)."""


def parse_bool(key: str, raw: Any) -> bool:
    """``raw`` as a bool: a JSON bool, or the strings ``"true"`` / ``"false"`` (any case).

    Raises:
        ValueError: anything else (numbers included), naming ``key``.
    """
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    raise ValueError(f"{_PREFIX} {key}={raw!r}: must be true or false")


def parse_layerwise(raw: Any) -> bool | None:
    """``layerwise_loads``: True / False (bools or ``"true"`` / ``"false"``), or None for ``"auto"``
    (any case; also a JSON null).

    Raises:
        ValueError: anything else, naming the key.
    """
    if raw is None or (isinstance(raw, str) and raw.strip().lower() == "auto"):
        return None
    try:
        return parse_bool("layerwise_loads", raw)
    except ValueError:
        raise ValueError(f'{_PREFIX} layerwise_loads={raw!r}: must be "auto", true or false') from None


def parse_load_failure_policy(raw: Any) -> str:
    """``load_failure_policy``: ``"recompute"`` or ``"fail"`` (any case, surrounding blanks ignored).

    Raises:
        ValueError: anything else, naming the key.
    """
    if isinstance(raw, str) and raw.strip().lower() in LOAD_FAILURE_POLICIES:
        return raw.strip().lower()
    raise ValueError(f'{_PREFIX} load_failure_policy={raw!r}: must be "recompute" or "fail"')


def _number(key: str, raw: Any, *, lo: float, lo_open: bool = False, hi: float | None = None) -> float:
    """A finite JSON number (or numeric string; not a bool) ``>= lo`` (``> lo`` when ``lo_open``)
    and ``< hi`` (when given).

    Raises:
        ValueError: anything else, naming ``key`` and the range.
    """
    x = math.nan
    if not isinstance(raw, bool) and isinstance(raw, (int, float, str)):
        try:
            x = float(raw)
        except ValueError:
            pass
    ok = math.isfinite(x) and (x > lo if lo_open else x >= lo) and (hi is None or x < hi)
    if not ok:
        rng = f"{'>' if lo_open else '>='} {lo:g}" + ("" if hi is None else f" and < {hi:g}")
        raise ValueError(f"{_PREFIX} {key}={raw!r}: must be a finite number {rng}")
    return x


def parse_load_policy(raw: Any) -> str:
    """``load_policy``: ``"auto"`` or ``"always"`` (any case, surrounding blanks ignored).

    Raises:
        ValueError: anything else, naming the key.
    """
    if isinstance(raw, str) and raw.strip().lower() in LOAD_POLICIES:
        return raw.strip().lower()
    raise ValueError(f'{_PREFIX} load_policy={raw!r}: must be "auto" or "always"')


LOAD_PRIOR_TIERS = ("cpu", "disk", "p2p", "remote")
"""The tier names ``load_prior_gbps`` takes."""


def parse_load_priors(raw: Any) -> dict[str, float]:
    """``load_prior_gbps``: an object mapping tier names (:data:`LOAD_PRIOR_TIERS`) to GB/s > 0.

    Raises:
        ValueError: not an object, an unknown tier, or a value that is not a finite number > 0;
            the message names the key (and the tier).
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"{_PREFIX} load_prior_gbps={raw!r}: must be an object of tier name -> GB/s")
    out = {}
    for tier, v in raw.items():
        if tier not in LOAD_PRIOR_TIERS:
            raise ValueError(f"{_PREFIX} load_prior_gbps: unknown tier {tier!r}; known: {', '.join(LOAD_PRIOR_TIERS)}")
        out[tier] = _number(f"load_prior_gbps.{tier}", v, lo=0.0, lo_open=True)
    return out


def _positive_int(key: str, raw: Any) -> int:
    """An integer >= 1 (a JSON integer, or an integral number / numeric string; not a bool)."""
    x = _number(key, raw, lo=1.0)
    if x != int(x):
        raise ValueError(f"{_PREFIX} {key}={raw!r}: must be an integer >= 1")
    return int(x)


def _mib(key: str, raw: Any) -> float:
    """A size in MiB: a finite number >= 0 (JSON number or numeric string; not a bool)."""
    mib = -1.0
    if not isinstance(raw, bool) and isinstance(raw, (int, float, str)):
        try:
            mib = float(raw)
        except ValueError:
            pass
    if not (math.isfinite(mib) and mib >= 0):
        raise ValueError(f"{_PREFIX} {key}={raw!r}: must be a finite number >= 0")
    return mib


@dataclass(frozen=True)
class ConnectorOptions:
    """The connector's options (see the module docstring for each key's meaning).

    Attributes:
        async_loads: load remote / large disk hits in the background.
        sync_disk_load_mib: MiB of disk chunks a hit may hold and still load synchronously while it
            is alone in the scheduler.
        sync_disk_load_busy_mib: the same limit while other requests are in the scheduler.
        layerwise_loads: True / False, or None for "auto" (decided from the cache's device and
            vLLM's CUDA graph mode).
        load_failure_policy: ``"recompute"`` / ``"fail"``, or None when not set (the connector then
            runs with recompute).
        load_policy: ``"auto"`` / ``"always"``.
        prefill_tokens_per_s: a calibrated prefill rate, or None (measured).
        load_prior_gbps: tier -> GB/s assumed until measured.
        load_min_samples: measured samples before the measurement replaces the prior.
        load_hysteresis: the relative band around break-even in which a decision stays.
        load_probe_s: seconds between probes of a tier that stopped loading (0: none).
    """

    async_loads: bool = True
    sync_disk_load_mib: float = DEFAULT_SYNC_DISK_LOAD_MIB
    sync_disk_load_busy_mib: float = 0.0
    layerwise_loads: bool | None = None
    load_failure_policy: str | None = None
    load_policy: str = "auto"
    prefill_tokens_per_s: float | None = None
    load_prior_gbps: Mapping[str, float] = field(default_factory=dict)
    load_min_samples: int = 3
    load_hysteresis: float = 0.1
    load_probe_s: float = 30.0

    KEYS = (
        "async_loads",
        "sync_disk_load_mib",
        "sync_disk_load_busy_mib",
        "layerwise_loads",
        "load_failure_policy",
        "load_policy",
        "prefill_tokens_per_s",
        "load_prior_gbps",
        "load_min_samples",
        "load_hysteresis",
        "load_probe_s",
    )

    @property
    def sync_disk_load_bytes(self) -> int:
        """``sync_disk_load_mib`` in bytes."""
        return int(self.sync_disk_load_mib * 2**20)

    @property
    def sync_disk_load_busy_bytes(self) -> int:
        """``sync_disk_load_busy_mib`` in bytes."""
        return int(self.sync_disk_load_busy_mib * 2**20)

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        """Options from a ``kv_connector_extra_config`` mapping (None or empty: the defaults).

        Raises:
            ValueError: an unknown key (the message lists the known ones and says which unknown
                ones are keys of lmtier's YAML file, :data:`lmtier.config_schema.KEYS`), or a value
                of the wrong type or range; the message names the key.
        """
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k not in cls.KEYS)
        if unknown:
            yaml_keys = [k for k in unknown if k in CONFIG_KEYS]
            hint = (
                f"; {', '.join(map(repr, yaml_keys))} {'is a key' if len(yaml_keys) == 1 else 'are keys'} of lmtier's "
                "YAML file (LMTIER_CONFIG_FILE), not of kv_connector_extra_config"
                if yaml_keys
                else ""
            )
            guesses = {k: difflib.get_close_matches(k, cls.KEYS, n=1) for k in unknown if k not in yaml_keys}
            guess = "".join(f"; did you mean {g[0]} for {k!r}?" for k, g in guesses.items() if g)
            raise ValueError(
                f"{_PREFIX}: unknown key(s) {', '.join(map(repr, unknown))}{hint}{guess}; known: {', '.join(cls.KEYS)}"
            )
        d = cls()
        return cls(
            async_loads=parse_bool("async_loads", extra["async_loads"]) if "async_loads" in extra else d.async_loads,
            sync_disk_load_mib=_mib("sync_disk_load_mib", extra["sync_disk_load_mib"])
            if "sync_disk_load_mib" in extra
            else d.sync_disk_load_mib,
            sync_disk_load_busy_mib=_mib("sync_disk_load_busy_mib", extra["sync_disk_load_busy_mib"])
            if "sync_disk_load_busy_mib" in extra
            else d.sync_disk_load_busy_mib,
            layerwise_loads=parse_layerwise(extra.get("layerwise_loads")),
            load_failure_policy=parse_load_failure_policy(extra["load_failure_policy"])
            if "load_failure_policy" in extra
            else None,
            load_policy=parse_load_policy(extra["load_policy"]) if "load_policy" in extra else d.load_policy,
            prefill_tokens_per_s=_number("prefill_tokens_per_s", extra["prefill_tokens_per_s"], lo=0.0, lo_open=True)
            if extra.get("prefill_tokens_per_s") is not None
            else None,
            load_prior_gbps=parse_load_priors(extra["load_prior_gbps"]) if "load_prior_gbps" in extra else {},
            load_min_samples=_positive_int("load_min_samples", extra["load_min_samples"])
            if "load_min_samples" in extra
            else d.load_min_samples,
            load_hysteresis=_number("load_hysteresis", extra["load_hysteresis"], lo=0.0, hi=1.0)
            if "load_hysteresis" in extra
            else d.load_hysteresis,
            load_probe_s=_number("load_probe_s", extra["load_probe_s"], lo=0.0)
            if "load_probe_s" in extra
            else d.load_probe_s,
        )
