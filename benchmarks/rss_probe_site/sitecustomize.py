"""RSS probe, imported by every Python process that has this folder on PYTHONPATH (diagnosis only).

With ``RSS_PROBE_DIR`` set, a daemon thread writes one JSON line every ``RSS_PROBE_PERIOD`` s
(default 5) to ``$RSS_PROBE_DIR/<pid>.jsonl``: glibc ``mallinfo2`` (arena = bytes the heaps took
from the system, fordblks = free bytes kept inside them, hblkhd = bytes in mmapped chunks),
VmRSS/RssAnon/RssFile, threads; when tcmalloc is preloaded, its ``MallocExtension`` counters
(current_allocated_bytes = live bytes, heap_size, page-heap free/unmapped, cache free bytes);
with ``RSS_PROBE_GC=1`` also the 25 most common Python object types every 6th sample; with
``RSS_PROBE_TRACEMALLOC=N`` a tracemalloc top-N diff against the first snapshot every 6th sample, in
the process whose comm starts with ``RSS_PROBE_TM_COMM`` (default VLLM::Worker) only (costly). Does
nothing without RSS_PROBE_DIR.
"""

import os

if os.environ.get("RSS_PROBE_DIR"):
    import ctypes
    import json
    import threading
    import time

    class _MI2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    def _mallinfo():
        try:
            libc = ctypes.CDLL("libc.so.6")
            f = libc.mallinfo2
            f.restype = _MI2
            m = f()
            return {n: getattr(m, n) for n, _ in _MI2._fields_}
        except Exception as e:  # noqa: BLE001
            return {"err": repr(e)}

    _TC_PROPS = (
        "generic.current_allocated_bytes",
        "generic.heap_size",
        "tcmalloc.pageheap_free_bytes",
        "tcmalloc.pageheap_unmapped_bytes",
        "tcmalloc.central_cache_free_bytes",
        "tcmalloc.thread_cache_free_bytes",
    )

    def _tcmalloc():
        """tcmalloc's own counters when it is preloaded (mallinfo2 then reads glibc's unused heap)."""
        try:
            f = ctypes.CDLL(None).MallocExtension_GetNumericProperty
        except (OSError, AttributeError):
            return None
        f.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]
        f.restype = ctypes.c_int
        out = {}
        for name in _TC_PROPS:
            v = ctypes.c_size_t(0)
            if f(name.encode(), ctypes.byref(v)):
                out[name] = v.value
        return out

    def _status():
        out = {}
        with open("/proc/self/status") as fh:
            for line in fh:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads", "VmSize"):
                    out[k] = int(v.split()[0])
        return out

    def _loop():
        d = os.environ["RSS_PROBE_DIR"]
        period = float(os.environ.get("RSS_PROBE_PERIOD", "5"))
        use_gc = os.environ.get("RSS_PROBE_GC") == "1"
        tm_n = int(os.environ.get("RSS_PROBE_TRACEMALLOC", "0") or 0)
        tm_comm = os.environ.get("RSS_PROBE_TM_COMM", "VLLM::Worker")  # only this process (by comm)
        first = None
        i = 0
        while True:
            rec = {"t": time.time(), "pid": os.getpid(), "argv0": " ".join(__import__("sys").argv[:3])[:200]}
            try:
                with open("/proc/self/comm") as fh:
                    rec["comm"] = fh.read().strip()
            except OSError:
                pass
            rec.update(_status())
            rec["mi"] = _mallinfo()
            tc = _tcmalloc()
            if tc is not None:
                rec["tcmalloc"] = tc
            if use_gc and i % 6 == 0:
                import collections
                import gc

                c = collections.Counter(type(o).__name__ for o in gc.get_objects())
                rec["gc_top"] = c.most_common(25)
                rec["gc_n"] = sum(c.values())
            if tm_n and rec.get("comm", "").startswith(tm_comm[:15]):
                import tracemalloc

                if not tracemalloc.is_tracing():
                    tracemalloc.start(int(os.environ.get("RSS_PROBE_TM_FRAMES", "1")))
            if tm_n and i % 6 == 0 and __import__("tracemalloc").is_tracing():
                import tracemalloc

                snap = tracemalloc.take_snapshot()
                if first is None:
                    first = snap
                else:
                    rec["tm_diff"] = [str(s) for s in snap.compare_to(first, "lineno")[:tm_n]]
                rec["tm_traced"] = tracemalloc.get_traced_memory()
            try:
                with open(os.path.join(d, f"{os.getpid()}.jsonl"), "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
            except OSError:
                pass
            i += 1
            time.sleep(period)

    def _start():
        threading.Thread(target=_loop, name="rss-probe", daemon=True).start()

    _start()
    os.register_at_fork(after_in_child=_start)
