"""lmtier.testing.procs: free ports handed out once."""

from __future__ import annotations

import os
import socket
import sys
import time
from multiprocessing import shared_memory

import pytest

from lmtier.testing import procs


class _FakeSocket:
    """A socket whose port-0 bind returns the next port of ``ports``."""

    ports: list[int] = []

    def __init__(self, *a, **kw) -> None:
        self.port = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def bind(self, addr) -> None:
        self.port = _FakeSocket.ports.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self.port)


def test_free_port_never_hands_out_a_port_twice(monkeypatch):
    """The kernel may return the same port to two port-0 binds in a row (a Mooncake master then
    got the same metrics and HTTP metadata port in CI): the second answer skips it."""
    monkeypatch.setattr(procs, "_HANDED_OUT", type(procs._HANDED_OUT)(maxlen=4096))
    monkeypatch.setattr(procs.socket, "socket", _FakeSocket)
    _FakeSocket.ports = [41000, 41000, 41000, 41001]
    assert procs.free_port() == 41000
    assert procs.free_port() == 41001
    _FakeSocket.ports = [41000] * 64
    with pytest.raises(OSError, match="handed out before"):
        procs.free_port()


def test_free_port_is_bindable():
    port = procs.free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
    assert port != procs.free_port()


_HOLD_SHM = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
m = shared_memory.SharedMemory(create=True, size=1 << 16)
resource_tracker.unregister(m._name, "shared_memory")  # as vLLM's: nobody cleans it at a crash
print(m.name, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
@pytest.mark.parametrize("how", ["kill_group", "stop"])
def test_a_stopped_or_killed_group_leaves_no_shared_memory(tmp_path, how):
    """A process killed before its own cleanup left its POSIX shared-memory segments in /dev/shm
    (RAM: each killed vLLM server left ~400 MB, six after a few suite runs). Stopping or killing its
    group now removes the segments it had mapped; one that a live process maps is kept."""
    log = tmp_path / "p.log"
    p = procs.Proc("holder", [sys.executable, "-c", _HOLD_SHM], dict(os.environ), log)
    deadline = time.monotonic() + 60
    while not log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    path = "/dev/shm/" + log.read_text().split()[0].lstrip("/")
    assert os.path.exists(path) and procs.shm_segments(procs.group_pids(p.pgid)) >= {path}
    mine = shared_memory.SharedMemory(create=True, size=4096)
    try:
        assert procs.release_segments({"/dev/shm/" + mine.name.lstrip("/")}) == []  # mapped here: kept
        getattr(p, how)(**({"grace_s": 0.5} if how == "stop" else {}))
        assert not os.path.exists(path)
    finally:
        mine.close()
        mine.unlink()
