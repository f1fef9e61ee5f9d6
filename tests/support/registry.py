"""A real Docker registry for the conversion tests, and an auth proxy the tests put in front.

Owns: `run_registry(tmp)` (the product's `weenvfs.tools.registry_server.RegistryServer`, the
server of `weenv dev registry`: Debian's `docker-registry serve` on 127.0.0.1 with a free port,
its data, config and log in `tmp`, basic auth from `htpasswd` users if given; stopped by pid;
`push` copies an OCI layout into it with skopeo), `tools_missing()`, and `AuthProxy`, a small
HTTP server in front of a registry that implements the Distribution token flow itself:
requests without a valid bearer token get 401 with a `WWW-Authenticate: Bearer
realm=.../token,service=...,scope=...` challenge; `/token` checks HTTP basic credentials
against `users` (or allows anonymous pulls) and hands out an opaque token; everything else is
forwarded to the registry, with `Range` passed through. In `basic` mode it asks for basic
credentials instead. It counts requests and can break the first transfer of a blob midway
(`cut_blobs`), to test resuming, or hold one midway until the test releases it
(`stall_blobs`, `stalled`, `release`), to kill a client while it downloads.

Must not: listen beyond loopback, or leave a process behind (the context managers stop what
they started, by pid).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import re
import secrets
import shutil
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from weenvfs.tools.registry_server import RegistryServer


def tools_missing() -> str | None:
    """Why the registry tests cannot run here, or None."""
    for tool in ("docker-registry", "skopeo", "umoci"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (Debian packages docker-registry skopeo umoci)"
    return None


@contextlib.contextmanager
def run_registry(tmp: Path, htpasswd: dict[str, str] | None = None) -> Iterator[RegistryServer]:
    """A registry on 127.0.0.1:<free port> storing into `tmp`; stopped on exit. With
    `htpasswd`, the registry itself requires HTTP basic auth from those users."""
    with RegistryServer(tmp, users=htpasswd) as registry:
        yield registry


# --- the auth proxy ---------------------------------------------------------------------------

_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "proxy-authorization",
    "proxy-authenticate",
    "host",
}
_SCOPE = re.compile(r"^/v2/(.+?)/(?:manifests|blobs|tags)/")


@dataclass
class AuthProxy:
    """State of a running proxy; `url` is 'http://127.0.0.1:PORT'."""

    upstream: str
    users: dict[str, str]
    mode: str = "bearer"  # or "basic"
    anonymous: bool = False
    cut_blobs: dict[str, int] = field(default_factory=dict)  # digest -> bytes sent, once
    stall_blobs: dict[str, int] = field(default_factory=dict)  # digest -> bytes sent, then held
    stalled: threading.Event = field(default_factory=threading.Event)  # a transfer is held
    release: threading.Event = field(default_factory=threading.Event)  # end held transfers
    corrupt_blobs: set[str] = field(default_factory=set)  # digests served with a byte flipped
    host: str = ""
    tokens: set[str] = field(default_factory=set)
    log: list[tuple[str, str, int]] = field(default_factory=list)  # method, path, status
    token_requests: list[str | None] = field(default_factory=list)  # user of each /token
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def record(self, method: str, path: str, status: int) -> None:
        with self.lock:
            self.log.append((method, path, status))

    def paths(self, status: int | None = None) -> list[str]:
        with self.lock:
            return [p for _, p, s in self.log if status is None or s == status]


def _basic_user(header: str | None, users: dict[str, str]) -> tuple[bool, str | None]:
    """(valid, user) for an Authorization header; (True, None) when there is none."""
    if not header:
        return True, None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return False, None
    try:
        user, _, password = base64.b64decode(value).decode().partition(":")
    except (ValueError, UnicodeDecodeError):
        return False, None
    return users.get(user) == password, user


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # the tests read AuthProxy.log instead

    def do_HEAD(self) -> None:  # noqa: N802
        self._handle()

    def do_GET(self) -> None:  # noqa: N802
        self._handle()

    def _handle(self) -> None:
        state = self.server.state
        path = self.path.partition("?")[0]
        if path == "/token":
            return self._token(state)
        if not self._authorized(state):
            return self._challenge(state, path)
        self._forward(state, path)

    def _reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.server.state.record(self.command, self.path, status)

    def _token(self, state: AuthProxy) -> None:
        valid, user = _basic_user(self.headers.get("Authorization"), state.users)
        with state.lock:
            state.token_requests.append(user)
        if not valid or (user is None and not state.anonymous):
            return self._reply(
                401, b'{"details": "invalid credentials"}', {"Content-Type": "application/json"}
            )
        token = secrets.token_hex(16)
        with state.lock:
            state.tokens.add(token)
        body = f'{{"token": "{token}", "expires_in": 300}}'.encode()
        self._reply(200, body, {"Content-Type": "application/json"})

    def _authorized(self, state: AuthProxy) -> bool:
        header = self.headers.get("Authorization", "")
        if state.mode == "basic":
            valid, user = _basic_user(header, state.users)
            return valid and user is not None
        scheme, _, token = header.partition(" ")
        with state.lock:
            return scheme.lower() == "bearer" and token in state.tokens

    def _challenge(self, state: AuthProxy, path: str) -> None:
        if state.mode == "basic":
            challenge = 'Basic realm="test-registry"'
        else:
            m = _SCOPE.match(path)
            scope = f',scope="repository:{m.group(1)}:pull"' if m else ""
            challenge = f'Bearer realm="{state.url}/token",service="test-registry"{scope}'
        self._reply(
            401,
            b'{"errors": [{"code": "UNAUTHORIZED"}]}',
            {"WWW-Authenticate": challenge, "Content-Type": "application/json"},
        )

    def _forward(self, state: AuthProxy, path: str) -> None:
        conn = http.client.HTTPConnection(state.upstream, timeout=60)
        headers = {
            k: v
            for k, v in self.headers.items()
            if k.lower() not in _HOP and k.lower() != "authorization"
        }
        conn.request(self.command, self.path, headers=headers)
        resp = conn.getresponse()
        try:
            self.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            self.end_headers()
            cut = self._cut_for(state, path) if resp.status == 200 else None
            stall = None
            if cut is None and resp.status == 200 and "/blobs/" in path:
                stall = state.stall_blobs.get(path.rpartition("/")[2])
            corrupt = "/blobs/" in path and path.rpartition("/")[2] in state.corrupt_blobs
            sent = 0
            while self.command != "HEAD":
                block = resp.read(1 << 16)
                if not block:
                    break
                if corrupt and sent == 0:
                    block = bytes([block[0] ^ 0xFF]) + block[1:]
                if cut is not None and sent + len(block) > cut:
                    self.wfile.write(block[: cut - sent])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    break
                if stall is not None and sent + len(block) > stall:
                    self.wfile.write(block[: stall - sent])
                    self.wfile.flush()
                    state.stalled.set()
                    state.release.wait(120)  # a hang guard: the test releases it at its end
                    self.close_connection = True
                    break
                self.wfile.write(block)
                sent += len(block)
            state.record(self.command, self.path, resp.status)
        finally:
            conn.close()

    def _cut_for(self, state: AuthProxy, path: str) -> int | None:
        if "/blobs/" not in path or self.headers.get("Range"):
            return None
        digest = path.rpartition("/")[2]
        with state.lock:
            return state.cut_blobs.pop(digest, None)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: AuthProxy

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients dropping connections (cut transfers, failed conversions) are expected


@contextlib.contextmanager
def run_auth_proxy(upstream: str, users: dict[str, str], **kwargs: object) -> Iterator[AuthProxy]:
    """An AuthProxy in front of the registry at `upstream` ('127.0.0.1:PORT')."""
    server = _Server(("127.0.0.1", 0), _Handler)
    state = AuthProxy(upstream, users, **kwargs)  # type: ignore[arg-type]
    state.host = f"127.0.0.1:{server.server_address[1]}"
    server.state = state
    thread = threading.Thread(target=server.serve_forever, name="auth-proxy", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release.set()  # no held transfer outlives the proxy
        server.shutdown()
        server.server_close()
        thread.join()
