"""A TCP relay on 127.0.0.1 in front of a local server, for what loopback does not have: a store's first-byte
time and bandwidth (bench/s3_reads.py: each request held `latency` s, the bytes the server sends counted and
sent at most `bytes_per_s` a connection), and a server's death as a client sees it (tests/test_server_engine.py:
cut() resets every open connection, in-flight requests and all, and the port refuses connections until start()
again, where killing `vllm serve` itself cost a ~70 s restart on the 2-core CI host).

A socket closed while another thread is blocked on it stays open until that call returns (close(2)), so cut()
shuts each socket down first: the listener's accept() and every pump's recv() return at once."""

from __future__ import annotations

import socket
import struct
import threading
import time

REQUEST_STARTS = (b"GET ", b"HEAD", b"POST", b"PUT ", b"DELE")  # an HTTP request's first bytes


class Relay:
    def __init__(self, upstream_port: int, latency: float = 0.0, bytes_per_s: float | None = None):
        self.upstream, self.port = upstream_port, 0  # its port from its first start on: a restart keeps it
        self.latency, self.rate = latency, bytes_per_s
        self.sent = self.requests = 0  # bytes the server sent through the relay; requests it was asked
        self.listener: socket.socket | None = None
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Relay:
        listener = socket.create_server(("127.0.0.1", self.port))
        self.port = listener.getsockname()[1]
        with self.lock:
            self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def cut(self) -> None:
        with self.lock:
            listener, self.listener = self.listener, None
            doomed, self.open = self.open, []
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # accept() returns (Linux); the port refuses from here
            except OSError:  # a listening socket is not connected elsewhere (macOS): close() alone
                pass
            listener.close()
        for sock in doomed:
            self._reset(sock)

    def reset_counts(self) -> None:
        with self.lock:
            self.sent = self.requests = 0

    @staticmethod
    def _reset(sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
            sock.shutdown(socket.SHUT_RD)  # a pump blocked in recv() returns
        except OSError:
            pass
        sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # shut down by cut()
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:  # the server itself is gone (the module's end)
                self._reset(client)
                continue
            with self.lock:
                live = self.listener is listener  # not cut since it was accepted
                if live:
                    self.open += [client, upstream]
            if not live:
                self._reset(client)
                self._reset(upstream)
                return
            running = [2]  # the pair's pumps: the second to end closes both
            for source, sink, asking in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(source, sink, asking, running), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, asking: bool, running: list[int]) -> None:
        try:
            self._relay(source, sink, asking)
        finally:
            with self.lock:
                running[0] -= 1
                done = running[0] == 0 and source in self.open  # not cut: cut() closed them
                if done:
                    self.open.remove(source)
                    self.open.remove(sink)
            if done:
                source.close()
                sink.close()

    def _relay(self, source: socket.socket, sink: socket.socket, asking: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if asking and data[:4] in REQUEST_STARTS:  # a request's first bytes: the server's first-byte time
                    with self.lock:
                        self.requests += 1
                    time.sleep(self.latency)
                elif not asking:
                    with self.lock:
                        self.sent += len(data)
                    if self.rate:
                        time.sleep(len(data) / self.rate)
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:  # one side reset: end the other pump's recv() too, so the pair ends and is closed
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
