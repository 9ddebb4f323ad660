"""What :class:`lmtier.integration.vllm.LMTierConnector`'s roles send each other every step.

* :class:`LMTierConnectorMetadata` — scheduler -> worker (vLLM's ``KVConnectorMetadata``): the
  step's loads and stores (:class:`lmtier.integration.vllm.worker.LoadOp` /
  :class:`~lmtier.integration.vllm.worker.StoreOp`) and the finished requests whose block frees wait
  for their stores.
* :class:`LMTierWorkerMetadata` — worker -> scheduler (vLLM's ``KVConnectorWorkerMetadata``): the
  index changes of the worker's tiers (:mod:`lmtier.integration.vllm.mirror`) and its tiers' load
  bandwidth samples (:mod:`lmtier.integration.vllm.loadpolicy`).

vLLM sources: ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` (0.32/0.33).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from lmtier.integration.vllm.mirror import DISK_EVICTED, EVICTED, STORED
from lmtier.integration.vllm.worker import LoadOp, StoreOp

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorWorkerMetadata = object  # type: ignore

__all__ = ["LMTierConnectorMetadata", "LMTierWorkerMetadata", "LoadOp", "StoreOp"]


@dataclass
class LMTierConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, every step.

    Attributes:
        loads: the step's loads (synchronous ones run before the forward, asynchronous ones start).
        stores: the step's stores (run after the forward).
        delayed_frees: requests whose blocks the scheduler keeps after they finished
            (``request_finished`` returned True): the worker lists each one in ``finished_sending``
            once its stores completed.
        preempted: requests vLLM preempted since the last step (their blocks are free and may be
            written by this step: the worker's ``handle_preemptions`` finishes the stores still
            reading blocks first); None: not known (a vLLM without ``preempted_req_ids``: the worker
            then finishes every store in flight each step).
    """

    loads: list[LoadOp] = field(default_factory=list)
    stores: list[StoreOp] = field(default_factory=list)
    delayed_frees: list[str] = field(default_factory=list)
    preempted: list[str] | None = field(default_factory=list)

    def is_empty(self) -> bool:
        """Nothing for the worker to do in this step (no load, store, delayed free or preemption)."""
        return not (self.loads or self.stores or self.delayed_frees or self.preempted is None or self.preempted)


@dataclass
class LMTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, every step: index changes of the worker's own tiers, and load samples.

    ``events``: ``(kind, rank-0 key, tier)`` in the order they happened on the worker (a chunk
    stored, evicted and stored again in one step ends up listed where it really is); see
    :mod:`lmtier.integration.vllm.mirror` for the kinds. With speculative decoding vLLM collects this
    before the step's ``wait_for_save``, so that step's stores arrive with the next step's metadata.

    ``load_samples``: ``(tier, path, bytes, seconds)`` of the worker's loads since its last metadata
    (:class:`lmtier.integration.vllm.loadpolicy.BusyMeter`; with TP > 1 every rank's, each in its
    own rank's bytes).
    """

    events: list = field(default_factory=list)
    load_samples: list = field(default_factory=list)

    def _keys(self, kind: str) -> list:
        return [k for e, k, _ in self.events if e == kind]

    @property
    def stored(self) -> list:
        """``(rank-0 key, tier)`` of the chunks stored, in order."""
        return [(k, t) for e, k, t in self.events if e == STORED]

    @property
    def evicted(self) -> list:
        """Rank-0 keys of the chunks that left the CPU pool, in order."""
        return self._keys(EVICTED)

    @property
    def disk_evicted(self) -> list:
        """Rank-0 keys of the chunks the disk tier deleted, in order."""
        return self._keys(DISK_EVICTED)

    def aggregate(self, other: LMTierWorkerMetadata) -> LMTierWorkerMetadata:
        """Append ``other``'s events (TP > 1: each rank reports its own shard's chunks under rank-0
        keys; the union may claim a chunk one rank lacks, which that rank then reports as a failed
        load, recomputed)."""
        self.events = list(self.events) + list(other.events)
        self.load_samples = list(self.load_samples) + list(other.load_samples)
        return self
