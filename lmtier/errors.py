"""The one error base of lmtier.

Every error class lmtier defines derives from :class:`LMTierError`, so a caller can catch all of
lmtier's own errors with one clause, while each class keeps the built-in base it always had
(``ValueError`` for invalid input or data, ``RuntimeError`` for failures at run time), so existing
``except ValueError`` / ``except RuntimeError`` clauses keep working:

* :class:`lmtier.config.ConfigError` (``ValueError``): invalid configuration; names the key
  (defined in :mod:`lmtier.config_schema`).
* :class:`lmtier.layout.LayoutError` (``ValueError``): KV tensors of an unsupported layout.
* :class:`lmtier.record.RecordError` (``ValueError``): a tier record that does not verify.
* :class:`lmtier.codec.quant.CodecInputError` (``ValueError``): KV the codec cannot quantize;
  :class:`lmtier.codec.chunk.CodecRecordError` (a ``CodecInputError``): a codec record that does
  not decode.
* :class:`lmtier.codec.pca.hf.CalibrationError` (``ValueError``): a model, checkpoint or text the PCA
  codec's calibration cannot use (names the module or the input).
* :class:`lmtier.tiers.base.TierError` (``RuntimeError``): a tier failure (a miss / a dropped store).
* :class:`lmtier.tiers.disk.io.NotRegularFile` (``OSError``): a disk record path that holds no regular
  file (a directory, a link, a FIFO, a device node); the disk tier turns it into a miss.
* :class:`lmtier.tiers.seal.tier.SealError` (``ValueError``): a sealed shared-tier record that does
  not open (no seal, unknown key, another chunk key or namespace, a tag that does not verify); the
  sealed tier turns it into a miss and deletes the value.
* :class:`lmtier.bench.disk.DdError` (``RuntimeError``): ``dd``, the disk benchmark's raw-device
  ceiling, failed in the benchmark's directory; ``lmtier bench disk`` prints it as one line.
* :class:`lmtier.integration.vllm.fetch.InjectedFault` (``RuntimeError``): test-only fault injection.
* :class:`lmtier.testing.redis.RedisUnavailable` (``RuntimeError``): the test harness found no
  redis-server.

This module imports nothing, so every lmtier module (torch-free ones included) can use it.
"""

from __future__ import annotations

__all__ = ["LMTierError"]


class LMTierError(Exception):
    """Base class of every error lmtier raises on purpose (see the module doc for the subclasses)."""
