"""Observability of :class:`lmtier.integration.vllm.LMTierConnector`: interval stats, Prometheus
series and per-process totals.

* :class:`LMTierStats` — vLLM's ``KVConnectorStats`` for one stats interval (the "KV Transfer
  metrics" log line when stats logging is on); both roles fill one through :class:`StatsSink`.
* :class:`LMTierPromMetrics` — the ``vllm:lmtier_*`` series on the server's ``/metrics``.
* :func:`process_totals` — cumulative counters of every connector in this process (test hook).

vLLM sources: ``vllm/distributed/kv_transfer/kv_connector/v1/metrics.py`` (0.32/0.33).
"""

from __future__ import annotations

import threading
from typing import Any

from lmtier.tiers.base import TIER_EVENTS

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
except ImportError:  # pragma: no cover
    KVConnectorStats = object  # type: ignore
    KVConnectorPromMetrics = object  # type: ignore

__all__ = [
    "HIT_TIERS",
    "LMTierStats",
    "LMTierPromMetrics",
    "StatsSink",
    "process_decision_totals",
    "process_load_policy",
    "TierEventReporter",
    "process_tenant_totals",
    "process_tier_event_totals",
    "process_totals",
]

_LAT_KEEP = 256  # latency samples kept per interval (per list)
HIT_TIERS = ("cpu", "disk", "p2p", "remote")
"""Where a claimed chunk is at lookup time (``hit_tokens_<tier>``; ``vllm:lmtier_hit_tokens_total{tier}``)."""
TENANT_FIELDS = (
    "lookup_tokens",
    "hit_tokens",
    "commits",
    "evicted_by_self",
    "evicted_by_others",
    "evicted_others",
    "denied",
    *(f"remote_{k}" for k in ("commits", "evicted_by_self", "evicted_by_others", "evicted_others", "denied")),
)
"""Per-tenant counters (``data["tenants"][tenant_id]``, tenant budgets on): lookup / hit tokens (the
scheduler), and the CPU pool's ``commits``, ``evicted_by_self`` / ``evicted_by_others`` (the
tenant's chunks evicted for its own / another tenant's stores), ``evicted_others`` (other tenants'
chunks evicted for its stores), ``denied`` (its reservations refused: nothing it may evict);
:meth:`lmtier.tiers.tenants.TenantLedger.stats`. The same with ``remote_`` for the remote tier's
budgets (this node's puts: :meth:`lmtier.tiers.redis.budget.RedisBudget.tenant_stats`). Plus the
gauges ``held_bytes`` / ``remote_held_bytes`` (the highest value reported in the interval, over TP
ranks)."""
_GAUGES = ("held_bytes", "remote_held_bytes")
TENANT_LABELS_MAX = 64
"""Distinct ``tenant`` label values per process in the Prometheus series; later tenants are ``other``."""
DECISIONS = ("loaded", "skipped")
"""The load policy's decisions per cached chunk (``data["decisions"][tier][decision]``, chunks):
claimed and loaded, or left for vLLM to recompute (:mod:`lmtier.integration.vllm.loadpolicy`)."""


class LMTierStats(KVConnectorStats):
    """Counters of one stats interval (summed over workers and the scheduler).

    Tokens: ``lookup_tokens`` (prompt tokens lmtier was asked about beyond vLLM's own prefix cache,
    per admitted request), ``hit_tokens_{cpu,disk,p2p,remote}`` (tokens claimed, by the tier holding the
    chunk at lookup time). Chunks / bytes: ``loaded_*``, ``stored_*``; ``store_skipped`` (already
    present or no free slot), ``load_failures`` (requests whose load failed, in part or whole),
    ``async_loads`` and ``layerwise_loads``
    (requests loaded in the background / layer by layer). Time:
    ``load_ms`` / ``store_ms`` (worker time spent, ms), and ``load_lat_s`` / ``store_lat_s`` (lists of
    per-request latencies in seconds; at most 256 kept per interval). With tenant budgets:
    ``tenants`` (tenant id -> :data:`TENANT_FIELDS` and ``held_bytes``). ``tier_events`` (tier name
    -> event -> count: the :data:`lmtier.tiers.base.TIER_EVENTS` of the disk, P2P and remote tiers).
    Load policy: ``decisions`` (tier -> :data:`DECISIONS` -> chunks, per admitted request) and
    ``policy`` (the latest :meth:`lmtier.integration.vllm.loadpolicy.LoadPolicy.snapshot`, a gauge:
    the newest one wins when intervals or roles are aggregated; ``{}`` when unchanged).
    """

    FIELDS = (
        "hit_tokens_cpu",
        "hit_tokens_disk",
        "hit_tokens_p2p",
        "hit_tokens_remote",
        "lookup_tokens",
        "loaded_chunks",
        "load_failures",
        "loaded_bytes",
        "load_ms",
        "async_loads",
        "stored_chunks",
        "store_skipped",
        "stored_bytes",
        "store_ms",
        "layerwise_loads",
        "device_decoded_chunks",
    )
    LISTS = ("load_lat_s", "store_lat_s")

    def __init__(self, data: dict | None = None):
        super().__init__(data=dict(data or {}))
        for k in self.FIELDS:
            self.data.setdefault(k, 0)
        for k in self.LISTS:
            self.data[k] = list(self.data.get(k) or [])
        self.data["tenants"] = {t: dict(row) for t, row in (self.data.get("tenants") or {}).items()}
        self.data["tier_events"] = {t: dict(row) for t, row in (self.data.get("tier_events") or {}).items()}
        self.data["decisions"] = {t: dict(row) for t, row in (self.data.get("decisions") or {}).items()}
        self.data["policy"] = dict(self.data.get("policy") or {})

    def reset(self):
        for k in self.FIELDS:
            self.data[k] = 0
        for k in self.LISTS:
            self.data[k] = []
        self.data["tenants"] = {}
        self.data["tier_events"] = {}
        self.data["decisions"] = {}
        self.data["policy"] = {}

    def aggregate(self, other):
        for k in self.FIELDS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        for k in self.LISTS:
            self.data[k] = (self.data.get(k, []) + list(other.data.get(k) or []))[-_LAT_KEEP:]
        for t, row in (other.data.get("tenants") or {}).items():
            for k, v in row.items():
                self.add_tenant(t, k, v)
        for t, row in (other.data.get("tier_events") or {}).items():
            for k, v in row.items():
                self.add_tier_event(t, k, v)
        for t, row in (other.data.get("decisions") or {}).items():
            for k, v in row.items():
                self.add_decision(t, k, v)
        if other.data.get("policy"):
            self.data["policy"] = dict(other.data["policy"])
        return self

    def reduce(self):
        out = {
            f"lmtier_{k}": (round(self.data[k], 2) if isinstance(self.data[k], float) else self.data[k])
            for k in self.FIELDS
        }
        hit = sum(self.data[f"hit_tokens_{t}"] for t in HIT_TIERS)
        out["lmtier_miss_tokens"] = max(self.data["lookup_tokens"] - hit, 0)
        for k in self.LISTS:
            v = self.data[k]
            out[f"lmtier_{k[:-2]}_mean_ms"] = round(1e3 * sum(v) / len(v), 2) if v else 0.0
        tenants = sorted(self.data["tenants"].items(), key=lambda kv: -kv[1].get("lookup_tokens", 0))
        for t, row in tenants[:8]:  # the log line: the 8 tenants that asked most
            if row.get("lookup_tokens"):
                out[f"lmtier_tenant_{t}_hit_rate"] = round(row.get("hit_tokens", 0) / row["lookup_tokens"], 3)
        for t, row in sorted(self.data["tier_events"].items()):
            for k, v in sorted(row.items()):
                out[f"lmtier_{t}_{k}"] = v
        for t, row in sorted(self.data["decisions"].items()):
            if row.get("skipped"):
                out[f"lmtier_{t}_chunks_recomputed"] = row["skipped"]
        pol = self.data["policy"]
        if pol.get("breakeven_gbps") is not None:
            out["lmtier_breakeven_gbps"] = round(pol["breakeven_gbps"], 4)
            out["lmtier_prefill_tok_s"] = round(pol["prefill_tokens_per_s"], 1)
        for t, row in sorted((pol.get("tiers") or {}).items()):
            if row.get("gbps") is not None:
                out[f"lmtier_{t}_load_gbps"] = round(row["gbps"], 4)
        return out

    def is_empty(self):
        return (
            not any(self.data.get(k) for k in self.FIELDS)
            and not any(self.data.get(k) for k in self.LISTS)
            and not self.data["tenants"]
            and not self.data["tier_events"]
            and not self.data["decisions"]
            and not self.data["policy"]
        )

    def add_tenant(self, tenant: str, key: str, value: float) -> None:
        """Add ``value`` to tenant ``tenant``'s counter ``key`` (:data:`TENANT_FIELDS`), or raise its
        ``held_bytes`` gauge to ``value``."""
        row = self.data["tenants"].setdefault(tenant, {})
        row[key] = max(row.get(key, 0), value) if key in _GAUGES else row.get(key, 0) + value

    def add_tier_event(self, tier: str, event: str, value: float) -> None:
        """Add ``value`` to tier ``tier``'s count of ``event`` (:data:`lmtier.tiers.base.TIER_EVENTS`)."""
        row = self.data["tier_events"].setdefault(tier, {})
        row[event] = row.get(event, 0) + value

    def add_decision(self, tier: str, decision: str, chunks: float = 1) -> None:
        """Add ``chunks`` to tier ``tier``'s count of ``decision`` (:data:`DECISIONS`)."""
        row = self.data["decisions"].setdefault(tier, {})
        row[decision] = row.get(decision, 0) + chunks

    def add(self, key: str, value: float = 1) -> None:
        if key in self.LISTS:
            if len(self.data[key]) < _LAT_KEEP:
                self.data[key].append(value)
            return
        self.data[key] = self.data.get(key, 0) + value


_TOTALS_LOCK = threading.Lock()
_TOTALS = LMTierStats()


def process_totals() -> dict[str, Any]:
    """Cumulative stats of every lmtier connector in this process since it started (test hook).

    Returns a copy of :class:`LMTierStats` ``data`` (counters and latency lists), summed over both
    roles. Unlike vLLM's interval stats this is never reset.
    """
    with _TOTALS_LOCK:
        return {
            k: (list(v) if isinstance(v, list) else v)
            for k, v in _TOTALS.data.items()
            if k not in ("tenants", "tier_events", "decisions", "policy")
        }


def process_decision_totals() -> dict[str, dict[str, float]]:
    """Cumulative load-policy decisions of every lmtier connector in this process (tier ->
    :data:`DECISIONS` -> chunks; test hook)."""
    with _TOTALS_LOCK:
        return {t: dict(row) for t, row in _TOTALS.data["decisions"].items()}


def process_load_policy() -> dict[str, Any]:
    """The latest load-policy snapshot any lmtier connector in this process exported
    (:meth:`lmtier.integration.vllm.loadpolicy.LoadPolicy.snapshot`; ``{}`` before one; test hook)."""
    with _TOTALS_LOCK:
        return dict(_TOTALS.data["policy"])


def process_tier_event_totals() -> dict[str, dict[str, float]]:
    """Cumulative tier event counts of every lmtier connector in this process (tier -> event ->
    count, :data:`lmtier.tiers.base.TIER_EVENTS`; test hook)."""
    with _TOTALS_LOCK:
        return {t: dict(row) for t, row in _TOTALS.data["tier_events"].items()}


def process_tenant_totals() -> dict[str, dict[str, float]]:
    """Cumulative per-tenant stats of every lmtier connector in this process (tenant budgets on;
    :data:`TENANT_FIELDS` and the highest ``held_bytes`` reported, by tenant id; test hook)."""
    with _TOTALS_LOCK:
        return {t: dict(row) for t, row in _TOTALS.data["tenants"].items()}


class LMTierPromMetrics(KVConnectorPromMetrics):
    """Prometheus series fed from :class:`LMTierStats` (``vllm:lmtier_*``).

    Counters: ``vllm:lmtier_hit_tokens_total{tier}``, ``vllm:lmtier_lookup_tokens_total``,
    ``vllm:lmtier_{loaded,stored}_{chunks,bytes}_total``, ``vllm:lmtier_load_failures_total``,
    ``vllm:lmtier_async_loads_total``, ``vllm:lmtier_store_skipped_total``. Histograms (seconds):
    ``vllm:lmtier_load_seconds`` (per request load), ``vllm:lmtier_store_seconds`` (per store op).
    Per tenant (tenant budgets on; label ``tenant``: the tenant id, at most
    :data:`TENANT_LABELS_MAX` values, then ``other``): ``vllm:lmtier_tenant_{lookup_tokens,
    hit_tokens,commits,evicted_others,denied}_total``, ``vllm:lmtier_tenant_evicted_total{by}``
    (``by``: ``self`` or ``other``) and the gauge ``vllm:lmtier_tenant_held_bytes``; with remote
    budgets the same as ``vllm:lmtier_tenant_remote_{commits,evicted_others,denied}_total``,
    ``vllm:lmtier_tenant_remote_evicted_total{by}``, ``vllm:lmtier_tenant_remote_held_bytes``. Tier events:
    ``vllm:lmtier_tier_events_total{tier,event}`` (:data:`lmtier.tiers.base.TIER_EVENTS`). Load
    policy: ``vllm:lmtier_load_decisions_total{tier,decision}`` (cached chunks, :data:`DECISIONS`),
    gauges ``vllm:lmtier_tier_load_gbps{tier,path}`` (effective load bandwidth in use, GB/s),
    ``vllm:lmtier_tier_loads{tier}`` (1: its chunks are loaded, 0: recomputed),
    ``vllm:lmtier_breakeven_gbps`` and ``vllm:lmtier_prefill_tokens_per_second``.
    """

    _COUNTERS = {
        "lookup_tokens": "prompt tokens looked up in lmtier beyond vLLM's prefix cache",
        "loaded_chunks": "chunks loaded from lmtier",
        "loaded_bytes": "bytes loaded from lmtier",
        "stored_chunks": "chunks stored into lmtier",
        "stored_bytes": "bytes stored into lmtier",
        "load_failures": "chunk loads that failed (recomputed or failed per policy)",
        "async_loads": "requests loaded asynchronously (disk / remote hits)",
        "store_skipped": "chunk stores skipped (present already or no free CPU slot)",
    }

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._c: dict[str, dict] = {}
        for name, doc in self._COUNTERS.items():
            m = self._counter_cls(name=f"vllm:lmtier_{name}", documentation=f"lmtier: {doc}.", labelnames=labelnames)
            self._c[name] = {i: m.labels(*lv) for i, lv in per_engine_labelvalues.items()}
        hit = self._counter_cls(
            name="vllm:lmtier_hit_tokens",
            documentation="lmtier: prompt tokens loaded, by tier.",
            labelnames=list(labelnames) + ["tier"],
        )
        self._hit = {(i, t): hit.labels(*lv, t) for i, lv in per_engine_labelvalues.items() for t in HIT_TIERS}
        buckets = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]
        self._h: dict[str, dict] = {}
        for key, name in (("load_lat_s", "load_seconds"), ("store_lat_s", "store_seconds")):
            h = self._histogram_cls(
                name=f"vllm:lmtier_{name}",
                documentation=f"lmtier: {name.replace('_', ' ')} per request/op.",
                buckets=buckets,
                labelnames=labelnames,
            )
            self._h[key] = {i: h.labels(*lv) for i, lv in per_engine_labelvalues.items()}
        self._lv = per_engine_labelvalues
        tl = list(labelnames) + ["tenant"]
        self._tc = {
            k: self._counter_cls(
                name=f"vllm:lmtier_tenant_{k}", documentation=f"lmtier: {k} per tenant.", labelnames=tl
            )
            for k in ("lookup_tokens", "hit_tokens", "commits", "evicted_others", "denied")
            + ("remote_commits", "remote_evicted_others", "remote_denied")
        }
        self._tev, self._theld = {}, {}
        for p, where in (("", "CPU-pool"), ("remote_", "remote-tier")):
            self._tev[p] = self._counter_cls(
                name=f"vllm:lmtier_tenant_{p}evicted",
                documentation=f"lmtier: a tenant's {where} chunks evicted, by whose store (self / other).",
                labelnames=tl + ["by"],
            )
            self._theld[p] = self._gauge_cls(
                name=f"vllm:lmtier_tenant_{p}held_bytes",
                documentation=f"lmtier: {where} bytes held per tenant.",
                labelnames=tl,
                multiprocess_mode="mostrecent",
            )
        self._tenant_labels: set[str] = set()
        self._tier_events = self._counter_cls(
            name="vllm:lmtier_tier_events",
            documentation="lmtier: tier events (records failing checksum/MAC/decoding, remote timeouts, "
            "calls refused by an open circuit breaker), by tier and event.",
            labelnames=list(labelnames) + ["tier", "event"],
        )
        self._decisions = self._counter_cls(
            name="vllm:lmtier_load_decisions",
            documentation="lmtier: cached chunks the load policy loaded or left to recompute, by tier and decision.",
            labelnames=list(labelnames) + ["tier", "decision"],
        )
        g = dict(multiprocess_mode="mostrecent")
        self._tier_gbps = self._gauge_cls(
            name="vllm:lmtier_tier_load_gbps",
            documentation="lmtier: a tier's effective load bandwidth (GB/s) the load policy uses, by tier and path.",
            labelnames=list(labelnames) + ["tier", "path"],
            **g,
        )
        self._tier_loads = self._gauge_cls(
            name="vllm:lmtier_tier_loads",
            documentation="lmtier: 1 while a tier's chunks are loaded, 0 while they are recomputed (slower).",
            labelnames=list(labelnames) + ["tier"],
            **g,
        )
        self._breakeven = self._gauge_cls(
            name="vllm:lmtier_breakeven_gbps",
            documentation="lmtier: break-even load bandwidth (GB/s): KV bytes per token x prefill tokens/s.",
            labelnames=labelnames,
            **g,
        )
        self._prefill = self._gauge_cls(
            name="vllm:lmtier_prefill_tokens_per_second",
            documentation="lmtier: the engine's prefill rate the load policy uses (tokens/s).",
            labelnames=labelnames,
            **g,
        )

    def _tenant_label(self, tenant: str) -> str:
        if tenant in self._tenant_labels or len(self._tenant_labels) < TENANT_LABELS_MAX:
            self._tenant_labels.add(tenant)
            return tenant
        return "other"

    def _observe_tenants(self, tenants: dict[str, dict[str, float]], engine_idx: int) -> None:
        lv = self._lv[engine_idx]
        for tenant, row in tenants.items():
            t = self._tenant_label(tenant)
            for k, c in self._tc.items():
                if row.get(k):
                    c.labels(*lv, t).inc(row[k])
            for p in ("", "remote_"):
                for field, by in (("evicted_by_self", "self"), ("evicted_by_others", "other")):
                    if row.get(p + field):
                        self._tev[p].labels(*lv, t, by).inc(row[p + field])
                if p + "held_bytes" in row and t != "other":
                    self._theld[p].labels(*lv, t).set(row[p + "held_bytes"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        d = transfer_stats_data or {}
        for name, per_engine in self._c.items():
            v = d.get(name, 0)
            if v:
                per_engine[engine_idx].inc(v)
        for t in HIT_TIERS:
            v = d.get(f"hit_tokens_{t}", 0)
            if v:
                self._hit[(engine_idx, t)].inc(v)
        for key, per_engine in self._h.items():
            for x in d.get(key) or ():
                per_engine[engine_idx].observe(x)
        if d.get("tenants"):
            self._observe_tenants(d["tenants"], engine_idx)
        for tier, row in (d.get("tier_events") or {}).items():
            for event, v in row.items():
                if v and event in TIER_EVENTS:
                    self._tier_events.labels(*self._lv[engine_idx], tier, event).inc(v)
        if d.get("decisions") or d.get("policy"):
            self._observe_policy(d.get("decisions") or {}, d.get("policy") or {}, engine_idx)

    def _observe_policy(self, decisions: dict, policy: dict, engine_idx: int) -> None:
        lv = self._lv[engine_idx]
        for tier, row in decisions.items():
            if tier not in HIT_TIERS:
                continue
            for decision, v in row.items():
                if v and decision in DECISIONS:
                    self._decisions.labels(*lv, tier, decision).inc(v)
        if policy.get("breakeven_gbps") is not None:
            self._breakeven.labels(*lv).set(policy["breakeven_gbps"])
            self._prefill.labels(*lv).set(policy["prefill_tokens_per_s"])
        for tier, row in (policy.get("tiers") or {}).items():
            if tier not in HIT_TIERS:
                continue
            self._tier_loads.labels(*lv, tier).set(row.get("loads", 1))
            if row.get("gbps") is not None:
                self._tier_gbps.labels(*lv, tier, row.get("path") or "unknown").set(row["gbps"])


class TierEventReporter:
    """Adds the :data:`~lmtier.tiers.base.TIER_EVENTS` of a tier manager's disk, P2P and remote tiers
    (``Tier.event_counts``) to a :class:`StatsSink` as deltas since the last :meth:`report` — the
    worker's manager, and the scheduler's own when it runs in another process (its lookups-only P2P
    tier is where entries of peers off the allow-list are refused). Counts before construction are
    not reported (a manager may outlive an engine)."""

    TIERS = ("disk", "p2p", "remote")
    """The manager attributes reported (the tier label of ``vllm:lmtier_tier_events_total``)."""

    def __init__(self, manager: Any, sink: StatsSink) -> None:
        self.manager, self.sink = manager, sink
        self._tiers = [(n, t) for n in self.TIERS if (t := getattr(manager, n, None)) is not None]
        self._seen = self.counts()

    def counts(self) -> dict[str, dict[str, int]]:
        """Cumulative counts now: tier name -> event -> count (tiers the manager has)."""
        out = {}
        for name, tier in self._tiers:
            counts = tier.event_counts()
            if name in ("disk", "remote"):
                counts.update(self.manager.write_events(name))
            out[name] = {e: counts.get(e, 0) for e in TIER_EVENTS}
        return out

    def report(self) -> None:
        """Add every count that grew since the last call to the sink (nothing to do, and no host work
        per step, for a manager without those tiers)."""
        if not self._tiers:
            return
        now = self.counts()
        for tier, row in now.items():
            last = self._seen.get(tier, {})
            for event, v in row.items():
                if v > last.get(event, 0):
                    self.sink.add_tier_event(tier, event, v - last.get(event, 0))
        self._seen = now


def _add_total(key: str, value: float, tenant: str | None = None, tier: str | None = None) -> None:
    with _TOTALS_LOCK:
        if tier is not None:
            _TOTALS.add_tier_event(tier, key, value)
            return
        if tenant is not None:
            _TOTALS.add_tenant(tenant, key, value)
            return
        if key in LMTierStats.LISTS:
            _TOTALS.add(key, value)
        else:
            _TOTALS.data[key] = _TOTALS.data.get(key, 0) + value


class StatsSink:
    """One connector's stats: the current interval's :class:`LMTierStats` plus the process totals.

    Thread-safe: the worker's background threads report through :meth:`add` too.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = LMTierStats()
        self._dirty = False  # something was added since the last take (set under the lock)

    def add(self, key: str, value: float = 1) -> None:
        """Add ``value`` to counter ``key`` (or append it to latency list ``key``) of this interval
        and of :func:`process_totals`. ``key``: a name of :attr:`LMTierStats.FIELDS` or ``LISTS``."""
        with self._lock:
            self._stats.add(key, value)
            self._dirty = True
        _add_total(key, value)

    def add_tenant(self, tenant: str, key: str, value: float = 1) -> None:
        """Add ``value`` to tenant ``tenant``'s counter ``key`` (:data:`TENANT_FIELDS`; ``held_bytes``:
        a gauge) in this interval and in :func:`process_totals` (``["tenants"]``)."""
        with self._lock:
            self._stats.add_tenant(tenant, key, value)
            self._dirty = True
        _add_total(key, value, tenant)

    def add_tier_event(self, tier: str, event: str, value: float = 1) -> None:
        """Add ``value`` to tier ``tier``'s count of ``event`` in this interval and in
        :func:`process_tier_event_totals`."""
        with self._lock:
            self._stats.add_tier_event(tier, event, value)
            self._dirty = True
        _add_total(event, value, tier=tier)

    def add_decision(self, tier: str, decision: str, chunks: float = 1) -> None:
        """Count ``chunks`` cached chunks of ``tier`` the load policy ``decision`` (:data:`DECISIONS`),
        in this interval and in :func:`process_decision_totals`."""
        with self._lock:
            self._stats.add_decision(tier, decision, chunks)
            self._dirty = True
        with _TOTALS_LOCK:
            _TOTALS.add_decision(tier, decision, chunks)

    def set_policy(self, snapshot: dict[str, Any]) -> None:
        """The load policy's current state (:meth:`~lmtier.integration.vllm.loadpolicy.LoadPolicy.snapshot`):
        this interval's gauge and :func:`process_load_policy`."""
        with self._lock:
            self._stats.data["policy"] = dict(snapshot)
            self._dirty = True
        with _TOTALS_LOCK:
            _TOTALS.data["policy"] = dict(snapshot)

    def take(self) -> LMTierStats | None:
        """This interval's stats (None when nothing happened); starts a new interval. Without an add
        since the last call it returns at once (vLLM asks every step)."""
        if not self._dirty:  # a racing add sets it after its update: seen by the next call
            return None
        with self._lock:
            self._dirty = False
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, LMTierStats()
        return out
