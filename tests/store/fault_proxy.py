"""A fault-injecting HTTP proxy for tests, in front of a real server (SeaweedFS's S3 port, or
the static web server of the HTTP tests).

Each request that matches `match` (a regex searched in "METHOD /path?query"; default: every
request) consumes one character of the script, in arrival order across all connections:

    g  pass the request through unchanged
    5  answer 500 InternalError (S3 XML body), without forwarding
    3  answer 503 ServiceUnavailable
    s  answer 503 SlowDown (S3's throttling answer)
    n  answer 501 NotImplemented (a server without the feature the request uses)
    t  stall: read the request, then wait `stall` seconds (beyond the client's read timeout)
       and close the connection without answering
    c  forward, then send the answer's headers and only half of its body, and close
    r  reset: close the connection with a TCP RST instead of answering
    f  flip one byte: of the answer's body for a GET, of the request's body for a PUT/POST
    k  forward, and add to the answer a checksum header of a kind few clients compute
       (x-amz-checksum-crc64nvme)

After the script, requests pass; a script ending in `*` repeats its last code forever.
Requests signed with an access key in `revoked` are answered 403 InvalidAccessKeyId (before
the script), to test credential rotation. `log` records (method, path, code) per request.
"""

from __future__ import annotations

import http.client
import re
import socket
import struct
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

CODES = frozenset("g53sntcrfk")
_ERRORS = {
    "5": (500, "InternalError", "We encountered an internal error. Please try again."),
    "3": (503, "ServiceUnavailable", "Please reduce your request rate."),
    "s": (503, "SlowDown", "Please reduce your request rate."),
    "n": (501, "NotImplemented", "A header you provided implies functionality that is not "
                                 "implemented."),
}
# Not forwarded: hop-by-hop headers, and Expect (the proxy already answered "100 Continue"
# and has read the whole body).
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "proxy-connection",
                         "te", "trailer", "upgrade", "expect"})
_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/")


def flip(data: bytes) -> bytes:
    """`data` with its middle byte inverted (empty data stays empty)."""
    if not data:
        return data
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


class FaultProxy:
    """Listens on 127.0.0.1 (a free port) and forwards to `upstream` (`http://host:port`)."""

    def __init__(self, upstream: str, script: str = "", *, stall: float = 5.0,
                 match: str | None = None) -> None:
        parts = urllib.parse.urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.stall = stall
        self.revoked: set[str] = set()
        self.log: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.set_script(script, match)
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.proxy = self
        self._server.reset_sockets = set()
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        """`http://127.0.0.1:PORT`, to use instead of the upstream's URL."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def set_script(self, script: str, match: str | None = None) -> None:
        """Start a new script (see the module docstring) for requests matching `match`."""
        repeat = script.endswith("*")
        codes = script[:-1] if repeat else script
        if set(codes) - CODES or (repeat and not codes):
            raise ValueError(f"bad fault script {script!r}: use {''.join(sorted(CODES))}[*]")
        with self._lock:
            self._codes, self._repeat, self._pos = codes, repeat, 0
            self._match = re.compile(match) if match else None

    def requests(self, method: str | None = None, code: str | None = None) -> int:
        """How many requests were seen, optionally only of `method` and/or with `code`."""
        with self._lock:
            return sum(1 for m, _, c in self.log
                       if (method is None or m == method) and (code is None or c == code))

    def _next_code(self, method: str, path: str, headers: http.client.HTTPMessage) -> str:
        credential = _CREDENTIAL.search(headers.get("Authorization", ""))
        with self._lock:
            if credential and credential.group(1) in self.revoked:
                code = "x"
            elif self._match is not None and not self._match.search(f"{method} {path}"):
                code = "g"
            elif self._pos < len(self._codes):
                code = self._codes[self._pos]
                self._pos += 1
            else:
                code = self._codes[-1] if self._repeat else "g"
            self.log.append((method, path, code))
            return code

    def start(self) -> FaultProxy:
        """Start serving in a background thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving; stalled requests are released at once."""
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    proxy: FaultProxy
    reset_sockets: set[int]  # ids of connections to close with a RST

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that gave up (its read timed out) breaks the connection while a faulty
        # answer is written; socketserver would print that to stderr, into the output of
        # the command under test. It is an expected part of fault injection.
        return

    def shutdown_request(self, request: socket.socket) -> None:  # type: ignore[override]
        # A reset connection must not get the FIN that shutdown() would send before the RST.
        if id(request) in self.reset_sockets:
            self.reset_sockets.discard(id(request))
            request.close()
            return
        super().shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._handle()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _handle(self) -> None:
        proxy = self.server.proxy
        body = self._read_body()
        code = proxy._next_code(self.command, self.path, self.headers)
        if code == "x":
            return self._error(403, "InvalidAccessKeyId", "The access key ID was revoked.")
        if code in _ERRORS:
            return self._error(*_ERRORS[code])
        if code == "t":
            proxy._stopping.wait(proxy.stall)
            self.close_connection = True
            return None
        if code == "r":
            return self._reset()
        if code == "f" and self.command in ("PUT", "POST"):
            body = flip(body)
        status, headers, answer = self._forward(body)
        if code == "f" and self.command == "GET":
            answer = flip(answer)
        if code == "k":
            headers.append(("x-amz-checksum-crc64nvme", "AAAAAAAAAAA="))
        self._send(status, headers, answer, cut=code == "c")
        return None

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.server.proxy.upstream, timeout=60)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                    conn.putheader(name, value)
            if body or self.command in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body or None)
            response = conn.getresponse()
            answer = response.read()
            headers = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
            return response.status, headers, answer
        finally:
            conn.close()

    def _send(self, status: int, headers: list[tuple[str, str]], body: bytes, cut: bool) -> None:
        if cut and not body:
            return self._reset()
        self.send_response_only(status)
        for name, value in headers:
            if name.lower() != "content-length" or self.command == "HEAD":
                self.send_header(name, value)
        if self.command != "HEAD":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body[: len(body) // 2] if cut else body)
        if cut:
            self.wfile.flush()
            self.close_connection = True
        return None

    def _error(self, status: int, code: str, message: str) -> None:
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            "<RequestId>fault-proxy</RequestId></Error>"
        ).encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body) if self.command != "HEAD" else 0))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _reset(self) -> None:
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.server.reset_sockets.add(id(self.connection))
        self.close_connection = True
