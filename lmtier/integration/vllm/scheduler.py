"""The scheduler role of :class:`lmtier.integration.vllm.LMTierConnector`: it decides.

``get_num_new_matched_tokens`` hashes the prompt into chunk keys (:func:`lmtier.keys.chunk_keys`)
and looks up the longest cached prefix across tiers; it claims only whole chunks beyond vLLM's own
prefix-cache hit and never the last prompt token. A hit whose claimed chunks all sit in the CPU pool
is loaded synchronously (before the step's forward), and so is a hit whose other claimed chunks are
on disk and hold at most ``sync_disk_load_mib`` (while no other request is in the scheduler;
``sync_disk_load_busy_mib`` otherwise); any other hit (a chunk in Redis, a large disk hit) is
loaded asynchronously (vLLM parks the request in ``WAITING_FOR_REMOTE_KVS`` until the worker reports
it). ``update_state_after_alloc`` records the load (which chunk goes to which blocks, starting at
the first token vLLM does not already hold — a chunk is never written over blocks vLLM holds).
``build_connector_meta`` adds the stores: every prompt chunk that becomes complete in this step and
is not stored yet. A request whose async load failed is never offered a hit again, so vLLM's re-ask
cannot loop.

Load policy (:mod:`lmtier.integration.vllm.loadpolicy`): the claim stops at the first chunk whose
tier loads slower than the engine recomputes (``load_policy: auto``) — unless a later tier that is
fast enough (P2P, remote: e.g. codec records in Redis behind a slow raw disk) holds copies of the
chunks from there on: they are claimed from it and the worker does not read the slow tier
(``LoadOp.skip_tiers``). The worker's load samples arrive with its metadata, the prefill rate is
timed here from ``build_connector_meta`` to ``update_connector_output``. With a CPU pool, the chunks
recomputed because of a slow tier are stored again (into the pool): the next hit loads them from there.

Index: the tier manager shared with the worker when both live in one process; otherwise an
:class:`lmtier.integration.vllm.mirror.IndexMirror` of the worker's CPU pool and disk chunks (fed by
:class:`lmtier.integration.vllm.metadata.LMTierWorkerMetadata`) followed by this process's own view of
the disk and remote tiers. Keys are rank 0's (every TP rank stores its shard under its own keys).

vLLM sources: ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` (0.32/0.33).
"""

from __future__ import annotations

import logging
from typing import Any

from lmtier.config import LMTierConfig
from lmtier.integration.vllm.common import SchedulerTiers, request_salt
from lmtier.integration.vllm.loadpolicy import LoadPlan, LoadPolicy, StepClock
from lmtier.integration.vllm.metadata import LMTierConnectorMetadata, LMTierWorkerMetadata
from lmtier.integration.vllm.mirror import IndexMirror
from lmtier.integration.vllm.options import ConnectorOptions
from lmtier.integration.vllm.stats import HIT_TIERS, StatsSink
from lmtier.integration.vllm.worker import LoadOp, StoreOp
from lmtier.keys import Namespace, chunk_keys
from lmtier.tiers.tenants import tenant_id

__all__ = ["LMTierScheduler"]

log = logging.getLogger("vllm.lmtier.connector")


class LMTierScheduler:
    """Scheduler-side state and decisions of one engine's connector (see the module docstring).

    Args:
        manager: the tiers this process sees: the worker's own manager when ``shared`` (in-process
            engine), else a manager of the disk / remote tiers only (or a
            :class:`lmtier.integration.vllm.common.NoTiers`).
        shared: ``manager`` is the worker's (no mirror needed).
        config: the lmtier configuration (sizes the mirror).
        options: the connector's options.
        namespace: rank 0's chunk-key namespace (the index key space).
        block_size: vLLM's block size in tokens.
        is_cuda: the KV cache is on a CUDA device (stores copy asynchronously: a finished request's
            blocks are kept until the worker reports them in ``finished_sending``).
        stats: where counters go.
    """

    def __init__(
        self,
        manager: SchedulerTiers,
        *,
        shared: bool,
        config: LMTierConfig,
        options: ConnectorOptions,
        namespace: Namespace,
        block_size: int,
        is_cuda: bool,
        stats: StatsSink,
    ) -> None:
        self.manager = manager
        self.options = options
        self.ns = namespace
        self.chunk = config.chunk_size
        self.block_size = block_size
        self._is_cuda = is_cuda
        self._stats = stats
        # per-tenant lookup / hit tokens in the stats
        self._tenants = config.cpu.tenants is not None or config.remote.tenants is not None
        self._shared_mgr = shared
        self._requests: dict[str, Any] = {}  # req_id -> Request (token ids, salt)
        # req_id -> (vLLM's hit, lmtier's hit (tokens), tiers of the claimed chunks, async, LoadPlan)
        self._lookups: dict[str, tuple[int, int, list[str], bool, LoadPlan]] = {}
        self._pending_loads: dict[str, LoadOp] = {}
        self._stored_upto: dict[str, int] = {}  # req_id -> chunks already stored / queued
        self._blocks: dict[str, list[int]] = {}
        self._async_store_reqs: set[str] = set()
        self._delayed_frees: list[str] = []
        self._no_load: set[str] = set()  # requests whose async load failed: recompute them
        self._counted: set[str] = set()  # requests whose lookup was counted in the stats
        self._issued: dict[str, LoadOp] = {}  # loads whose outcome is not known yet
        # Requests past their prompt whose every prompt chunk is stored or planned: a decode step skips
        # them in build_connector_meta (left on preemption, a failed load, or when they finish).
        self._decoding: set[str] = set()
        # req_id -> (salt, chunk keys of the prompt's longest keyed prefix): vLLM asks a waiting
        # request again every step until it is admitted; hashing its prompt once is enough.
        self._keys: dict[str, tuple[Any, list[bytes]]] = {}
        self.policy = LoadPolicy(
            bytes_per_token=namespace.chunk_bytes / self.chunk,
            mode=options.load_policy,
            prefill_tokens_per_s=options.prefill_tokens_per_s,
            priors_gbps=options.load_prior_gbps,
            min_samples=options.load_min_samples,
            hysteresis=options.load_hysteresis,
            probe_s=options.load_probe_s,
        )
        self.policy.refresh()  # priors with a calibrated prefill rate decide at once
        self._steps = StepClock(min_prefill_tokens=self.chunk)
        self._policy_seen = -1  # the policy version last exported to the stats
        # Chunks recomputed because their tier is slow are stored again when there is a CPU pool.
        self._restore_slow = config.cpu.enabled
        slot = -(-namespace.chunk_bytes // 4096) * 4096
        # Mirror of the worker's tiers when the worker lives in another process (unused when shared).
        self.mirror = IndexMirror(
            max(
                1024,
                (config.cpu.capacity_bytes if config.cpu.enabled else 0) // slot
                + (config.disk.capacity_bytes if config.disk.enabled else 0) // namespace.chunk_bytes,
            )
        )

    def open_state(self) -> dict[str, Any]:
        """Per-request state still held, by name (every value empty once every request finished)."""
        return {
            "requests": self._requests,
            "lookups": self._lookups,
            "pending_loads": self._pending_loads,
            "stored_upto": self._stored_upto,
            "blocks": self._blocks,
            "no_load": self._no_load,
            "issued": self._issued,
            "counted": self._counted,
            "decoding": self._decoding,
            "keys": self._keys,
        }

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Tokens beyond vLLM's own hit (``num_computed_tokens``, block aligned) that lmtier can load.

        Returns ``(n, load_async)``: ``n`` is a multiple of the block size, ``num_computed_tokens + n``
        is a whole number of chunks and at most ``len(prompt) - 1``. ``load_async`` is True when any
        claimed chunk is in Redis or the claimed disk chunks exceed ``sync_disk_load_mib``. The claim
        ends before the first chunk whose tier the load policy finds slower than recompute
        (:meth:`lmtier.integration.vllm.loadpolicy.LoadPolicy.plan`). Side-effect free apart from
        caching the lookup.
        """
        prompt = request.prompt_token_ids or []
        rid = request.request_id
        self._requests[rid] = request
        # Whole chunks strictly before the last prompt token: vLLM must compute at least one token.
        max_hit = (max(len(prompt) - 1, 0) // self.chunk) * self.chunk
        if (
            max_hit <= num_computed_tokens
            or getattr(request, "skip_reading_prefix_cache", False)
            or rid in self._no_load
        ):
            self._lookups.pop(rid, None)
            return 0, False
        keys = self._prompt_keys(request, max_hit // self.chunk)
        tiers = self._lookup(keys)
        plan = self.policy.plan(tiers, num_computed_tokens // self.chunk)
        if plan.skipped and plan.probe is None:
            tiers, plan = self._faster_copy(keys, tiers, plan)
        tiers = tiers[: plan.chunks]
        hit = len(tiers) * self.chunk
        if hit <= num_computed_tokens:
            self._lookups[rid] = (num_computed_tokens, 0, [], False, plan)
            return 0, False
        claimed = tiers[num_computed_tokens // self.chunk :]
        load_async = self.options.async_loads and self._load_async(claimed)
        self._lookups[rid] = (num_computed_tokens, hit, tiers, load_async, plan)
        return hit - num_computed_tokens, load_async

    def _prompt_keys(self, request, n: int, salt: Any = None) -> list[bytes]:
        """The chunk keys of the first ``n`` chunks of ``request``'s prompt (``salt``: its
        :func:`~lmtier.integration.vllm.common.request_salt`, computed when None), hashed once per
        request and salt. A request's prompt only grows (vLLM's streaming sessions extend it): the
        keys of a prefix are a prefix of the keys, so a longer prefix hashes again and a shorter one
        is a slice; another salt (e.g. new multimodal inputs) hashes again."""
        if salt is None:
            salt = request_salt(request)
        rid = request.request_id
        got = self._keys.get(rid)
        if got is not None and got[0] == salt and len(got[1]) >= n:
            return got[1][:n]
        keys = chunk_keys(request.prompt_token_ids[: n * self.chunk], self.ns, cache_salt=salt)
        self._keys[rid] = (salt, keys)
        return keys

    def _faster_copy(self, keys: list[bytes], tiers: list[str], plan: LoadPlan) -> tuple[list[str], LoadPlan]:
        """Where the plan stops at a slow tier: a later tier the worker reads (P2P, then remote) that
        loads fast enough and holds the next chunks. Returns ``(tiers, plan)`` with those chunks
        claimed from it and every slow tier in ``plan.avoid``, else the arguments unchanged (a
        lookup error is no copy)."""
        start, stop = plan.chunks, len(tiers)
        later = {"disk": ("p2p", "remote"), "p2p": ("remote",)}.get(plan.skipped[0], ())
        for name, tier in (("p2p", self.manager.p2p), ("remote", self.manager.remote)):
            if name not in later or tier is None or not self.policy.loads(name):
                continue
            try:
                flags = tier.contains_many(keys[start:stop])
            except Exception:
                log.warning("lmtier: looking for copies in tier %s failed", name, exc_info=True)
                continue
            m = next((i for i, f in enumerate(flags) if not f), len(flags))
            if m:
                avoid = tuple(t for t in ("disk", "p2p", "remote") if not self.policy.loads(t))
                return tiers[:start] + [name] * m, LoadPlan(start + m, list(tiers[start + m :]), None, avoid)
        return tiers, plan

    def _load_async(self, claimed: list[str]) -> bool:
        """Whether claimed chunks (tier names) load in the background: any remote or peer chunk, or disk
        chunks of more than ``sync_disk_load_mib`` (``sync_disk_load_busy_mib`` while the scheduler
        holds other requests); CPU chunks always load synchronously."""
        if "remote" in claimed or "p2p" in claimed:
            return True
        disk = sum(1 for t in claimed if t == "disk")
        o = self.options
        limit = o.sync_disk_load_bytes if len(self._requests) <= 1 else o.sync_disk_load_busy_bytes
        return disk > 0 and disk * self.ns.chunk_bytes > limit

    def _lookup(self, keys: list[bytes]) -> list[str]:
        """Tiers of the longest cached prefix of ``keys``: the shared manager's index, or (worker in
        another process) the mirror of the worker's tiers followed by this process's disk/P2P/remote view."""
        if self._shared_mgr:
            return self.manager.lookup(keys)
        found = self.mirror.prefix(keys)
        rest = keys[len(found) :]
        if rest and any(t is not None for t in (self.manager.disk, self.manager.p2p, self.manager.remote)):
            found += self.manager.lookup(rest)
        return found

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        got = self._lookups.get(request.request_id)
        if not got or num_external_tokens <= 0 or not got[1]:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        names = {
            "cpu": CacheHitSource.HOST,
            "disk": CacheHitSource.DISK,
            "p2p": CacheHitSource.P2P,
            "remote": CacheHitSource.EXTERNAL_UNSPECIFIED,
        }
        out: dict = {}
        for t, n in self._hits_by_tier(got).items():
            if n:
                out[names[t]] = out.get(names[t], 0) + n
        if sum(out.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return out

    def _hits_by_tier(self, lookup) -> dict[str, int]:
        nc, hit, tiers = lookup[:3]
        out = dict.fromkeys(HIT_TIERS, 0)
        for i, t in enumerate(tiers):
            lo, hi = max(i * self.chunk, nc), (i + 1) * self.chunk
            if hi > lo:
                out[t] += hi - lo
        return out

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        """Record the load of the claimed chunks into the blocks vLLM just allocated.

        ``blocks.get_block_ids()[0]`` lists all the request's blocks (vLLM's own hits first). For an
        asynchronous load vLLM calls this twice: with the claimed tokens, then (after the load was
        reported) with ``num_external_tokens == 0``, which is a no-op here.
        """
        rid = request.request_id
        got = self._lookups.get(rid)
        if rid not in self._counted and got is not None:
            self._counted.add(rid)
            prompt_len = len(request.prompt_token_ids or [])
            looked = max((max(prompt_len - 1, 0) // self.chunk) * self.chunk - got[0], 0)
            self._stats.add("lookup_tokens", looked)
            if self._tenants:
                self._stats.add_tenant(tenant_id(getattr(request, "cache_salt", None)), "lookup_tokens", looked)
            self._count_decisions(got)
        if num_external_tokens <= 0:
            return
        block_ids = list(blocks.get_block_ids()[0])
        nc = got[0] if got is not None else 0
        nb = (nc + num_external_tokens + self.block_size - 1) // self.block_size
        if got is None or not got[1] or nc + num_external_tokens != got[1] or len(block_ids) < nb:
            # vLLM allocated external tokens that do not match our offer (cannot happen with vLLM
            # 0.32/0.33): never leave claimed tokens unwritten — report those blocks as failed loads,
            # so vLLM recomputes them (or fails the request, per kv_load_failure_policy).
            log.error(
                "lmtier: request %s: vLLM allocated %d external tokens, lookup said %s; recomputing them",
                rid,
                num_external_tokens,
                got,
            )
            self._pending_loads[rid] = LoadOp(
                rid, [], None, nc, block_ids[:nb], is_async=bool(got and got[3]), poisoned=True
            )
            return
        nc, hit, tiers, load_async, plan = got
        if plan.probe is not None:
            self.policy.probed(plan.probe)
        op = LoadOp(
            rid,
            list(request.prompt_token_ids[:hit]),
            request_salt(request),
            nc,
            block_ids[:nb],
            is_async=load_async,
            skip_tiers=plan.avoid,
        )
        self._pending_loads[rid] = op
        self._issued[rid] = op
        for t, n in self._hits_by_tier(got).items():
            if n:
                self._stats.add(f"hit_tokens_{t}", n)
        if self._tenants:
            self._stats.add_tenant(tenant_id(getattr(request, "cache_salt", None)), "hit_tokens", hit - nc)
        # Loaded chunks are stored already: never store them again for this request.
        self._stored_upto[rid] = max(self._stored_upto.get(rid, 0), hit // self.chunk)

    def _count_decisions(self, lookup) -> None:
        """Count the load policy's decision for one admitted request: its claimed chunks as loaded, the
        cached chunks it left to recompute as skipped, by tier (``vllm:lmtier_load_decisions_total``)."""
        nc, hit, tiers, _, plan = lookup
        for t in tiers[nc // self.chunk :] if hit else ():
            self._stats.add_decision(t, "loaded")
        for t in plan.skipped:
            self._stats.add_decision(t, "skipped")

    def build_connector_meta(self, scheduler_output) -> LMTierConnectorMetadata:
        preempted = getattr(scheduler_output, "preempted_req_ids", ())
        meta = LMTierConnectorMetadata(
            loads=list(self._pending_loads.values()) if self._pending_loads else [],
            delayed_frees=self._delayed_frees,
            preempted=list(preempted) if preempted is not None else None,
        )
        if self._pending_loads:
            self._pending_loads.clear()
        if self._delayed_frees:
            self._delayed_frees = []
        if preempted:
            self._decoding.difference_update(preempted)
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        todo: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            self._decoding.discard(new.req_id)
            todo.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        decoding = self._decoding
        for i, rid in enumerate(cached.req_ids):
            nb = cached.new_block_ids[i]
            if nb is not None:
                if rid in resumed:
                    self._blocks[rid] = list(nb[0])
                    decoding.discard(rid)
                else:
                    self._blocks.setdefault(rid, []).extend(nb[0])
            if rid not in decoding:
                todo.append((rid, cached.num_computed_tokens[i]))
        prefill = 0  # prompt tokens computed in this step (the load policy's prefill rate)
        for rid, computed in todo:
            req = self._requests.get(rid)
            if req is None or not req.prompt_token_ids:
                continue
            prompt = req.prompt_token_ids
            prefill += max(0, min(scheduler_output.num_scheduled_tokens.get(rid, 0), len(prompt) - computed))
            done = computed + scheduler_output.num_scheduled_tokens.get(rid, 0)
            full = min(done, len(prompt)) // self.chunk
            first = self._stored_upto.get(rid, 0)
            if full <= first:
                if computed >= len(prompt) and first >= len(prompt) // self.chunk:
                    decoding.add(rid)  # past its prompt, every prompt chunk handled: skip it from now on
                continue
            blocks = state.get_block_ids(rid)[0] if state is not None else self._blocks.get(rid, [])
            need = full * self.chunk // self.block_size
            if len(blocks) < need:
                continue
            salt = request_salt(req)
            # Skip chunks some tier already holds (the lookup is cheap for local tiers).
            keys = self._prompt_keys(req, full, salt)
            found = self._lookup(keys[first:]) if (self.manager.cpu is not None or len(self.mirror)) else []
            present = len(found)
            if self._restore_slow:  # a copy the load policy will not load is no copy: store it again
                present = next((i for i, t in enumerate(found) if not self.policy.loads(t)), present)
            self._stored_upto[rid] = full
            if first + present >= full:
                continue
            meta.stores.append(
                StoreOp(rid, list(prompt[: full * self.chunk]), salt, first + present, list(blocks[:need]))
            )
            if self._is_cuda:
                self._async_store_reqs.add(rid)
        self._steps.scheduled(
            scheduler_output.total_num_scheduled_tokens,
            prefill,
            sync_loads=bool(meta.loads) and any(not op.is_async for op in meta.loads),
        )
        return meta

    def update_connector_output(self, connector_output):
        """A failed async load leaves the request recomputing: never offer it a hit again (vLLM
        re-asks ``get_num_new_matched_tokens`` right after this call)."""
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, LMTierWorkerMetadata) and not self._shared_mgr:
            for k in self.mirror.apply(wm.events):  # in the order they happened on the worker
                if self.manager.disk is not None:  # gone from the worker's disk: from this view too
                    self.manager.disk.forget(k)
        self._update_policy(wm.load_samples if isinstance(wm, LMTierWorkerMetadata) else ())
        if not self._issued and not getattr(connector_output, "failed_recving", None):
            return  # no load awaits its outcome, none failed (a decode step)
        failed = set(getattr(connector_output, "failed_recving", None) or ())
        for rid in failed:
            self._lookups.pop(rid, None)
            if rid in self._requests:  # with policy "fail" vLLM already finished it (request_finished ran)
                self._no_load.add(rid)
                self._stored_upto[rid] = 0  # recomputed from token 0: store what no tier holds
                self._decoding.discard(rid)
        # Sync loads report failed blocks in the step that ran them: the recomputed chunks from the
        # first bad block on were not stored by this request, so let it store them again.
        invalid = set(getattr(connector_output, "invalid_block_ids", None) or ())
        finished = set(getattr(connector_output, "finished_recving", None) or ())
        for rid, op in list(self._issued.items()):
            if op.is_async and rid not in finished and rid not in failed:
                continue  # still loading
            del self._issued[rid]
            bad = [i for i, b in enumerate(op.block_ids) if b in invalid]
            if bad and rid in self._stored_upto:
                self._stored_upto[rid] = min(self._stored_upto[rid], bad[0] * self.block_size // self.chunk)
                self._decoding.discard(rid)

    def _update_policy(self, samples) -> None:
        """After a step: feed the load policy the worker's load samples and the step's time, re-take
        its decisions, and export them when they or their inputs changed (the decisions depend on
        the estimates only: without a new sample nothing is re-taken)."""
        step = self._steps.finished()
        if samples or step is not None:
            self.policy.add_load_samples(samples)
            if step is not None:
                self.policy.add_prefill_sample(*step)
            self.policy.refresh()
        if self.policy.version != self._policy_seen:
            self._policy_seen = self.policy.version
            self._stats.set_policy(self.policy.snapshot())

    def request_finished(self, request, block_ids: list[int]):
        """Drop the request's state. Returns ``(True, None)`` only while CUDA stores still read its
        blocks (the worker then lists it in ``finished_sending``). Blocks of a request still waiting
        for an async load are held by vLLM itself until the worker reports ``finished_recving``."""
        rid = request.request_id
        for d in (
            self._requests,
            self._lookups,
            self._pending_loads,
            self._stored_upto,
            self._blocks,
            self._issued,
            self._keys,
        ):
            d.pop(rid, None)
        self._no_load.discard(rid)
        self._counted.discard(rid)
        self._decoding.discard(rid)
        # CUDA stores copy asynchronously: keep the blocks until the worker reports the copy done.
        delay = rid in self._async_store_reqs
        self._async_store_reqs.discard(rid)
        if delay:
            self._delayed_frees.append(rid)
        return delay, None
