"""Wall and thread-CPU time of a vLLM KV connector's hooks, summed per hook (benchmark instrumentation).

Used by ``bench_step_overhead.py`` (wrappers on one connector instance per role) and
``bench_vllm_gpu.py`` (wrappers on the connector classes, installed before vLLM builds the engine,
so lmtier's ``LMTierConnector`` and vLLM's ``OffloadingConnector`` are timed alike). Hook names are
those of vLLM's ``KVConnectorBase_V1`` (vllm/distributed/kv_transfer/kv_connector/v1/base.py).
"""

from __future__ import annotations

import time

SCHED_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "get_kv_connector_stats",
)
WORKER_HOOKS = (
    "bind_connector_metadata",
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "has_connector_metadata",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "get_kv_connector_stats",
    "clear_connector_metadata",
)


class HookTimers:
    """Per-hook nanoseconds (wall, thread CPU) and calls since the last :meth:`take`."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.cpu: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.installed: list[tuple[object, str, object]] = []  # (owner, name, original or None)
        self.overhead_ns = 0
        self.overhead_cpu_ns = 0

    def _timed(self, fn, label_of):
        """``fn`` wrapped: its time added under ``label_of(args)``."""
        ns, cpu, calls, clock, tclock = self.ns, self.cpu, self.calls, time.perf_counter_ns, time.thread_time_ns

        def timed(*a, **k):
            c0 = tclock()
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                t1 = clock()
                c1 = tclock()
                label = label_of(a)
                ns[label] = ns.get(label, 0) + t1 - t0
                cpu[label] = cpu.get(label, 0) + c1 - c0
                calls[label] = calls.get(label, 0) + 1

        return timed

    def wrap_instance(self, obj: object, method: str, label: str) -> None:
        """Time ``obj.method`` (an instance attribute over the bound method; :meth:`remove` drops it)."""
        setattr(obj, method, self._timed(getattr(obj, method), lambda a: label))
        self.installed.append((obj, method, None))

    def install(self, sched, worker) -> None:
        """Time every hook of the scheduler-side (``S.``) and worker-side (``W.``) connector instances."""
        for h in SCHED_HOOKS:
            if hasattr(sched, h):
                self.wrap_instance(sched, h, f"S.{h}")
        for h in WORKER_HOOKS:
            if hasattr(worker, h):
                self.wrap_instance(worker, h, f"W.{h}")

    def wrap_class(self, cls: type, role_of) -> None:
        """Time every hook of connector class ``cls`` (``role_of(self)`` -> ``"S"`` / ``"W"`` prefixes the
        label); installed on the class, so instances built later are timed too."""
        for h in dict.fromkeys(SCHED_HOOKS + WORKER_HOOKS):
            fn = getattr(cls, h, None)
            if fn is None:
                continue
            setattr(cls, h, self._timed(fn, lambda a, h=h: f"{role_of(a[0]) if a else '?'}.{h}"))
            self.installed.append((cls, h, fn))

    def remove(self) -> None:
        """Undo every wrapper."""
        for owner, method, orig in reversed(self.installed):
            if orig is None:
                delattr(owner, method)
            else:
                setattr(owner, method, orig)
        self.installed = []

    def calibrate(self) -> None:
        """The wrapper's own cost per call (an empty method through the same wrapper)."""

        class Empty:
            def f(self):
                return None

        e = Empty()
        self.wrap_instance(e, "f", "_cal")
        n = 20000
        for _ in range(n):
            e.f()
        self.overhead_ns = min(self.ns["_cal"] // n, 10**6)
        self.overhead_cpu_ns = min(self.cpu["_cal"] // n, 10**6)
        self.installed.pop()
        self.ns.clear()
        self.cpu.clear()
        self.calls.clear()

    def take(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(wall ns, thread CPU ns, calls) per hook since the last call, the wrapper's cost removed."""
        ns = {k: max(0, v - self.overhead_ns * self.calls[k]) for k, v in self.ns.items()}
        cpu = {k: max(0, v - self.overhead_cpu_ns * self.calls[k]) for k, v in self.cpu.items()}
        calls = dict(self.calls)
        self.ns.clear()
        self.cpu.clear()
        self.calls.clear()
        return ns, cpu, calls
