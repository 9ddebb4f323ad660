"""A fork server ("zygote") for tests that start many short vLLM engines one after the other
(tests/test_config_matrix.py, tests/test_connector_tp.py, :func:`lmtier.testing.vllm.run_engine`): it
imports vLLM, torch and lmtier once and forks one child per engine, which saves the ~6-8 s import of
every engine start on a 2-core box. Each child is a fresh
process for its engine (its own LLM, connector, tier managers and CPU pool; a restart is a new
child); only the imported modules are shared. The zygote starts no thread and runs no torch op
before forking.

A test script uses it in two places: :class:`EngineLauncher` in the test (it starts
``python SCRIPT --zygote`` or ``python -m MODULE --zygote``), and :func:`serve` in that script's
``__main__`` for ``--zygote``.

Protocol: one JSON line per engine on the zygote's stdin ``{"spec", "out", "log", "env", "cwd",
"replace_env"}`` (``replace_env``: ``env`` is the child's whole environment, not additions);
the zygote answers ``{"pid"}`` at once, then ``{"rc"}`` (the child's exit code: 0, 1 on an
exception, ``-signal``) when the child exited. The child's stdout and stderr go to ``log``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lmtier.testing.vllm import engine_env

__all__ = ["EngineLauncher", "serve"]


class EngineLauncher:
    """Starts ``python script --zygote`` (its :func:`serve`) and runs engines as its children.

    Args:
        root: working directory; the zygote's stderr goes to ``root/zygote.log`` (vLLM's cache:
            :func:`lmtier.testing.vllm.vllm_cache_root`, shared by every engine).
        script: the test file (or its engine-child script: tests/config_matrix_child.py) whose
            ``__main__`` calls :func:`serve` for ``--zygote``; or
        module: a module run with ``python -m`` the same way (:func:`lmtier.testing.vllm.run_engine`).
        repo: put first on the children's ``PYTHONPATH`` (the tree under test).

    The environment: this one without ``LMTIER_*`` variables (``LMTIER_REQUIRE_*`` kept), vLLM's
    engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), a 1 GiB CPU KV cache, offline.
    """

    def __init__(self, root: Path, script: Path | None = None, *, module: str | None = None) -> None:
        env = engine_env(None)
        self.log = open(root / "zygote.log", "w")
        cmd = ["-m", module] if module is not None else [str(Path(script).resolve())]
        self.proc = subprocess.Popen(
            [sys.executable, *cmd, "--zygote"],
            env=env,
            cwd=str(root),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
        )

    def run(
        self, spec_path: Path, out_path: Path, log_path: Path, env: dict, timeout_s: float, *, replace_env: bool = False
    ) -> int:
        """Run one child (``child(spec_path, out_path)`` of :func:`serve`, in ``spec_path``'s directory,
        ``env`` added — or, with ``replace_env``, its whole environment —, output to ``log_path``);
        returns its exit code.

        Raises:
            AssertionError: it ran past ``timeout_s`` seconds (it is then SIGKILLed), or the zygote died.
        """
        req = {"spec": str(spec_path), "out": str(out_path), "log": str(log_path), "env": env}
        req["replace_env"] = replace_env
        req["cwd"] = str(spec_path.parent)
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        pid = None
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)  # the zygote then answers its rc
                    self.proc.stdout.readline()
                raise AssertionError(f"engine {spec_path.stem} timed out after {timeout_s} s; log {log_path}")
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the zygote died: {(Path(self.log.name)).read_text()[-3000:]}")
            msg = json.loads(line)
            if "pid" in msg:
                pid = msg["pid"]
            else:
                return msg["rc"]

    def close(self) -> None:
        """End the zygote (stdin closed: it exits after its last child) and close its log."""
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def serve(child: Callable[[str, str], None], preload: Callable[[], None]) -> None:
    """The zygote's loop: ``preload()`` (the imports every child needs), then for each request line on
    stdin fork a child that runs ``child(spec, out)`` and wait for it (see the module doc)."""
    preload()
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the engine child
            code = 1
            try:
                fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.close(fd)
                if req.get("replace_env"):
                    os.environ.clear()
                os.environ.update(req["env"])
                os.chdir(req["cwd"])
                child(req["spec"], req["out"])
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # stdin closed: no engine ran in this process, skip the interpreter's teardown of vLLM and torch
