"""The connector's per-step host work: a step with nothing to load or store issues no work.

vLLM calls the connector's hooks every engine step (both roles), and its attention layers call
``wait_for_layer_load`` / ``save_kv_layer`` once per layer whenever ``has_connector_metadata()`` is
True. On a decode step — nothing to load, store or free — lmtier must do no per-layer call, never wait
for in-flight stores (``handle_preemptions`` without a preemption), never re-take the load policy's
decisions and never look a running request up again. These tests count calls into the worker's data
path, the load policy and the hashing (not time; the host time per hook is
benchmarks/bench_step_overhead.py's). They run vLLM's own ``Scheduler`` with the connector, through
the fake model runner of lmtier.testing.scheduler_harness.
"""

from __future__ import annotations

import collections

import pytest

from lmtier.testing.scheduler_harness import CHUNK, LAYERS, prompt
from lmtier.testing.vllm import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _vllm():
    require_vllm()


def _count(obj, name: str, counter: collections.Counter, key: str, step: list[int]):
    """Wrap ``obj.name`` so that each call adds one to ``counter[(key, step[0])]``."""
    fn = getattr(obj, name)

    def spy(*a, **k):
        counter[(key, step[0])] += 1
        return fn(*a, **k)

    setattr(obj, name, spy)


def _decode_steps(h, rids) -> set[int]:
    """Run ``h`` to the end; returns the steps that scheduled exactly one token for each of
    ``len(rids)`` requests and no new request (decode-only steps with all of them running)."""
    decode: set[int] = set()
    orig = h.sched.schedule

    def schedule(*a, **k):
        out = orig(*a, **k)
        n = out.num_scheduled_tokens
        if len(n) == len(rids) and all(v == 1 for v in n.values()) and not out.scheduled_new_reqs:
            decode.add(h.steps)  # (Harness.step counts the step before it schedules)
        return out

    h.sched.schedule = schedule
    h.run()
    return decode


@pytest.mark.parametrize("layerwise", [False, True])
def test_decode_steps_issue_no_work(make, layerwise):
    """Four requests decode 12 tokens each after one of them loaded a CPU hit (layer by layer when
    ``layerwise``): the decode steps call nothing in the data path, the load policy or the hashing,
    and report no per-layer work; the loading step does."""
    extra = {"layerwise_loads": True} if layerwise else {}
    h = make(disk=False, max_batched=512, extra=extra)
    base = prompt(1, 3 * CHUNK + 5)
    h.add(base, max_tokens=2)
    h.run()  # stores its chunks: the next request with this prefix loads them
    calls: collections.Counter = collections.Counter()
    step = [0]
    w = h.worker.connector_worker
    t = w.transfers
    for name in ("store", "poll_stores", "load", "load_layerwise", "wait_layer", "start_load", "finished_sending"):
        _count(t, name, calls, name, step)
    _count(t._storer, "poll_stores", calls, "storer.poll_stores", step)
    _count(h.conn.connector_scheduler.policy, "refresh", calls, "policy.refresh", step)
    _count(h.conn.connector_scheduler, "_lookup", calls, "lookup", step)
    _count(w.manager.cpu, "reserve", calls, "cpu.reserve", step)
    per_layer: dict[int, list[bool]] = collections.defaultdict(list)
    inner_wait = h.worker.wait_for_layer_load

    def wait(layer_name):  # the fake forward calls it per layer; vLLM asks has_connector_metadata first
        per_layer[step[0]].append(h.worker.has_connector_metadata())
        return inner_wait(layer_name)

    h.worker.wait_for_layer_load = wait
    inner_step = h.step

    def counted_step():
        step[0] = h.steps + 1
        return inner_step()

    h.step = counted_step
    rids = [h.add(base + prompt(50 + i, 20), max_tokens=12) for i in range(3)]
    rids.append(h.add(prompt(9, 2 * CHUNK + 3), max_tokens=12))
    decode = _decode_steps(h, rids)
    assert len(decode) >= 8, decode
    on_decode: collections.Counter = collections.Counter()
    for (k, s), v in calls.items():
        if s in decode:
            on_decode[k] += v
    assert dict(on_decode) == {"finished_sending": len(decode)}, on_decode  # the only call: delayed frees
    assert all(not any(v) for s, v in per_layer.items() if s in decode)  # vLLM makes no per-layer call
    assert len(h.loads) == 3 and all(not op.is_async for op in h.loads)
    loading = {s for s, v in per_layer.items() if any(v)}
    if layerwise:  # the loading step's forward waits per layer
        assert loading and all(v == [True] * LAYERS for s, v in per_layer.items() if s in loading)
        assert sum(v for (k, _), v in calls.items() if k == "load_layerwise") >= 1
    else:  # loaded before the forward: no per-layer work in any step
        assert not loading
        assert sum(v for (k, _), v in calls.items() if k == "load") == 3
    assert sum(v for (k, _), v in calls.items() if k == "store") >= 1  # the new chunks were stored
    assert {o: len(h.outputs[o]) for o in rids} == dict.fromkeys(rids, 12)
    h.check_clean()


def test_handle_preemptions_waits_only_after_a_preemption(make):
    """``handle_preemptions`` runs before every forward (vLLM 0.32/0.33); the worker finishes its
    in-flight stores only in a step whose metadata lists preempted requests."""
    h = make(num_blocks=10, max_batched=128)
    preempted_steps: set[int] = set()
    waits: list[int] = []
    orig_meta = h.conn.build_connector_meta

    def build(so):
        meta = orig_meta(so)
        assert set(meta.preempted) == set(so.preempted_req_ids)
        if meta.preempted:
            preempted_steps.add(h.steps)
        return meta

    h.conn.build_connector_meta = build
    inner = h.worker.connector_worker.handle_preemptions

    def handle():
        waits.append(h.steps)
        return inner()

    h.worker.connector_worker.handle_preemptions = handle
    rids = [h.add(prompt(20 + i, 60), max_tokens=50) for i in range(3)]
    h.run()
    assert preempted_steps, "the pool was not small enough to preempt"
    assert waits == sorted(preempted_steps)
    assert h.steps > 2 * len(waits)
    assert all(len(h.outputs[r]) == 50 for r in rids)
    h.check_clean()


def test_handle_preemptions_metadata_unknown_waits(make):
    """Metadata without a preemption list (None: a vLLM that does not report them) waits every time;
    an empty list does not; another connector's metadata waits."""
    from lmtier.integration.vllm.metadata import LMTierConnectorMetadata

    h = make(disk=False)
    n = [0]
    h.worker.connector_worker.handle_preemptions = lambda: n.__setitem__(0, n[0] + 1)
    h.worker.handle_preemptions(LMTierConnectorMetadata())
    assert n[0] == 0
    h.worker.handle_preemptions(LMTierConnectorMetadata(preempted=["r1"]))
    assert n[0] == 1
    h.worker.handle_preemptions(LMTierConnectorMetadata(preempted=None))
    assert n[0] == 2
    h.worker.handle_preemptions(object())
    assert n[0] == 3


def test_stats_sink_take_is_none_until_an_add():
    """``take`` returns None without an add since the last call, the interval after an add."""
    from lmtier.integration.vllm.stats import StatsSink

    s = StatsSink()
    assert s.take() is None
    s.add("stored_chunks", 2)
    got = s.take()
    assert got is not None and got.data["stored_chunks"] == 2
    assert s.take() is None
    s.set_policy({"tiers": {}})
    assert s.take().data["policy"] == {"tiers": {}}


def test_waiting_request_prompt_hashed_once(make, monkeypatch):
    """A request that waits for KV space is asked ``get_num_new_matched_tokens`` again every step;
    its prompt is hashed once (and its stores reuse those keys), not at every ask."""
    from lmtier.integration.vllm import scheduler as sched_mod

    hashed: collections.Counter = collections.Counter()
    real = sched_mod.chunk_keys

    def counting(token_ids, ns, **kw):
        hashed[len(token_ids) // CHUNK] += 1
        return real(token_ids, ns, **kw)

    monkeypatch.setattr(sched_mod, "chunk_keys", counting)
    h = make(num_blocks=14, max_batched=128, disk=False)
    rids = [h.add(prompt(30 + i, 70), max_tokens=40) for i in range(3)]
    h.run()
    asks = collections.Counter(r for r, _, _ in h.lookups)
    assert max(asks.values()) >= 5, asks  # some request waited and was asked again and again
    assert sum(hashed.values()) <= 2 * len(rids), (hashed, asks)  # lookup prefix + the stores' longer one
    assert all(len(h.outputs[r]) == 40 for r in rids)
    h.check_clean()
