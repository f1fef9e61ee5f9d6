"""A TCP relay on 127.0.0.1 that delays (and optionally rate-limits) what it forwards: the
link a benchmark puts between WeEnv and a store where the kernel has no `sch_netem`.

`TcpRelay(target, delay, rate=None, handshake=False)`: each direction of each connection
delivers every piece `delay` seconds after it arrived, at most `rate` bytes per second when
given; with `handshake` a new connection first waits a round trip (2 x delay) before the
relay connects on, as a TCP handshake over the link would. `relay(...)` is the same as a
context manager that yields the port. Used by prefetch.py (a shaped link) and store.py (a
delayed link); netshape.py shapes with `tc` in a network namespace instead.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from collections.abc import Iterator


class TcpRelay:
    """Forwards connections to 127.0.0.1:`port` on to `target` (see the module)."""

    def __init__(self, target: tuple[str, int], delay: float, rate: float | None = None,
                 handshake: bool = False) -> None:
        self.target, self.delay, self.rate, self.handshake = target, delay, rate, handshake
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        if self.handshake:
            time.sleep(2 * self.delay)  # the handshake's round trip
        try:
            upstream = socket.create_connection(self.target, timeout=10)
        except OSError:
            client.close()
            return
        for sock in (client, upstream):
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets.append(sock)
        self._pipe(client, upstream)
        self._pipe(upstream, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        pieces: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def read() -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(256 << 10):
                    pieces.put((time.monotonic() + self.delay, data))
            pieces.put((time.monotonic() + self.delay, b""))

        def write() -> None:
            free = 0.0  # when the link is done sending what it took so far
            with contextlib.suppress(OSError):
                while True:
                    due, data = pieces.get()
                    start = max(due, free)
                    time.sleep(max(0.0, start - time.monotonic()))
                    if not data:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    if self.rate:
                        free = start + len(data) / self.rate
                        time.sleep(max(0.0, free - time.monotonic()))
                    dst.sendall(data)

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()


@contextlib.contextmanager
def relay(target: tuple[str, int], delay: float, rate: float | None = None,
          handshake: bool = False) -> Iterator[int]:
    """A `TcpRelay` for the duration of the block; yields its port."""
    link = TcpRelay(target, delay, rate, handshake)
    try:
        yield link.port
    finally:
        link.close()
