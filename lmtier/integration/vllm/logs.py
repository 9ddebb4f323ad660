"""What the connector logs when it starts: lmtier's loggers routed into vLLM's logging
(:func:`route_lmtier_logging`) and the startup line (:func:`startup_line`).

Why the routing: lmtier's library modules log under ``lmtier.*`` (``lmtier.config``,
``lmtier.tiers.disk``, ...), the connector under ``vllm.lmtier.connector``. vLLM configures only its
own ``vllm`` logger (``vllm/logger.py``: ``DEFAULT_LOGGING_CONFIG``, one stream handler, level
``VLLM_LOGGING_LEVEL`` or ``--log-level``, ``propagate: False``) and leaves the root logger bare, so
inside a vLLM process an ``lmtier.*`` WARNING went through Python's last-resort handler (a bare line,
no process, level or time) and INFO lines (``lmtier effective config: ...``) were dropped. The
connector calls :func:`route_lmtier_logging` in both roles, in every process it starts in; a
library user outside vLLM never calls it and keeps Python's defaults.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

from lmtier.config import LMTierConfig
from lmtier.integration.vllm.options import ConnectorOptions

__all__ = ["route_lmtier_logging", "startup_line", "RateLimitedWarning"]

LMTIER_LOGGER = "lmtier"
VLLM_LOGGER = "vllm"


def route_lmtier_logging() -> bool:
    """Send the ``lmtier`` logger's records to vLLM's handlers, at vLLM's level.

    When the ``lmtier`` logger has no handler, the root logger has none and the ``vllm`` logger has
    some: ``lmtier`` gets the ``vllm`` logger's handlers (the same objects: vLLM's stream, format
    and handler level), the ``vllm`` logger's level (vLLM sets it from ``VLLM_LOGGING_LEVEL`` /
    ``--log-level``; INFO when it has none) and ``propagate = False`` (as vLLM's own logger; a record
    is handled once). Otherwise nothing changes: a handler the user put on ``lmtier`` or on the root
    logger (``logging.basicConfig``, a ``VLLM_LOGGING_CONFIG_PATH`` file naming ``lmtier``) is theirs,
    and with ``VLLM_CONFIGURE_LOGGING=0`` vLLM has no handler to share. Idempotent: once routed,
    ``lmtier`` has handlers and a second call (the other role in the same process) does nothing.

    Returns:
        True when it routed the logger, False when it left it alone.
    """
    lmtier_log = logging.getLogger(LMTIER_LOGGER)
    vllm_log = logging.getLogger(VLLM_LOGGER)
    if lmtier_log.handlers or logging.getLogger().handlers or not vllm_log.handlers:
        return False
    for handler in vllm_log.handlers:
        lmtier_log.addHandler(handler)
    lmtier_log.setLevel(vllm_log.level or logging.INFO)
    lmtier_log.propagate = False
    return True


def _serde(config: LMTierConfig, tier: str) -> str:
    """``naive``, or ``cachegen(<codec level>)`` for a ``cachegen`` serde."""
    level = config.serde_level(tier)
    return "naive" if level is None else f"cachegen({level})"


def startup_line(
    role: str,
    namespace_hex: str,
    config: LMTierConfig,
    *,
    tiers: Mapping[str, bool],
    options: ConnectorOptions,
    pca_model_id: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> str:
    """The connector's one-line INFO summary of how it started.

    ``lmtier connector (WORKER) namespace <hex>, chunk 256 tokens, tiers: cpu=True disk=True
    remote=True, serde: disk=cachegen(pca_default) remote=naive, codec_pca_model '/m.lmtpca' (id
    0x1a2b3c4d), ConnectorOptions(...)``. The serde (and, for ``cachegen``, the codec level) is listed
    for each enabled lower tier (the segment is left out when neither is on); ``codec_pca_model`` only
    when an enabled tier codes with a PCA level, its model id only when given.

    Args:
        role: ``"SCHEDULER"`` or ``"WORKER"`` (vLLM's ``KVConnectorRole`` name).
        namespace_hex: the namespace digest as shown (16 hex digits).
        config: the lmtier configuration.
        tiers: ``{"cpu": bool, "disk": bool, "remote": bool}``: which tiers this role serves from (a
            scheduler in another process than the worker counts the worker's CPU pool it mirrors).
        options: the parsed ``kv_connector_extra_config`` (shown by its ``repr``).
        pca_model_id: :attr:`lmtier.codec.pca.PCAModel.model_id` of the loaded ``codec_pca_model``,
            or None (not loaded in this process, or no PCA level).
        tp_rank, tp_size: this process's tensor-parallel rank: at ``tp_size`` > 1 the model id is
            shown as the rank's (a tensor-parallel file holds one model per rank's KV heads).
    """
    parts = [
        f"lmtier connector ({role}) namespace {namespace_hex}, chunk {config.chunk_size} tokens, "
        f"tiers: cpu={tiers['cpu']} disk={tiers['disk']} remote={tiers['remote']}"
    ]
    lower = [t for t in ("disk", "remote") if tiers[t]]
    if lower:
        parts.append("serde: " + " ".join(f"{t}={_serde(config, t)}" for t in lower))
    if config.codec_pca_model is not None and any(config.serde_level(t) is not None for t in lower):
        whose = f"rank {tp_rank} of {tp_size}: " if tp_size > 1 else ""
        model_id = "" if pca_model_id is None else f" ({whose}id {pca_model_id:#010x})"
        parts.append(f"codec_pca_model {config.codec_pca_model!r}{model_id}")
    parts.append(repr(options))
    return ", ".join(parts)


class RateLimitedWarning:
    """A warning logged at most once per ``period_s`` seconds: the calls in between are counted, and
    the next warning says how many there were (a dead tier fails every load; one line per load would
    flood the log). Thread-safe.

    Args:
        logger: where the warnings go.
        period_s: seconds between two warnings (> 0).
    """

    def __init__(self, logger: logging.Logger, period_s: float = 30.0) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s!r}")
        self._logger, self._period = logger, period_s
        self._lock = threading.Lock()
        self._next = 0.0
        self._suppressed = 0

    def __call__(self, msg: str, *args: object) -> bool:
        """Log ``msg % args`` as a warning unless one was logged less than ``period_s`` ago; returns
        whether it was logged."""
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                self._suppressed += 1
                return False
            n, self._suppressed, self._next = self._suppressed, 0, now + self._period
        if n:
            msg, args = msg + " (and %d more since the last such warning)", (*args, n)
        self._logger.warning(msg, *args)
        return True
