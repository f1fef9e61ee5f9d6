"""The HTTP endpoint of the node's metrics: where it listens, and the process that serves it.

Owns:
- `parse_address` / `choose`: `--metrics HOST:PORT|off`, else $WEENV_METRICS, else
  DEFAULT_METRICS (127.0.0.1 only: exposing the node is the operator's choice). An address
  someone chose that cannot be bound is an error; the built-in default that is taken
  (another node service, another exporter) is logged and the server runs without metrics;
- `Exporter`: for `weenv mountd`, which stays single-threaded because it forks (mountd.py):
  the parent binds the port (so a bad address fails the command, one line, before it reports
  ready), then forks a child that serves it with threads and a `metrics.NodeCollector`; the
  child exits when its parent does, and a child that died is started again (`poll`). The
  bound address is written to `<mountd socket>.metrics` (useful with port 0);
- `serve_registry`: the same endpoint in a thread, for a process that may have threads (the
  containerd snapshotter registers its own collectors next to `NodeCollector`).

Must not: count anything (metrics.py) or import prometheus_client before a server is wanted
(the CLI parses --metrics without it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weenvfs.errors import UsageError, WeenvError
from weenvfs.switches import OFF_WORDS

from .config import DEFAULT_METRICS
from .service_forks import forget_children

log = logging.getLogger(__name__)

ENV = "WEENV_METRICS"
ADDRESS_SUFFIX = ".metrics"
PARENT_CHECK = 1.0  # seconds between two checks, in the child, that the server still runs


@dataclass(frozen=True)
class Address:
    """Where the endpoint listens."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str, what: str = "--metrics") -> Address | None:
    """HOST:PORT ([V6]:PORT for IPv6; port 0: any free port), or None for `off`; UsageError
    (one line, naming `what` was wrong) for anything else."""
    if text.strip().lower() in OFF_WORDS:
        return None
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"{what}: expected HOST:PORT or off, got {text!r}")
    return Address(host, int(port))


def argument(text: str) -> str:
    """The argparse type of a `--metrics` option: `text`, checked."""
    import argparse

    try:
        parse_address(text)
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--metrics: ")) from None
    return text


def choose(flag: str | None, env: str = ENV, default: str = DEFAULT_METRICS
           ) -> tuple[Address | None, bool]:
    """The address to serve on and whether someone chose it (the flag, else $`env`, by
    default $WEENV_METRICS) rather than it being the built-in `default`."""
    if flag is not None:
        return parse_address(flag), True
    chosen = os.environ.get(env)
    return parse_address(chosen or default, f"${env}"), chosen is not None


def address_file(server_socket: Path) -> Path:
    """Where the mount server of `server_socket` writes the address its metrics listen on."""
    return server_socket.with_name(server_socket.name + ADDRESS_SUFFIX)


def read_address(server_socket: Path) -> str | None:
    """The address the metrics of the server of `server_socket` listen on, if any."""
    try:
        return address_file(server_socket).read_text().strip() or None
    except OSError:
        return None


def bind(address: Address) -> Any:
    """A WSGI server bound and listening on `address` (its app is set by whoever serves it);
    WeenvError in one line when the address cannot be used."""
    from wsgiref.simple_server import make_server

    from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

    try:
        infos = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]

        class Server(ThreadingWSGIServer):
            address_family = family

        return make_server(sockaddr[0], address.port, _no_app, Server,
                           handler_class=_SilentHandler)
    except (OSError, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or error
        raise WeenvError(f"cannot serve metrics on {address}: {reason}") from None


def _no_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
    return [b"metrics are not served yet\n"]


def serve_registry(registry: Any, address: Address) -> Any:
    """Serve `registry` on `address` from a daemon thread of this process; the server (call
    `shutdown()` then `server_close()` to stop it)."""
    from prometheus_client import make_wsgi_app

    httpd = bind(address)
    httpd.set_app(make_wsgi_app(registry))
    threading.Thread(target=httpd.serve_forever, name="weenv-metrics", daemon=True).start()
    return httpd


class Exporter:
    """The metrics endpoint of one mount server (see the module docstring)."""

    def __init__(self, address: Address, chosen: bool, server_socket: Path) -> None:
        self.address = address
        self.chosen = chosen
        self.server_socket = server_socket
        self.httpd: Any = None
        self.bound = ""  # the address bound, its port chosen when 0 was asked for
        self.child = 0

    def start(self, held: tuple[Any, ...]) -> bool:
        """Bind and start serving; True if it serves. WeenvError when a chosen address cannot
        be bound; the default one is logged and skipped. `held`: what the child must close
        (the server's lock and sockets)."""
        try:
            self.httpd = bind(self.address)
        except WeenvError as error:
            if self.chosen:
                raise
            log.warning("%s: the node's metrics are off (choose an address: --metrics or "
                        "$%s)", error, ENV)
            return False
        host, port = self.httpd.server_address[:2]
        self.bound = str(Address(host, port))
        path = address_file(self.server_socket)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(self.bound + "\n")
        tmp.replace(path)
        self._fork(held)
        log.info("metrics on http://%s/metrics (exporter %d)", self.bound, self.child)
        return True

    @property
    def socket(self) -> socket.socket | None:
        """The listening socket, which every other child of the server must close."""
        return None if self.httpd is None else self.httpd.socket

    def poll(self, held: tuple[Any, ...]) -> None:
        """Start the exporter again if it died (its totals start from zero again)."""
        if not self.child:
            return
        with contextlib.suppress(ChildProcessError):
            pid, status = os.waitpid(self.child, os.WNOHANG)
            if pid == 0:
                return
            log.warning("the metrics exporter %d exited (status %d); starting it again",
                        self.child, status)
        self._fork(held)

    def stop(self) -> None:
        """Stop the child, close the port and remove the address file."""
        if self.child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signal.SIGTERM)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.child, 0)
            self.child = 0
        if self.httpd is not None:
            self.httpd.server_close()
            self.httpd = None
            address_file(self.server_socket).unlink(missing_ok=True)

    def _fork(self, held: tuple[Any, ...]) -> None:
        parent = os.getpid()
        pid = os.fork()
        if pid:
            self.child = pid
            return
        code = 70
        try:
            forget_children()
            for thing in held:
                thing.close()
            code = _child(self.httpd, self.server_socket, parent, self.bound)
        except BaseException:  # noqa: BLE001 - a forked child must never return into the loop
            log.exception("the metrics exporter failed")
        os._exit(code)


def _child(httpd: Any, server_socket: Path, parent: int, address: str) -> int:
    """The exporter process: serve the node's metrics until the server is gone or SIGTERM."""
    import setproctitle
    from prometheus_client import CollectorRegistry, make_wsgi_app

    from .metrics import NodeCollector

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setproctitle.setproctitle(f"weenv mountd metrics {address} ({server_socket})")
    collector = NodeCollector(server_socket)
    registry = CollectorRegistry()
    registry.register(collector)
    collector.start()
    httpd.set_app(make_wsgi_app(registry))
    threading.Thread(target=httpd.serve_forever, name="weenv-metrics", daemon=True).start()
    try:
        while not stop.wait(PARENT_CHECK) and os.getppid() == parent:
            pass
    finally:
        collector.close()
    return 0
