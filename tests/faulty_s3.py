"""A loopback HTTP proxy in front of moto's S3 server that fails the first N requests.

The faults are the ones S3 really serves under load: 503 SlowDown, 500 InternalError,
and a connection closed without an answer. After them, requests pass through unchanged.
"""

from __future__ import annotations

import http.client
import itertools
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULTS = ("slowdown", "internal", "reset")
ERROR_BODY = ('<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
              "<RequestId>fault-injection</RequestId></Error>")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


class FaultyS3Proxy:
    def __init__(self, upstream: str, faults: int):
        self.upstream = urlsplit(upstream)
        self.remaining = faults
        self.injected: list[tuple[str, str, str]] = []  # (fault, method, path)
        self.passed = 0
        self._lock = threading.Lock()
        self._kinds = itertools.cycle(FAULTS)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FaultyS3Proxy":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _next_fault(self, method: str, path: str) -> str | None:
        with self._lock:
            if self.remaining <= 0:
                self.passed += 1
                return None
            self.remaining -= 1
            kind = next(self._kinds)
            self.injected.append((kind, method, path))
            return kind

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                fault = proxy._next_fault(self.command, self.path)
                if fault == "reset":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault is not None:
                    status, code = (503, "SlowDown") if fault == "slowdown" else (500, "InternalError")
                    payload = ERROR_BODY.format(code=code, message=f"injected {code}").encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    payload = response.read()
                    self.send_response(response.status, response.reason)
                    for key, value in response.getheaders():
                        if key.lower() in HOP_BY_HOP or key.lower() == "content-length":
                            continue
                        self.send_header(key, value)
                    if self.command == "HEAD":
                        self.send_header("Content-Length", response.getheader("Content-Length") or "0")
                    else:
                        self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _serve

        return Handler
