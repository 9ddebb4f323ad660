"""Local-disk tier (tier 2): one self-describing record file per chunk, O_DIRECT I/O.

:class:`DiskTier` (:mod:`lmtier.tiers.disk.tier`: index, eviction, visibility),
:mod:`lmtier.tiers.disk.records` (record-file reads and writes),
:mod:`lmtier.tiers.disk.io` (POSIX helpers, :func:`background_priority`),
:mod:`lmtier.tiers.disk.gds` (kvikio loads into CUDA tensors), :mod:`lmtier.tiers.disk.tmpfiles`
(temporary file names; which ones a starting tier removes).
"""

from lmtier.tiers.disk.io import background_priority
from lmtier.tiers.disk.tier import DiskTier

__all__ = ["DiskTier", "background_priority"]
