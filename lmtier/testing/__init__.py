"""The one server harness of lmtier's tests, benchmarks, demo (``scripts/demo.py``) and soak
(``tests/soak/run_soak.py``). Modules (import the one you need; this package imports none of them):

* :mod:`lmtier.testing.redis` — a real ``redis-server`` (:class:`~lmtier.testing.redis.RedisServer`:
  kill, pause, restart on the same port, TLS, ``--maxmemory``), a Redis Cluster, the binary lookup
  (:func:`~lmtier.testing.redis.find_redis_server`) and the skip-or-fail rule of ``LMTIER_REQUIRE_REDIS``.
* :mod:`lmtier.testing.mooncake` — a real Mooncake Store (``mooncake_master`` and store servers: kill,
  pause, restart on the same ports) and the skip-or-fail rule of ``LMTIER_REQUIRE_MOONCAKE``.
* :mod:`lmtier.testing.fixtures` — its pytest fixtures (``redis_server``, ``redis_url``, ...).
* :mod:`lmtier.testing.vllm` — in-process vLLM engines in a child process for the connector tests,
  the test model folder and the skip-or-fail rule of ``LMTIER_REQUIRE_VLLM``.
* :mod:`lmtier.testing.zygote` — a fork server that imports vLLM once and forks one child per engine
  (tests/test_config_matrix.py's many short engines).
* :mod:`lmtier.testing.server` — around a vLLM OpenAI server: the connector's
  ``--kv-transfer-config``, Prometheus ``/metrics`` parsing, the workload texts.
* :mod:`lmtier.testing.demo_workload` — the demo's token-exact prompts (system prompt, multi-turn, RAG).
* :mod:`lmtier.testing.demo_report` — the demo's per-pass results, checks, table and metric deltas.
* :mod:`lmtier.testing.procs` — a child process in its own process group with a log file, a free port.
* :mod:`lmtier.testing.procmem` — a process's memory from ``/proc`` by region; server allocator settings.
* :mod:`lmtier.testing.vllm_gpu_shim` — what vLLM 0.33's Python-only package needs to run its engine on
  a CUDA machine without its compiled parts (a platform plugin and a few ops; GPU benchmarks only).
"""
