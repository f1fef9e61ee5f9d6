"""A small static web server for the HTTP store tests: serves a directory with Range support.

Python's SimpleHTTPRequestHandler ignores Range, so this one is written out: GET and HEAD of
files, one `bytes=` range per request (206 with Content-Range, 416 when unsatisfiable, several
ranges get the whole file as 200), a directory without its trailing slash is redirected to it
(301, like nginx and Apache), a directory with it answers 200 with a short listing page, and
anything missing 404. HTTP/1.1 keep-alive, one thread per connection, 127.0.0.1 only.
`ignore_range = True` makes it answer every Range request with the whole file, as some
servers do; `chunked = True` sends whole-file answers without a Content-Length, in chunked
transfer encoding, as servers that stream do.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: tests assert on behaviour, not on access logs

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def _serve(self, send_body: bool) -> None:
        self.server.requests.append((self.command, self.path, self.headers.get("Range")))
        path = urllib.parse.urlsplit(self.path).path
        local = os.path.join(self.server.root, urllib.parse.unquote(path).lstrip("/"))
        if ".." in path.split("/") or not os.path.exists(local):
            return self._answer(404, b"not found\n", send_body)
        if os.path.isdir(local):
            if not path.endswith("/"):
                return self._answer(301, b"", send_body, {"Location": path + "/"})
            return self._answer(200, b"<html>directory</html>\n", send_body)
        with open(local, "rb") as f:
            data = f.read()
        wanted = self.headers.get("Range")
        if wanted and not self.server.ignore_range:
            return self._ranged(data, wanted, send_body)
        if self.server.chunked:
            return self._chunked(data, send_body)
        self._answer(200, data, send_body)

    def _chunked(self, data: bytes, send_body: bool) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if send_body:
            for at in range(0, len(data), 64 << 10):
                piece = data[at : at + (64 << 10)]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")

    def _ranged(self, data: bytes, wanted: str, send_body: bool) -> None:
        size = len(data)
        match = _RANGE.fullmatch(wanted.strip())
        if match is None or match.groups() == ("", ""):
            return self._answer(200, data, send_body)  # several ranges or garbage: all of it
        first, last = match.groups()
        if first == "":  # suffix range: the last N bytes
            start, end = max(0, size - int(last)), size - 1
        else:
            start, end = int(first), min(int(last) if last else size - 1, size - 1)
        if start >= size or start > end:
            return self._answer(416, b"", send_body, {"Content-Range": f"bytes */{size}"})
        headers = {"Content-Range": f"bytes {start}-{end}/{size}"}
        self._answer(206, data[start : end + 1], send_body, headers)

    def _answer(
        self, status: int, body: bytes, send_body: bool, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if send_body:
            self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    root: str
    ignore_range: bool
    chunked: bool
    requests: list[tuple[str, str, str | None]]

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that stops reading midway (a bounded read refusing a body) is expected;
        anything else is printed as usual."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)  # type: ignore[arg-type]


class RangeHTTPServer:
    """Serve `root` on 127.0.0.1 (a free port) in a background thread; a context manager."""

    def __init__(self, root: Path | str) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.root = str(root)
        self._server.ignore_range = False
        self._server.chunked = False
        self._server.requests = []
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        """`http://127.0.0.1:PORT` (no trailing slash)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def root(self) -> str:
        """The folder served."""
        return self._server.root

    @property
    def requests(self) -> list[tuple[str, str, str | None]]:
        """(method, path, Range header) of every request so far."""
        return self._server.requests

    @property
    def ignore_range(self) -> bool:
        """Whether Range headers are ignored (200 with the whole file)."""
        return self._server.ignore_range

    @ignore_range.setter
    def ignore_range(self, value: bool) -> None:
        self._server.ignore_range = value

    @property
    def chunked(self) -> bool:
        """Whether whole-file answers go without a Content-Length (chunked encoding)."""
        return self._server.chunked

    @chunked.setter
    def chunked(self, value: bool) -> None:
        self._server.chunked = value

    def start(self) -> RangeHTTPServer:
        """Start serving."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> RangeHTTPServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
