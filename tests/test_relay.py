"""bench/relay.py, the TCP relay the S3 bench (latency, bandwidth, counting) and the server-engine tests (a
server's death: cut, then start again) put in front of a local server: checked on loopback against an echo
server, in a second."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from bench.relay import Relay


@pytest.fixture
def echo():
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=echo_until_eof, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def echo_until_eof(conn: socket.socket) -> None:
    with conn:
        try:
            while data := conn.recv(4096):
                conn.sendall(data)
        except OSError:
            pass


def wait_until(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_the_relay_counts_closes_finished_connections_and_comes_back_on_its_port_after_a_cut(echo):
    relay = Relay(echo).start()
    with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as conn:
        conn.sendall(b"GET /x HTTP/1.1\r\n\r\n")
        assert conn.recv(4096) == b"GET /x HTTP/1.1\r\n\r\n"
        assert len(relay.open) == 2 and relay.requests == 1 and relay.sent == 19
    assert wait_until(lambda: relay.open == [])  # both pumps ended: the pair closed, not kept
    port = relay.port
    live = socket.create_connection(("127.0.0.1", port), timeout=5)
    assert wait_until(lambda: len(relay.open) == 2)
    relay.cut()  # the server's death as a client sees it: the open connection reset, the port refusing
    with pytest.raises((ConnectionResetError, BrokenPipeError)):
        live.sendall(b"x" * 65536)
        assert live.recv(1) != b""  # an orderly end (FIN) reads as b"": not the reset a dead server gives
    live.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    relay.start()  # back, on the same port
    assert relay.port == port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"again")
        assert conn.recv(4096) == b"again"
    relay.cut()
