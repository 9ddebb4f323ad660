"""lmtier.testing.procs: free ports handed out once."""

from __future__ import annotations

import socket

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
